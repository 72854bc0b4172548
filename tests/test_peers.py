"""``python -m experiments.bench peers``: its figures, table and argument checks, without a
run (the bench itself needs root, a testbed and PyTorch; it is not part of the suite)."""

from __future__ import annotations

import pytest

from experiments.bench import peers


def test_summary_table_and_arguments():
    run = {
        "rows": {
            "jax-compute": {"times_s": [1.0, 1.2, 1.1], "bytes": [0.0, 0.0, 0.0]},
            "jax-f32": {"times_s": [3.0, 3.6, 3.3], "bytes": [6e7] * 3, "accuracy": 0.9},
            "jax-stacked": {"times_s": [1.5, 1.8, 1.5], "bytes": [1e7] * 3, "accuracy": 0.91},
            "torch-compute": {"times_s": [0.5, 0.5, 0.5], "bytes": [0.0] * 3},
            "torch-f32": {"times_s": [2.5, 2.5, 2.5], "bytes": [7e7] * 3, "accuracy": 0.92},
            "torch-batched-powersgd": {"times_s": [], "bytes": [], "error": "AssertionError"},
        }
    }
    s = peers.summarize(run)
    # paired rounds: exposed = row - own twin of the same round, speedup vs own f32 baseline
    assert s["jax-stacked"]["exposed_comm_s"] == pytest.approx(0.5)  # median of .5 .6 .4
    assert s["jax-stacked"]["speedup"] == pytest.approx(2.0)  # 3/1.5, 3.6/1.8, 3.3/1.5
    assert s["jax-stacked"]["speedup_range"] == pytest.approx([2.0, 2.2])
    assert s["jax-f32"]["speedup"] == pytest.approx(1.0)
    assert s["torch-f32"]["exposed_comm_s"] == pytest.approx(2.0)
    assert s["jax-compute"]["exposed_comm_s"] is None and s["jax-compute"]["speedup"] is None
    assert s["torch-batched-powersgd"]["step_time_s"] is None
    table = peers.build_table(s)
    assert "failed: AssertionError" in table
    assert "| 2.00x (2.00-2.20) |" in table and "| 60.0 |" in table
    assert len(table.splitlines()) == 2 + len(run["rows"])

    names = list(peers.labels())
    ok = peers._parser().parse_args([])
    assert peers.validate(ok, names) is None
    bad = {
        "--rows=jax-f32,nope": "unknown ['nope']",
        "--batch=30": "a multiple of the 4 devices",
        "--rows=jax-f32,jax-stacked": "need 'jax-f32' and 'jax-compute'",
        "--steps=6": "multiples of --sync-every",
    }
    for arg, why in bad.items():
        assert why in peers.validate(peers._parser().parse_args([arg]), names), arg
