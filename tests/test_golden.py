"""Golden test: every option of the gradient sync, in one and two processes.

The cases are in ``tests/golden.py``; the records in ``tests/golden/``: a digest of every
leaf (compared bit for bit) and, for the cases whose bits depend on the CPU (PowerSGD's
LAPACK QR), the values (compared within the case's stated tolerance). Where the platform's
tanh/exp/log differ from the recording's (no FMA), every case is compared within a stated
tolerance instead (``golden.ELEMENTARY_ULPS``).
``JAXCOMM_GOLDEN_WRITE=1`` records them instead of comparing (name the change of bits in the
commit).
"""

import inspect
import json
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
from golden import (
    CASES,
    ELEMENTARY_ULPS,
    Record,
    cases_to_run,
    compare,
    load,
    platform_matches,
    run_cases,
    save,
    tolerances,
)
from helpers import launch_two_processes

import jaxcomm

WRITE = os.environ.get("JAXCOMM_GOLDEN_WRITE") == "1"
WORKER = str(Path(__file__).with_name("_golden_worker.py"))


def _check(setting: str, got: Record, skipped: dict[str, str]) -> None:
    if WRITE:
        assert not skipped, f"cannot record with cases skipped: {skipped}"
        save(setting, got)
        return
    want = load(setting)
    same_platform = platform_matches()
    tolerance = tolerances(list(got.digests), same_platform)
    if same_platform:
        where = "bit for bit but PowerSGD (LAPACK): the recording platform's elementary digest"
    else:
        where = (
            f"this platform's elementary digest differs from the recording's: compared within "
            f"{ELEMENTARY_ULPS} ulps, the cases that round not compared; re-record here "
            "(JAXCOMM_GOLDEN_WRITE=1) to check a refactoring bit for bit"
        )
    problems = compare(got, want, tolerance)
    ran = {c.split("/")[-1] for c in got.digests}
    missing = sorted(c for c in want.digests if c.split("/")[-1] not in ran | set(skipped))
    problems += [f"{c}: recorded but not run (re-record)" for c in missing]
    assert not problems, f"{setting} ({where}): {len(problems)} differences:\n" + "\n".join(
        problems[:60]
    )
    if not same_platform:
        uncompared = sorted(
            {c.split("/")[-1] for c in got.digests} - {c.split("/")[-1] for c in tolerance}
        )
        warnings.warn(f"{setting}: {where}: not compared: {uncompared}", stacklevel=2)
    if skipped:
        warnings.warn(f"{setting}: skipped golden cases: {json.dumps(skipped)}", stacklevel=2)


def test_every_option_matches_its_record_in_one_process(mesh):
    names, skipped = cases_to_run("one_process")
    _check("one_process", run_cases(names, mesh), skipped)


def test_every_option_matches_its_record_in_two_processes(tmp_path):
    names, skipped = cases_to_run("two_processes")
    # The workers see the caller's XLA flags (an --xla_cpu_max_isa), not conftest's 8 devices.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ["XLA_FLAGS"])
    env = {"JC_GOLDEN_OUT": str(tmp_path), "XLA_FLAGS": flags.strip()}
    launch_two_processes(sys.executable, WORKER, timeout=600, env=env)
    digests, values = {}, {}
    for k in (0, 1):
        for case, leaves in json.loads((tmp_path / f"p{k}.json").read_text()).items():
            digests[f"p{k}/{case}"] = leaves
        with np.load(tmp_path / f"p{k}.npz") as npz:
            values |= {f"p{k}/{key}": npz[key] for key in npz.files}
    assert {c.split("/")[1] for c in digests} == set(names), "the workers ran other cases"
    _check("two_processes", Record(digests, values), skipped)


def test_golden_cases_cover_every_option():
    """Every option in the library's own lists has a case: each all-reduce algorithm, each
    compressor factory, each ``param_gather`` that ``shard_optimizer=True`` takes, each
    front end (``*_data_parallel``); and the kinds without a list."""
    C = jaxcomm.compression
    kinds = {name.split(":")[0] for name in CASES}
    assert kinds >= {"alg", "comp", "stage", "warmup", "buckets", "microbatches", "local_sgd"}
    assert {f"alg:{a}" for a in jaxcomm.collectives.ALGORITHMS} <= set(CASES)
    compressors = {
        name
        for name in C.__all__
        if inspect.isfunction(getattr(C, name))
        and inspect.signature(getattr(C, name)).return_annotation in ("Compressor", C.Compressor)
    }
    assert compressors >= {"bf16", "fp16", "int8", "int4", "powersgd", "topk"}  # the list works
    # Not compressors of their own: quantized(bits) is int8() or int4(); from_codec(codec)
    # wraps a codec (bf16, int8, ... are built with it).
    compressors -= {"quantized", "from_codec"}
    assert {f"comp:{c}" for c in compressors} <= set(CASES)
    gathers = {"none"}
    for name in compressors:
        try:
            jaxcomm.sharded.check_param_gather(getattr(C, name)())
        except (TypeError, ValueError):  # needs arguments, or not a gather
            continue
        gathers.add(name)
    assert gathers >= {"none", "bf16", "int8"}
    assert {f"shard:gather_{g}" for g in gathers} <= set(CASES)
    fronts = {n for n in jaxcomm.__all__ if n.endswith("_data_parallel") and n != "data_parallel"}
    assert fronts >= {"nnx_data_parallel", "linen_data_parallel", "pmap_data_parallel"}
    assert {f"front:{f}" for f in fronts} <= set(CASES)
    # The tolerance cases are the ones that orthogonalise (LAPACK); every other is bitwise
    # where the platform's elementary functions have the recording's bits.
    assert {n for n, c in CASES.items() if c.ulps is not None} == {"comp:powersgd"}
    # Every compressor rounds (a codec, a selection) but PowerSGD and random-k (exact values
    # at random indices): those compare within a tolerance on any platform.
    comps = {n for n in CASES if n.startswith(("comp:", "stage:", "warmup:"))}
    assert {n for n in comps if not CASES[n].rounds} == {"comp:powersgd", "comp:random_k"}
