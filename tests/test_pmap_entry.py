"""``jaxcomm.pmap_data_parallel`` takes what ``jax.pmap`` takes: ``in_axes`` / ``out_axes``
(the state unreplicated or in rows), static and donated arguments; what the sync keeps per
device stays out of the state the script sees (its eval step and checkpoint code see only
replicated values), and every way of losing it is refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import jax_utils
from flax.training import checkpoints
from helpers import assert_replicas_equal, assert_rows_equal
from jax import lax
from test_pmap import make_state, pmap_batch, step

import jaxcomm
from jaxcomm.pmap import first_row

CURRENT = {"in_axes": (None, 0), "out_axes": (None, 0), "axis_name": "batch"}


def topk_tx(momentum=0.9):
    """A sync with error feedback (a residual per device) before SGD with momentum."""
    sync = jaxcomm.sync_gradients(compression=jaxcomm.compression.topk(0.25), min_size=0)
    return optax.chain(sync, optax.sgd(0.1, momentum=momentum))


def eval_step(state, batch):
    logits, _ = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        batch["x"],
        mutable=["batch_stats"],
    )
    return {"loss": lax.pmean(jnp.mean(logits**2), "batch")}


def equal_leaves(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_current_form_trains_as_jax_pmap(mesh):
    """``in_axes=(None, 0), out_axes=(None, 0)``: the state goes in and out unreplicated,
    metrics one row per device; params within 1e-6 of jax.pmap's after 3 steps."""
    p = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    ref = jax.pmap(functools.partial(step, mean_grads=True), **CURRENT)
    state = make_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1, momentum=0.9)))
    want = make_state(optax.sgd(0.1, momentum=0.9))
    for seed in range(3):
        state, metrics = p(state, pmap_batch(seed))
        want, want_metrics = ref(want, pmap_batch(seed))
    assert metrics["loss"].shape == (8,)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-6)
    assert jax.tree.leaves(state.params)[0].shape == jax.tree.leaves(want.params)[0].shape
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)
    assert int(state.step) == 3
    assert assert_replicas_equal(state) > 0


def test_per_device_state_stays_out_of_the_state_the_script_sees(mesh, tmp_path):
    """With error feedback (a residual per device): the returned state holds only values
    every device shares (jax.pmap's eval step and orbax's conversion take it whole); a
    checkpoint of it restored into a new step object is refused until the step's own
    per-device state is loaded, and then trains on as the uninterrupted run."""
    p = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    state = make_state(topk_tx())
    for seed in range(2):
        state, _ = p(state, pmap_batch(seed))
    assert p.per_device_paths  # the residual is kept per device ...
    for x in jax.tree.leaves(state):
        assert x.is_fully_replicated  # ... but not in the state the script sees
    jax.pmap(eval_step, in_axes=(None, 0), axis_name="batch")(state, pmap_batch())

    # Upstream's save_checkpoint, and the step's own per-device state beside it.
    saved = jax.tree.map(ocp.utils.fully_replicated_host_local_array_to_global_array, state)
    checkpoints.save_checkpoint_multiprocess(str(tmp_path / "ckpt"), saved, 2)
    with ocp.StandardCheckpointer() as checkpointer:  # as docs/porting.md says
        checkpointer.save(tmp_path / "per_device_2", p.per_device_state())
    uninterrupted, _ = p(state, pmap_batch(2))

    fresh = make_state(topk_tx())  # the script's create_train_state, then its restore
    restored = checkpoints.restore_checkpoint(str(tmp_path / "ckpt"), fresh)
    q = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    with pytest.raises(ValueError, match=r"load_per_device_state"):
        q(restored, pmap_batch(2))
    with ocp.StandardCheckpointer() as checkpointer:
        q.load_per_device_state(checkpointer.restore(tmp_path / "per_device_2"))
    resumed, _ = q(restored, pmap_batch(2))
    assert equal_leaves(resumed.params, uninterrupted.params)
    assert equal_leaves(resumed.batch_stats, uninterrupted.batch_stats)
    assert assert_replicas_equal(resumed) > 0
    assert equal_leaves(q.per_device_state(), p.per_device_state())


def test_an_older_state_is_refused_when_per_device_state_moved_on(mesh):
    p = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    first, _ = p(make_state(topk_tx()), pmap_batch(0))
    p(first, pmap_batch(1))
    with pytest.raises(ValueError, match=r"version \[1\].*holds version 2"):
        p(first, pmap_batch(2))


def test_rows_form_steps_in_the_steps_own_program(mesh):
    """With the state in rows (in_axes=0, out_axes=0), once built, a call runs the step's
    program alone: it reads the rows as replicas and writes the new state as rows (no
    program of their own); the state is the one passed whole would give (within f32
    rounding: XLA:CPU fuses the row reads into the update, which may round once less)."""
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1, momentum=0.9))
    p = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(step)
    q = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    rows, whole = jax_utils.replicate(make_state(tx)), make_state(tx)
    rows, _ = p(rows, pmap_batch(0))
    whole, _ = q(whole, pmap_batch(0))

    def own_program(xs):
        raise AssertionError(f"a program of its own for {len(xs)} rows")

    p.engine.read_rows = p.engine.write_rows = own_program
    for seed in (1, 2):
        rows, metrics = p(rows, pmap_batch(seed))
        whole, _ = q(whole, pmap_batch(seed))
    assert metrics["loss"].shape == (8,)
    assert_rows_equal(rows)
    once = jax.tree.map(first_row, rows)
    assert int(once.step) == int(whole.step) == 3
    for x, y in zip(jax.tree.leaves(once), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_rows_form_unreplicate_and_replicate_lose_nothing(mesh):
    """The older form (``jax_utils.replicate`` / ``unreplicate``): row 0 of the returned
    state is all of it; a round trip through the host trains on as the uninterrupted run."""
    p = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(step)
    state = jax_utils.replicate(make_state(topk_tx()))
    state, _ = p(state, pmap_batch(0))
    assert_rows_equal(state)  # every leaf, the token included: row 0 is the whole state
    host = jax.device_get(jax_utils.unreplicate(state))  # the older form's save
    per_device = jax.device_get(p.per_device_state())
    a, _ = p(state, pmap_batch(1))
    q = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(step)
    q.load_per_device_state(per_device)
    b, _ = q(jax_utils.replicate(host), pmap_batch(1))
    assert equal_leaves(a.params, b.params)


def test_a_restore_that_dropped_the_optimizer_state_is_refused(mesh):
    """A state at step 3 whose momentum is tx.init's (Flax logs such a restore at INFO
    level only) is refused at the first call."""
    p = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    state, _ = p(make_state(topk_tx()), pmap_batch(0))
    dropped = make_state(topk_tx()).replace(step=3, params=state.params)
    q = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    with pytest.raises(ValueError, match=r"at step 3 but its optimizer state is the one"):
        q(dropped, pmap_batch(1))


def test_shard_optimizer_on_the_pmap_entry(mesh):
    """``shard_optimizer=True``: adam's moments in chunks per device, held by the step
    object; the params equal the Linen decorator's sharded step bit for bit."""
    tx = optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-2))
    p = jaxcomm.pmap_data_parallel(mesh, shard_optimizer=True)(step, **CURRENT)
    linen = jaxcomm.linen_data_parallel(mesh, axis_name="batch", shard_optimizer=True)(step)
    a = b = make_state(tx)
    for seed in range(2):
        a, _ = p(a, pmap_batch(seed))
        b, _ = linen(b, {k: v.reshape(-1, *v.shape[2:]) for k, v in pmap_batch(seed).items()})
    assert any("opt_state" in path for path in p.per_device_paths)
    assert all(x.is_fully_replicated for x in jax.tree.leaves(a))
    assert equal_leaves(a.params, b.params)
    assert assert_replicas_equal(a) > 0


def test_static_and_donated_arguments_as_jax_pmap(mesh):
    def scaled_step(state, batch, scale):
        state, metrics = step(state, batch)
        return state, {"loss": metrics["loss"] * scale}

    p = jaxcomm.pmap_data_parallel(mesh)(
        scaled_step, **CURRENT, static_broadcasted_argnums=(2,), donate_argnums=(0,)
    )
    state = make_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)))
    _, m1 = p(state, pmap_batch(), 1.0)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))  # donated
    state = make_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)))
    _, m2 = p(state, pmap_batch(), 2.0)  # another static value: another program
    np.testing.assert_array_equal(np.asarray(m2["loss"]), 2 * np.asarray(m1["loss"]))


def test_pmap_arguments_it_does_not_take_are_refused_by_name(mesh):
    build = jaxcomm.pmap_data_parallel(mesh)
    with pytest.raises(NotImplementedError, match=r"in_axes entry 1"):
        build(step, in_axes=(None, 1), axis_name="batch")
    with pytest.raises(NotImplementedError, match=r"axes per leaf"):
        build(step, in_axes=({"x": 0},), axis_name="batch")
    with pytest.raises(TypeError, match=r"devices=.*the mesh gives the devices"):
        build(step, axis_name="batch", devices=jax.devices())
    with pytest.raises(NotImplementedError, match=r"out_axes entry 1"):
        build(step, out_axes=(None, 1), axis_name="batch")
    with pytest.raises(ValueError, match=r"\(donate_argnums\)=-1 must be an integer >= 0"):
        build(step, axis_name="batch", donate_argnums=-1)
    with pytest.raises(ValueError, match=r"argnums\)='a' must be an integer >= 0 \(got str\)"):
        build(step, axis_name="batch", static_broadcasted_argnums=("a",))
    with pytest.raises(ValueError, match=r"arguments \[1\] are both static and donated"):
        build(step, axis_name="batch", static_broadcasted_argnums=1, donate_argnums=1)
    with pytest.raises(ValueError, match=r"two names for one axis"):
        jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(step, axis_name="b")
    p = build(step, in_axes=(None, 0, 0), axis_name="batch")
    with pytest.raises(ValueError, match=r"names 3 arguments but the step was called with 2"):
        p(make_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))), pmap_batch())

    def per_device_output(state, batch):
        state, _ = step(state, batch)
        return state, {"x": batch["x"].sum()}

    p = build(per_device_output, in_axes=(None, 0), out_axes=None, axis_name="batch")
    with pytest.raises(ValueError, match=r"out_axes=None differs across devices"):
        p(make_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))), pmap_batch())


@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_a_pmap_shaped_batch_is_refused_where_the_global_batch_is_taken(mesh, front):
    batch = pmap_batch()  # (8, 4, ...): jax.pmap's layout
    if front == "linen":
        dp = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(step)
        args = (make_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))),)
    else:
        from flax import nnx

        model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(
            model, optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)), wrt=nnx.Param
        )

        def nnx_step(model, optimizer, batch):
            def loss_fn(m):
                return jnp.mean((m(batch["x"]) - 1.0) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        dp = jaxcomm.nnx_data_parallel(mesh)(nnx_step)
        args = (model, opt)
    with pytest.raises(ValueError, match=r"jax.pmap's layout \(devices, per_device"):
        dp(*args, batch)
    dp(*args, {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items()})  # the fix


@pytest.mark.parametrize("compression", ["adaptive", "int8", "topk"])
def test_compressed_syncs_on_the_pmap_entry_equal_the_linen_decorator(mesh, compression):
    """Every sync option runs on the pmap entry as on its sibling (same program, bit for
    bit); the profiler's drive is refused by name (tests/test_flax_drive.py)."""
    codec = {
        "adaptive": lambda: jaxcomm.compression.adaptive(),
        "int8": lambda: jaxcomm.compression.int8(),
        "topk": lambda: jaxcomm.compression.topk(0.25),
    }[compression]

    def tx():
        sync = jaxcomm.sync_gradients(compression=codec(), min_size=0)
        return optax.chain(sync, optax.sgd(0.1, momentum=0.9))

    p = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    linen = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(step)
    a, b = make_state(tx()), make_state(tx())
    for seed in range(3):
        a, _ = p(a, pmap_batch(seed))
        b, _ = linen(b, {k: v.reshape(-1, *v.shape[2:]) for k, v in pmap_batch(seed).items()})
    assert equal_leaves(a.params, b.params)
    assert assert_replicas_equal(a) > 0
    assert p.per_device_paths == linen.per_device_paths


def test_rows_form_with_the_host_choosing_the_rung(mesh):
    """Adaptive compression with the state in rows: the host reads its rung from a row
    of the state (jaxcomm.phase_clock) and the step of that rung reads and writes the
    rows in its own program; the params follow the state passed whole, the per-device
    residuals stay with the step object."""

    def tx():
        sync = jaxcomm.sync_gradients(compression=jaxcomm.compression.adaptive(), min_size=0)
        return optax.chain(sync, optax.sgd(0.1, momentum=0.9))

    p = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(step)
    q = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    rows, whole = jax_utils.replicate(make_state(tx())), make_state(tx())
    for seed in range(3):
        rows, _ = p(rows, pmap_batch(seed))
        whole, _ = q(whole, pmap_batch(seed))
    assert p.per_device_state()  # the residuals, held by the step object
    assert_rows_equal(rows)
    for x, y in zip(jax.tree.leaves(rows.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(first_row(x)), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_an_argument_with_in_axes_none_goes_whole_to_every_device(mesh):
    def weighted_step(state, batch, weights):
        state, metrics = step(state, batch)
        return state, {"loss": metrics["loss"] * weights[0] + weights[1]}

    axes = {"in_axes": (None, 0, None), "out_axes": (None, 0), "axis_name": "batch"}
    p = jaxcomm.pmap_data_parallel(mesh)(weighted_step, **axes)
    weights = np.array([2.0, 0.5], np.float32)
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    _, got = p(make_state(tx), pmap_batch(), weights)
    _, want = jax.pmap(
        lambda s, b, w: (lambda r: (r[0], {"loss": r[1]["loss"] * w[0] + w[1]}))(
            step(s, b, mean_grads=True)
        ),
        **axes,
    )(make_state(optax.sgd(0.1)), pmap_batch(), weights)
    np.testing.assert_allclose(np.asarray(got["loss"]), np.asarray(want["loss"]), rtol=1e-6)


WRAPPED = {
    "masked": lambda: optax.chain(
        jaxcomm.sync_gradients(),
        optax.masked(optax.sgd(0.1, momentum=0.9), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    ),
    "apply_if_finite": lambda: optax.chain(
        jaxcomm.sync_gradients(), optax.apply_if_finite(optax.sgd(0.1), 3)
    ),
    "inject_hyperparams": lambda: optax.chain(
        jaxcomm.sync_gradients(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    ),
}


@pytest.mark.parametrize("wrapper", list(WRAPPED))
def test_optax_wrappers_on_the_pmap_entry_equal_the_linen_decorator(mesh, wrapper):
    p = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT)
    linen = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(step)
    a, b = make_state(WRAPPED[wrapper]()), make_state(WRAPPED[wrapper]())
    for seed in range(2):
        a, _ = p(a, pmap_batch(seed))
        b, _ = linen(b, {k: v.reshape(-1, *v.shape[2:]) for k, v in pmap_batch(seed).items()})
    assert equal_leaves(a, b)
    assert assert_replicas_equal(a) > 0


@pytest.mark.parametrize("front", ["pmap", "linen"])
def test_apply_if_finite_around_the_sync_is_refused_by_name(mesh, front):
    """Its test of the raw local gradients would let one device skip alone."""
    tx = optax.apply_if_finite(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)), 3)
    if front == "pmap":
        p, batch = jaxcomm.pmap_data_parallel(mesh)(step, **CURRENT), pmap_batch()
    else:
        p = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(step)
        batch = {k: v.reshape(-1, *v.shape[2:]) for k, v in pmap_batch().items()}
    with pytest.raises(ValueError, match=r"chain\(jaxcomm.sync_gradients\(\), optax.apply_if"):
        p(make_state(tx), batch)
