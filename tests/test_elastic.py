"""Training that survives a lost node: a checkpoint written on 8 devices restored onto 4 or
6 (``jaxcomm.elastic``), asynchronous checkpoints of which a partial one is never
restored, and the refusals (another model or optimizer, a global batch that does not
divide, a minimum above the nodes left, one folder for two jobs)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from helpers import ROOT, assert_replicas_equal, assert_trees_bitwise_equal, train
from jax.sharding import Mesh
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm
from experiments import elastic as experiment
from jaxcomm import elastic
from jaxcomm.checkpoint import JOB_FILE, Checkpointer

AX = ("inter", "intra")
BATCH = 24  # divides over 8, 6 and 4 devices
SAVE_AT, STEPS = 3, 6


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]).reshape(2, n // 2), AX)


def _schedule():
    return optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, STEPS)


def _dp(mesh, *, sharded=False, compression=None, opt=None):
    sync = jaxcomm.sync_gradients(
        **({} if compression is None else {"compression": compression, "min_size": 64})
    )
    opt = opt or optax.adamw(_schedule(), weight_decay=0.1)
    return jaxcomm.data_parallel(mlp_loss, optax.chain(sync, opt), mesh, shard_optimizer=sharded)


def _close(a, b):
    # f32 rounding of another reduction order: 8 devices' partial means summed vs 4 or 6
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("devices", [4, 6])
def test_restored_on_fewer_devices_goes_on_as_the_uninterrupted_run(
    mesh, tmp_path, devices, sharded
):
    """8 devices for 3 steps, checkpoint, restored onto 4 or 6, 3 more steps: the params,
    step, data position and the schedule's learning rate are those of the 8-device run of
    6 steps on the same global batches (the loss is the global batch's mean, so only the
    reduction order differs)."""
    p0 = mlp_init(jax.random.key(0))
    batches = mlp_batches(STEPS, size=BATCH)
    dp8 = _dp(mesh, sharded=sharded)
    straight, _ = train(dp8, dp8.init(p0), batches)
    state, _ = train(dp8, dp8.init(p0), batches[:SAVE_AT])
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, position=SAVE_AT, meta={"global_batch": BATCH})
    ckpt.close()

    dpm = _dp(_mesh(devices), sharded=sharded)
    like = dpm.init(p0)
    restored, data = elastic.restore(Checkpointer(tmp_path / "ckpt"), dpm, like, global_batch=BATCH)
    assert data["position"] == SAVE_AT and data["devices"] == 8
    assert int(restored.step) == SAVE_AT
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert x.shape == y.shape and x.sharding == y.sharding
    assert_trees_bitwise_equal(restored.params, state.params)
    resumed, _ = train(dpm, restored, batches[data["position"] :])
    assert int(resumed.step) == int(straight.step) == STEPS
    _close(resumed.params, straight.params)
    if sharded:  # Adam's moments moved into 4 or 6 pieces, none lost
        mu = jax.tree.leaves(resumed.opt_state.inner)[1]
        assert mu.shape[0] == devices and dpm.per_device_paths
    else:
        _close(resumed.opt_state, straight.opt_state)


def _ef_dp(mesh, kind):
    if kind == "int8":
        compression = jaxcomm.compression.int8(error_feedback=True)
    else:  # adaptive: its level, window and hold replicated, its residual per device
        compression = jaxcomm.compression.adaptive(adjustment_step=2, initial_compression_ratio=0.7)
    return _dp(mesh, compression=compression)


def _per_device(dp, state):
    paths = {".opt_state" + p for p in dp.per_device_paths}
    return [
        (jax.tree_util.keystr(p), x)
        for p, x in jax.tree_util.tree_leaves_with_path(state)
        if jax.tree_util.keystr(p) in paths
    ]


@pytest.mark.parametrize("kind", ["int8", "adaptive"])
def test_error_feedback_residuals_are_relaid_by_the_stated_rule(mesh, tmp_path, kind):
    """Residuals of 8 devices restored onto 4: 'mean' gives every device the mean of the 8
    (the correction the averaged gradient owes is kept), 'zero' resets them; replicated
    state (the adaptive compressor's level and window) is kept bit for bit; restoring from
    the checkpoint equals moving the live state (elastic.resize) bit for bit, also after
    training on."""
    p0 = mlp_init(jax.random.key(1), sizes=(12, 64, 3))
    batches = mlp_batches(STEPS, size=BATCH)
    dp8 = _ef_dp(mesh, kind)
    state, _ = train(dp8, dp8.init(p0), batches[:SAVE_AT])
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, position=SAVE_AT)
    ckpt.close()
    old = _per_device(dp8, state)
    assert old
    rows = np.asarray(old[0][1])
    assert rows.shape[0] == 8 and np.abs(rows).max() > 0
    assert len({rows[i].tobytes() for i in range(8)}) == 8  # a residual of its own per device

    dp4 = _ef_dp(_mesh(4), kind)
    like = dp4.init(p0)
    for rule in elastic.RULES:
        restored, _ = elastic.restore(Checkpointer(tmp_path / "ckpt"), dp4, like, rule=rule)
        for (path, new), (_, was) in zip(_per_device(dp4, restored), old, strict=True):
            new, was = np.asarray(new), np.asarray(was)
            assert new.shape == (4, *was.shape[1:]), path
            want = was.mean(0) if rule == "mean" else np.zeros_like(was[0])
            for r in range(4):
                np.testing.assert_allclose(new[r], want, rtol=1e-6, atol=1e-7, err_msg=path)
        # everything not per device is the saved state's, bit for bit
        paths = {p for p, _ in old}
        for (path, x), y in zip(
            jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(state), strict=True
        ):
            if jax.tree_util.keystr(path) not in paths:
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path
        moved = elastic.resize(state, dp4, rule=rule)
        assert_trees_bitwise_equal(restored, moved)
        if rule == "mean":  # one rule trained on: the same program, the same bits
            a, _ = train(dp4, restored, batches[SAVE_AT:])
            b, _ = train(dp4, moved, batches[SAVE_AT:])
            assert_trees_bitwise_equal(a, b)
            assert int(a.step) == STEPS
    if kind == "adaptive":
        (ad,) = jaxcomm.compression.adaptive_states(restored.opt_state)
        (ad8,) = jaxcomm.compression.adaptive_states(state.opt_state)
        assert int(ad.window) == 2 and int(ad.level) == int(ad8.level)


def test_global_batch_and_minimum_are_refused_with_the_allowed_values(mesh, tmp_path):
    assert elastic.per_device_batch(24, 6) == 4
    with pytest.raises(ValueError, match=r"16 does not divide over 6 devices.*\[1, 2, 4, 8, 16\]"):
        elastic.per_device_batch(16, 6)
    assert elastic.check_minimum(3, 2) == 3
    with pytest.raises(
        ValueError, match=r"2 nodes left, the job's minimum is 3 \(allowed: 3 or more"
    ):
        elastic.check_minimum(2, 3)

    p0 = mlp_init(jax.random.key(0))
    dp8 = _dp(mesh)
    state = dp8.init(p0)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, position=0, meta={"global_batch": 16})
    dp6 = _dp(_mesh(6))
    like = dp6.init(p0)
    with pytest.raises(ValueError, match="16 does not divide over 6 devices"):
        elastic.restore(ckpt, dp6, like, global_batch=16)
    with pytest.raises(ValueError, match="written with global batch 16, this run's is 24"):
        elastic.restore(ckpt, dp6, like, global_batch=24)
    with pytest.raises(ValueError, match="rule='keep' must be one of"):
        elastic.restore(ckpt, dp6, like, rule="keep")
    # the plain restore onto another device count names the way that works
    dp4 = _dp(_mesh(4), compression=jaxcomm.compression.int8(error_feedback=True))
    ckpt.save(dp8.init(p0)._replace(step=state.step + 1), position=1)
    with pytest.raises(ValueError, match="another structure"):
        ckpt.restore(dp4.init(p0))
    ckpt.close()


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(mesh, tmp_path):
    p0 = mlp_init(jax.random.key(0))
    dp8 = _dp(mesh, compression=jaxcomm.compression.int8(error_feedback=True))
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(dp8.init(p0), position=0)
    mesh4 = _mesh(4)
    other_model = _dp(mesh4, compression=jaxcomm.compression.int8(error_feedback=True))
    like = other_model.init(mlp_init(jax.random.key(0), sizes=(12, 40, 3)))
    with pytest.raises(
        ValueError, match=r"\[0\]\['b'\] is float32\[32\], this run's float32\[40\]"
    ):
        elastic.restore(ckpt, other_model, like)
    other_opt = _dp(mesh4, opt=optax.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="another optimizer or model"):
        elastic.restore(ckpt, other_opt, other_opt.init(p0))
    before = sorted(os.listdir(tmp_path / "ckpt"))
    assert before == ["0"] and ckpt.latest_step() == 0
    ckpt.close()


def test_a_folder_of_another_job_is_refused_and_left_as_it_was(mesh, tmp_path):
    p0 = mlp_init(jax.random.key(0))
    dp8 = _dp(mesh)
    first = Checkpointer(tmp_path / "ckpt", job="job-a")
    first.save(dp8.init(p0), position=0)
    first.close()
    listing = sorted(os.listdir(tmp_path / "ckpt"))
    owner = (tmp_path / "ckpt" / JOB_FILE).read_text()
    with pytest.raises(ValueError, match="belongs to job 'job-a'.*this job is 'job-b'"):
        Checkpointer(tmp_path / "ckpt", job="job-b")
    assert sorted(os.listdir(tmp_path / "ckpt")) == listing
    assert (tmp_path / "ckpt" / JOB_FILE).read_text() == owner
    again = Checkpointer(tmp_path / "ckpt", job="job-a")  # a restart of the same job
    assert again.latest_step() == 0
    again.close()


_PARTIAL = """
import os, sys, jax, jax.numpy as jnp
import jaxcomm
from jaxcomm.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], async_save=True)
def state(step, value):
    big = jnp.full((2048, 2048), value, jnp.float32)  # 16 MiB: written in the background
    return jaxcomm.TrainState(jnp.int32(step), {"w": big, "b": jnp.full(3, value)}, (), None)
ckpt.save(state(2, 2.0), position=2)
ckpt.wait()
ckpt.save(state(4, 4.0), position=4)  # returns once on the host
print(sorted(os.listdir(sys.argv[1])), flush=True)
os._exit(0)  # the process dies while step 4 is written
"""


def test_a_checkpoint_cut_short_is_never_restored(tmp_path):
    """An asynchronous save whose process dies before the write is finished leaves a
    temporary folder; the newest complete checkpoint is the one restored, and the same
    step saved again after the restart replaces the unfinished write."""
    folder = tmp_path / "ckpt"
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _PARTIAL, str(folder)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    listed = json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"'))
    assert "2" in listed and "4" not in listed, listed  # step 4 was still being written
    assert any(name.startswith("4.") for name in os.listdir(folder)), os.listdir(folder)
    ckpt = Checkpointer(folder)
    assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]
    like = jaxcomm.TrainState(
        jax.ShapeDtypeStruct((), np.int32),
        {
            "w": jax.ShapeDtypeStruct((2048, 2048), np.float32),
            "b": jax.ShapeDtypeStruct((3,), np.float32),
        },
        (),
        None,
    )
    state, data = ckpt.restore(like)
    assert data["position"] == 2 and int(state.step) == 2
    assert float(state.params["w"][0, 0]) == 2.0 and float(state.params["w"][-1, -1]) == 2.0
    # the restarted run reaches step 4 again: its write replaces the unfinished one
    ckpt.save(jax.tree.map(lambda x: x + 1, state)._replace(step=np.int32(4)), position=4)
    assert ckpt.all_steps() == [2, 4] and sorted(os.listdir(folder))[:2] == ["2", "4"]
    assert float(ckpt.restore(like)[0].params["w"][0, 0]) == 3.0
    ckpt.close()


def test_async_save_writes_the_state_it_was_given(mesh, tmp_path):
    """The asynchronous save copies the state before it returns: a state trained on (and
    its buffers donated) after the save still restores as it was at the save."""
    p0 = mlp_init(jax.random.key(0))
    batches = mlp_batches(4, size=BATCH)
    dp8 = _dp(mesh, compression=jaxcomm.compression.int8(error_feedback=True))
    state, _ = train(dp8, dp8.init(p0), batches[:2])
    saved = jax.tree.map(np.asarray, state)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=True)
    ckpt.save(state, position=2)
    state, _ = train(dp8, state, batches[2:])  # goes on while the write runs
    ckpt.wait()
    restored, data = ckpt.restore(dp8.init(p0))
    ckpt.close()
    assert data["position"] == 2 and data["devices"] == 8 and len(data["leaves"]) > 0
    assert_trees_bitwise_equal(restored, saved)
    assert assert_replicas_equal(restored) > 0


def test_the_agent_environment_becomes_jaxcomm_variables():
    """torchrun's RANK/WORLD_SIZE/MASTER_ADDR become the JAXCOMM_* variables (the
    coordinator one port above the agent's store); a missing variable or several
    processes per node are refused."""
    agent = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1",
             "MASTER_PORT": "29400"}  # fmt: skip
    env = elastic.agent_env(2, agent)
    assert env == {
        "JAXCOMM_COORDINATOR": "10.0.0.1:29401",
        "JAXCOMM_NUM_PROCESSES": "3",
        "JAXCOMM_PROCESS_ID": "2",
        "JAXCOMM_LOCAL_DEVICES": "2",
    }
    assert (
        elastic.agent_env(2, {**agent, "JAXCOMM_ELASTIC_PORT": "5000"})["JAXCOMM_COORDINATOR"]
        == "10.0.0.1:5000"
    )
    with pytest.raises(ValueError, match=r"\['RANK'\] are not set.*torchrun"):
        elastic.agent_env(2, {k: v for k, v in agent.items() if k != "RANK"})
    with pytest.raises(ValueError, match="--nproc-per-node=2: a JAX process drives every"):
        elastic.agent_env(2, {**agent, "LOCAL_WORLD_SIZE": "2"})
    assert elastic.parse_nodes("2:3") == (2, 3) and elastic.parse_nodes("4") == (4, 4)
    for bad in ("3:2", "0:2", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="must be MIN:MAX node counts"):
            elastic.parse_nodes(bad)


def test_elastic_flag_refusals(tmp_path, monkeypatch, capsys):
    """Each refusal of --elastic is named before anything starts (no JAX runtime, no
    JAXCOMM_* variable set)."""
    from experiments import resnet152
    from jaxcomm import distributed

    agent = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h",
             "MASTER_PORT": "1"}  # fmt: skip
    for k in (*agent, *distributed.ENV_VARS):
        monkeypatch.setenv(k, "")  # undone at the end, whatever the test sets
        monkeypatch.delenv(k)
    base = ["--train", "--checkpoint-dir", str(tmp_path), "--elastic", "2:3"]
    cases = [
        (base, "are not set"),
        (["--elastic", "5:3", "--train"], "must be MIN:MAX"),
        ([*base, "--ablation"], "--elastic runs --train only"),
        (["--train", "--elastic", "2:3"], "--elastic needs --checkpoint-dir"),
        ([*base, "--resume"], "resumes by itself"),
    ]
    for i, (argv, message) in enumerate(cases):
        if i == 1:
            for k, v in agent.items():
                monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit):
            resnet152.main(argv)
        assert message in capsys.readouterr().err, argv
        assert not any(os.environ.get(k) for k in distributed.ENV_VARS)


def test_digits_accuracy_after_a_restart_on_fewer_devices(tmp_path):
    """The digits quality guard (int8 with error feedback, 300 steps) stopped at step 150
    and restored from 8 devices onto 4 (residuals by 'mean'): its test accuracy is the
    straight run's within 0.3 points (one test image is 0.28)."""
    int8 = jaxcomm.compression.int8(error_feedback=True)
    r = experiment.digits_restart(str(tmp_path / "ckpt"), {"compression": int8})
    assert r["test_images"] == 357 and r["accuracy"] > 0.9
    assert abs(r["difference_points"]) <= 0.3, r
