"""Flax NNX data parallelism (``jaxcomm.nnx_data_parallel``) and the Flax guardrails."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_replicas_equal

import jaxcomm
from jaxcomm.nnx import key_data


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, dropout: float = 0.2):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.linear = nnx.Linear(4 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn(self.conv(x))))
        return self.linear(x.reshape(x.shape[0], -1))


class Linear(nnx.Module):
    """The cheapest model for tests about state rather than layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.linear(x.reshape(x.shape[0], -1))


def logits_step(model, optimizer, metrics, batch):
    """One training step; returns the logits the metrics saw (gathered over devices)."""

    def loss_fn(model):
        logits = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses.mean(), (losses, logits)

    (_, (losses, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    metrics.update(loss=losses, logits=logits, labels=batch["y"])
    return logits


def step_body(model, optimizer, metrics, batch):
    logits_step(model, optimizer, metrics, batch)


def batch(seed=0, n=32):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }


def setup(tx=None, model=None):
    model = model or CNN(nnx.Rngs(0, dropout=1))
    tx = tx or optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def metric_state(metrics):
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(metrics))}


def test_metrics_and_params_equal_one_device_global_batch(mesh):
    """One data-parallel step on the global batch gives the one-device metrics (counts and
    correct predictions exactly) and params (to f32 rounding)."""
    dp_objs = setup(model=Linear(nnx.Rngs(0)))
    one_objs = setup(optax.adamw(1e-2), model=Linear(nnx.Rngs(0)))
    b = batch()
    jaxcomm.nnx_data_parallel(mesh)(step_body)(*dp_objs, b)
    nnx.jit(step_body)(*one_objs, b)
    got, want = metric_state(dp_objs[2]), metric_state(one_objs[2])
    assert got.keys() == want.keys() and len(got) == 4
    for k in got:
        if "count" in str(k) or "accuracy" in str(k):
            np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=str(k))
    assert int(got[("accuracy", "count")]) == 32
    for a, b_ in zip(
        jax.tree.leaves(nnx.state(dp_objs[0], nnx.Param)),
        jax.tree.leaves(nnx.state(one_objs[0], nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)


class Masks(nnx.Module):
    def __init__(self, rngs):
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.mask = nnx.BatchStat(jnp.zeros(256))


def mask_step(model):
    model.mask[...] = model.dropout(jnp.ones(256))


def test_dropout_masks_differ_across_devices_and_reproduce(mesh):
    step = jaxcomm.nnx_data_parallel(mesh)(mask_step)
    a = Masks(nnx.Rngs(dropout=3))
    step(a)
    mean = np.asarray(a.mask[...])
    # One device keeps 0 or 2 (rate 0.5); the mean of 8 equal masks too. Values in between
    # mean the devices drew different masks.
    assert np.any((mean > 0) & (mean < 2))
    first = mean.copy()
    step(a)
    assert not np.array_equal(np.asarray(a.mask[...]), first)  # the count advanced
    b = Masks(nnx.Rngs(dropout=3))
    step(b)
    np.testing.assert_array_equal(np.asarray(b.mask[...]), first)  # same seed, same masks
    assert assert_replicas_equal(key_data(nnx.state(a))) > 0


def test_cnn_replicas_agree_and_state_is_usable_afterwards(mesh, tmp_path):
    model, optimizer, metrics = setup()
    step = jaxcomm.nnx_data_parallel(mesh, check_replicas=1)(logits_step)
    seen = []
    for i in range(3):
        seen.append(np.asarray(step(model, optimizer, metrics, batch(i))))
    # The metrics, summed over devices, equal the accuracy and mean loss of the 96
    # predictions recomputed here from the gathered logits and the labels.
    logits = np.concatenate(seen)
    labels = np.concatenate([batch(i)["y"] for i in range(3)])
    assert logits.shape == (96, 10)
    got = metrics.compute()
    np.testing.assert_allclose(got["accuracy"], np.mean(logits.argmax(-1) == labels), rtol=1e-6)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(got["loss"], np.mean(loss), rtol=1e-5)
    assert int(metrics.accuracy.count[...]) == 96
    assert int(optimizer.step[...]) == 3
    assert assert_replicas_equal(key_data(nnx.state((model, optimizer, metrics)))) > 20
    # Running statistics moved (averaged across devices).
    assert not np.allclose(model.bn.mean[...], 0)
    # Ordinary Flax code afterwards, no mesh context.
    metrics.reset()
    model.eval()
    logits = nnx.jit(lambda m, x: m(x))(model, batch(5)["x"])
    assert logits.shape == (32, 10)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", nnx.state(model, nnx.Param))
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt", nnx.state(model, nnx.Param))
    trained = jax.tree.leaves(nnx.state(model, nnx.Param))
    for a, b_ in zip(jax.tree.leaves(restored), trained, strict=True):
        np.testing.assert_array_equal(a, b_)
    # Training continues after the reset.
    model.train()
    step(model, optimizer, metrics, batch(6))
    assert int(metrics.accuracy.count[...]) == 32


def test_per_device_optimizer_state(mesh):
    comp = jaxcomm.compression.int8(error_feedback=True)
    tx = optax.chain(jaxcomm.sync_gradients(compression=comp, min_size=1), optax.sgd(0.1))
    model, optimizer, metrics = setup(tx, model=Linear(nnx.Rngs(0)))
    step = jaxcomm.nnx_data_parallel(mesh)(step_body)
    step(model, optimizer, metrics, batch(0))
    step(model, optimizer, metrics, batch(1))
    assert step.per_device_paths and all("compression" in p for p in step.per_device_paths)
    stacked = [x for x in jax.tree.leaves(optimizer.opt_state) if x.ndim and x.shape[0] == 8]
    assert stacked and not np.array_equal(stacked[0][0], stacked[0][1])  # own residuals
    assert assert_replicas_equal(key_data(nnx.state((model, optimizer)))) > 0


# -- guardrails -----------------------------------------------------------------------------


def test_sync_after_a_stateful_transform_is_refused(mesh):
    objs = setup(optax.chain(optax.adamw(1e-3), jaxcomm.sync_gradients()))
    with pytest.raises(ValueError, match=r"Put the sync first.*sync_gradients\(\), optax.adamw"):
        jaxcomm.nnx_data_parallel(mesh)(step_body)(*objs, batch())


def test_optimizer_without_sync_is_refused(mesh):
    objs = setup(optax.adamw(1e-3))
    with pytest.raises(ValueError, match="never synchronises"):
        jaxcomm.nnx_data_parallel(mesh)(step_body)(*objs, batch())


def test_non_additive_metric_is_refused(mesh):
    model, optimizer, _ = setup()
    metrics = nnx.MultiMetric(loss=nnx.metrics.Welford("loss"))
    with pytest.raises(NotImplementedError, match="Welford"):
        jaxcomm.nnx_data_parallel(mesh)(lambda m, o, mt, b: None)(
            model, optimizer, metrics, batch()
        )


def test_module_as_mesh_is_refused():
    with pytest.raises(TypeError, match="nnx_data_parallel"):
        jaxcomm.nnx_data_parallel(CNN(nnx.Rngs(0)))


def test_nnx_optimizer_to_data_parallel_is_refused(mesh):
    _, optimizer, _ = setup()
    with pytest.raises(TypeError, match=r"got an nnx.Optimizer.*nnx_data_parallel\(mesh\)"):
        jaxcomm.data_parallel(lambda p, b: 0.0, optimizer, mesh)


def test_nnx_module_as_params_is_refused(mesh):
    dp = jaxcomm.data_parallel(lambda p, b: 0.0, jaxcomm.sync_gradients(), mesh)
    with pytest.raises(TypeError, match=r"nnx.state\(model, nnx.Param\)"):
        dp.init(CNN(nnx.Rngs(0)))


def test_linen_variables_with_batch_stats_as_params_are_refused(mesh):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            return nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))

    variables = Net().init(jax.random.key(0), jnp.ones((2, 3)))
    dp = jaxcomm.data_parallel(lambda p, b: 0.0, jaxcomm.sync_gradients(), mesh)
    with pytest.raises(ValueError, match=r"\['batch_stats'\].*with_model_state=True"):
        dp.init(variables)


# -- Linen ----------------------------------------------------------------------------------


def linen_state(tx, *, key=None):
    import flax.linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
            return nn.Dense(10)(nn.Dropout(0.5, deterministic=not train)(x))

    class State(train_state.TrainState):
        batch_stats: dict
        key: jax.Array
        mask: jax.Array

    model = Net()
    v = model.init(jax.random.key(0), jnp.ones((2, 64)), train=False)
    return State.create(
        apply_fn=model.apply,
        params=v["params"],
        batch_stats=v["batch_stats"],
        key=jax.random.key(1) if key is None else key,
        mask=jnp.zeros(256),
        tx=tx,
    )


def linen_step(state, batch):
    key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, upd = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["x"],
            mutable=["batch_stats"],
            rngs={"dropout": key},
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), upd

    (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    mask = jax.random.bernoulli(jax.random.fold_in(key, 7), 0.5, (256,)).astype(jnp.float32)
    state = state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"], mask=mask)
    return state, {"loss": loss}


def linen_batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 64)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, 10, 32).astype(np.int32)}


def test_linen_train_state_replicas_and_per_device_keys(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-2))
    step = jaxcomm.linen_data_parallel(mesh, check_replicas=1)(linen_step)
    state, _ = step(linen_state(tx), linen_batch(0))
    first = np.asarray(state.mask)  # the devices' masks averaged: 0..1 in steps of 1/8
    assert np.any((first > 0) & (first < 1))
    state, metrics = step(state, linen_batch(1))
    assert int(state.step) == 2 and np.isfinite(metrics["loss"])
    assert assert_replicas_equal(key_data(state)) > 10
    assert not np.allclose(jax.tree.leaves(state.batch_stats)[0], 0)  # running means moved
    again, _ = step(linen_state(tx), linen_batch(0))
    np.testing.assert_array_equal(np.asarray(again.mask), first)  # same key, same masks


def test_linen_sync_after_a_stateful_transform_is_refused(mesh):
    state = linen_state(optax.chain(optax.adamw(1e-3), jaxcomm.sync_gradients()))
    with pytest.raises(ValueError, match=r"Put the sync first: TrainState.create"):
        jaxcomm.linen_data_parallel(mesh)(linen_step)(state, linen_batch())


def test_linen_key_replaced_in_the_step_is_refused(mesh):
    def step(state, batch):
        state, metrics = linen_step(state, batch)
        return state.replace(key=jax.random.split(state.key)[0]), metrics

    state = linen_state(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)))
    with pytest.raises(ValueError, match="fold_in"):
        jaxcomm.linen_data_parallel(mesh)(step)(state, linen_batch())


def test_local_sgd_is_refused_by_the_nnx_front_end(mesh):
    # The model's gradient is taken at its replicated params, not at local_sgd's per-device
    # ones: refused rather than silently wrong.
    objs = setup(jaxcomm.local_sgd(optax.sgd(0.1), sync_every=2), model=Linear(nnx.Rngs(0)))
    with pytest.raises(NotImplementedError, match="local_sgd runs under jaxcomm.data_parallel"):
        jaxcomm.nnx_data_parallel(mesh)(step_body)(*objs, batch())


# -- the siblings: one engine, the FrontEnd protocol, no patch of optax ----------------------


def test_the_flax_front_ends_are_siblings_that_satisfy_front_end(mesh):
    from jaxcomm.front_end import FrontEnd

    fronts = [
        jaxcomm.nnx_data_parallel(mesh)(step_body),
        jaxcomm.linen_data_parallel(mesh)(linen_step),
        jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(linen_step),
    ]
    for front in fronts:
        assert isinstance(front, FrontEnd)
    kinds = [type(f) for f in fronts]
    for a in kinds:  # none is built on another
        assert not any(b is not a and issubclass(a, b) for b in kinds)


def test_nnx_optimizer_states_round_trip(mesh):
    objs = setup(model=Linear(nnx.Rngs(0)))
    step = jaxcomm.nnx_data_parallel(mesh)(step_body)
    leaves, _ = step.drive_inputs(*objs, batch())
    (opt,) = step.optimizer_states(leaves)
    want = nnx.as_pure(objs[1].opt_state)
    assert jax.tree.structure(opt) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bumped = jax.tree.map(lambda x: x + 1, opt)
    new = step.with_optimizer_states(leaves, [bumped])
    (again,) = step.optimizer_states(new)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(bumped), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = sum(a is not b for a, b in zip(leaves, new, strict=True))
    assert changed == len(jax.tree.leaves(opt))  # only the optimizer's leaves


def test_linen_optimizer_states_are_the_train_states(mesh):
    state = linen_state(optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-2)))
    step = jaxcomm.linen_data_parallel(mesh)(linen_step)
    leaves, _ = step.drive_inputs(state, linen_batch())
    (opt,) = step.optimizer_states(leaves)
    assert jax.tree.structure(opt) == jax.tree.structure(state.opt_state)


def test_model_and_optimizer_updates_from_the_replicated_params(mesh):
    def body(model, optimizer, batch):
        grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(
            m(batch["x"]), batch["y"]).mean())(model)  # fmt: skip
        optimizer.update(grads)

    def make(sync):
        model = Linear(nnx.Rngs(0))
        tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)) if sync else optax.sgd(0.1)
        return model, nnx.ModelAndOptimizer(model, tx)

    dp, one = make(True), make(False)
    jaxcomm.nnx_data_parallel(mesh, check_replicas=1)(body)(*dp, batch())
    nnx.jit(body)(*one, batch())
    got, want = jax.tree.leaves(nnx.state(dp[0])), jax.tree.leaves(nnx.state(one[0]))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_an_own_apply_gradients_takes_replicated_params(mesh):
    from flax.training import train_state

    def make(apply):
        class State(train_state.TrainState):
            def apply_gradients(self, *, grads, **kwargs):
                updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
                params = optax.apply_updates(apply(self.params), updates)
                return self.replace(step=self.step + 1, params=params, opt_state=opt_state)

        params = {"w": jnp.ones((64, 10)) * 0.01}
        tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
        return State.create(apply_fn=None, params=params, tx=tx)

    def step(state, batch):
        grads = jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads), {}

    # Its params come from each device's copy of the old params: proven the same on every
    # device (jaxcomm.same_value), with or without jaxcomm.replicated_params.
    got = []
    for apply in (lambda p: p, jaxcomm.replicated_params):
        dp = jaxcomm.linen_data_parallel(mesh, check_replicas=1)(step)
        state, _ = dp(make(apply), linen_batch())
        assert int(state.step) == 1 and assert_replicas_equal(state.params) > 0
        got.append(jax.device_get(state.params))
    np.testing.assert_array_equal(got[0]["w"], got[1]["w"])


def test_a_param_computed_from_the_batch_is_refused(mesh):
    def step(state, batch):
        grads = jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(state.params)
        state = state.apply_gradients(grads=grads)
        return state.replace(params={"w": state.params["w"] * jnp.mean(batch["x"])}), {}

    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    state = train_state.TrainState.create(
        apply_fn=None, params={"w": jnp.ones((64, 10)) * 0.01}, tx=tx
    )
    with pytest.raises(ValueError, match=r"params\['w'\] comes out of the step different"):
        jaxcomm.linen_data_parallel(mesh)(step)(state, linen_batch())


def test_two_steps_trace_at_once_in_two_threads(mesh):
    import threading

    errors = []

    def run(seed):
        try:
            objs = setup(model=Linear(nnx.Rngs(seed)))
            jaxcomm.nnx_data_parallel(mesh, check_replicas=1)(step_body)(*objs, batch(seed))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
