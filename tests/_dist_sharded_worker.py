"""Worker for tests/test_sharded_distributed.py: run under ``python -m jaxcomm.tools.launch``
(not a test module).

Each process feeds its half of every global batch to a sharded step (f32, and int8
gradients + bf16 param gathers) and to data parallelism, with clip_by_global_norm and
AdamW; replicas are compared by their bits across processes every step
(``check_replicas=1``); the f32 sharded losses and params must match data parallelism.
Then hybrid sharding (``shard_params=True``: each process a node, its 2 devices the
node's 'intra'): equal to data parallelism; each process prints a digest of its
devices' blocks of the params and moments (node 0's copy and node 1's, which the test
compares).
"""

import hashlib

import jaxcomm

jaxcomm.init_distributed(collective_timeout_s=60, heartbeat_timeout_s=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mlp import mlp_batches, mlp_init, mlp_loss  # noqa: E402

mesh = jaxcomm.make_mesh()
me = jax.process_index()
p0 = mlp_init(jax.random.key(0), sizes=(12, 64, 64, 3))


def run(compression=None, param_gather=None, shard=True, steps=3, layout=None):
    tx = optax.chain(
        jaxcomm.sync_gradients(compression=compression),
        jaxcomm.sharded.clip_by_global_norm(0.1),
        optax.adamw(1e-2, weight_decay=0.1),
    )
    kw = {"shard_optimizer": True, "param_gather": param_gather} if shard else {}
    kw = {"shard_params": True} if layout == "hybrid" else kw
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, check_replicas=1, **kw)
    state, losses = dp.init(p0), []
    for batch in mlp_batches(steps, size=32):
        local = {k: v[me * 16 : (me + 1) * 16] for k, v in batch.items()}
        state, metrics = dp(state, local)
        losses.append(float(metrics["loss"]))
    if layout == "hybrid":
        return losses, state
    return losses, [np.asarray(x.addressable_shards[0].data) for x in jax.tree.leaves(state.params)]


ref, ref_params = run(shard=False)
f32, f32_params = run()
q, _ = run(jaxcomm.compression.int8(), jaxcomm.compression.bf16())
np.testing.assert_allclose(f32, ref, rtol=1e-5)
for a, b in zip(f32_params, ref_params, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
assert max(abs(a - b) for a, b in zip(q, ref, strict=True)) < 0.02, (q, ref)
print(f"SHARDED_OK process={me}", flush=True)

# Hybrid sharding across processes: 'inter' is the processes, 'intra' a process's devices.
from jax.experimental import multihost_utils  # noqa: E402

hybrid, state = run(layout="hybrid")
np.testing.assert_allclose(hybrid, ref, rtol=1e-5)
whole = [multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(state.params)]
for a, b in zip(whole, ref_params, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
digest = hashlib.sha256()
for x in jax.tree.leaves(state):  # params, AdamW moments: this node's blocks
    for shard in sorted(x.addressable_shards, key=lambda s: str(s.index)):
        digest.update(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
print(f"HYBRID_OK process={me} digest={digest.hexdigest()}", flush=True)
