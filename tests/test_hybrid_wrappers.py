"""optax's wrappers under hybrid sharding (``shard_params=True``), mesh 2 x 4, an MLP
12-128-3: ``optax.masked`` and ``optax.MultiSteps`` inside the chain, after the sync, equal
the replicated step within f32 rounding (copies across 'inter' equal by their bits);
``optax.apply_if_finite`` inside, and every wrapper around the chain, are refused by name
with the fix. The NNX front end runs the same layout (one case)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_copies_equal
from mlp import mlp_batches, mlp_init, mlp_loss
from test_hybrid_flax import MLP, nnx_step

import jaxcomm

SIZES = (12, 128, 3)


def _sync():
    return jaxcomm.sync_gradients()


def _no_bias(p):
    return [{"w": True, "b": False} for _ in p]


@pytest.fixture(scope="module")
def params():
    return mlp_init(jax.random.key(0), SIZES)


def _train(mesh, tx, params, steps, **kw):
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, **kw)
    state, seen = dp.init(params), []
    for b in mlp_batches(steps, size=32):
        state, _ = dp(state, b)
        if kw.get("shard_params"):
            assert assert_copies_equal(state) > 0
        seen.append([np.asarray(x) for x in jax.tree.leaves(state.params)])
    return seen


def _close(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_masked_inside_the_chain_equals_replicated(mesh, params):
    """Adam on the weights only (the biases take the synced gradient as their update)."""

    def tx():
        return optax.chain(_sync(), optax.masked(optax.adam(1e-2), _no_bias))

    hyb = _train(mesh, tx(), params, 2, shard_params=True)
    ref = _train(mesh, tx(), params, 2)
    for h, r in zip(hyb, ref, strict=True):
        _close(h, r)


def test_multi_steps_inside_the_chain_equals_replicated(mesh, params):
    """Two micro-steps per update: the synced gradients accumulated on the blocks (the
    accumulators split like the params) equal MultiSteps around the replicated chain (the
    local gradients accumulated, then synced: the same mean)."""
    inside = optax.chain(_sync(), optax.MultiSteps(optax.adam(1e-2), 2))
    around = optax.MultiSteps(optax.chain(_sync(), optax.adam(1e-2)), 2)
    hyb = _train(mesh, inside, params, 2, shard_params=True)
    ref = _train(mesh, around, params, 2)
    p0 = [np.asarray(x) for x in jax.tree.leaves(params)]
    _close(hyb[0], p0)  # the first micro-step only accumulates
    assert any(not np.array_equal(a, b) for a, b in zip(hyb[1], p0, strict=True))
    for h, r in zip(hyb, ref, strict=True):
        _close(h, r)


def test_apply_if_finite_inside_the_chain_is_refused(mesh, params):
    """It decides from each device's block: the devices of a node would decide apart."""
    tx = optax.chain(_sync(), optax.apply_if_finite(optax.adam(1e-2), 3))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_params=True)
    with pytest.raises(ValueError, match=r"notfinite_count.*optax.apply_if_finite"):
        dp.init(params)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda c: optax.masked(c, _no_bias),
        lambda c: optax.MultiSteps(c, 2),
        lambda c: optax.apply_if_finite(c, 3),
    ],
    ids=["masked", "multi_steps", "apply_if_finite"],
)
def test_wrapper_around_the_chain_is_refused(mesh, params, wrap):
    tx = wrap(optax.chain(_sync(), optax.adam(1e-2)))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_params=True)
    with pytest.raises(ValueError, match=r"shard_params=True\) needs.*goes inside it, after"):
        dp.init(params)


def test_nnx_multi_steps_inside_the_chain_equals_replicated(mesh):
    """The NNX front end under the same layout: MultiSteps inside the chain over two
    batches of 32 equals one replicated Adam step on the two batches as one of 64 (the
    mean of the two mean gradients)."""
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(32, 12)).astype(np.float32),
            "y": rng.integers(0, 3, 32).astype(np.int32),
        }
        for _ in range(2)
    ]
    both = jax.tree.map(lambda *x: np.concatenate(x), *batches)

    def run(tx, batches, **kw):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = jaxcomm.nnx_data_parallel(mesh, **kw)(nnx_step)
        seen = []
        for b in batches:
            step(model, optimizer, nnx.metrics.Average("loss"), b)
            if kw:
                assert assert_copies_equal(nnx.state((model, optimizer))) > 0
            seen.append([np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
        return seen

    inside = optax.chain(_sync(), optax.MultiSteps(optax.adam(1e-2), 2))
    hyb = run(inside, batches, shard_params=True)
    (ref,) = run(optax.chain(_sync(), optax.adam(1e-2)), [both])
    p0 = [np.asarray(x) for x in jax.tree.leaves(nnx.state(MLP(nnx.Rngs(0)), nnx.Param))]
    _close(hyb[0], p0)  # the first micro-step only accumulates
    _close(hyb[1], ref)
