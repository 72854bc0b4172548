"""Issue 29 for the Flax front ends: every way a step can be written is either equal to the
one-device computation of the same script or refused when the step is built."""

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_replicas_equal, launch_two_processes
from test_flax import linen_batch, linen_state, linen_step

import jaxcomm
from jaxcomm.nnx import key_data

WORKER = str(Path(__file__).with_name("_dist_flax_worker.py"))
MASK = (np.arange(64 * 10).reshape(64, 10) % 3 != 0).astype(np.float32)  # zeroes a third


def batch(seed=0, n=32):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 64)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }


def nnx_objs(sync: bool):
    model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
    tx = optax.adamw(1e-2)
    tx = optax.chain(jaxcomm.sync_gradients(), tx) if sync else tx
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def max_norm(w, limit):
    return w * jnp.minimum(1.0, limit / jnp.linalg.norm(w))


def params_of(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


# -- item 2: a param changed after the optimizer's update is kept --------------------------


def edit_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: xent(m(batch["x"]), batch["y"]))(model)
    optimizer.update(model, grads)
    model.kernel[...] = model.kernel[...] * MASK  # pruning mask
    model.bias[...] = max_norm(model.bias[...], 0.05)  # max-norm constraint
    return {"loss": loss}


def test_nnx_param_changed_after_update_is_kept(mesh):
    original = optax.apply_updates
    dp_model, dp_opt = nnx_objs(sync=True)
    one_model, one_opt = nnx_objs(sync=False)
    step = jaxcomm.nnx_data_parallel(mesh, check_replicas=1)(edit_step)
    one = nnx.jit(edit_step)
    for i in range(2):
        step(dp_model, dp_opt, batch(i))
        one(one_model, one_opt, batch(i))
    kernel = np.asarray(dp_model.kernel[...])
    assert np.all(kernel[MASK == 0] == 0)  # the mask survived the step
    assert np.linalg.norm(np.asarray(dp_model.bias[...])) <= 0.05 * (1 + 1e-6)
    for got, want in zip(params_of(dp_model), params_of(one_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert assert_replicas_equal(key_data(nnx.state((dp_model, dp_opt)))) > 0
    assert optax.apply_updates is original  # substituted only while the step is traced


def test_linen_params_replaced_after_apply_gradients_are_kept(mesh):
    model = nn.Dense(10)
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))["params"]

    def state(tx):
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        def loss_fn(p):
            return xent(state.apply_fn({"params": p}, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads=grads)
        p = state.params
        new = {"kernel": p["kernel"] * MASK, "bias": max_norm(p["bias"], 0.05)}
        return state.replace(params=new), {"loss": loss}

    dp = jaxcomm.linen_data_parallel(mesh, check_replicas=1)(step)
    one = jax.jit(step)
    a = state(optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-2)))
    b = state(optax.adamw(1e-2))
    for i in range(2):
        a, _ = dp(a, batch(i))
        b, _ = one(b, batch(i))
    assert np.all(np.asarray(a.params["kernel"])[MASK == 0] == 0)
    for got, want in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert assert_replicas_equal(a) > 0


def test_param_changed_from_the_batch_is_refused(mesh):
    def step(model, optimizer, batch):
        edit_step(model, optimizer, batch)
        model.bias[...] += batch["x"].mean()  # this device's part of the batch only

    with pytest.raises(ValueError, match=r"param .*bias.* different on each device"):
        jaxcomm.nnx_data_parallel(mesh)(step)(*nnx_objs(sync=True), batch())


# -- item 3: what the step returns, combined by what it is ---------------------------------


def output_step(model, optimizer, batch, *, mark=lambda op, x: x):
    def loss_fn(model):
        logits = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses.mean(), (logits, losses)

    (loss, (logits, losses)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    correct = (logits.argmax(-1) == batch["y"]).sum()
    return {
        "loss": loss,  # float scalar: averaged
        "logits": logits,  # per example: gathered in batch order
        "correct": mark("sum", correct),
        "worst": mark("max", losses.max()),
        "bias": model.bias[...],  # the same on every device: as it is
    }


def test_nnx_outputs_per_example_gathered_reductions_as_marked(mesh):
    ops = {"sum": jaxcomm.outputs.sum, "max": jaxcomm.outputs.max}
    dp = jaxcomm.nnx_data_parallel(mesh)(
        lambda m, o, b: output_step(m, o, b, mark=lambda op, x: ops[op](x))
    )
    got = dp(*nnx_objs(sync=True), batch())
    want = nnx.jit(output_step)(*nnx_objs(sync=False), batch())
    assert got["logits"].shape == (32, 10)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    assert int(got["correct"]) == int(want["correct"]) and got["correct"].dtype == jnp.int32
    np.testing.assert_allclose(got["worst"], want["worst"], rtol=1e-6)
    assert got["bias"].shape == (10,)
    np.testing.assert_allclose(got["bias"], want["bias"], rtol=1e-5, atol=1e-6)


def test_linen_per_example_outputs_are_gathered(mesh):
    def step(state, batch):
        state, metrics = linen_step(state, batch)
        logits = state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats}, batch["x"], train=False
        )
        return state, {**metrics, "pred": logits.argmax(-1)}

    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    state, out = jaxcomm.linen_data_parallel(mesh)(step)(linen_state(tx), linen_batch())
    assert out["pred"].shape == (32,)
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        linen_batch()["x"],
        train=False,
    )
    np.testing.assert_array_equal(out["pred"], logits.argmax(-1))


def test_integer_scalar_output_is_refused(mesh):
    with pytest.raises(TypeError, match=r"\['correct'\].*Mark it: jaxcomm.outputs.sum"):
        jaxcomm.nnx_data_parallel(mesh)(output_step)(*nnx_objs(sync=True), batch())


# -- item 7: a legacy raw key is folded per device ------------------------------------------


def test_linen_legacy_raw_key_draws_per_device_masks(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    step = jaxcomm.linen_data_parallel(mesh, check_replicas=1)(linen_step)
    raw = jax.random.PRNGKey(1)
    state, _ = step(linen_state(tx, key=raw), linen_batch())
    # Device d draws from fold_in(key, d), as with a typed key: the stored mask is the mean
    # of the 8 devices' masks (linen_step: fold_in(fold_in(key, step), 7)).
    want = np.mean(
        [
            jax.random.bernoulli(
                jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(raw, d), 0), 7),
                0.5,
                (256,),
            )
            for d in range(8)
        ],
        axis=0,
    )
    np.testing.assert_array_equal(np.asarray(state.mask), want)
    assert np.any((want > 0) & (want < 1))  # the devices' masks differ
    np.testing.assert_array_equal(np.asarray(state.key), np.asarray(raw))  # stored as it was
    typed, _ = step(linen_state(tx, key=jax.random.key(1)), linen_batch())
    np.testing.assert_array_equal(np.asarray(state.mask), np.asarray(typed.mask))
    assert assert_replicas_equal(state) > 0


def test_linen_raw_key_shaped_field_without_a_key_name_is_refused(mesh):
    class State(train_state.TrainState):
        seed_pair: jax.Array

    state = linen_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)))
    state = State.create(
        apply_fn=state.apply_fn, params=state.params, tx=state.tx, seed_pair=jnp.zeros(2, "uint32")
    )
    step = jaxcomm.linen_data_parallel(mesh)(lambda s, b: (s, {}))
    with pytest.raises(ValueError, match=r"seed_pair .*legacy raw key.*jax.random.key\(seed\)"):
        step(state, linen_batch())


# -- issue 41 item 4: a transform before the sync, in any wrapper, checked at the sync -------
_BEFORE_SYNC = r"sync_gradients receives gradients transformed.*does not commute with the mean"


@pytest.mark.parametrize("wrap", ["chain", "named_chain", "inject_hyperparams"])
def test_nnx_clip_before_the_sync_is_refused(mesh, wrap):
    parts = (optax.clip_by_global_norm(0.05), jaxcomm.sync_gradients(), optax.sgd(0.1))
    tx = {
        "chain": lambda: optax.chain(*parts),
        "named_chain": lambda: optax.named_chain(*zip("abc", parts, strict=True)),
        "inject_hyperparams": lambda: optax.inject_hyperparams(
            lambda learning_rate: optax.chain(*parts[:2], optax.sgd(learning_rate))
        )(learning_rate=0.1),
    }[wrap]()
    model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @jaxcomm.nnx_data_parallel(mesh)
    def step(model, optimizer, batch):
        grads = nnx.grad(lambda m: xent(m(batch["x"]), batch["y"]))(model)
        optimizer.update(model, grads)

    with pytest.raises(ValueError, match="nnx_data_parallel: jaxcomm." + _BEFORE_SYNC):
        step(model, optimizer, batch())


def test_linen_clip_before_the_sync_is_refused(mesh):
    tx = optax.chain(optax.clip_by_global_norm(0.05), jaxcomm.sync_gradients(), optax.sgd(0.1))
    step = jaxcomm.linen_data_parallel(mesh)(linen_step)
    with pytest.raises(ValueError, match="linen_data_parallel: jaxcomm." + _BEFORE_SYNC):
        step(linen_state(tx), linen_batch())


# -- item 6: processes that start from different params are refused ------------------------


def test_per_process_seeds_are_refused_at_the_first_call():
    # Also (issue 41 item 5, the same launch): each process's part of the batch refused at
    # the first call, naming shapes and the fix; a compile that fails on one process
    # makes every process raise (tests/_dist_flax_worker.py, cases 3 and 4).
    out = launch_two_processes(sys.executable, WORKER, timeout=120)
    for rank in (0, 1):
        for case in ("SAME_SEED_OK", "REFUSED_OK", "PARTS_REFUSED_OK", "COMPILE_AGREED_OK"):
            assert f"[{rank}] {case}" in out, out
