"""Worker for tests/test_flax_silent.py: run under ``python -m jaxcomm.launch`` (not a test
module).

1. Every process builds the model from the same seed: one NNX step runs, replicas agree.
2. Each process seeds its model with its own index: the first call of the step is refused
   on every process, naming the cause.
"""

import jaxcomm

jaxcomm.init_distributed(collective_timeout_s=20, heartbeat_timeout_s=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

mesh = jaxcomm.make_mesh()
me = jax.process_index()
n = jax.device_count()
rng = np.random.default_rng(0)  # the same global batch on every process
batch = {
    "x": rng.normal(size=(4 * n, 8)).astype(np.float32),
    "y": rng.integers(0, 3, 4 * n).astype(np.int32),
}


def build(seed):
    model = nnx.Linear(8, 3, rngs=nnx.Rngs(seed))
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def body(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


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
