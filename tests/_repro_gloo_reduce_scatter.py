"""Repro (not a test): on multi-process CPU (gloo), a reduce-scatter over 'intra' followed by a
psum over 'inter' sometimes returns a wrong tail on the intra-index-0 device.

  python -m jaxcomm.launch --nprocs 2 --local-devices 2 -- \
      python tests/_repro_gloo_reduce_scatter.py

Seen with jax/jaxlib 0.10.2 on a 2-core machine: 2-16 of 60 device results wrong per 15 runs of
16 MiB (a tail of 1.7K-18K elements of the first shard); psum+slice instead of the
reduce-scatter, the reduce-scatter alone, and the psum alone were right every time.
Known upstream: jax-ml/jax#40830 (gloo's ReduceScatterHalvingDoubling sends from the caller's
buffer, which the other ranks overwrite; chunks of 256 KiB were not affected).
"""

import os

import jaxcomm

jaxcomm.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = jaxcomm.make_mesh()
axes = ("inter", "intra")
me, ldev, nd = jax.process_index(), jax.local_device_count(), mesh.devices.size
n = int(os.environ.get("N", 4 << 20))
rows = [np.random.default_rng(d).standard_normal(n, dtype=np.float32) for d in range(nd)]
want = np.sum(rows, 0)
spec = NamedSharding(mesh, P(axes))
x = jax.make_array_from_process_local_data(spec, np.stack(rows[me * ldev : (me + 1) * ldev]))


def rs_then_psum(v):
    return lax.psum(lax.psum_scatter(v[0], "intra", tiled=True), "inter")[None]


f = jax.jit(jax.shard_map(rs_then_psum, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
bad = 0
for it in range(int(os.environ.get("IT", 15))):
    for s in f(x).addressable_shards:
        k = list(mesh.devices.flat).index(s.device) % ldev
        w = want[k * (n // ldev) : (k + 1) * (n // ldev)]
        wrong = np.nonzero(np.abs(np.asarray(s.data)[0] - w) > 1e-3)[0]
        if len(wrong):
            bad += 1
            print(f"iteration {it} {s.device}: {len(wrong)} wrong from index {wrong[0]}")
print(f"process {me}: {bad} wrong device results")
