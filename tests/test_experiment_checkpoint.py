"""Stopping and resuming the experiment's training from an orbax checkpoint is bit-identical
to an uninterrupted run: params, batch statistics, optimizer state (per-device state
included), step and data position."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from experiments import step as steplib
from experiments.data import SyntheticImages
from experiments.training import train
from jaxcomm.checkpoint import Checkpointer

STEPS, STOP = 4, 2


class _ResidualState(NamedTuple):
    residual: jaxcomm.PerDevice


def _per_device_residual():
    """A stand-in for an error-feedback buffer: per-device state that differs per device
    (it accumulates the gradient scaled by the device's position), so restoring it wrongly
    (replicated, re-initialised or shuffled) changes the final state."""

    def init(params):
        idx = jax.lax.axis_index(("inter", "intra")).astype(jnp.float32)
        return _ResidualState(
            jaxcomm.PerDevice(jax.tree.map(lambda p: jnp.full_like(p, idx), params))
        )

    def update(grads, state, params=None):
        idx = jax.lax.axis_index(("inter", "intra")).astype(jnp.float32)
        residual = jax.tree.map(lambda r, g: 0.5 * r + (idx + 1) * g, state.residual.value, grads)
        return grads, _ResidualState(jaxcomm.PerDevice(residual))

    return optax.GradientTransformation(init, update)


def _build(mesh, parts, kind="residual_transform"):
    schedule = steplib.learning_rate(lr=0.4, global_batch=16, warmup=1, total_steps=STEPS)
    if kind == "int8_error_feedback":  # the real thing: int8 with per-device residuals
        int8 = jaxcomm.compression.int8(error_feedback=True)
        sync = {"algorithm": "hierarchical", "compression": int8}
        tx = steplib.make_optimizer(sync, schedule)
    else:
        tx = steplib.make_optimizer(
            {"algorithm": "hierarchical"}, schedule, extra=[_per_device_residual()]
        )
    dp, state = steplib.build_step(parts, tx, mesh)
    data = SyntheticImages(
        dp.batch_sharding, global_batch=16, image_size=16, num_classes=10, seed=5
    )
    return dp, state, data


@pytest.mark.parametrize("kind", ["residual_transform", "int8_error_feedback"])
def test_stop_and_resume_is_bit_identical(mesh, tmp_path, kind):
    parts = steplib.make_model("resnet-micro", 10, seed=0)
    dp, state, data = _build(mesh, parts, kind)

    # The uninterrupted run.
    ref, ref_position, _ = train(dp, state, data, start=0, stop=STEPS)

    # The same run, stopped after STOP steps with a checkpoint ...
    fresh = dp.init(*jax.tree.map(np.array, (parts.params, parts.batch_stats)))
    ckpt = Checkpointer(tmp_path / "ckpt")
    meta = {"model": "resnet-micro"}
    _, position, _ = train(dp, fresh, data, start=0, stop=STOP, checkpointer=ckpt, meta=meta)
    assert position == STOP and ckpt.latest_step() == STOP
    ckpt.close()

    # ... and resumed from the checkpoint into a freshly initialised state (the target
    # gives shapes and shardings only), reading data from the saved position.
    like = dp.init(*jax.tree.map(np.array, (parts.params, parts.batch_stats)))
    ckpt2 = Checkpointer(tmp_path / "ckpt")
    restored, saved = ckpt2.restore(like)
    ckpt2.close()
    assert saved["position"] == STOP and saved["step"] == STOP and saved["model"] == "resnet-micro"
    assert int(restored.step) == STOP
    out, out_position, _ = train(dp, restored, data, start=saved["position"], stop=STEPS)

    assert out_position == ref_position == STEPS and int(out.step) == int(ref.step) == STEPS
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(ref), strict=True
    ):
        assert a.sharding == b.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), jax.tree_util.keystr(path))

    # The per-device state is really per device (8 different entries), and batch
    # statistics moved away from their initial values, so both paths were exercised.
    per_device = [
        x
        for x in jax.tree.leaves(out.opt_state, is_leaf=lambda x: isinstance(x, jaxcomm.PerDevice))
        if isinstance(x, jaxcomm.PerDevice)
    ]
    leaf = np.asarray(jax.tree.leaves(per_device[0].value)[0])
    assert leaf.shape[0] == 8 and len({leaf[i].tobytes() for i in range(8)}) == 8
    stats0 = jax.tree.leaves(parts.batch_stats)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(out.model_state), stats0, strict=True)
    )


def test_restore_refuses_another_structure(mesh, tmp_path):
    parts = steplib.make_model("resnet-micro", 10, seed=0)
    ckpt = Checkpointer(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(None)
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(
        steplib.make_loss_fn(parts.graphdef), tx, mesh, with_model_state=True, check_replicas=1
    )
    state = dp.init(parts.params, parts.batch_stats)
    ckpt.save(state, position=0)
    tx2 = optax.chain(jaxcomm.sync_gradients(), optax.adam(0.1))
    other = jaxcomm.data_parallel(
        steplib.make_loss_fn(parts.graphdef), tx2, mesh, with_model_state=True
    )
    with pytest.raises(ValueError, match="another structure"):
        ckpt.restore(other.init(parts.params, parts.batch_stats))
    ckpt.close()
