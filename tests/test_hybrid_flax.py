"""Hybrid sharding under the Flax front ends: ``nnx_data_parallel(mesh, shard_params=True)``
and ``linen_data_parallel(mesh, shard_params=True)`` on a tiny MLP 12-128-3, mesh 2 x 4.

Equal to the replicated step within f32 rounding over three AdamW steps, the params and
Adam's moments stored split over 'intra' (global arrays with the layout's shardings),
copies across 'inter' equal by their bits after every step, and the refusals by name.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_copies_equal
from jax.sharding import PartitionSpec as P

import jaxcomm

STEPS = 3
SPLIT = {(12, 128): P(None, "intra"), (128,): P("intra"), (128, 3): P("intra"), (3,): P()}


def _batches(n=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(32, 12)).astype(np.float32),
            "y": rng.integers(0, 3, 32).astype(np.int32),
        }
        for _ in range(n)
    ]


def _tx(**sync):
    return optax.chain(jaxcomm.sync_gradients(**sync), optax.adamw(1e-2, weight_decay=0.1))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l0 = nnx.Linear(12, 128, rngs=rngs)
        self.l1 = nnx.Linear(128, 3, rngs=rngs)

    def __call__(self, x):
        return self.l1(nnx.relu(self.l0(x)))


def nnx_step(model, optimizer, metrics, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return loss


def _nnx_run(mesh, tx, **kw):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.metrics.Average("loss")
    step = jaxcomm.nnx_data_parallel(mesh, **kw)(nnx_step)
    losses = []
    for b in _batches():
        losses.append(float(step(model, optimizer, metrics, b)))
        if kw.get("shard_params"):
            assert assert_copies_equal(nnx.state((model, optimizer, metrics))) > 0
    return model, optimizer, losses, step


@pytest.fixture(scope="module")
def nnx_runs(mesh):
    return {
        "ref": _nnx_run(mesh, _tx()),
        "hyb": _nnx_run(mesh, _tx(), shard_params=True),
    }


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_nnx_equals_replicated_step(nnx_runs):
    (m_ref, _, l_ref, _), (m_hyb, _, l_hyb, _) = nnx_runs["ref"], nnx_runs["hyb"]
    np.testing.assert_allclose(l_hyb, l_ref, rtol=1e-6)
    for a, b in zip(_params(m_hyb), _params(m_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_nnx_params_and_moments_stored_split(nnx_runs, mesh):
    """The nnx.Param variables hold global arrays split over 'intra' (the (3,) bias kept
    whole); Adam's moments are split like their params; nothing is per device."""
    m, opt, _, step = nnx_runs["hyb"]
    for p in _params(m):
        assert p.sharding.spec == SPLIT[p.shape], (p.shape, p.sharding)
    adam = nnx.as_pure(opt.opt_state)[1][0]
    for mu, p in zip(jax.tree.leaves(adam.mu), _params(m), strict=True):
        assert mu.shape == p.shape and mu.sharding == p.sharding
    assert step.per_device_paths == []
    assert step.syncs and step.syncs[0].axes == ("inter", "intra")  # the sync as built


def test_nnx_split_params_serve_plain_flax_code(nnx_runs):
    """An eval step under nnx.jit reads the split params as they are."""
    (m_ref, _, _, _), (m_hyb, _, _, _) = nnx_runs["ref"], nnx_runs["hyb"]
    x = _batches(1, seed=5)[0]["x"]
    logits = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(logits(m_hyb, x), logits(m_ref, x), rtol=1e-5, atol=1e-6)


def test_nnx_only_the_sync_of_the_blocks_crosses_inter(nnx_runs, mesh):
    """The compiled NNX step (jaxcomm.wire_bytes): the params' all-gathers and the
    gradients' reduce-scatters over 'intra'; over 'inter' the sync of this device's blocks
    (1/4 of the MLP's gradient bytes, the (3,) bias whole: 2060 bytes, as data_parallel's
    hybrid step) and scalars (the loss, the metric's sum and count)."""
    m, opt, _, step = nnx_runs["hyb"]
    compiled = step.compile(m, opt, nnx.metrics.Average("loss"), _batches(1)[0])
    wb = jaxcomm.wire_bytes(compiled, mesh=mesh)
    intra = {c["kind"] for c in wb["collectives"] if c["axes"] == ("intra",)}
    assert {"all-gather", "reduce-scatter"} <= intra
    cross = [c for c in wb["collectives"] if "inter" in c["axes"]]
    assert sum(c["operand_bytes"] for c in cross if c["operand_bytes"] > 64) == 2060, cross


def _fresh(tx):
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_nnx_resumes_from_a_host_copy_bit_for_bit(nnx_runs):
    """One step, the state copied to the host (what a checkpoint holds), put into fresh
    objects, two more steps: the three-step run's params, bit for bit (the trained Adam
    state, without per-device leaves, is laid out again at the next call)."""
    m_hyb, _, _, step = nnx_runs["hyb"]
    batches = _batches()
    model, optimizer = _fresh(_tx())
    step(model, optimizer, nnx.metrics.Average("loss"), batches[0])
    saved = jax.device_get(nnx.state((model, optimizer)))
    model, optimizer = _fresh(_tx())
    nnx.update((model, optimizer), saved)
    for b in batches[1:]:
        step(model, optimizer, nnx.metrics.Average("loss"), b)
    for a, b in zip(_params(model), _params(m_hyb), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_error_feedback_per_device_and_resumed_into_the_layout(mesh):
    """int8 with error feedback: the residuals of each device's blocks are stored per
    device, copies across 'inter' equal by their bits. A host copy of that state is
    refused (its blocks cannot be derived); laid out first with shard_optimizer_state and
    restored with its shardings, it trains on as the straight run, bit for bit."""
    tx = lambda: _tx(compression=jaxcomm.compression.int8(error_feedback=True), min_size=0)  # noqa: E731
    step = jaxcomm.nnx_data_parallel(mesh, shard_params=True)(nnx_step)
    batches = _batches()
    model, optimizer = _fresh(tx())
    for i, b in enumerate(batches):
        step(model, optimizer, nnx.metrics.Average("loss"), b)
        assert assert_copies_equal(nnx.state((model, optimizer))) > 0
        if i == 1:
            saved = jax.device_get(nnx.state((model, optimizer)))
    assert step.per_device_paths and all("compression" in p for p in step.per_device_paths)
    straight = _params(model)

    model, optimizer = _fresh(tx())
    nnx.update((model, optimizer), saved)
    with pytest.raises(ValueError, match=r"per-device leaves.*shard_optimizer_state"):
        step(model, optimizer, nnx.metrics.Average("loss"), batches[2])
    model, optimizer = _fresh(tx())
    step.shard_optimizer_state(model, optimizer)
    target = nnx.state((model, optimizer))
    nnx.update(
        (model, optimizer),
        jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), saved, target),
    )
    step(model, optimizer, nnx.metrics.Average("loss"), batches[2])
    for a, b in zip(_params(model), straight, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_powersgd_with_a_warm_up(mesh):
    """powersgd(rank=1) with warmup_steps=1 under the NNX front end: its factors stored
    per device (one type through the warm-up's lax.cond), copies across 'inter' equal by
    their bits after each of three steps (the first uncompressed), the loss falling."""
    comp = jaxcomm.compression.powersgd(rank=1)
    sync = jaxcomm.sync_gradients(compression=comp, warmup_steps=1, min_size=0)
    _, _, losses, step = _nnx_run(mesh, optax.chain(sync, optax.sgd(0.1)), shard_params=True)
    assert any("['q']" in p for p in step.per_device_paths), step.per_device_paths
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(128)(x)))


def linen_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _linen_run(mesh, **kw):
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 12)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_tx())
    step = jaxcomm.linen_data_parallel(mesh, check_replicas=1, **kw)(linen_step)
    losses = []
    for b in _batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        assert assert_copies_equal(state) > 0
    return state, losses


def test_linen_equals_replicated_step(mesh):
    ref, l_ref = _linen_run(mesh)
    hyb, l_hyb = _linen_run(mesh, shard_params=True)
    np.testing.assert_allclose(l_hyb, l_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(hyb.params), jax.tree.leaves(ref.params), strict=True):
        assert a.sharding.spec == SPLIT[a.shape]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for mu, p in zip(
        jax.tree.leaves(hyb.opt_state[1][0].mu), jax.tree.leaves(hyb.params), strict=True
    ):
        assert mu.sharding == p.sharding


# -- refusals ----------------------------------------------------------------------------


def test_refused_at_construction(mesh):
    with pytest.raises(TypeError, match=r"shard_params='yes'\) must be True or False"):
        jaxcomm.nnx_data_parallel(mesh, shard_params="yes")
    with pytest.raises(ValueError, match="pass only shard_params=True"):
        jaxcomm.linen_data_parallel(mesh, shard_params=True, shard_optimizer=True)
    with pytest.raises(ValueError, match=r"axes=\('inter', 'intra'\)"):
        jaxcomm.nnx_data_parallel(mesh, axes=("intra",), shard_params=True)


def test_compute_only_twin_refused(nnx_runs):
    m, opt, _, step = nnx_runs["hyb"]
    metrics = nnx.metrics.Average("loss")
    with pytest.raises(NotImplementedError, match="compute-only twin"):
        step.compile(m, opt, metrics, _batches(1)[0], communicate=False)


def test_two_optimizers_refused(mesh):
    def two(model, o1, o2, batch):
        del model, o1, o2, batch

    model = MLP(nnx.Rngs(0))
    opts = [nnx.Optimizer(model, _tx(), wrt=nnx.Param) for _ in range(2)]
    step = jaxcomm.nnx_data_parallel(mesh, shard_params=True)(two)
    with pytest.raises(NotImplementedError, match="takes 2 optimizers"):
        step(model, *opts, _batches(1)[0])


def test_apply_if_finite_inside_the_chain_refused(mesh):
    # It decides from each device's block: the devices of a node would decide apart.
    model = MLP(nnx.Rngs(0))
    tx = optax.chain(jaxcomm.sync_gradients(), optax.apply_if_finite(optax.adam(1e-2), 3))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jaxcomm.nnx_data_parallel(mesh, shard_params=True)(nnx_step)
    with pytest.raises(ValueError, match=r"notfinite_count.*optax.apply_if_finite"):
        step(model, opt, nnx.metrics.Average("loss"), _batches(1)[0])


def test_two_models_refused_naming_shard_params(mesh):
    def two(model, other, optimizer, batch):
        del model, other, optimizer, batch

    model, other = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(1))
    opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    step = jaxcomm.nnx_data_parallel(mesh, shard_params=True)(two)
    with pytest.raises(ValueError, match=r"shard_params=True\): the step takes 2 nnx.Module"):
        step(model, other, opt, _batches(1)[0])


def _clipped(model, optimizer, batch):
    """A max-norm after optimizer.update, of the whole (gathered) kernel."""
    grads = nnx.grad(lambda m: m(batch["x"]).mean())(model)
    optimizer.update(model, grads)
    model.l0.kernel[...] = jnp.clip(model.l0.kernel[...], -0.05, 0.05)


def test_param_changed_after_update_is_kept(mesh):
    """The clip after the update: each device stores its slice of the clipped kernel,
    equal to the replicated step's (the clip binds: some entries sit at the bound)."""
    out = []
    for kw in ({"shard_params": True}, {}):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
        step = jaxcomm.nnx_data_parallel(mesh, **kw)(_clipped)
        for b in _batches(2):
            step(model, optimizer, b)
        if kw:
            assert model.l0.kernel[...].sharding.spec == P(None, "intra")
            assert assert_copies_equal(nnx.state((model, optimizer))) > 0
        out.append(_params(model))
    for a, b in zip(*out, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert np.isclose(np.abs(np.asarray(out[0][1])), 0.05).sum() > 0


def test_param_changed_from_each_devices_batch_is_refused(mesh):
    def drifting(model, optimizer, batch):
        grads = nnx.grad(lambda m: m(batch["x"]).mean())(model)
        optimizer.update(model, grads)
        model.l0.kernel[...] = model.l0.kernel[...] + batch["x"].mean()

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    step = jaxcomm.nnx_data_parallel(mesh, shard_params=True)(drifting)
    with pytest.raises(ValueError, match=r"l0.*kernel.*changed after the optimizer's update"):
        step(model, optimizer, _batches(1)[0])
