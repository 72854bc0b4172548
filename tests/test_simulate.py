"""The scale simulator: workloads, the overlap/batching schedule, the stacked rows, the CLI
and calibration."""

import json

import numpy as np
import pytest

from jaxcomm import calibration as cal
from jaxcomm import cost, simulate
from jaxcomm import topology as T


@pytest.fixture(scope="module")
def rn50():
    return simulate.workload("resnet50")


def test_resnet_workload(rn50):
    assert len(rn50.leaf_bytes) == 161
    assert rn50.total_bytes == pytest.approx(25.56e6 * 4, rel=1e-3)
    ready = rn50.ready_times()
    fwd = (1 - rn50.backward_fraction) * rn50.compute_s
    # Backward runs head -> stem: the last tensor is ready first, the stem at compute end.
    assert ready[0] == pytest.approx(rn50.compute_s)
    assert np.all(np.diff(ready) <= 0) and ready[-1] > fwd
    assert sorted(rn50.leaf_bytes[-2:]) == [1000 * 4, 2048 * 1000 * 4]  # the head is last


def _wl(sizes, compute=0.1):
    return simulate.Workload("t", tuple(sizes), (1.0,) * len(sizes), compute)


def test_no_overlap_is_compute_plus_every_collective():
    topo = T.fat_tree(16, 4, None)
    wl = _wl([4_000_000] * 5 + [1000] * 20)
    r = simulate.step_time(wl, topo, algorithm="ring", overlap=False, launch_s=1e-5)
    want = sum(1e-5 + cost.predict("ring", b, topo) for b in wl.leaf_bytes)
    assert r["step_s"] == pytest.approx(wl.compute_s + want)
    assert r["collectives"] == 25 and r["algorithms"] == {"ring": 25}


def test_overlap_hides_communication_behind_backward():
    topo = T.fat_tree(16, 4, None)
    wl = _wl([4_000_000] * 10, compute=1.0)
    plain = simulate.step_time(wl, topo, algorithm="hierarchical", overlap=False)
    over = simulate.step_time(wl, topo, algorithm="hierarchical", overlap=True)
    # Each bucket but the last (ready at compute end) runs during the backward pass.
    last = 1e-5 + cost.predict("hierarchical", 4_000_000, topo)
    assert over["step_s"] == pytest.approx(wl.compute_s + last)
    assert plain["step_s"] == pytest.approx(wl.compute_s + 10 * last)


def test_batching_pays_per_call_latency_once():
    topo = T.fat_tree(64, 4, 4)
    wl = _wl([4096] * 400)
    many = simulate.step_time(wl, topo, algorithm="auto", overlap=False, launch_s=1e-5)
    few = simulate.step_time(
        wl, topo, algorithm="auto", overlap=False, launch_s=1e-5, bucket_bytes=1 << 20
    )
    assert (many["collectives"], few["collectives"]) == (400, 2)
    assert few["comm_s"] < many["comm_s"] / 20


def test_rows_and_json(rn50, tmp_path):
    res = simulate.simulate(rn50, lambda n: T.fat_tree(n, 16, 8, oversubscription=2), [16, 64])
    for n in ("16", "64"):
        rows = res["nodes"][n]["rows"]
        assert [r["row"] for r in rows] == [name for name, _ in simulate.ROWS]
        assert rows[0]["speedup"] == 1.0
        assert rows[0]["collectives"] == 161 and rows[-1]["collectives"] < 161
        assert all(r["step_s"] >= rn50.compute_s for r in rows)
        assert rows[2]["step_s"] <= rows[1]["step_s"]  # overlap never hurts
        hops = res["nodes"][n]["ring_hops"]
        assert hops["aware"] <= hops["random"]
    assert res["nodes"]["64"]["devices"] == 512
    json.dumps(res)  # JSON-ready
    text = simulate.format_tables(res)
    assert "+batching" in text and "halving_doubling" in text


def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = simulate.main(
        ["--model", "300000000", "--compute-ms", "200", "--nodes", "16,32", "--topology",
         "dgx_h100", "--json", str(out), "--plot", str(png)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert list(data["nodes"]) == ["16", "32"] and data["workload"]["bytes"] == 300_000_000
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "step time with optimisations stacked" in capsys.readouterr().out


def test_cli_bad_input(capsys):
    assert simulate.main(["--model", "resnet9", "--nodes", "16"]) == 2
    assert "resnet9" in capsys.readouterr().err


def _points(alpha, beta, axis, p, sizes):
    return [
        {"axis": axis, "bytes": n, "time_s": cost.ring_time(n, p, alpha, beta), "group_size": p}
        for n in sizes
    ]


def test_calibration_fit_recovers_alpha_beta():
    sizes = [1 << k for k in range(10, 26, 3)]
    doc = {
        "points": _points(3e-5, 2e-9, "inter", 2, sizes) + _points(1e-5, 1e-10, "intra", 4, sizes)
    }
    c = cal.from_dict(doc)
    assert c.axes["inter"].alpha == pytest.approx(3e-5, rel=1e-6)
    assert c.axes["inter"].beta == pytest.approx(2e-9, rel=1e-6)
    assert c.axes["intra"].fitted
    errs = cal.prediction_errors(c)
    assert len(errs) == 2 * len(sizes) and max(abs(e["error"]) for e in errs) < 1e-6
    topo = cal.apply(T.fat_tree(2, 2, None, devices_per_node=4), c)
    assert topo.levels[0].latency == pytest.approx(1e-5)
    assert topo.levels[1].bandwidth == pytest.approx(1 / 2e-9)


def test_calibration_given_values_report_error(tmp_path, capsys):
    pts = _points(1e-4, 1e-9, "inter", 2, [1 << 16, 1 << 22])
    pts[1]["time_s"] *= 1.25  # a measurement 25% slower than the model
    doc = {"inter": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "group_size": 2}, "points": pts}
    c = cal.from_dict(doc)
    errs = cal.prediction_errors(c)
    assert errs[0]["error"] == pytest.approx(0, abs=1e-9)
    assert errs[1]["error"] == pytest.approx(1 / 1.25 - 1)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    rc = simulate.main(["--model", "100000000", "--compute-ms", "100", "--nodes", "16",
                        "--calibration", str(path)])  # fmt: skip
    assert rc == 0 and "-20.0%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"points": [{"axis": "inter", "bytes": 10}]}, r"points\[0\]\.time_s"),
        ({"points": [{"axis": "inter", "bytes": -1, "time_s": 1}]}, r"points\[0\]\.bytes"),
        ({"points": [{"axis": "inter", "bytes": 1, "time_s": 1}]}, r"points\[0\]\.group_size"),
        ({"inter": {"alpha_s": "1"}}, r"inter\.alpha_s"),
        ({"points": [{"axis": "x", "bytes": 1, "time_s": 1, "group_size": 2}]}, "two message"),
        ({}, "no axis"),
    ],
)
def test_calibration_errors_name_field(doc, field):
    with pytest.raises(cal.CalibrationError, match=field):
        cal.from_dict(doc)


def test_measure_writes_loadable_points(mesh):
    doc = cal.measure(mesh, sizes=(4096, 65536), repeats=1)
    assert doc["inter"]["group_size"] == 2 and doc["intra"]["group_size"] == 4
    assert len(doc["points"]) == 4 and all(p["time_s"] > 0 for p in doc["points"])
    fitted = cal.from_dict(json.loads(json.dumps(doc)))
    assert {"inter", "intra"} <= set(fitted.axes) and fitted.axes["intra"].fitted
    assert len(cal.prediction_errors(fitted)) == 4
