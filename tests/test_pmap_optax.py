"""``jaxcomm.pmap_data_parallel`` on a pmap script of the optax form: ``update_fn(params,
opt_state, batch, rng)`` with ``tx`` closed over, no ``TrainState``
(``tests/pmap_optax_script.py`` -> ``tests/pmap_optax_script_ported.py``). The entry finds
the state (or is told it with ``state_argnums=``) and gives it the ``TrainState`` form's
guarantees: the five ways such a port went wrong silently are each refused by name or
train as ``jax.pmap`` does."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pmap_optax_script
import pmap_optax_script_ported
import pytest
from flax import jax_utils
from flax.training import checkpoints
from helpers import assert_rows_equal
from jax import lax
from test_pmap import HERE, changed_lines

import jaxcomm

SMALL = {"num_steps": 4, "hidden": 16}


def test_the_port_changes_at_most_6_lines():
    original = (HERE / "pmap_optax_script.py").read_text()
    ported = (HERE / "pmap_optax_script_ported.py").read_text()
    n = changed_lines(original, ported)
    assert 0 < n <= 6, n


def rows_at(step: int, into: dict):
    def on_step(s, params, opt_state):
        if s == step:
            into["params"], into["opt_state"] = params, opt_state

    return on_step


def test_port_trains_as_the_pmap_script():
    """Dropout keys folded per device, clip_by_global_norm after the sync: losses and
    params within 1e-6 of jax.pmap's, the same test accuracy; the state in rows, every row
    the same bits (the checkpoints: the resume test below)."""
    seen: dict = {}
    a = pmap_optax_script.train(SMALL)
    b = pmap_optax_script_ported.train(SMALL, on_step=rows_at(4, seen))
    np.testing.assert_allclose(a[2], b[2], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)
    assert a[3] == b[3]
    assert_rows_equal((seen["params"], seen["opt_state"]))
    # The sync's count and the schedule's count both count the steps.
    assert int(b[1][0].count) == int(b[1][1][1][1].count) == 4


def test_resume_from_the_pmap_scripts_checkpoint_keeps_momentum_and_count(tmp_path):
    """Case 5: the port resumes from a checkpoint the unported script wrote (no sync in
    its optimizer state): lift_opt_state carries the momentum and the schedule's count
    over, so the resumed run equals the unported run that never stopped."""
    small = {**SMALL, "dropout": 0.0}  # the script's resumed run draws other dropout keys
    straight = pmap_optax_script.train(
        {**small, "workdir": str(tmp_path / "a"), "checkpoint_every": 2}
    )
    shutil.copytree(tmp_path / "a" / "checkpoint_2", tmp_path / "b" / "checkpoint_2")
    config = {**small, "workdir": str(tmp_path / "b"), "checkpoint_every": 2}
    resumed = pmap_optax_script_ported.train(config)  # steps 3 and 4 from checkpoint_2
    np.testing.assert_allclose(resumed[2], straight[2][2:], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(resumed[0]), jax.tree.leaves(straight[0]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)
    trace = resumed[1][1][1][0].trace
    want = straight[1][1][0].trace  # the unported chain: no sync entry
    for x, y in zip(jax.tree.leaves(trace), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)
    assert int(resumed[1][1][1][1].count) == 4  # the schedule did not start again


def test_lift_opt_state_from_the_old_chain(tmp_path):
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    old = old_tx.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    for _ in range(3):
        _, old = old_tx.update(g, old, params)
    sync = jaxcomm.sync_gradients(compression=jaxcomm.compression.int8(), min_size=0)
    for tx in (
        optax.chain(sync, old_tx),  # the chain wrapped
        optax.chain(sync, optax.clip_by_global_norm(1.0), optax.adam(1e-2)),  # flattened
    ):
        lifted = jaxcomm.lift_opt_state(old, tx, params)
        assert jax.tree.structure(lifted) == jax.tree.structure(jax.jit(tx.init)(params))
        assert int(lifted[0].count) == 3  # the sync's warm-up does not start again
        moments = [x for x in jax.tree.leaves(lifted[1:]) if np.ndim(x)]
        assert moments and all(
            np.array_equal(a, b)
            for a, b in zip(moments, [x for x in jax.tree.leaves(old) if np.ndim(x)], strict=True)
        )
    # A state of tx's own structure (the ported run's checkpoint, restored without a
    # target: dicts, its EmptyStates None) comes back as it is.
    checkpoints.save_checkpoint(str(tmp_path), lifted, 3)
    again = jaxcomm.lift_opt_state(checkpoints.restore_checkpoint(str(tmp_path), None), tx, params)
    assert jax.tree.structure(again) == jax.tree.structure(lifted)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(lifted), strict=True)
    )
    # optax.named_chain: paired by name.
    clip, adam = ("clip", optax.clip_by_global_norm(1.0)), ("adam", optax.adam(1e-2))
    named = optax.named_chain(clip, adam)
    old = named.update(g, named.init(params), params)[1]
    lifted = jaxcomm.lift_opt_state(old, optax.named_chain(("sync", sync), clip, adam), params)
    assert int(lifted["sync"].count) == int(lifted["adam"][0].count) == 1
    with pytest.raises(ValueError, match=r"does not fit tx"):
        jaxcomm.lift_opt_state(old, optax.chain(sync, optax.sgd(0.1, momentum=0.9)), params)
    with pytest.raises(ValueError, match=r"tx holds no jaxcomm.sync_gradients"):
        jaxcomm.lift_opt_state(old, old_tx, params)


# -- the other four cases, on a small step of the optax form ------------------------------


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (5, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 3)) * 0.5,
    }


def make_step(tx, mean_grads=False):
    def update_fn(params, opt_state, batch, rng):
        rng, new_rng = jax.random.split(rng)

        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
            logits = h @ p["w2"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        if mean_grads:
            g = jax.tree.map(lambda x: lax.pmean(x, axis_name="batch"), g)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, lax.pmean(loss, "batch"), new_rng

    return update_fn


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(8, 4, 5)).astype(np.float32),
        "y": rng.integers(0, 3, (8, 4)).astype(np.int32),
    }


def start(tx):
    params = init_params()
    return (*jax_utils.replicate((params, tx.init(params))), jax_utils.replicate(jax.random.key(1)))


def sync(**kwargs):
    return jaxcomm.sync_gradients(min_size=0, **kwargs)


def test_the_optax_form_equals_jax_pmap_and_finds_its_state(mesh):
    """Found or named, the state is params + opt_state: the same run as jax.pmap's with
    the script's pmean; the rows stay the same bits (check_replicas compares them)."""
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))
    ref = jax.pmap(make_step(inner, mean_grads=True), axis_name="batch")
    want = start(inner)
    for s in range(3):
        wp, wo, _, wr = ref(*want[:2], batch(s), want[2])
        want = (wp, wo, wr)
    tx = optax.chain(sync(), inner)
    p = jaxcomm.pmap_data_parallel(mesh, check_replicas=1)(make_step(tx), axis_name="batch")
    got = start(tx)
    for s in range(3):
        params, opt_state, loss, rng = p(*got[:2], batch(s), got[2])
        got = (params, opt_state, rng)
    assert loss.shape == (8,)
    for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)
    for x, y in zip(jax.tree.leaves(got[1][1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)  # momentum and counts
    assert_rows_equal((got[0], got[1]))
    assert not p.per_device_paths


@pytest.mark.parametrize("state_argnums", [None, (0, 1)])
def test_case_1_no_sync_in_the_chain_is_refused(mesh, state_argnums):
    """The script's pmean deleted and no sync added: every device would train alone."""
    tx = optax.sgd(0.1, momentum=0.9)
    p = jaxcomm.pmap_data_parallel(mesh)(
        make_step(tx), axis_name="batch", state_argnums=state_argnums
    )
    match = "cannot see its state" if state_argnums is None else "never synchronises"
    with pytest.raises(ValueError, match=match) as e:
        p(*start(tx)[:2], batch(), start(tx)[2])
    assert "jaxcomm.sync_gradients()" in str(e.value)


@pytest.mark.parametrize(
    "chain",
    [
        lambda: optax.chain(optax.clip_by_global_norm(0.5), sync(), optax.sgd(0.1)),
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9), sync()),
    ],
    ids=["after_clip", "last"],
)
def test_case_2_the_sync_after_a_transform_is_refused(mesh, chain):
    tx = chain()
    p = jaxcomm.pmap_data_parallel(mesh)(make_step(tx), axis_name="batch")
    with pytest.raises(ValueError, match=r"sync_gradients is (entry 1|last) of the chain.*first"):
        p(*start(tx)[:2], batch(), start(tx)[2])


def test_case_3_the_scripts_own_gradient_mean_is_refused(mesh):
    """The kept pmean is refused; a flat sync alone (one psum per flat buffer, never a
    param's shape) is not taken for it."""
    tx = optax.chain(sync(algorithm="flat"), optax.sgd(0.1))
    p = jaxcomm.pmap_data_parallel(mesh)(make_step(tx, mean_grads=True), axis_name="batch")
    with pytest.raises(ValueError, match=r"delete lax.pmean\(grads, 'batch'\)"):
        p(*start(tx)[:2], batch(), start(tx)[2])
    p = jaxcomm.pmap_data_parallel(mesh)(make_step(tx), axis_name="batch")
    assert np.all(np.isfinite(p(*start(tx)[:2], batch(), start(tx)[2])[2]))


def test_a_trainstate_restore_that_dropped_the_optimizer_state_names_the_lift(mesh):
    from test_pmap import make_state, pmap_batch, step

    tx = optax.chain(sync(), optax.sgd(0.1, momentum=0.9))
    dropped = make_state(tx).replace(step=3)  # params and step restored, tx.init's momentum
    p = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(
        step, in_axes=(None, 0), out_axes=(None, 0)
    )
    with pytest.raises(ValueError, match=r"jaxcomm.lift_opt_state\(old_opt_state, tx, params\)"):
        p(dropped, pmap_batch())


def test_case_4_error_feedback_residuals_are_held_by_the_step_object(mesh, tmp_path):
    """int8 with error feedback: the residuals stay per device in the step object, the
    opt_state the script sees (and checkpoints with its unchanged code) holds a token; a
    restore into a new step object is refused until per_device_state() is loaded, then
    trains on bit for bit."""
    tx = optax.chain(
        sync(compression=jaxcomm.compression.int8(error_feedback=True)),
        optax.sgd(0.1, momentum=0.9),
    )
    p = jaxcomm.pmap_data_parallel(mesh)(make_step(tx), axis_name="batch")
    params, opt_state, rng = start(tx)
    for s in range(2):
        params, opt_state, _, rng = p(params, opt_state, batch(s), rng)
    assert any("opt_state" in path for path in p.per_device_paths)
    assert_rows_equal((params, opt_state))  # what the script sees: replicated values only
    saved = jax_utils.unreplicate((params, opt_state))
    checkpoints.save_checkpoint(str(tmp_path), (*saved, 2), 2)
    per_device = jax.device_get(p.per_device_state())
    uninterrupted = p(params, opt_state, batch(2), rng)[0]

    fresh = init_params()
    target = (fresh, tx.init(fresh), 0)
    r_params, r_opt, _ = checkpoints.restore_checkpoint(str(tmp_path), target)
    q = jaxcomm.pmap_data_parallel(mesh)(make_step(tx), axis_name="batch")
    args = (*jax_utils.replicate((r_params, r_opt)), batch(2), rng)
    with pytest.raises(ValueError, match=r"load_per_device_state"):
        q(*args)
    q.load_per_device_state(per_device)
    resumed = q(*args)[0]
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_donate_argnums_frees_the_donated_state_arguments_only(mesh):
    """As under jax.pmap: donate_argnums=(0,) frees the params rows, not opt_state's (the
    state named here with state_argnums)."""
    tx = optax.chain(sync(), optax.sgd(0.1, momentum=0.9))
    p = jaxcomm.pmap_data_parallel(mesh)(
        make_step(tx), axis_name="batch", donate_argnums=(0,), state_argnums=(0, 1)
    )
    params, opt_state, rng = start(tx)
    new = p(params, opt_state, batch(), rng)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(opt_state))
    p(new[0], new[1], batch(1), new[3])  # the returned rows train on
    assert all(x.is_deleted() for x in jax.tree.leaves(new[0]))


def test_state_the_entry_cannot_place_is_refused(mesh):
    tx = optax.chain(sync(), optax.sgd(0.1))

    def swapped(params, opt_state, batch, rng):  # returns the state in other places
        out = make_step(tx)(params, opt_state, batch, rng)
        return out[2], out[0], out[1], out[3]

    p = jaxcomm.pmap_data_parallel(mesh)(swapped, axis_name="batch")
    with pytest.raises(ValueError, match=r"state_argnums="):
        p(*start(tx)[:2], batch(), start(tx)[2])
    q = jaxcomm.pmap_data_parallel(mesh)(make_step(tx), axis_name="batch", state_argnums=(0, 1, 3))
    with pytest.raises(ValueError, match=r"pass keys and other values as ordinary"):
        q(*start(tx)[:2], batch(), start(tx)[2])
    params, opt_state, rng = start(tx)
    params = jax.tree.map(lambda x: x.at[3].add(1.0), params)  # rows that differ
    with pytest.raises(jaxcomm.ReplicaDivergenceError):
        jaxcomm.pmap_data_parallel(mesh)(make_step(tx), axis_name="batch", state_argnums=(0, 1))(
            params, opt_state, batch(), rng
        )


def test_model_state_beside_the_params_is_found(mesh):
    """update_fn(params, batch_stats, opt_state, batch): the batch statistics (the same
    rows, returned in place) are model state; SyncBatchNorm over 'batch'; as jax.pmap."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(8)(x))
            return nn.Dense(3)(x)

    model = Net()
    v = model.init(jax.random.key(0), jnp.ones((2, 5)))

    def make(tx, mean_grads):
        def update(params, batch_stats, opt_state, batch):
            def loss_fn(p):
                out, upd = model.apply(
                    {"params": p, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
                )
                loss = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()
                return loss, upd

            (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
            if mean_grads:
                g = lax.pmean(g, "batch")
            updates, opt_state = tx.update(g, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, upd["batch_stats"], opt_state, lax.pmean(loss, "batch")

        return update

    inner = optax.sgd(0.1, momentum=0.9)
    tx = optax.chain(sync(), inner)
    want = jax.pmap(make(inner, True), axis_name="batch")(
        *jax_utils.replicate((v["params"], v["batch_stats"], inner.init(v["params"]))), batch()
    )
    p = jaxcomm.pmap_data_parallel(mesh)(make(tx, False), axis_name="batch")
    got = p(*jax_utils.replicate((v["params"], v["batch_stats"], tx.init(v["params"]))), batch())
    for x, y in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)
    assert_rows_equal(got[:3])
