"""The data-parallel step equals single-device full-batch training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal
from mlp import mlp_init, mlp_loss

import jaxcomm

_mlp_init = mlp_init
_loss = mlp_loss


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 64, 12)).astype(np.float32)
    y = rng.integers(0, 3, size=(20, 64)).astype(np.int32)
    return x, y


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical"])
def test_twenty_steps_equal_single_device(mesh, data, algorithm):
    x, y = data
    params0 = _mlp_init(jax.random.key(0))
    tx = optax.adam(1e-2)
    dp = jaxcomm.data_parallel(
        _loss, optax.chain(jaxcomm.sync_gradients(algorithm=algorithm), tx), mesh, check_replicas=5
    )
    state = dp.init(params0)
    ref_p, ref_s = params0, tx.init(params0)

    @jax.jit
    def ref_step(p, s, batch):
        loss, g = jax.value_and_grad(_loss)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    for i in range(20):
        batch = {"x": x[i], "y": y[i]}
        state, metrics = dp(state, batch)
        ref_p, ref_s, ref_loss = ref_step(ref_p, ref_s, batch)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert int(state.step) == 20
    assert assert_replicas_equal(state) > 0


def test_optimizer_without_sync_is_refused(mesh, data):
    x, y = data
    dp = jaxcomm.data_parallel(_loss, optax.sgd(0.1), mesh)
    with pytest.raises(ValueError, match="never synchronises"):  # refused when built
        dp.init(_mlp_init(jax.random.key(0)))


def test_batch_not_divisible(mesh, data):
    x, y = data
    dp = jaxcomm.data_parallel(_loss, optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)), mesh)
    state = dp.init(_mlp_init(jax.random.key(0)))
    with pytest.raises(ValueError, match="does not divide by the 8"):
        dp(state, {"x": x[0][:60], "y": y[0][:60]})


def test_sync_outside_shard_map_is_a_clear_error():
    tx = jaxcomm.sync_gradients()
    g = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        tx.update(g, tx.init(g))


def test_bad_constructor_arguments(mesh):
    with pytest.raises(ValueError, match="algorithm='nope'"):
        jaxcomm.sync_gradients(algorithm="nope")
    with pytest.raises(ValueError, match="not in the mesh axes"):
        jaxcomm.data_parallel(_loss, optax.sgd(0.1), mesh, axes=("data",))


def test_per_device_state_is_sharded_and_local(mesh, data):
    """A transform's PerDevice state is stacked per device, sharded, and local inside."""
    from typing import NamedTuple

    class CounterState(NamedTuple):
        seen: jaxcomm.PerDevice

    def per_device_counter():
        def init(params):
            idx = jax.lax.axis_index(("inter", "intra")).astype(jnp.float32)
            return CounterState(jaxcomm.PerDevice(jnp.full((2,), idx)))

        def update(g, s, p=None):
            assert s.seen.value.shape == (2,)  # local view inside shard_map
            return g, CounterState(jaxcomm.PerDevice(s.seen.value + 1))

        return optax.GradientTransformation(init, update)

    x, y = data
    tx = optax.chain(jaxcomm.sync_gradients(), per_device_counter(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(_loss, tx, mesh, check_replicas=1)
    state = dp.init(_mlp_init(jax.random.key(0)))
    state, _ = dp(state, {"x": x[0], "y": y[0]})
    seen = state.opt_state[1].seen.value
    assert seen.shape == (8, 2)
    assert seen.sharding.spec[0] == ("inter", "intra")
    np.testing.assert_array_equal(seen[:, 0], np.arange(8) + 1)
    assert dp.per_device_paths == ["[1].seen.value"]
    assert_replicas_equal(state)


def test_flax_nnx_model(mesh, data):
    """The README's NNX pattern: split the model, merge inside the loss."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(12, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    x, y = data
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.5))
    dp = jaxcomm.data_parallel(loss_fn, tx, mesh, check_replicas=1)
    state = dp.init(params)
    losses = []
    for _ in range(5):
        state, metrics = dp(state, {"x": x[0], "y": y[0]})
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    ref = jax.grad(loss_fn)(params, {"x": x[0], "y": y[0]})
    assert jax.tree.structure(ref) == jax.tree.structure(state.params)


def test_model_state_and_metrics_are_averaged_in_one_buffer(mesh):
    # Batch statistics (model state) and metrics, each a few floats: one all-reduce buffer
    # for all of them (gloo runs a tuple all-reduce one operand after the other), with the
    # values of per-leaf means and the same bits on every device.
    def loss(params, state, batch):
        h = batch["x"] @ params["w"]
        stats = {"mean": h.mean(0), "var": h.var(0), "count": state["count"] + 1}
        return jnp.mean(h**2), (stats, {"positive": jnp.mean(h > 0)})

    tx = optax.chain(jaxcomm.sync_gradients(algorithm="flat"), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(loss, tx, mesh, with_model_state=True, check_replicas=1)
    params = {"w": np.random.default_rng(0).normal(size=(12, 3)).astype(np.float32)}
    zeros = np.zeros(3, np.float32)
    state = dp.init(params, {"mean": zeros, "var": zeros, "count": np.int32(0)})
    x = np.random.default_rng(1).normal(size=(64, 12)).astype(np.float32)
    batch = dp.shard_batch({"x": x})
    census = jaxcomm.hlo.collectives(dp.step_fn(state), state, batch, mesh=mesh).collectives
    buffers = sum(c.num_buffers for c in census if c.kind == "all-reduce")
    assert buffers == 2, census  # the gradient's buffer, and one for the 2 + 2 small leaves
    new, metrics = dp(state, batch)
    h = (x @ params["w"]).reshape(8, 8, 3)  # per device
    np.testing.assert_allclose(new.model_state["mean"], h.mean(1).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.model_state["var"], h.var(1).mean(0), rtol=1e-5, atol=1e-6)
    assert int(new.model_state["count"]) == 1
    np.testing.assert_allclose(metrics["positive"], (h > 0).mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], (h**2).mean(), rtol=1e-5)
    assert assert_replicas_equal(new) > 0
