"""python -m experiments.bench collectives: rows, correctness, busbw convention, alpha-beta fit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench import collectives as sweep

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    argv = ["--intra", "4", "--min-bytes", "1K", "--max-bytes", "64K", "--reps", "2"]
    argv += ["--compressors", "int8", "--json", str(d / "s.json"), "--fit", str(d / "f.json")]
    assert sweep.main(argv) == 0
    return json.loads((d / "s.json").read_text()), json.loads((d / "f.json").read_text())


def test_rows_are_checked_and_follow_nccl_tests(result):
    res, _ = result
    assert res["devices"] == 8 and res["mesh"] == {"inter": 2, "intra": 4}
    # algorithm rows (compressor rows are lossy and carry rel_error instead)
    timed = [r for r in res["rows"] if "missing" not in r and "rel_error" not in r]
    names = {r["name"] for r in timed}
    assert {"flat", "hierarchical"} <= names
    assert sorted({r["bytes"] for r in timed}) == [1024, 4096, 16384, 65536]
    for r in timed:
        assert r["ok"] and r["max_abs_err"] == 0.0  # integer data: exact f32 sums
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * 7 / 8)
    comp = [r for r in res["rows"] if r["name"] == "int8"]
    assert comp and all(("missing" in r) or r["rel_error"] < 0.5 for r in comp)


def test_fit_json_form(result):
    _, fit = result
    assert set(fit) == {"inter", "intra", "points"}
    for axis in ("inter", "intra"):
        assert set(fit[axis]) == {"alpha_s", "beta_s_per_byte"}
        assert fit[axis]["alpha_s"] >= 0 and fit[axis]["beta_s_per_byte"] >= 0
    assert len(fit["points"]) == 8
    assert set(fit["points"][0]) == {"axis", "bytes", "time_s"}


def test_fit_recovers_a_line():
    pts = [(b, 5e-5 + 2e-9 * b) for b in (1 << 10, 1 << 14, 1 << 18, 1 << 22)]
    alpha, beta = sweep.fit_alpha_beta(pts)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and beta == pytest.approx(2e-9, rel=1e-6)
    assert sweep.fit_alpha_beta([(1, 3.0), (10, 2.0)]) == (2.5, 0.0)  # no negative beta


def test_sizes_and_bad_input():
    assert sweep.sizes(1024, 1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert sweep.parse_bytes("256M") == 256 << 20
    with pytest.raises(ValueError, match="64M"):
        sweep.parse_bytes("lots")
    with pytest.raises(SystemExit):
        sweep.main(["--min-bytes", "1M", "--max-bytes", "1K"])


def test_sweep_across_processes():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMM_")}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "jaxcomm.tools.launch", "--nprocs", "2", "--local-devices", "2"]
    cmd += ["--", sys.executable, "-m", "experiments.bench", "collectives", "--max-bytes", "4K"]
    cmd += ["--reps", "1", "--mpi"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 process(es), mesh {'inter': 2, 'intra': 2}" in p.stdout
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith("[0]")]
    assert sum(1 for r in rows if len(r) > 6 and r[2] == "hierarchical" and r[-1] == "ok") == 2
    assert "mpi4jax  missing" in p.stdout  # needs one device per process under mpirun
