"""Sharded optimizer state under the Flax front ends: ``nnx_data_parallel(mesh,
shard_optimizer=True)`` and ``linen_data_parallel(mesh, shard_optimizer=True)``."""

import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_replicas_equal, assert_trees_bitwise_equal, launch_two_processes
from mlp import mlp_loss
from test_flax import Linear, batch, linen_batch, linen_state, linen_step, setup, step_body

import jaxcomm
from jaxcomm.compression import bf16, int8
from jaxcomm.nnx import key_data
from jaxcomm.sharded import ShardedState, per_device_bytes
from jaxcomm.state import unwrap_per_device

STEPS = 5
WORKER = str(Path(__file__).with_name("_dist_flax_worker.py"))


def _adamw(eps=1e-8):
    # clip_by_global_norm after the sync: its norm is summed over the shards
    return optax.chain(
        jaxcomm.sync_gradients(),
        jaxcomm.sharded.clip_by_global_norm(0.5),
        optax.adamw(1e-2, eps=eps, weight_decay=0.1),
    )


def _nnx_run(mesh, steps=STEPS, **kw):
    model, optimizer, metrics = setup(_adamw(), model=Linear(nnx.Rngs(0)))
    step = jaxcomm.nnx_data_parallel(mesh, check_replicas=1, **kw)(step_body)
    for i in range(steps):
        step(model, optimizer, metrics, batch(i))
    return model, optimizer, metrics, step


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_nnx_sharded_equals_replicated_optimizer(mesh):
    """AdamW with clipping after the sync: the sharded step's params and metrics equal
    data parallelism's within f32 tolerance; its Adam moments take 1/N per device."""
    m_dp, o_dp, met_dp, _ = _nnx_run(mesh)
    m_z, o_z, met_z, step = _nnx_run(mesh, shard_optimizer=True)
    for a, b in zip(_params(m_dp), _params(m_z), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(met_z.compute()["loss"], met_dp.compute()["loss"], rtol=1e-5)
    assert isinstance(unwrap_per_device(nnx.as_pure(o_z.opt_state)), ShardedState)
    assert step.per_device_paths  # the moments' chunks
    dense = per_device_bytes(nnx.state(o_dp, nnx.optimizer.OptState))
    sharded = per_device_bytes(nnx.state(o_z, nnx.optimizer.OptState))
    assert sharded < 0.2 * dense  # ~1/8 of the moments, plus the replicated counts
    assert assert_replicas_equal(key_data(nnx.state(m_z))) > 0


@pytest.mark.parametrize("gather", [bf16, int8])
def test_nnx_param_gather_replicas_agree_bit_for_bit(mesh, gather):
    model, _, _, _ = _nnx_run(mesh, steps=3, shard_optimizer=True, param_gather=gather())
    reference, _, _, _ = _nnx_run(mesh, steps=3, shard_optimizer=True)
    assert assert_replicas_equal(nnx.state(model, nnx.Param)) > 0
    for a, b in zip(_params(reference), _params(model), strict=True):
        np.testing.assert_allclose(b, a, atol=0.05 * np.abs(a).max())  # the wire's rounding


def _linen_sgd(mesh, lr, *, comp=None, **kw):
    """``(initial params, params after 3 steps)`` of the Linen step with SGD."""
    tx = optax.chain(jaxcomm.sync_gradients(compression=comp), optax.sgd(lr))
    step = jaxcomm.linen_data_parallel(mesh, check_replicas=1, **kw)(linen_step)
    state = linen_state(tx)
    p0 = state.params
    for i in range(3):
        state, _ = step(state, linen_batch(i))
    assert assert_replicas_equal(key_data(state.params)) > 0
    return p0, state.params


def _off_bound(p0, ref, params):
    """Leaves of ``params`` farther from the replicated f32 optimizer's ``ref`` than the
    wire's rounding allows: SGD maps the gradient's error linearly to the params, and
    int8 with blocks rounds each of the two reduce-scatter stages by at most a quantum,
    1/127 of a block's absmax (about 3 rms for 256 Gaussian values): at most 2 x 3 / 127
    ~ 5% of the move, bounded by 10%; the bf16 gather rounds each param to 2**-8
    relative; plus f32 noise (1e-6 per element) for a bias whose gradient is rounding
    noise (the Dense before BatchNorm)."""
    off = []
    for path, a, b, c in zip(
        jax.tree_util.tree_flatten_with_path(ref)[0],
        *(jax.tree.leaves(t) for t in (ref, params, p0)),
        strict=True,
    ):
        a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
        bound = 0.1 * np.linalg.norm(a - c) + 2**-8 * np.linalg.norm(a) + 1e-6 * np.sqrt(a.size)
        if np.linalg.norm(b - a) > bound:
            off.append(jax.tree_util.keystr(path[0]))
    return off


def test_linen_int8_gradients_and_bf16_gathers(mesh):
    """qgZ + qwZ under Linen: int8 reduce-scatters (dithered by the state's step count)
    and bf16 gathers; replicas bit-equal, each param leaf within the codecs' rounding of
    the replicated f32 optimizer's after 3 SGD steps. The bound rejects a step that does
    not train (``sgd(0.0)``)."""
    p0, ref = _linen_sgd(mesh, 0.1)
    _, params = _linen_sgd(mesh, 0.1, comp=int8(), shard_optimizer=True, param_gather=bf16())
    assert _off_bound(p0, ref, params) == []
    _, still = _linen_sgd(mesh, 0.0, comp=int8(), shard_optimizer=True, param_gather=bf16())
    assert len(_off_bound(p0, ref, still)) >= 5  # every leaf that moves


def test_linen_sharded_equals_replicated_optimizer(mesh):
    """A Linen TrainState with batch statistics, dropout keys and a field set after
    apply_gradients: sharded equals unsharded within f32 tolerance, over three steps.

    The Dense bias before BatchNorm gets a gradient of f32 rounding noise (the norm
    removes it), which Adam would scale up to a full step of either sign, whichever way a
    reduce-scatter or an all-reduce rounds it: ``eps=1e-3`` keeps that noise small."""
    out = {}
    for shard in (False, True):
        step = jaxcomm.linen_data_parallel(mesh, check_replicas=1, shard_optimizer=shard)(
            linen_step
        )
        state = linen_state(_adamw(eps=1e-3))
        for i in range(3):
            state, metrics = step(state, linen_batch(i))
        out[shard] = (state, metrics)
    (dp, m_dp), (z, m_z) = out[False], out[True]
    assert isinstance(unwrap_per_device(z.opt_state), ShardedState)
    for a, b in zip(jax.tree.leaves(dp.params), jax.tree.leaves(z.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(m_z["loss"]), float(m_dp["loss"]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(z.mask), np.asarray(dp.mask))
    assert assert_replicas_equal(key_data(z.params)) > 0


def test_orbax_checkpoint_resumes_bit_for_bit(mesh, tmp_path):
    """NNX: the sharded state saved by orbax after 2 steps, restored into a fresh model
    and optimizer laid out sharded (``shard_optimizer_state``), trains on to the
    uninterrupted run's params and optimizer state bit for bit."""
    import orbax.checkpoint as ocp

    def fresh():
        model, optimizer, metrics = setup(_adamw(), model=Linear(nnx.Rngs(0)))
        step = jaxcomm.nnx_data_parallel(mesh, shard_optimizer=True, check_replicas=1)(step_body)
        return model, optimizer, metrics, step

    def pure(model, optimizer):
        return nnx.as_pure(nnx.state((model, optimizer)))

    model, optimizer, metrics, step = fresh()
    for i in range(4):
        step(model, optimizer, metrics, batch(i))
    straight = pure(model, optimizer)

    model, optimizer, metrics, step = fresh()
    for i in range(2):
        step(model, optimizer, metrics, batch(i))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", pure(model, optimizer))
    checkpointer.wait_until_finished()

    model, optimizer, metrics, step = fresh()
    step.shard_optimizer_state(model, optimizer)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        pure(model, optimizer),
    )
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    nnx.update((model, optimizer), restored)
    for i in range(2, 4):
        step(model, optimizer, metrics, batch(i))
    assert_trees_bitwise_equal(pure(model, optimizer), straight)


def test_linen_shard_optimizer_state_returns_the_laid_out_state(mesh):
    step = jaxcomm.linen_data_parallel(mesh, shard_optimizer=True)(linen_step)
    state = step.shard_optimizer_state(linen_state(_adamw()))
    assert isinstance(unwrap_per_device(state.opt_state), ShardedState)
    state, _ = step(state, linen_batch(0))  # taken as it is
    assert int(state.step) == 1
    with pytest.raises(ValueError, match="shard_optimizer=True"):
        jaxcomm.linen_data_parallel(mesh)(linen_step).shard_optimizer_state(state)


def test_a_trained_optimizer_state_is_not_resharded(mesh):
    """Moments an unsharded step has trained would be lost: refused."""
    model, optimizer, metrics = setup(_adamw(), model=Linear(nnx.Rngs(0)))
    jaxcomm.nnx_data_parallel(mesh, check_replicas=1)(step_body)(
        model, optimizer, metrics, batch(0)
    )
    step = jaxcomm.nnx_data_parallel(mesh, shard_optimizer=True)(step_body)
    with pytest.raises(ValueError, match="not the one its init gives"):
        step(model, optimizer, metrics, batch(1))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"param_gather": bf16()}, ValueError, r"param_gather=.*needs shard_optimizer=True"),
        (
            {"shard_bucket_bytes": 1024},
            ValueError,
            r"shard_bucket_bytes=1024\) needs shard_optimizer=True",
        ),
        ({"shard_optimizer": 1}, TypeError, r"shard_optimizer=1\) must be True or False"),
        (
            {"shard_optimizer": True, "param_gather": "bf16"},
            ValueError,
            r"param_gather='bf16'\): expected None .*bf16\(\), int8\(\) or int4\(\)",
        ),
        (
            {"shard_optimizer": True, "shard_bucket_bytes": 0},
            ValueError,
            r"shard_bucket_bytes\)=0 must be an integer >= 1",
        ),
    ],
)
def test_bad_sharding_arguments_are_refused_at_construction(mesh, kwargs, error, match):
    """The same checks, naming the value and what is allowed, on every step builder."""
    tx = optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-2))
    builders = {
        "nnx_data_parallel": jaxcomm.nnx_data_parallel,
        "linen_data_parallel": jaxcomm.linen_data_parallel,
        "data_parallel": lambda mesh, **kw: jaxcomm.data_parallel(mlp_loss, tx, mesh, **kw),
    }
    for name, build in builders.items():
        with pytest.raises(error, match=name + r"\(" + match):
            build(mesh, **kwargs)


@pytest.mark.parametrize(
    "transforms,match",
    [
        ((optax.adam(1e-2), optax.scale_by_trust_ratio()), r"do not shard: on the .* pieces"),
        ((optax.apply_if_finite(optax.adam(1e-2), 3),), r"do not shard: after .* one inf"),
    ],
    ids=["trust_ratio", "apply_if_finite"],
)
def test_a_transform_that_does_not_shard_is_refused_at_the_first_call(mesh, transforms, match):
    tx = optax.chain(jaxcomm.sync_gradients(), *transforms)
    model, optimizer, metrics = setup(tx, model=Linear(nnx.Rngs(0)))
    step = jaxcomm.nnx_data_parallel(mesh, shard_optimizer=True)(step_body)
    with pytest.raises(ValueError, match=r"nnx_data_parallel\(shard_optimizer=True\).*" + match):
        step(model, optimizer, metrics, batch(0))


def test_the_compute_only_twin_is_refused(mesh):
    model, optimizer, metrics = setup(_adamw(), model=Linear(nnx.Rngs(0)))
    step = jaxcomm.nnx_data_parallel(mesh, shard_optimizer=True)(step_body)
    with pytest.raises(NotImplementedError, match="compute-only twin"):
        step.compile(model, optimizer, metrics, batch(0), communicate=False)


def test_two_processes_train_sharded_nnx_state_alike():
    """Two processes of two devices each: the sharded NNX step (f32 and bf16 gathers)
    and the hybrid one (shard_params=True, a process a node) lay out and train the state
    alike on both, replicas compared every step, equal to the unsharded step."""
    out = launch_two_processes(sys.executable, WORKER, "sharded", timeout=120)
    for rank in (0, 1):
        assert f"[{rank}] SHARDED_F32_OK" in out and f"[{rank}] SHARDED_BF16_OK" in out, out
        assert f"[{rank}] HYBRID_OK" in out, out


def _no_bias(p):
    """Weight decay on every param but the biases, chosen by path."""
    return jax.tree_util.tree_map_with_path(lambda k, _: "bias" not in jax.tree_util.keystr(k), p)


def test_nnx_weight_decay_mask_by_path_equals_replicated_optimizer(mesh):
    """The mask sees the pieces in the optimizer's own tree (the nnx.State's paths): the
    biases (set to 1.0, so that a decay of them shows: 0.05 per step) are not decayed,
    as in data parallelism."""
    out = []
    for shard in (False, True):
        model = Linear(nnx.Rngs(0))
        model.linear.bias[...] = model.linear.bias[...] + 1.0
        tx = optax.chain(
            jaxcomm.sync_gradients(), optax.adamw(1e-2, weight_decay=0.5, mask=_no_bias)
        )
        model, optimizer, metrics = setup(tx, model=model)
        step = jaxcomm.nnx_data_parallel(mesh, check_replicas=1, shard_optimizer=shard)
        step = step(step_body)
        for i in range(STEPS):
            step(model, optimizer, metrics, batch(i))
        out.append(_params(model))
    for a, b in zip(*out, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_linen_weight_decay_mask_by_path_equals_replicated_optimizer(mesh):
    """Linen: the mask sees the pieces in the TrainState params' own tree; the biases (set
    to 1.0, so that a decay of them shows) are not decayed, as in data parallelism."""
    out = []
    for shard in (False, True):
        tx = optax.chain(
            jaxcomm.sync_gradients(),
            optax.adamw(1e-2, eps=1e-3, weight_decay=0.5, mask=_no_bias),
        )
        state = linen_state(tx)
        one = lambda k, x: x + 1.0 if "bias" in jax.tree_util.keystr(k) else x  # noqa: E731
        state = state.replace(params=jax.tree_util.tree_map_with_path(one, state.params))
        step = jaxcomm.linen_data_parallel(mesh, check_replicas=1, shard_optimizer=shard)
        step = step(linen_step)
        for i in range(3):
            state, _ = step(state, linen_batch(i))
        out.append([np.asarray(x) for x in jax.tree.leaves(state.params)])
    for a, b in zip(*out, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_nnx_checkpoint_restores_under_other_buckets(mesh, tmp_path):
    """A sharded state saved with a bucket per leaf (``shard_bucket_bytes=64``) restores
    into a step with one bucket (the default): the state is one piece per param leaf
    whatever the buckets, so the run goes on as the uninterrupted one."""
    import orbax.checkpoint as ocp

    def fresh(bucket_bytes):
        model, optimizer, metrics = setup(_adamw(), model=Linear(nnx.Rngs(0)))
        step = jaxcomm.nnx_data_parallel(
            mesh, shard_optimizer=True, shard_bucket_bytes=bucket_bytes, check_replicas=1
        )(step_body)
        return model, optimizer, metrics, step

    def pure(model, optimizer):
        return nnx.as_pure(nnx.state((model, optimizer)))

    model, optimizer, metrics, step = fresh(None)
    for i in range(4):
        step(model, optimizer, metrics, batch(i))
    straight = _params(model)

    model, optimizer, metrics, step = fresh(64)
    for i in range(2):
        step(model, optimizer, metrics, batch(i))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", pure(model, optimizer))
    checkpointer.wait_until_finished()

    model, optimizer, metrics, step = fresh(None)
    step.shard_optimizer_state(model, optimizer)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        pure(model, optimizer),
    )
    nnx.update((model, optimizer), checkpointer.restore(tmp_path / "ckpt", target))
    for i in range(2, 4):
        step(model, optimizer, metrics, batch(i))
    for a, b in zip(straight, _params(model), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
