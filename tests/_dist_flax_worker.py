"""Worker for tests/test_flax_silent.py and tests/test_flax_sharded.py: run under
``python -m jaxcomm.launch`` (not a test module).

Without arguments:

1. Every process builds the model from the same seed: one NNX step runs, replicas agree.
2. Each process seeds its model with its own index: the first call of the step is refused
   on every process, naming the cause.

With ``sharded``: the NNX step with sharded Adam state (``shard_optimizer=True``, f32 and
bf16 param gathers): every process lays out the same fresh state, three steps run with
the replicas compared after each, and the params equal the unsharded step's to f32
rounding (bf16: to its rounding).
"""

import sys

import jaxcomm

jaxcomm.init_distributed(collective_timeout_s=20, heartbeat_timeout_s=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

mesh = jaxcomm.make_mesh()
me = jax.process_index()
n = jax.device_count()


def make_batch(seed):
    rng = np.random.default_rng(seed)  # the same global batch on every process
    return {
        "x": rng.normal(size=(4 * n, 8)).astype(np.float32),
        "y": rng.integers(0, 3, 4 * n).astype(np.int32),
    }


def build(seed, transform=None):
    model = nnx.Linear(8, 3, rngs=nnx.Rngs(seed))
    tx = optax.chain(jaxcomm.sync_gradients(), transform or optax.sgd(0.1))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def body(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


def trained(**kw):
    model, optimizer = build(0, optax.adam(1e-2))
    step = jaxcomm.nnx_data_parallel(mesh, check_replicas=1, **kw)(body)
    for i in range(3):
        out = step(model, optimizer, make_batch(i))
    assert np.isfinite(float(out["loss"])), out
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    return [np.asarray(x.addressable_data(0)) for x in params]


if sys.argv[1:] == ["sharded"]:
    from jaxcomm.compression import bf16

    dense = trained()
    for name, kw, tol in (("f32", {}, 1e-6), ("bf16", {"param_gather": bf16()}, 2e-2)):
        sharded = trained(shard_optimizer=True, **kw)
        for a, b in zip(dense, sharded, strict=True):
            np.testing.assert_allclose(b, a, atol=tol * (1 + np.abs(a).max()))
        print(f"SHARDED_{name.upper()}_OK process={me}", flush=True)
    raise SystemExit(0)

batch = make_batch(0)
same = jaxcomm.nnx_data_parallel(mesh, check_replicas=1)(body)
out = same(*build(0), batch)
assert np.isfinite(float(out["loss"])), out
print(f"SAME_SEED_OK process={me}", flush=True)

differ = jaxcomm.nnx_data_parallel(mesh)(body)
try:
    differ(*build(me), batch)
    raise SystemExit("a model seeded per process trained")
except ValueError as e:
    msg = str(e)
    assert "differ between processes" in msg and "processes [1]" in msg, msg
    assert "jax.process_index()" in msg, msg  # the fix
print(f"REFUSED_OK process={me}", flush=True)
