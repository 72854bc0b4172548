"""MPI backend (mpi4jax) under mpirun; skipped with the reason where mpi4jax or mpirun is absent."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcomm.collectives import mpi

ROOT = Path(__file__).resolve().parents[1]
OK, WHY = mpi.available()
if OK and shutil.which("mpirun") is None:
    OK, WHY = False, "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
if not OK:
    print(f"\ntests/test_mpi.py skipped: {WHY}", file=sys.stderr)
pytestmark = pytest.mark.skipif(not OK, reason=WHY)


def _mpirun(args, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMM_")}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", OMPI_MCA_rmaps_base_oversubscribe="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    cmd += ["-x", "PYTHONPATH", "-x", "XLA_FLAGS", "-x", "JAX_PLATFORMS", sys.executable, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_allreduce_and_sync_gradients_under_mpirun():
    p = _mpirun([str(ROOT / "tests" / "_mpi_worker.py")])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MPI_OK rank=0 size=2" in p.stdout and "MPI_OK rank=1 size=2" in p.stdout


def test_sweep_compares_mpi_with_gloo():
    p = _mpirun(
        ["-m", "experiments.bench", "collectives", "--max-bytes", "4K", "--reps", "1", "--mpi"]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines()]
    mpi_rows = [r for r in rows if len(r) == 6 and r[1] == "mpi4jax"]
    flat_rows = [r for r in rows if len(r) == 6 and r[1] == "flat"]
    assert len(mpi_rows) == 2 and all(r[-1] == "ok" for r in mpi_rows), p.stdout
    assert len(flat_rows) == 2 and all(r[-1] == "ok" for r in flat_rows), p.stdout


def test_missing_mpi4jax_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(mpi, "available", lambda: (False, "mpi4jax is not installed: pip ..."))
    with pytest.raises(ImportError, match="mpi4jax is not installed"):
        mpi.mpi_sync_gradients()
