"""Replicas agree: every leaf typed replicated holds the same bits on every device.

The matrix runs a tiny MLP for 2 steps per combination with ``check_replicas=1`` (the
library's runtime check) and ``helpers.assert_replicas_equal`` (an independent bitwise
comparison) after every step. The full product of algorithm (6) x compressor (9) x
``compress_stage`` (2) x ``bucket_bytes`` (3) x ``warmup_steps`` (2) is 648 compiled steps,
too slow for ``make test``; ``MATRIX`` takes every algorithm x compressor pair (54) and
assigns the other three axes greedily so that *every pair of values of any two axes* occurs
at least once (pairwise coverage, checked by ``test_matrix_is_pairwise_complete``).
Microbatches (without compression), the optax wrappers, and one test per divergence
found on the old step (each failed there) follow.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    FAST_COMPILE,
    assert_copies_equal,
    assert_replicas_equal,
    per_device,
    replicated,
    train,
)
from mlp import mlp_init, mlp_loss

import jaxcomm

C = jaxcomm.compression
ALGORITHMS = ["flat", "hierarchical", "ring", "tree", "halving_doubling", "auto"]
COMPRESSORS = {
    "none": lambda: None,
    "bf16": C.bf16,
    "fp16": C.fp16,
    "int8": lambda: C.int8(block=32),
    "int4": lambda: C.int4(block=32),
    "topk": lambda: C.topk(0.1),
    "random_k": lambda: C.random_k(0.25),
    "powersgd": lambda: C.powersgd(rank=2),
    "adaptive": lambda: C.adaptive(0.5, adjustment_step=1, error_low=0.2, error_high=0.3),
}
STAGES = ["all", "inter"]
BUCKETS = [None, (256, 1024), "auto"]
WARMUPS = [0, 1]
OTHER = list(itertools.product(STAGES, BUCKETS, WARMUPS))
# Compile fast (about 40% less time on 2 cores): replicas run one program, so whether they
# agree does not depend on the optimisation level.
FAST = FAST_COMPILE


def _pairs(row):
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def _pairwise_matrix():
    covered, rows = set(), []
    for alg, comp in itertools.product(ALGORITHMS, COMPRESSORS):
        best = max(OTHER, key=lambda o: len(_pairs((alg, comp, *o)) - covered))
        rows.append((alg, comp, *best))
        covered |= _pairs(rows[-1])
    return rows


MATRIX = _pairwise_matrix()


def test_matrix_is_pairwise_complete():
    axes = [ALGORITHMS, list(COMPRESSORS), STAGES, BUCKETS, WARMUPS]
    want = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(axes)), 2)
        for a in axes[i]
        for b in axes[j]
    }
    got = set().union(*(_pairs(r) for r in MATRIX))
    assert want <= got, sorted(want - got, key=str)[:5]


@pytest.fixture(scope="module")
def params():
    return mlp_init(jax.random.key(0))


def _batches(n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.integers(0, 3, 16)}
        for _ in range(n)
    ]


def _changed(a, b) -> bool:
    return any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("algorithm, comp, stage, bucket, warmup", MATRIX)
def test_replicas_agree_across_the_matrix(mesh, params, algorithm, comp, stage, bucket, warmup):
    sync = jaxcomm.sync_gradients(
        algorithm=algorithm,
        compression=COMPRESSORS[comp](),
        compress_stage=stage,
        bucket_bytes=bucket,
        warmup_steps=warmup,
        min_size=64,
    )
    tx = optax.chain(sync, optax.adam(1e-2))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, check_replicas=1, compiler_options=FAST)
    state, metrics = train(dp, dp.init(params), _batches())
    assert np.isfinite(float(metrics["loss"]))
    assert _changed(state.params, params)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_replicas_agree_with_microbatches(mesh, params, algorithm):
    tx = optax.chain(jaxcomm.sync_gradients(algorithm=algorithm), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(
        mlp_loss, tx, mesh, microbatches=2, check_replicas=1, compiler_options=FAST
    )
    state, _ = train(dp, dp.init(params), _batches())
    assert _changed(state.params, params)


# shard_optimizer: (gradient compressor, param gather, sync options, step options),
# None for f32
SHARDED = {
    "f32": (None, None, {}, {}),
    "bf16-bf16": ("bf16", "bf16", {}, {}),
    "int8-bf16": ("int8", "bf16", {}, {}),
    "int4-int8": ("int4", "int8", {}, {}),
    "int8-inter-stage": ("int8", None, {"compress_stage": "inter"}, {}),
    "f32-microbatches": (None, None, {}, {"microbatches": 2}),
    "int8-small-buckets": ("int8", "bf16", {}, {"shard_bucket_bytes": 1024}),
    "int8-adamw-mask-by-path": ("int8", "bf16", {}, {}),
}


def _no_bias(params):
    """Weight decay on the weights only, chosen by path (as Flax scripts exclude biases)."""
    return jax.tree_util.tree_map_with_path(
        lambda k, _: "'b'" not in jax.tree_util.keystr(k), params
    )


# The optimizer after the sync of a SHARDED row, where it is not Adam.
SHARDED_INNER = {
    "int8-adamw-mask-by-path": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=_no_bias),
}


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_replicas_agree_with_sharded_optimizer(mesh, params, name):
    grad, gather, sync_kw, step_kw = SHARDED[name]
    grad, gather = (None if c is None else getattr(C, c)() for c in (grad, gather))
    inner = SHARDED_INNER.get(name, lambda: optax.adam(1e-2))()
    tx = optax.chain(jaxcomm.sync_gradients(compression=grad, **sync_kw), inner)
    dp = jaxcomm.data_parallel(
        mlp_loss, tx, mesh, shard_optimizer=True, param_gather=gather, check_replicas=1,
        compiler_options=FAST, **step_kw,
    )  # fmt: skip
    state, _ = train(dp, dp.init(params), _batches())
    assert _changed(state.params, params)
    if "shard_bucket_bytes" in step_kw:
        assert len(dp.sharded.shard_plan.plan.buffers) > 1


# shard_params=True (jaxcomm.hybrid): the compressors whose state or decisions the layout
# places differently (fp16's skip and adaptive's rung over both data axes, residuals and
# PowerSGD's Q per device, random_k's seeds), the algorithms, compress_stage and warm-up
# spread over five rows (f32, bf16, int4, topk with error feedback: tests/test_hybrid.py).
# The leaves stored split over 'intra' are compared across 'inter' (the devices holding
# the same block) by helpers.assert_copies_equal.
HYBRID = {
    "fp16-tree": {"algorithm": "tree", "compression": C.fp16},
    "int8-ef-ring-inter": {
        "algorithm": "ring",
        "compression": lambda: C.int8(block=32, error_feedback=True),
        "compress_stage": "inter",
    },
    "random_k-flat-warmup": {
        "algorithm": "flat",
        "compression": lambda: C.random_k(0.25),
        "warmup_steps": 1,
    },
    "powersgd": {"compression": lambda: C.powersgd(rank=2)},
    "adaptive-halving-doubling": {
        "algorithm": "halving_doubling",
        "compression": lambda: C.adaptive(0.5, adjustment_step=1, error_low=0.2, error_high=0.3),
    },
}


@pytest.mark.parametrize("name", list(HYBRID))
def test_replicas_agree_with_hybrid_sharded_params(mesh, params, name):
    kw = dict(HYBRID[name])
    if "compression" in kw:
        kw["compression"] = kw["compression"]()
    tx = optax.chain(jaxcomm.sync_gradients(min_size=16, **kw), optax.adam(1e-2))
    dp = jaxcomm.data_parallel(
        mlp_loss, tx, mesh, shard_params=True, check_replicas=1, compiler_options=FAST
    )
    state = dp.init(params)
    for batch in _batches():
        state, metrics = train(dp, state, [batch])
        assert assert_copies_equal(state) > 0  # the split leaves, across 'inter'
    assert np.isfinite(float(metrics["loss"]))
    assert _changed(state.params, params)


def test_replicas_agree_with_a_codec_of_ones_own(mesh, params):
    def mean(c, ctx, i, seed):  # values on a grid, summed by psum
        sent = jnp.round(c * 64) / 64
        return jax.lax.psum(sent, ctx.axes) / jax.lax.psum(1, ctx.axes), sent

    grid = C.from_codec(C.BufferCodec("grid", mean), error_feedback=True)
    for stage in ("all", "inter"):
        sync = jaxcomm.sync_gradients(compression=grid, compress_stage=stage, min_size=64)
        tx = optax.chain(sync, optax.adam(1e-2))
        dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, check_replicas=1, compiler_options=FAST)
        state, _ = train(dp, dp.init(params), _batches())
        assert _changed(state.params, params)


def _sync():
    return jaxcomm.sync_gradients(compression=C.int8(block=32, error_feedback=True), min_size=64)


def _label(p):
    return [{"w": "a", "b": "b"} for _ in p]


WRAPPERS = {
    "multi_steps": lambda: optax.MultiSteps(optax.chain(_sync(), optax.sgd(0.1)), 2),
    "multi_steps_inside": lambda: optax.chain(_sync(), optax.MultiSteps(optax.sgd(0.1), 2)),
    "apply_if_finite_inside": lambda: optax.chain(
        _sync(), optax.apply_if_finite(optax.adam(1e-2), 3)
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        lambda learning_rate: optax.chain(_sync(), optax.sgd(learning_rate))
    )(learning_rate=0.1),
    "masked_inside": lambda: optax.chain(
        _sync(), optax.masked(optax.adam(1e-2), lambda p: [{"w": True, "b": False} for _ in p])
    ),
    "named_chain": lambda: optax.named_chain(("sync", _sync()), ("sgd", optax.sgd(0.1))),
    "scale_before_sync": lambda: optax.chain(optax.scale(0.5), _sync(), optax.sgd(0.1)),
    "partition": lambda: optax.partition(
        {"a": optax.chain(_sync(), optax.adam(1e-2)), "b": optax.chain(_sync(), optax.sgd(0.1))},
        _label,
    ),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_replicas_agree_under_optax_wrappers(mesh, params, name):
    dp = jaxcomm.data_parallel(
        mlp_loss, WRAPPERS[name](), mesh, check_replicas=1, compiler_options=FAST
    )
    state, _ = train(dp, dp.init(params), _batches(4))
    assert _changed(state.params, params)


def test_multi_steps_after_the_sync_equals_multi_steps_around_it(mesh, params):
    # After the sync MultiSteps sums the synchronised gradients (its accumulators are
    # replicated state); around it, each device's own, synchronised every k-th step: the
    # same mean, within f32 rounding.
    inside = optax.chain(jaxcomm.sync_gradients(), optax.MultiSteps(optax.adam(1e-2), 2))
    around = optax.MultiSteps(optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-2)), 2)
    out = []
    for tx in (inside, around):
        dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, check_replicas=1, compiler_options=FAST)
        state, _ = train(dp, dp.init(params), _batches(4))
        out.append(jax.tree.leaves(state.params))
    assert _changed(out[0], jax.tree.leaves(params))
    for a, b in zip(*out, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_masked_around_the_sync_is_refused(mesh, params):
    # Leaves outside the mask get the raw local gradient as their update: params would
    # drift apart. Refused when the step is built, naming the leaf.
    tx = optax.masked(
        optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)),
        lambda p: [{"w": True, "b": False} for _ in p],
    )
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    with pytest.raises(ValueError, match=r"params\[0\]\['b'\].*varies over mesh axes"):
        dp.init(params)


def test_apply_if_finite_around_the_sync_is_refused(mesh, params):
    # Its finiteness test reads the raw local gradients: a NaN on one device would make
    # only that device skip the update, and the sync's collectives inside the branch.
    tx = optax.apply_if_finite(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)), 3)
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    with pytest.raises(
        ValueError, match=r"optax.chain\(jaxcomm.sync_gradients\(\), optax.apply_if"
    ):
        dp.init(params)


def test_compressor_state_that_varies_unmarked_is_refused(mesh, params):
    # State that steers later steps must be invariant; a compressor that keeps a local
    # value without a PerDevice mark is refused (it would be silently per device).
    def init(specs):
        return jnp.zeros(())

    def reduce(xs, state, ctx):
        return [jax.lax.pmean(x, ctx.axes) for x in xs], jnp.sum(xs[0])  # local sum

    comp = C.Compressor("local-state", init, reduce)
    sync = jaxcomm.sync_gradients(compression=comp, min_size=1)
    dp = jaxcomm.data_parallel(mlp_loss, optax.chain(sync, optax.sgd(0.1)), mesh)
    with pytest.raises(ValueError, match=r"'local-state'.*not marked jaxcomm.PerDevice"):
        dp.init(params)


# -- one test per divergence of the old step --------------------------------------------
def _linear_loss(p, batch):
    """Gradient of params['w'] is the local batch mean of batch['g']: fully controlled."""
    return jnp.mean(jnp.sum(batch["g"] * p["w"], axis=-1))


def test_fp16_overflow_in_one_intra_shard_skips_the_step_everywhere(mesh):
    # compress_stage='inter': device intra=i sums the i-th quarter of the buffer across
    # nodes. An overflow in the last quarter only was seen by the intra=3 devices alone:
    # they skipped the step, the others applied it.
    n = 64
    g = np.ones((16, n), np.float32)
    g[:, 3 * n // 4 :] = 6e5  # / 2 nodes, cast to fp16: above 65504 -> inf
    sync = jaxcomm.sync_gradients(compression=C.fp16(), compress_stage="inter", min_size=1)
    dp = jaxcomm.data_parallel(_linear_loss, optax.chain(sync, optax.sgd(0.1)), mesh)
    w0 = {"w": jnp.zeros(n)}
    state, _ = train(dp, dp.init(w0), [{"g": g}])
    np.testing.assert_array_equal(np.asarray(state.params["w"]), 0.0)  # skipped everywhere
    fp16_state = state.opt_state[0].compression
    assert int(fp16_state.overflow_steps) == 1 and not bool(fp16_state.finite)


def test_adaptive_inter_level_is_one_decision(mesh):
    # compress_stage='inter': the intra=0 shard is smooth (int8 error tiny), the others
    # heavy-tailed (large error). Signals averaged over 'inter' only gave each intra
    # position its own level ([3,2,2,2,3,2,2,2] on the old step).
    n = 4 * 256
    rng = np.random.default_rng(0)
    g = (rng.standard_cauchy(size=(16, n)) ** 3).astype(np.float32)
    g[:, : n // 4] = 1.0
    comp = C.adaptive(0.5, adjustment_step=1, error_low=0.05, error_high=0.06, block=256)
    sync = jaxcomm.sync_gradients(compression=comp, compress_stage="inter", min_size=1)
    dp = jaxcomm.data_parallel(_linear_loss, optax.chain(sync, optax.sgd(1e-3)), mesh)
    state = dp.init({"w": jnp.zeros(n)})
    levels = []
    for _ in range(3):
        state, _ = train(dp, state, [{"g": g}])
        levels.append(int(state.opt_state[0].compression.level))
    assert max(levels) > 0, levels  # it moved off the start level (bf16)


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("stage", STAGES)
def test_adaptive_every_rung_keeps_replicas_equal(mesh, params, stage, stochastic):
    # The error band is out of reach, so the ladder climbs one rung per step: every rung
    # (quantized and sparse) runs once, from the shared residual, replicas compared bitwise;
    # the int rungs round stochastically or to nearest.
    ladder = ("f32", "bf16", "int8", "int4", "topk:0.05", "random_k:0.02")
    comp = C.adaptive(0.0, min_compression=0.0, max_compression=1.0, adjustment_step=1,
                      ladder=ladder, error_low=2.0, error_high=3.0, block=32,
                      stochastic=stochastic)  # fmt: skip
    sync = jaxcomm.sync_gradients(compression=comp, compress_stage=stage, min_size=64)
    dp = jaxcomm.data_parallel(
        mlp_loss, optax.chain(sync, optax.adam(1e-2)), mesh, check_replicas=1,
        compiler_options=FAST,
    )  # fmt: skip
    state = dp.init(params)
    levels = []
    for batch in _batches(len(ladder), seed=3):
        state, metrics = train(dp, state, [batch])
        levels.append(int(state.opt_state[0].compression.level))
    assert levels == list(range(len(ladder)))
    assert np.isfinite(float(metrics["loss"]))


def _multisteps(mesh, k=2):
    tx = optax.MultiSteps(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.5)), k)
    return jaxcomm.data_parallel(_linear_loss, tx, mesh, check_replicas=1)


def test_multisteps_accumulators_are_per_device_and_survive_a_resume(mesh):
    rng = np.random.default_rng(1)
    gs = [rng.normal(size=(16, 8)).astype(np.float32) for _ in range(2)]
    w0 = {"w": jnp.zeros(8)}
    # Uninterrupted: two micro-steps, one update with the mean of both steps' gradients.
    dp = _multisteps(mesh)
    straight, _ = train(dp, dp.init(w0), [{"g": g} for g in gs])
    expect = -0.5 * np.mean([g.mean(0) for g in gs], axis=0)
    np.testing.assert_allclose(np.asarray(straight.params["w"]), expect, rtol=1e-5, atol=1e-6)
    # Resumed: checkpoint (device_get) after the first micro-step, restore, continue.
    dp = _multisteps(mesh)
    state, _ = train(dp, dp.init(w0), [{"g": gs[0]}])
    assert any("acc_grads" in p for p in dp.per_device_paths), dp.per_device_paths
    ckpt = jax.device_get(state)
    acc = ckpt.opt_state.acc_grads["w"]
    assert acc.shape == (8, 8)  # one row per device: each holds its own gradients
    assert not np.allclose(acc[0], acc[1])
    dp2 = _multisteps(mesh)
    restored = jax.device_put(ckpt, dp2.state_shardings(ckpt))
    resumed, _ = train(dp2, restored, [{"g": gs[1]}])
    np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(straight.params["w"]))


def test_adam_before_the_sync_is_refused(mesh, params):
    # optax.chain(adam, sync): the moments would be computed from each device's own
    # gradients and differ across devices. Refused when the step is built, naming the leaf.
    dp = jaxcomm.data_parallel(mlp_loss, optax.chain(optax.adam(1e-2), _sync()), mesh)
    with pytest.raises(ValueError, match=r"\.mu.*own gradients.*sync_gradients\(\) first"):
        dp.init(params)


# -- the runtime check -------------------------------------------------------------------
def _perturb_one_device(x: jax.Array, device_index: int) -> jax.Array:
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    arrays = []
    for i, s in enumerate(shards):
        data = np.asarray(s.data).copy()
        if i == device_index:
            data.reshape(-1)[0] = np.nextafter(data.reshape(-1)[0], np.float32(np.inf))
        arrays.append(jax.device_put(data, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)


def test_check_replicas_names_the_leaf_and_the_devices(mesh, params):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, check_replicas=2)
    state = dp.init(params)
    bad = state.params[1]["w"]
    state = state._replace(
        params=[state.params[0], {**state.params[1], "w": _perturb_one_device(bad, 3)}]
    )
    state, _ = dp(state, _batches(1)[0])  # step 1: not checked (every 2 steps)
    with pytest.raises(jaxcomm.ReplicaDivergenceError, match=r"params\[1\]\['w'\]") as err:
        dp(state, _batches(1)[0])
    assert "3 (inter=0, intra=3)" in str(err.value)
    assert err.value.paths == [".params[1]['w']"]
    # The test harness's independent comparison sees it too.
    with pytest.raises(AssertionError, match=r"\[1\]\['w'\]"):
        assert_replicas_equal(state.params)


def test_check_replicas_passes_sharded_leaves_and_equal_copies(mesh):
    x = per_device(mesh, np.arange(8.0))
    y = replicated(mesh, np.ones(3))
    jaxcomm.check_replicas({"sharded": x, "replicated": y}, mesh=mesh)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_check_replicas_argument_is_validated(mesh, bad):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    with pytest.raises(
        ValueError, match=r"check_replicas=.* must be an integer >= 0 \(got \w+\); N compares"
    ):
        jaxcomm.data_parallel(mlp_loss, tx, mesh, check_replicas=bad)


def test_check_replicas_compares_typed_keys_by_their_data(mesh):
    keys = jax.device_put(
        jax.random.split(jax.random.key(0), 3), replicated(mesh, np.ones(1)).sharding
    )
    jaxcomm.check_replicas({"keys": keys}, mesh=mesh)
    assert_replicas_equal({"keys": keys})
