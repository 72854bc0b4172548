"""Sharded optimizer state across 2 processes x 2 CPU devices (gloo on loopback)."""

import re
import sys
from pathlib import Path

from helpers import launch_two_processes

WORKER = str(Path(__file__).with_name("_dist_sharded_worker.py"))


def test_sharded_and_hybrid_steps_across_processes():
    """Sharded optimizer state and hybrid sharding across 2 processes x 2 devices: equal
    to data parallelism (f32, after a binding clip_by_global_norm); under hybrid
    sharding the two nodes' copies of the params and Adam's moments (one per process)
    equal by their bits after three steps."""
    out = launch_two_processes(sys.executable, WORKER, timeout=300)
    for rank in (0, 1):
        assert f"[{rank}] SHARDED_OK process={rank}" in out, out
    digests = re.findall(r"\[(\d)\] HYBRID_OK process=\1 digest=([0-9a-f]+)", out)
    assert len(digests) == 2 and digests[0][1] == digests[1][1], out
