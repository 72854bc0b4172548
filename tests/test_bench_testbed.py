"""``python -m experiments.bench testbed``'s table: link bounds and efficiencies from the run's data
(the networked run itself is exercised by tests/test_testbed.py's jobs and docs/benchmarks.md)."""

import pytest

from experiments.bench import testbed as bench


def test_table_puts_each_method_beside_its_link_bound():
    mib = 1 << 20
    run = {
        "link_bps": 250e6,  # 31.25 MB/s
        "nodes": 2,
        "devices_per_node": 2,
        "rows": [{
            "bytes": 16 * mib,
            "results": {
                "flat psum": {"time_s": 0.9, "rel_error": 5e-8, "link_bytes": 24 * mib},
                "int8": {"time_s": 0.3, "rel_error": 1e-2, "link_bytes": 4 * mib},
                "compute only (no collective)": {"time_s": 0.1},
                "psum over intra only": {"time_s": 0.05, "busbw_GBps": 0.3},
                "psum over inter only": {"time_s": 1.1, "busbw_GBps": 0.015},
                "overlap probe: both, independent": {"time_s": 1.2, "probe": True,
                                                     "overlap": 0.5},
            },
        }],
    }  # fmt: skip
    text = "\n".join(bench._table(run))
    res = run["rows"][0]["results"]
    assert res["flat psum"]["link_bound_s"] == pytest.approx(24 * mib / 31.25e6)
    # efficiency: the line-rate time of the link bytes / what the sync adds to the step
    assert res["int8"]["link_efficiency"] == pytest.approx(4 * mib / 31.25e6 / 0.2)
    assert "int8" in text and f"{res['int8']['link_efficiency']:.2f}" in text
    assert "50% of the shorter hidden" in text
    assert "3.00x" in text  # flat / int8


def test_zero_testbed_rows_get_link_bound_and_efficiency():
    from experiments.bench import zero

    rows = {
        "dp-f32": {"crossing_inter": 31.25e6, "step_s": 1.5},
        "zero-int8-bf16": {"crossing_inter": 12.5e6, "step_s": 0.5},
    }
    zero.bookkeep(rows, 250e6, 0.1)
    assert rows["dp-f32"]["link_bound_s"] == pytest.approx(1.0)  # 31.25 MB at 31.25 MB/s
    assert rows["dp-f32"]["efficiency"] == pytest.approx(1.0 / 1.4)
    assert rows["zero-int8-bf16"]["exposed_s"] == pytest.approx(0.4)
    assert rows["zero-int8-bf16"]["efficiency"] == pytest.approx(0.4 / 0.4)
    res = {"model": "m", "params": 1e6, "mesh": {"inter": 2, "intra": 2}, "link": "250mbit",
           "compute_only_s": 0.1, "rows": {k: v | {"gradients": "f32", "param_gather": "-"}
                                           for k, v in rows.items()}}  # fmt: skip
    text = zero._testbed_table(res)
    assert "1.000" in text and "0.71" in text and "zero-int8-bf16" in text
    # no compute-only time or no link rate: no efficiency, no bound
    zero.bookkeep(rows, 0, None)
    assert rows["dp-f32"]["link_bound_s"] is None and rows["dp-f32"]["efficiency"] is None
    assert "-" in zero._testbed_table(res)
