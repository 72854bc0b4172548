"""Sharded optimizer state at build time: 1/N of the state per device (read from the
arrays' shardings; ResNet-152 from its shapes) and the settings that are refused."""

import jax
import optax
import pytest
from mlp import mlp_init, mlp_loss

import jaxcomm
from jaxcomm.compression import bf16, fp16, topk
from jaxcomm.models import gradient_shapes
from jaxcomm.sharded import per_device_bytes

SIZES = (16, 256, 256, 8)


def _pair(mesh, tx):
    chain = lambda: optax.chain(jaxcomm.sync_gradients(), tx)  # noqa: E731
    dp = jaxcomm.data_parallel(mlp_loss, chain(), mesh)
    return dp, jaxcomm.data_parallel(mlp_loss, chain(), mesh, shard_optimizer=True)


def test_state_is_one_nth_per_device(mesh):
    p0 = mlp_init(jax.random.key(0), sizes=SIZES)
    dp, zp = _pair(mesh, optax.adam(1e-3))
    a, b = dp.init(p0), zp.init(p0)
    # read from the arrays' shardings (addressable shards), not from shapes
    full, shard = per_device_bytes(a.opt_state), per_device_bytes(b.opt_state)
    assert shard <= full / 8 + 16, (shard, full)  # + Adam's count, replicated


def test_state_is_one_nth_for_resnet50_shapes(mesh):
    # ResNet-50's 161 leaves and 25.6M parameters (ResNet-152's 467 leaves take the
    # build-time probe three times as long, for the same property)
    shapes = gradient_shapes("resnet50")
    zp = jaxcomm.data_parallel(
        mlp_loss,
        optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-3)),
        mesh,
        shard_optimizer=True,
    )
    state = zp.abstract_state(shapes)  # nothing allocated
    replicated = per_device_bytes(jax.eval_shape(optax.adam(1e-3).init, shapes))
    sharded = per_device_bytes(state.opt_state)
    assert replicated > 2e8  # 2 x 25.6M f32 moments
    # each leaf is padded to a multiple of 8 on its own: at most one f32 more per moment
    padding = 2 * 4 * len(jax.tree.leaves(shapes))
    assert sharded <= replicated / 8 + padding + 16, sharded / replicated


def _build(mesh, *tx, sync=None, **kw):
    sync = jaxcomm.sync_gradients() if sync is None else sync
    zp = jaxcomm.data_parallel(mlp_loss, optax.chain(sync, *tx), mesh, shard_optimizer=True, **kw)
    return zp.init(mlp_init(jax.random.key(0)))


def test_transform_that_does_not_shard_is_refused(mesh):
    # LAMB's trust ratio reads each leaf's norm: on flat shards it is another update
    with pytest.raises(ValueError, match=r"after jaxcomm.sync_gradients do not shard"):
        _build(mesh, jaxcomm.sharded.clip_by_global_norm(1.0), optax.lamb(1e-3))
    # a weight-decay mask built from the leaves' shapes sees 1-D shards only
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    with pytest.raises(ValueError, match=r"after jaxcomm.sync_gradients do not shard"):
        _build(mesh, optax.adamw(1e-3, weight_decay=0.1, mask=mask))
    # optax's clip takes the norm of each device's pieces alone: refused, naming the twin
    with pytest.raises(ValueError, match=r"jaxcomm.sharded.clip_by_global_norm\)"):
        _build(mesh, optax.clip_by_global_norm(0.05), optax.adam(1e-3))


def test_apply_if_finite_is_refused(mesh):
    """Data parallelism skips a step whose mean gradient holds one inf on every device;
    on the shards each device would decide from its own piece (most take the step): the
    probe's gradient with one inf shows it, and the build refuses it."""
    tx = optax.apply_if_finite(optax.adam(1e-2), 3)
    with pytest.raises(
        ValueError,
        match=r"do not shard: after a gradient with one inf .*"
        r"apply_if_finite.*Use shard_optimizer=False",
    ):
        _build(mesh, tx)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"sync": optax.identity()}, ValueError, "the sync first"),
        ({"sync": jaxcomm.sync_gradients(compression=topk(0.1))}, ValueError, "no reduce-scatter"),
        ({"sync": jaxcomm.sync_gradients(warmup_steps=3)}, NotImplementedError, "warmup_steps"),
        ({"param_gather": fp16()}, ValueError, "all_gather"),
        ({"microbatches": 2, "accumulate": "overlap"}, NotImplementedError, "accumulate"),
        ({"sync": jaxcomm.sync_gradients(algorithm="flat")}, NotImplementedError, "algorithm"),
        ({"sync": jaxcomm.sync_gradients(min_size=0)}, NotImplementedError, "min_size"),
    ],
)
def test_unsupported_settings_are_refused(mesh, kw, error, match):
    with pytest.raises(error, match=match):
        _build(mesh, optax.adam(1e-3), **kw)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: optax.named_chain(*((str(k), t) for k, t in enumerate(tx))),
        lambda tx: optax.MultiSteps(optax.chain(*tx), every_k_schedule=2),
        lambda tx: optax.inject_hyperparams(lambda: optax.chain(*tx))(),
    ],
    ids=["named_chain", "multi_steps", "inject_hyperparams"],
)
def test_a_wrapped_chain_is_refused_by_name(mesh, wrap):
    """shard_optimizer=True splits the optimizer at the sync; a chain inside an optax
    wrapper (here with a clip before the sync, which would clip each device's own
    gradient) is refused when the step is built, not run silently."""
    tx = wrap([optax.clip_by_global_norm(0.05), jaxcomm.sync_gradients(), optax.sgd(0.1)])
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_optimizer=True)
    with pytest.raises(ValueError, match=r"needs the optimizer as optax.chain.*the sync first"):
        dp.init(mlp_init(jax.random.key(0)))


def test_param_gather_needs_shard_optimizer(mesh):
    with pytest.raises(ValueError, match="needs shard_optimizer=True"):
        jaxcomm.data_parallel(
            mlp_loss, optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-3)), mesh,
            param_gather=bf16(),
        )  # fmt: skip


def test_fit_bench_predicts_memory_and_trains_what_fits():
    """``python -m experiments.bench zero --fit``'s rows on a small MLP under a limit of
    3x its params on every device: sharded Adam state is 1/8 per device and, with a
    bucket per layer, the sharded step fits and trains; data parallelism (about 4x the
    params per device) and one bucket per dtype (about 4.5x) do not, and are not run."""
    from experiments.bench import zero

    layer = 256 * 256 * 4
    res = zero.fit(256, 8, 2, limit_bytes=3 * 8 * 8 * layer, bucket_bytes=layer, check_replicas=1)
    z, one, dp = (res["rows"][k] for k in ("zero-f32", "zero-f32-one-bucket", "dp-f32"))
    adam = dp["opt_state_bytes_per_device"]
    assert z["opt_state_bytes_per_device"] == pytest.approx(adam / 8, rel=1e-3)
    assert z["total_peak_bytes"] < 0.75 * dp["total_peak_bytes"] < one["total_peak_bytes"]
    assert z["fits"] and z["losses"][-1] < z["losses"][0] and z["peak_rss_bytes"] > 0
    for r in (one, dp):
        assert not r["fits"] and "losses" not in r
    text = zero._fit_table(res)
    assert "zero-f32-one-bucket" in text and text.count("not run") == 2
