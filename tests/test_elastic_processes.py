"""The kill test in the suite: a process of a running ``jax.distributed`` job is killed,
the survivors stop on their own, and the job finishes on the processes left from the
newest complete checkpoint (``experiments.elastic.kill_test``, the benchmark's code, with
this test playing the elastic agent's restart because the suite has no torch)."""

import os

from helpers import assert_trees_bitwise_equal

from experiments import elastic

EVERY, KILL_AT, STEPS = 6, 8, 12


def test_a_killed_process_is_survived_by_a_restart_on_the_processes_left(tmp_path, monkeypatch):
    """3 processes x 1 CPU device on loopback, each ``python -m experiments.resnet152
    --preset cpu-smoke --train --elastic 2:3`` (ResNet-micro 16 px, asynchronous checkpoints
    every 6 steps, the flat-psum row: a collective across processes every step), exactly
    what ``--elastic`` runs under torchrun. Once step 8 has ended, process 2 is killed
    (SIGKILL).

    The test plays only the agent's part, which PyTorch's elastic agent (torchrun) plays
    in production (``python -m experiments.elastic kill-test --torchrun PATH``): it starts
    the processes with the variables torchrun gives its workers and, once the survivors
    have ended, starts the job again on the 2 processes left (restart count 1). Everything
    else is the processes' own: the survivors must end with an error within the bound the
    project states (heartbeat 20 s, collective timeout 45 s: a minute), and the restarted
    job must restore the newest complete checkpoint (step 6, written on 3 devices) onto 2
    devices and finish.

    The reference is the same job without a kill, stopped at step 6 on 3 processes and
    resumed on 2 (it runs while the survivors wait for the heartbeat). The final params of
    both are compared bit for bit: both restore step 6 onto the same 2 devices and read
    the same global batches, so any difference is a lost or wrong update. Replicas were
    compared by their bits inside every process before each checkpoint
    (``jaxcomm.check_replicas`` in the training loop, which fails the process otherwise).
    """
    # Compiled programs shared between the four jobs (the reference's repeat the kill
    # run's): the same programs, compiled once.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    out = str(tmp_path / "kill-test")
    r = elastic.kill_test(
        out, nodes=3, devices_per_node=1, per_device_batch=4, config="baseline",
        model="resnet-micro", kill_at=KILL_AT, steps=STEPS, every=EVERY,
        overlap_reference=True, timeout_s=240,
    )  # fmt: skip
    logs = "\n".join(
        f"== {name}\n" + open(os.path.join(out, name)).read()[-1500:]
        for name in sorted(os.listdir(out))
        if name.endswith(".log")
    )
    summary = f"{r}\n{logs}"
    shown = ("kill_step", "restored_step", "steps_lost", "survivors_stopped_s",
             "kill_to_next_step_s", "seconds")  # fmt: skip
    print({k: r.get(k) for k in shown})
    # the kill landed between the checkpoints of steps 6 and 12 (4 steps of slack)
    assert KILL_AT <= r["kill_step"] < 2 * EVERY, summary
    # the survivors ended by themselves, with an error, within the stated bound
    assert r["survivors_stopped_s"] is not None, summary
    assert r["survivors_stopped_s"] <= elastic.STOP_BOUND_S, summary
    assert all(code != 0 for code in r["survivors_exit_codes"]), summary
    # the restart restored the newest complete checkpoint onto the 2 devices left
    assert r["complete_at_restart"] == [EVERY], summary
    assert r["restored_step"] == EVERY == r["reference_stop"], summary
    assert 0 < r["steps_lost"] <= EVERY, summary
    assert r["devices_after"] == 2, summary
    # where the time from the kill to the next step went: every phase logged, in order
    rows = r["recovery"]
    assert [row[0] for row in rows] == [p[0] for p in elastic.RECOVERY_PHASES], summary
    assert all(seconds is not None for _, seconds, _ in rows), summary
    assert abs(sum(s for _, s, _ in rows) - r["kill_to_next_step_s"]) < 1e-6, summary
    print(elastic.format_recovery(rows))
    assert r["final_step"] == STEPS and r["exit_codes"] == [0, 0], summary
    assert r["reference_exit_codes"] == [[0, 0, 0], [0, 0]], summary
    killed, reference = (elastic.read_params(folder) for folder in r["final_checkpoints"])
    assert_trees_bitwise_equal(killed, reference)
    assert r["params_bitwise_equal"] and r["params_max_abs_diff"] == 0.0
