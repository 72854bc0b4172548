"""jaxcomm.tools.launch and init_distributed: 2 processes x 2 CPU devices over gloo on loopback."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FAST_COMPILE_FLAGS

from jaxcomm import distributed
from jaxcomm.tools import launch

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("_dist_worker.py"))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in distributed.ENV_VARS}
    # conftest's 8 fake devices must not leak into the workers: they get 2 each.
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _launch(timeout, **extra):
    cmd = [sys.executable, "-m", "jaxcomm.tools.launch", "--nprocs", "2", "--local-devices", "2"]
    cmd += ["--", sys.executable, WORKER]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=_env(**extra), capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def test_hierarchical_equals_flat_across_processes():
    p, _ = _launch(120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[0] CHECK_OK process=0 mesh={'inter': 2, 'intra': 2}" in p.stdout
    assert "[1] CHECK_OK process=1 mesh={'inter': 2, 'intra': 2}" in p.stdout


@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed_peer", "frozen_peer"]
)
def test_dead_peer_is_an_error_not_a_hang(sig):
    # SIGKILL closes the peer's sockets (gloo read error); SIGSTOP leaves them open, so only
    # the low collective/heartbeat timeouts of init_distributed can end the wait.
    p, elapsed = _launch(90, JC_TEST_PEER_SIGNAL=str(int(sig)))
    out = p.stdout + p.stderr
    assert "[0] CHECK_OK" in out and "[1] CHECK_OK" in out, out
    assert "UNEXPECTED_SUCCESS" not in out
    assert p.returncode != 0, out
    assert elapsed < 60, f"took {elapsed:.0f} s"
    if sig == signal.SIGSTOP:
        # process 0 failed on its own (the stopped peer cannot exit), then the launcher
        # ended the stopped one.
        assert "[launch] process 0 exited" in out, out


def test_run_group_returns_first_failure_and_ends_the_rest():
    t0 = time.monotonic()
    rc = launch.run_group(
        [[sys.executable, "-c", "import sys; sys.exit(3)"], ["sleep", "30"]],
        [{}, {}],
        settle_s=1.0,
        out=open(os.devnull, "w"),
    )
    assert rc == 3
    assert time.monotonic() - t0 < 15


def test_run_group_lets_a_survivor_report_before_ending_it():
    # A survivor whose collective fails once its peer is gone names the operation: its
    # last words must reach the terminal, not be cut by SIGTERM.
    survivor = "import sys, time; time.sleep(1.5); print('row X failed'); sys.exit(3)"
    out = io.StringIO()
    rc = launch.run_group(
        [[sys.executable, "-c", "import sys; sys.exit(5)"], [sys.executable, "-c", survivor]],
        [{}, {}],
        settle_s=10.0,
        out=out,
    )
    assert rc == 5
    assert "[1] row X failed" in out.getvalue(), out.getvalue()
    assert "[launch] process 0 exited with 5; the others end within 10 s" in out.getvalue()


def test_launcher_env_validation(monkeypatch):
    for k in distributed.ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    assert distributed.launcher_env() is None
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
    with pytest.raises(ValueError, match="are not set"):
        distributed.launcher_env()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    monkeypatch.setenv(distributed.ENV_LOCAL_DEVICES, "1")
    with pytest.raises(ValueError, match="non-negative integer"):
        distributed.launcher_env()


def test_launch_usage_errors():
    with pytest.raises(SystemExit):
        launch.main(["--nprocs", "2"])
    with pytest.raises(SystemExit):
        launch.main(["--nprocs", "0", "--", "true"])


REPORT = (
    "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
)


@pytest.mark.parametrize(
    "line, kept",
    [
        (REPORT, None),
        ("1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", None),
        # two threads' reports interleaved, as gloo writes them
        (
            " is connected to  is connected to  peer ranks. 1Expected number of connected peer "
            "ranks is :  peer ranks. 1Expected number of connected peer ranks is : ",
            None,
        ),
        ("ablation: 17% " + REPORT, "ablation: 17% "),
        ("Rank 3 of the table is connected", "Rank 3 of the table is connected"),
        ("plain output", "plain output"),
    ],
)
def test_gloo_reports_are_dropped(line, kept):
    assert launch.quiet(line) == kept


def test_forwarded_output_has_no_gloo_reports():
    out = io.StringIO()
    script = (
        f"print({REPORT!r}); print(' is connected to 3 peer ranks. [Gloo] Rank Expected'); "
        "print('1'); print('result 1'); print('2')"
    )
    assert launch.run_group([[sys.executable, "-c", script]], [{}], out=out) == 0
    assert out.getvalue().splitlines() == ["[0] result 1", "[0] 2"]
