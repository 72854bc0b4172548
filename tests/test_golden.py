"""Golden test: every option of the gradient sync, bit for bit, in one and two processes.

The cases and the digests are in ``tests/golden.py``; the recorded digests in
``tests/golden/``. ``JAXCOMM_GOLDEN_WRITE=1`` records them instead of comparing (name the
change of bits in the commit).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden import CASES, load, run_case, save

from jaxcomm import distributed

WRITE = os.environ.get("JAXCOMM_GOLDEN_WRITE") == "1"
WORKER = str(Path(__file__).with_name("_golden_worker.py"))
ROOT = Path(__file__).resolve().parent.parent


def _compare(setting: str, got: dict) -> None:
    if WRITE:
        save(setting, got)
        return
    want = load(setting)
    assert sorted(got) == sorted(want), "cases differ from the recorded ones"
    changed = {
        case: [leaf for leaf in want[case] if got[case].get(leaf) != want[case][leaf]]
        for case in want
    }
    changed = {case: leaves for case, leaves in changed.items() if leaves}
    assert not changed, f"bits changed (case: leaves): {json.dumps(changed, indent=1)[:3000]}"


def test_every_option_bit_for_bit_in_one_process(mesh):
    _compare("one_process", {name: run_case(name, mesh) for name in CASES})


def test_golden_cases_cover_every_option():
    kinds = {name.split(":")[0] for name in CASES}
    assert kinds == {"alg", "comp", "stage", "warmup", "buckets", "microbatches", "local_sgd"}
    import jaxcomm

    assert {f"alg:{a}" for a in jaxcomm.collectives.ALGORITHMS} <= set(CASES)


def test_every_option_bit_for_bit_in_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in distributed.ENV_VARS}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", JC_GOLDEN_OUT=str(tmp_path))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "jaxcomm.launch", "--nprocs", "2", "--local-devices", "2"]
    p = subprocess.run(
        [*cmd, "--", sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600
    )
    if p.returncode != 0:
        pytest.fail(f"golden worker failed:\n{(p.stdout + p.stderr)[-4000:]}")
    got = {}
    for k in (0, 1):
        for case, leaves in json.loads((tmp_path / f"p{k}.json").read_text()).items():
            got[f"p{k}/{case}"] = leaves
    _compare("two_processes", got)
