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
