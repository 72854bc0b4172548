"""Every front end goes on after a restart on fewer devices (``jaxcomm.elastic``): the NNX
and Linen decorators (per-device state in their objects, a sharded optimizer's chunks) and
the pmap entry (per-device state held by the step object), saved on 8 devices, restored
onto 4 (a 2x2 mesh of the first 4), trained on, against the uninterrupted 8-device run.
``tests/test_elastic.py`` covers ``data_parallel``."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax import lax
from jax.sharding import Mesh
from mlp import mlp_batches, mlp_init, mlp_logits, mlp_loss

import jaxcomm
from jaxcomm import elastic
from jaxcomm.checkpoint import Checkpointer
from jaxcomm.pmap import first_row

AX = ("inter", "intra")
BATCH = 24  # divides over 8 and 4 devices
SAVE_AT, STEPS = 3, 6
BATCHES = mlp_batches(STEPS, size=BATCH)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]).reshape(2, n // 2), AX)


def _tx(sync):
    if sync == "f32":
        return optax.chain(jaxcomm.sync_gradients(), optax.adam(3e-2))
    int8 = jaxcomm.compression.int8(error_feedback=True)
    return optax.chain(jaxcomm.sync_gradients(compression=int8, min_size=0), optax.adam(3e-2))


def _close(a, b):
    # f32 rounding of another reduction order: 8 devices' partial means summed vs 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# -- the three front ends, each: build, fresh state, run, params --------------------------


class _Mlp(nnx.Module):
    """tests/mlp.py's MLP (the same initial params) as an NNX module."""

    def __init__(self):
        (first, second) = mlp_init(jax.random.key(0))
        self.w0, self.b0 = nnx.Param(first["w"]), nnx.Param(first["b"])
        self.w1, self.b1 = nnx.Param(second["w"]), nnx.Param(second["b"])

    def params(self):
        return [{"w": self.w0[...], "b": self.b0[...]}, {"w": self.w1[...], "b": self.b1[...]}]


def _nnx_loss(model, batch):
    return mlp_loss(model.params(), batch)


class Nnx:
    def build(self, mesh, shard):
        @jaxcomm.nnx_data_parallel(mesh, shard_optimizer=shard)
        def step(model, optimizer, batch):
            optimizer.update(model, nnx.grad(_nnx_loss)(model, batch))

        return step

    def fresh(self, sync):
        model = _Mlp()
        return (model, nnx.Optimizer(model, _tx(sync), wrt=nnx.Param))

    def run(self, step, state, batches):
        for b in batches:
            step(*state, b)
        return state

    def params(self, state):
        return state[0].params()

    def step_count(self, state):
        return int(state[1].step[...])

    def opt_state(self, state):
        return nnx.as_pure(state[1].opt_state)


class Linen:
    def build(self, mesh, shard):
        @jaxcomm.linen_data_parallel(mesh, shard_optimizer=shard)
        def step(state, batch):
            grads = jax.grad(mlp_loss)(state.params, batch)
            return state.apply_gradients(grads=grads), {}

        return step

    def fresh(self, sync):
        return (
            TrainState.create(
                apply_fn=mlp_logits, params=mlp_init(jax.random.key(0)), tx=_tx(sync)
            ),
        )

    def run(self, step, state, batches):
        (s,) = state
        for b in batches:
            s, _ = step(s, b)
        return (s,)

    def params(self, state):
        return state[0].params

    def step_count(self, state):
        return int(state[0].step)

    def opt_state(self, state):
        return state[0].opt_state


def _pmap_step(state, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": lax.pmean(loss, "batch")}


class Pmap(Linen):
    """The current Flax form: the state once, the batch in rows (devices, per_device, ...)."""

    def build(self, mesh, shard):
        return jaxcomm.pmap_data_parallel(mesh, shard_optimizer=shard)(
            _pmap_step, in_axes=(None, 0), out_axes=(None, 0), axis_name="batch"
        )

    def run(self, step, state, batches):
        (s,) = state
        n = step.num_devices
        for b in batches:
            s, _ = step(s, jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), b))
        return (s,)


class PmapRows(Pmap):
    """The older Flax form: the state in pmap's rows (``jax_utils.replicate``'s layout),
    ``in_axes=0``; :func:`jaxcomm.elastic.restore` returns it once, the script replicates
    it as it does a fresh one."""

    def build(self, mesh, shard):
        return jaxcomm.pmap_data_parallel(mesh, shard_optimizer=shard)(
            _pmap_step, axis_name="batch"
        )

    def run(self, step, state, batches):
        (s,) = state
        n = step.num_devices
        if np.ndim(s.step) == 0:  # once: as rows, one per device
            s = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), s)
        for b in batches:
            s, _ = step(s, jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), b))
        return (s,)

    def _once(self, state):
        (s,) = state
        return jax.tree.map(first_row, s) if np.ndim(s.step) == 1 else s  # no collective

    def params(self, state):
        return self._once(state).params

    def step_count(self, state):
        return int(self._once(state).step)

    def opt_state(self, state):
        return self._once(state).opt_state


FRONT_ENDS = {"nnx": Nnx(), "linen": Linen(), "pmap": Pmap(), "pmap-rows": PmapRows()}


def _interrupted(fe, sync, shard, tmp_path, rule="mean"):
    """8 devices for SAVE_AT steps, saved, restored onto 4: ``(the 8-device state at the
    save, the 4-device step, the restored state, the checkpoint's data, the 8-device step)``."""
    step8 = fe.build(_mesh(8), shard)
    state = fe.run(step8, fe.fresh(sync), BATCHES[:SAVE_AT])
    ckpt = Checkpointer(tmp_path / "ckpt")
    elastic.save(ckpt, step8, *state, position=SAVE_AT, meta={"global_batch": BATCH})
    ckpt.close()
    saved = jax.tree.map(np.asarray, (fe.params(state), fe.opt_state(state)))
    step4 = fe.build(_mesh(4), shard)
    restored, data = elastic.restore(
        Checkpointer(tmp_path / "ckpt"), step4, *fe.fresh(sync), rule=rule, global_batch=BATCH
    )
    restored = restored if isinstance(restored, tuple) else (restored,)
    return saved, step8, step4, restored, data


@pytest.mark.parametrize(
    "name,shard",
    # Linen's sharded state takes NNX's path (the engine's chunks, stacked in the objects)
    [("nnx", False), ("nnx", True), ("linen", False), ("pmap-rows", False)],
    ids=["nnx", "nnx-sharded", "linen", "pmap-rows"],
)
def test_restored_on_fewer_devices_goes_on_as_the_uninterrupted_run(tmp_path, name, shard):
    """f32 sync, Adam: 3 steps on 8 devices, saved, restored onto 4, 3 more steps equal
    the 8-device run of 6 steps on the same global batches within f32 rounding of the
    other reduction order (rtol 2e-5); the restored params and replicated optimizer state
    are the saved ones bit for bit; a sharded optimizer's chunks are cut anew into 4."""
    fe = FRONT_ENDS[name]
    saved, step8, step4, restored, data = _interrupted(fe, "f32", shard, tmp_path)
    assert data["position"] == SAVE_AT and data["devices"] == 8
    assert data["front_end"] == name.removesuffix("-rows")
    assert fe.step_count(restored) == SAVE_AT
    assert _bits(fe.params(restored)) == _bits(saved[0])
    if not shard:
        assert _bits(fe.opt_state(restored)) == _bits(saved[1])
    else:  # Adam's moments in 4 pieces now; their elements are the saved ones
        chunks = [x for x in jax.tree.leaves(fe.opt_state(restored)) if np.ndim(x) == 2]
        assert chunks and all(x.shape[0] == 4 for x in chunks)
    resumed = fe.run(step4, restored, BATCHES[SAVE_AT:])
    straight = fe.run(step8, fe.fresh("f32"), BATCHES)
    assert fe.step_count(resumed) == fe.step_count(straight) == STEPS
    _close(fe.params(resumed), fe.params(straight))


@pytest.mark.parametrize("name", ["nnx", "pmap"])
def test_error_feedback_residuals_follow_the_rule(tmp_path, name):
    """int8 with error feedback: each device's residual (in the nnx.Optimizer, or held by
    the pmap step object) restored onto 4 devices is the mean of the 8 saved ones
    (rule='mean'), or zero (rule='zero'); everything replicated is as saved, bit for bit;
    the restored run trains on. (With compression the continued run is not the
    uninterrupted one: the 4-device mean is quantised otherwise.)"""
    fe = FRONT_ENDS[name]
    step8 = fe.build(_mesh(8), False)
    state = fe.run(step8, fe.fresh("int8"), BATCHES[:SAVE_AT])
    if name == "pmap":
        held = step8.per_device_state()["state_0"]["leaves"]
    else:
        held = [x for x in jax.tree.leaves(fe.opt_state(state)) if np.shape(x)[:1] == (8,)]
    old = [np.asarray(x) for x in held]
    assert old and all(len({r.tobytes() for r in x}) == 8 for x in old)  # one per device
    ckpt = Checkpointer(tmp_path / "ckpt")
    elastic.save(ckpt, step8, *state, position=SAVE_AT)
    ckpt.close()
    step4 = fe.build(_mesh(4), False)
    for rule in ("zero", "mean"):  # the second one trains on
        ckpt = Checkpointer(tmp_path / "ckpt")
        restored, _ = elastic.restore(ckpt, step4, *fe.fresh("int8"), rule=rule)
        ckpt.close()
        restored = restored if isinstance(restored, tuple) else (restored,)
        if name == "pmap":
            new = step4.per_device_state()["state_0"]["leaves"]
        else:
            new = [x for x in jax.tree.leaves(fe.opt_state(restored)) if np.shape(x)[:1] == (4,)]
        assert len(new) == len(old)
        for was, now in zip(old, new, strict=True):
            want = was.mean(0) if rule == "mean" else np.zeros_like(was[0])
            assert np.shape(now) == (4, *was.shape[1:])
            for r in range(4):
                np.testing.assert_allclose(np.asarray(now)[r], want, rtol=1e-6, atol=1e-7)
        assert _bits(fe.params(restored)) == _bits(fe.params(state))
    resumed = fe.run(step4, restored, BATCHES[SAVE_AT:])
    assert fe.step_count(resumed) == STEPS
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(fe.params(resumed)))


def test_a_checkpoint_of_another_front_end_or_model_is_refused(tmp_path):
    fe = FRONT_ENDS["linen"]
    step8 = fe.build(_mesh(8), False)
    state = fe.fresh("f32")
    ckpt = Checkpointer(tmp_path / "ckpt")
    elastic.save(ckpt, step8, *state, position=0)
    nnx_step = FRONT_ENDS["nnx"].build(_mesh(4), False)
    with pytest.raises(ValueError, match="written from a linen step.*this step is a nnx one"):
        elastic.restore(ckpt, nnx_step, *FRONT_ENDS["nnx"].fresh("f32"))
    other = TrainState.create(
        apply_fn=mlp_logits, params=mlp_init(jax.random.key(0), sizes=(12, 40, 3)), tx=_tx("f32")
    )
    with pytest.raises(ValueError, match=r"\['b'\] is float32\[32\], this run's float32\[40\]"):
        elastic.restore(ckpt, fe.build(_mesh(4), False), other)
    with pytest.raises(TypeError, match="is not a jaxcomm step"):
        elastic.save(ckpt, jax.jit(_pmap_step), *state, position=0)
    ckpt.close()
