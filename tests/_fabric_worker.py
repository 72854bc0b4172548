"""Worker for tests/test_testbed.py: run under a leaf-spine testbed (not a test module).

Times nothing: all-reduces a buffer over a mesh in process order and over one ordered by
``jaxcomm.topology.detect()`` (the testbed's topology file), checks both sums, and prints
the bytes the spine carried for each, per byte of the buffer, as ``FABRIC {json}``.
"""

import json

import jaxcomm

jaxcomm.init_distributed(collective_timeout_s=60, heartbeat_timeout_s=30)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomm.testbed import spine_bytes  # noqa: E402

N = 1 << 18  # 1 MiB of f32
AXES = ("inter", "intra")
out = {}
for label, kwargs in (("process", {}), ("topology", {"topology": jaxcomm.topology.detect()})):
    mesh = jaxcomm.make_mesh(intra=1, **kwargs)
    sharding = NamedSharding(mesh, P(AXES))
    local = np.full((jax.local_device_count(), N), jax.process_index() + 1.0, np.float32)
    x = jax.make_array_from_process_local_data(sharding, local)
    fn = jax.jit(jax.shard_map(lambda v: lax.psum(v, AXES), mesh=mesh, in_specs=P(AXES),
                               out_specs=P(AXES)))  # fmt: skip
    jax.block_until_ready(fn(x))  # compile and connect outside the counted window
    multihost_utils.sync_global_devices(f"{label} start")
    before = spine_bytes()  # every process reads; process 0's figure is printed
    # nobody sends before every process has read its counters
    multihost_utils.sync_global_devices(f"{label} counted")
    y = jax.block_until_ready(fn(x))
    multihost_utils.sync_global_devices(f"{label} end")
    out[label] = (spine_bytes() - before) / (4 * N)
    out[f"{label}_order"] = [d.process_index for d in mesh.devices.flat]
    want = sum(range(1, jax.process_count() + 1))
    assert all(np.all(np.asarray(s.data) == want) for s in y.addressable_shards), label
if jax.process_index() == 0:
    print("FABRIC " + json.dumps(out), flush=True)
