"""Sharded optimizer state across 2 processes x 2 CPU devices (gloo on loopback)."""

import os
import subprocess
import sys
from pathlib import Path

from jaxcomm import distributed

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("_dist_sharded_worker.py"))


def test_sharded_step_across_processes():
    env = {k: v for k, v in os.environ.items() if k not in distributed.ENV_VARS}
    env |= {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # 2 devices each, not conftest's 8
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "jaxcomm.launch", "--nprocs", "2", "--local-devices", "2"]
    p = subprocess.run(
        [*cmd, "--", sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):
        assert f"[{rank}] SHARDED_OK process={rank}" in p.stdout, p.stdout
