"""Worker for tests/test_flax_silent.py and tests/test_flax_sharded.py: run under
``python -m jaxcomm.tools.launch`` (not a test module).

Without arguments:

1. Every process builds the model from the same seed: one NNX step runs, replicas agree.
2. Each process seeds its model with its own index: the first call of the step is refused
   on every process, naming the cause.
3. Each process passes its own part of the batch (``data_parallel``'s convention, not the
   Flax front ends'): the first call is refused on every process, naming the shapes
   (uneven parts) or the processes whose values differ, and the fix; the fix
   (``jax.make_array_from_process_local_data``) trains as the global batch does. NNX and
   Linen.
4. Process 1 fails to compile the step (an injected error): every process raises, none
   runs the step alone (process 0 names process 1).

With ``sharded``: the NNX step with sharded Adam state (``shard_optimizer=True``, f32 and
bf16 param gathers): every process lays out the same fresh state, three steps run with
the replicas compared after each, and the params equal the unsharded step's to f32
rounding (bf16: to its rounding); then hybrid sharding (``shard_params=True``: each
process a node), its params gathered whole equal to the unsharded step's.
"""

import sys

import jaxcomm

jaxcomm.init_distributed(collective_timeout_s=20, heartbeat_timeout_s=10)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.stages  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

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
    return [multihost_utils.process_allgather(x, tiled=True) for x in params]


if sys.argv[1:] == ["sharded"]:
    from jaxcomm.compression import bf16

    dense = trained()
    for name, kw, tol in (("f32", {}, 1e-6), ("bf16", {"param_gather": bf16()}, 2e-2)):
        sharded = trained(shard_optimizer=True, **kw)
        for a, b in zip(dense, sharded, strict=True):
            np.testing.assert_allclose(b, a, atol=tol * (1 + np.abs(a).max()))
        print(f"SHARDED_{name.upper()}_OK process={me}", flush=True)
    for a, b in zip(dense, trained(shard_params=True), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6 * (1 + np.abs(a).max()))
    print(f"HYBRID_OK process={me}", flush=True)
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


# 3. A process's part of the batch in place of the global batch.
def refused(step, *args):
    try:
        step(*args)
    except ValueError as e:
        msg = str(e)
        assert "the batch differs between processes" in msg, msg
        assert "make_array_from_process_local_data(step.batch_sharding, part)" in msg, msg
        return msg
    raise SystemExit("each process's part of the batch was taken as the global batch")


glob = make_batch(1)
h = 2 * n  # the global batch has 4n rows: each of the 2 processes holds 2n
part = {k: v[me * h : (me + 1) * h] for k, v in glob.items()}
msg = refused(jaxcomm.nnx_data_parallel(mesh)(body), *build(0), part)
assert "processes [1] passed other values than process 0" in msg, msg
assert f"a part of {h} rows on each of 2 processes makes a global batch of {2 * h} rows" in msg
k = 3 * n if me == 0 else n  # uneven parts: named by their shapes
msg = refused(jaxcomm.nnx_data_parallel(mesh)(body), *build(0), {a: v[:k] for a, v in glob.items()})
assert f"process 1 passed [2]['x'] ({n}, 8) float32" in msg, msg
assert f"process 0 passed [2]['x'] ({3 * n}, 8) float32" in msg, msg
# The fix: the global array made from each process's part trains as the global batch.
fixed = jaxcomm.nnx_data_parallel(mesh)(body)
made = {k: jax.make_array_from_process_local_data(fixed.batch_sharding, v) for k, v in part.items()}
model_a, opt_a = build(0)
model_b, opt_b = build(0)
out_a = fixed(model_a, opt_a, made)
out_b = jaxcomm.nnx_data_parallel(mesh)(body)(model_b, opt_b, glob)
np.testing.assert_allclose(float(out_a["loss"]), float(out_b["loss"]), rtol=1e-6)
for a, b in zip(
    jax.tree.leaves(nnx.state(model_a, nnx.Param)),
    jax.tree.leaves(nnx.state(model_b, nnx.Param)),
    strict=True,
):
    np.testing.assert_allclose(
        np.asarray(a.addressable_data(0)), np.asarray(b.addressable_data(0)), rtol=1e-6
    )


def linen_body(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


net = nn.Dense(3)
linen_state = TrainState.create(
    apply_fn=net.apply,
    params=net.init(jax.random.key(0), np.ones((1, 8), np.float32))["params"],
    tx=optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)),
)
refused(jaxcomm.linen_data_parallel(mesh)(linen_body), linen_state, part)
print(f"PARTS_REFUSED_OK process={me}", flush=True)

# 4. One process fails to compile (injected, as an out-of-memory would): all raise.
compile_ = jax.stages.Lowered.compile


def failing(self, *args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: injected on process 1")


if me == 1:
    jax.stages.Lowered.compile = failing
try:
    jaxcomm.nnx_data_parallel(mesh)(body)(*build(0), batch)
    raise SystemExit("a step that process 1 could not compile ran")
except RuntimeError as e:
    msg = str(e)
    assert "injected on process 1" in msg, msg
    if me == 0:
        assert "process 1 could not compile the nnx_data_parallel step" in msg, msg
finally:
    jax.stages.Lowered.compile = compile_
print(f"COMPILE_AGREED_OK process={me}", flush=True)
