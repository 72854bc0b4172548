"""Nothing silently wrong (issue 29): each way to hold data_parallel is correct or refused.

Every test compares the data-parallel step with the one-device computation of the same
script, or checks that the step is refused when built with a message naming the cause.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal
from mlp import mlp_batches, mlp_init, mlp_logits, mlp_loss

import jaxcomm
from jaxcomm.compression import fp16


def _init(key=0):
    return mlp_init(jax.random.key(key), sizes=(12, 16, 3))


def _ref_step(tx, loss=mlp_loss):
    @jax.jit
    def step(p, s, batch):
        value, g = jax.value_and_grad(loss)(p, batch)
        u, s = tx.update(g, s, p, value=value)
        return optax.apply_updates(p, u), s, value

    return step


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# -- item 1: a transform before the sync that needs global values --------------------------
@pytest.mark.parametrize(
    "pre",
    [
        lambda: optax.clip_by_global_norm(0.05),
        lambda: optax.clip(1e-3),
        lambda: optax.chain(optax.scale(2.0), optax.clip_by_block_rms(1e-3)),
        lambda: optax.adaptive_grad_clip(1e-3),
    ],
    ids=["clip_by_global_norm", "clip", "block_rms", "adaptive_grad_clip"],
)
def test_nonlinear_transform_before_sync_is_refused(mesh, pre):
    tx = optax.chain(pre(), jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    with pytest.raises(ValueError, match=_REFUSED):
        dp.init(_init())


_REFUSED = (
    r"data_parallel: jaxcomm.sync_gradients receives gradients transformed by what runs "
    r"before it.*does not commute with the mean.*sync_gradients\(\) first"
)

# The same clip before the sync, held by wrappers the check must see through whatever
# their structure (issue 41 item 4: it read optax.chain's closures and missed these).
WRAPPED_CLIP = {
    "named_chain": lambda: optax.named_chain(
        ("clip", optax.clip_by_global_norm(0.05)),
        ("sync", jaxcomm.sync_gradients()),
        ("sgd", optax.sgd(0.1)),
    ),
    "multi_steps": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.05), jaxcomm.sync_gradients(), optax.sgd(0.1)),
        every_k_schedule=1,
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        lambda learning_rate: optax.chain(
            optax.clip_by_global_norm(0.05), jaxcomm.sync_gradients(), optax.sgd(learning_rate)
        )
    )(learning_rate=0.1),
    # A user's own wrapper: hands the update a transformed gradient, nothing optax knows.
    "user_wrapper": lambda: _clipping_wrapper(
        optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    ),
}


def _clipping_wrapper(inner):
    def update(g, s, p=None, **extra):
        norm = optax.tree.norm(g)
        g = jax.tree.map(lambda x: x * jnp.minimum(1.0, 0.05 / norm), g)
        return inner.update(g, s, p, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


@pytest.mark.parametrize("make", list(WRAPPED_CLIP.values()), ids=list(WRAPPED_CLIP))
def test_clip_before_sync_inside_any_wrapper_is_refused(mesh, make):
    params = _init()
    # The clip is active on these gradients (else running the step would be harmless).
    g = jax.grad(mlp_loss)(params, mlp_batches(1, size=64)[0])
    assert float(optax.tree.norm(g)) > 0.05
    dp = jaxcomm.data_parallel(mlp_loss, make(), mesh)
    with pytest.raises(ValueError, match=_REFUSED):
        dp.init(params)


def test_linear_transforms_before_sync_stay_allowed_and_exact(mesh):
    inner = optax.chain(optax.scale(0.5), optax.identity(), optax.add_decayed_weights(1e-2))
    tx = optax.chain(inner, jaxcomm.sync_gradients(), optax.sgd(0.1, momentum=0.9))
    ref_tx = optax.chain(inner, optax.sgd(0.1, momentum=0.9))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    params = _init()
    state, ref = dp.init(params), (params, ref_tx.init(params))
    step = _ref_step(ref_tx)
    for b in mlp_batches(3, size=64):
        state, _ = dp(state, b)
        ref = step(ref[0], ref[1], b)[:2]
    _close(state.params, ref[0])


def test_sync_first_then_clip_equals_one_device(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    ref_tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    params = _init()
    state = dp.init(params)
    b = mlp_batches(1, size=64)[0]
    state, _ = dp(state, b)
    p, _, _ = _ref_step(ref_tx)(params, ref_tx.init(params), b)
    _close(state.params, p)


# -- item 3: aux outputs combined by their kind, microbatches too ----------------------------
def _aux_loss(params, batch):
    logits = mlp_logits(params, batch["x"])
    loss = mlp_loss(params, batch)
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
    return loss, {
        "logits": logits,
        "correct": jaxcomm.outputs.sum(correct),
        "worst": jaxcomm.outputs.max(jnp.max(jnp.abs(logits))),
        "acc": jnp.mean(jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32),
    }


@pytest.mark.parametrize("n,accumulate", [(1, "local"), (4, "local"), (4, "overlap")])
def test_aux_outputs_equal_one_device(mesh, n, accumulate):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(
        _aux_loss, tx, mesh, has_aux=True, microbatches=n, accumulate=accumulate
    )
    params = _init()
    state = dp.init(params)
    b = mlp_batches(1, size=64)[0]
    state, m = dp(state, b)
    logits = mlp_logits(params, b["x"])
    np.testing.assert_allclose(m["logits"], logits, rtol=1e-5, atol=1e-5)
    assert m["logits"].shape == (64, 3)
    assert int(m["correct"]) == int(jnp.sum(jnp.argmax(logits, -1) == b["y"]))
    np.testing.assert_allclose(m["worst"], jnp.max(jnp.abs(logits)), rtol=1e-6)
    np.testing.assert_allclose(m["loss"], mlp_loss(params, b), rtol=1e-5)
    assert m["loss"].dtype == jnp.float32
    assert_replicas_equal(m)


# -- item 4: an fp16 overflow skips the whole step ------------------------------------------
def test_fp16_overflow_leaves_params_and_state_as_they_were(mesh):
    def loss(p, batch):  # one device's batch holds a huge value: the fp16 sum overflows
        return jnp.mean(batch["x"] @ p["w"]) + 1e-3 * jnp.sum(p["w"] ** 2)

    tx = optax.chain(
        jaxcomm.sync_gradients(compression=fp16(), min_size=1),
        optax.add_decayed_weights(0.1),
        optax.sgd(0.1, momentum=0.9),
    )
    dp = jaxcomm.data_parallel(loss, tx, mesh)
    state = dp.init({"w": np.ones((4, 2), np.float32)})
    x = np.ones((16, 4), np.float32)
    state, _ = dp(state, {"x": x})  # a good step: momentum is non-zero now
    before = state
    bad = x.copy()
    bad[0] = 1e9
    state, _ = dp(state, {"x": bad})
    assert int(state.opt_state[0].compression.overflow_steps) == 1
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        (state.params, state.opt_state[1:], state.opt_state[0].count),
        (before.params, before.opt_state[1:], before.opt_state[0].count),
    )
    assert_replicas_equal(state)


# -- item 5: optax's extra args (value=) ------------------------------------------------------
@pytest.mark.parametrize("n,accumulate", [(1, "local"), (4, "overlap")])
def test_reduce_on_plateau_gets_the_global_loss(mesh, n, accumulate):
    from optax.contrib import reduce_on_plateau

    def make():
        return optax.chain(optax.sgd(0.5), reduce_on_plateau(patience=1, factor=0.5, cooldown=0))

    tx = optax.chain(jaxcomm.sync_gradients(), make())
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, microbatches=n, accumulate=accumulate)
    params = _init()
    state, ref = dp.init(params), (params, make().init(params))
    step = _ref_step(make())
    b = mlp_batches(1, size=64)[0]
    for _ in range(6):  # the same batch: the loss falls, then plateaus as lr grows small
        state, m = dp(state, b)
        ref = step(ref[0], ref[1], b)
        np.testing.assert_allclose(m["loss"], ref[2], rtol=1e-5)
    _close(state.params, ref[0], 1e-4)
    _close(state.opt_state[1][1], ref[1][1], 1e-4)


# -- item 10: a batch in pmap's layout -------------------------------------------------------
def test_pmap_layout_batch_is_refused(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    state = dp.init(_init())
    b = mlp_batches(1, size=64)[0]
    pmapped = jax.tree.map(lambda x: x.reshape(8, 8, *x.shape[1:]), b)
    with pytest.raises(ValueError, match=r"\(8, 8, 12\).*pmap.*reshape.*\(64, 12\)"):
        dp(state, pmapped)
    # a global batch of one example per device stays allowed
    small = mlp_batches(1, size=8)[0]
    state, m = dp(state, small)
    assert np.isfinite(float(m["loss"]))


def test_init_traces_under_eval_shape_with_the_build_probes(mesh):
    # The build-time probes (layout, transforms before the sync) read host values of the
    # params; under eval_shape they are tracers and must be probed abstractly.
    tx = optax.chain(optax.scale(0.5), jaxcomm.sync_gradients(), optax.adam(1e-3))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    abstract = jax.eval_shape(mlp_init, jax.random.key(0))
    state = jax.eval_shape(dp.init, abstract)
    assert jax.tree.structure(state.params) == jax.tree.structure(abstract)
