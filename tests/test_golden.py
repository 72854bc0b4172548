"""Golden test: every option of the gradient sync, bit for bit, in one and two processes.

The cases and the digests are in ``tests/golden.py``; the recorded digests in
``tests/golden/``. ``JAXCOMM_GOLDEN_WRITE=1`` records them instead of comparing (name the
change of bits in the commit).
"""

import json
import os
import sys
from pathlib import Path

from golden import CASES, load, run_case, save
from helpers import launch_two_processes

WRITE = os.environ.get("JAXCOMM_GOLDEN_WRITE") == "1"
WORKER = str(Path(__file__).with_name("_golden_worker.py"))


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
    env = {"JC_GOLDEN_OUT": str(tmp_path)}
    launch_two_processes(sys.executable, WORKER, timeout=600, env=env)
    got = {}
    for k in (0, 1):
        for case, leaves in json.loads((tmp_path / f"p{k}.json").read_text()).items():
            got[f"p{k}/{case}"] = leaves
    _compare("two_processes", got)
