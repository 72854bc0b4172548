"""The measured network in the loop of the Flax front ends: ``CommProfiler.drive`` on an
``nnx_data_parallel`` and a ``linen_data_parallel`` step."""

import os

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from helpers import assert_replicas_equal

import jaxcomm
from jaxcomm import hlo
from jaxcomm.nnx import key_data

C = jaxcomm.compression


def _tx():
    comp = C.adaptive(
        0.5, min_compression=0.0, adjustment_step=2, ladder=("f32", "bf16", "int8"),
        comm_low=0.15, comm_high=0.3,
    )  # fmt: skip
    return optax.chain(jaxcomm.sync_gradients(compression=comp, min_size=64), optax.sgd(0.05))


def _batch(n=16):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(n, 64)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }


def _drive_on_a_slow_link(prof, step, call, adaptive):
    """Runs 3 windows of 2 steps under a synthetic clock (1 s of compute; 5 s between
    calls, so a window reads 5 s from its first call to its end: 2.5 s per step, a share
    of 1 - 1 / 2.5 = 0.6, over ``comm_high``); returns the level after each window."""
    driver = step.feedback
    prof.compute_time, driver.compute0, driver.recent = 1.0, 1.0, [1.0]
    now = [0.0]
    driver._clock = lambda: now[0]
    levels = []
    for i in range(6):
        call()
        now[0] += 5.0
        if i % 2:
            levels.append(int(adaptive().level))
    return levels


def _check_drive(prof, twin, mesh, levels, adaptive):
    # The first window runs bf16 with the share unknown; the second window's first step
    # reads the share measured over it (0.6, written into the state) and moves to int8.
    assert levels == [1, 2, 2], levels
    assert [(c["from"], c["to"], c["reason"], c["step"]) for c in prof.level_changes] == [
        ("bf16", "int8", "network", 2)
    ]
    assert float(adaptive().comm_share) == pytest.approx(0.6)  # written inside the step
    assert [w["comm_share"] for w in prof.windows] == pytest.approx([0.6] * 3)
    # The census is the driven step's; the twin sends none of the sync's collectives:
    # what is left are the metrics' scalars.
    assert max(c.operand_elements for c in prof.module.collectives) >= 160
    twin = hlo.parse_collectives(twin.as_text(), mesh=mesh)
    assert all(c.operand_elements <= 8 for c in twin.collectives), twin.collectives


class _Linear(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_nnx_step_is_driven(mesh):
    model = _Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))

    @jaxcomm.nnx_data_parallel(mesh, check_replicas=1)
    def train_step(model, optimizer, metrics, batch):
        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)

    batch = _batch()
    twin = train_step.compile(model, optimizer, metrics, batch, communicate=False)
    prof = jaxcomm.CommProfiler(log_file=os.devnull)
    prof.drive(train_step, model, optimizer, metrics, batch, twin_reps=1, calibrate=False,
               retime_twin=0)  # fmt: skip
    adaptive = lambda: optimizer.opt_state[0].compression  # noqa: E731
    levels = _drive_on_a_slow_link(
        prof, train_step, lambda: train_step(model, optimizer, metrics, batch), adaptive
    )
    _check_drive(prof, twin, mesh, levels, adaptive)
    assert assert_replicas_equal(key_data(nnx.state((model, optimizer)))) > 0
    assert np.isfinite(float(metrics.compute()["loss"]))


def test_linen_step_is_driven(mesh):
    model = nn.Dense(10)
    params = model.init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=_tx())

    @jaxcomm.linen_data_parallel(mesh, check_replicas=1)
    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    batch = _batch()
    twin = train_step.compile(state, batch, communicate=False)
    prof = jaxcomm.CommProfiler(log_file=os.devnull)
    # Calibrated: each rung timed once on a copy of the state set to it.
    prof.drive(train_step, state, batch, twin_reps=1, retime_twin=0)
    assert len(prof.kernel_times) == 3 and int(state.opt_state[0].compression.level) == 1
    train_step.feedback.kernel = [0.0] * 3  # the synthetic clock below has no kernels
    box = [state]

    def call():
        box[0], metrics = train_step(box[0], batch)
        assert np.isfinite(float(metrics["loss"]))

    adaptive = lambda: box[0].opt_state[0].compression  # noqa: E731
    levels = _drive_on_a_slow_link(prof, train_step, call, adaptive)
    _check_drive(prof, twin, mesh, levels, adaptive)
    assert assert_replicas_equal(box[0]) > 0


def test_drive_refuses_what_it_cannot_drive(mesh):
    model = _Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)),
                              wrt=nnx.Param)  # fmt: skip

    @jaxcomm.nnx_data_parallel(mesh)
    def train_step(model, optimizer, batch):
        grads = nnx.grad(lambda m: (m(batch["x"]) ** 2).mean())(model)
        optimizer.update(model, grads)

    with pytest.raises(ValueError, match="no adaptive compressor"):
        jaxcomm.CommProfiler().drive(train_step, model, optimizer, _batch())
    with pytest.raises(TypeError, match="nnx_data_parallel"):
        jaxcomm.CommProfiler().drive(lambda *a: None, model, optimizer, _batch())
    pmap_step = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(lambda state, batch: state)
    with pytest.raises(TypeError, match="pmap_data_parallel.*linen_data_parallel"):
        jaxcomm.CommProfiler().drive(pmap_step, None, _batch())
