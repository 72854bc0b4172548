"""Sharded optimizer state across 2 processes x 2 CPU devices (gloo on loopback)."""

import sys
from pathlib import Path

from helpers import launch_two_processes

WORKER = str(Path(__file__).with_name("_dist_sharded_worker.py"))


def test_sharded_step_across_processes():
    out = launch_two_processes(sys.executable, WORKER, timeout=300)
    for rank in (0, 1):
        assert f"[{rank}] SHARDED_OK process={rank}" in out, out
