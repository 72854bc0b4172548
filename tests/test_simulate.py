"""The scale simulator: workloads, the overlap/batching schedule, the stacked rows, the CLI
and calibration."""

import json
import pathlib

import numpy as np
import pytest

from jaxcomm import cost
from jaxcomm import topology as T
from jaxcomm.tools import calibration as cal
from jaxcomm.tools import simulate


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
    r = simulate.step_time(wl, topo, algorithm="flat", overlap=False, launch_s=1e-5)
    want = sum(1e-5 + cost.predict("flat", b, topo) for b in wl.leaf_bytes)  # one call each
    assert r["step_s"] == pytest.approx(wl.compute_s + want)
    assert r["collectives"] == r["calls"] == 25 and r["algorithms"] == {"flat": 25}
    # jaxcomm.allreduce's packing: the 5 large leaves alone, the 20 small ones in one buffer.
    packed = simulate.step_time(wl, topo, algorithm="flat", overlap=False, packing="allreduce")
    assert packed["collectives"] == 6 and packed["step_s"] < r["step_s"]


def test_overlap_hides_communication_behind_backward():
    topo = T.fat_tree(16, 4, None)
    wl = _wl([4_000_000] * 10, compute=1.0)
    plain = simulate.step_time(wl, topo, algorithm="hierarchical", overlap=False)
    over = simulate.step_time(wl, topo, algorithm="hierarchical", overlap=True)
    # Each bucket but the last (ready at compute end) runs during the backward pass; a
    # hierarchical all-reduce is three calls (reduce-scatter, all-reduce, all-gather).
    last = 3e-5 + cost.predict("hierarchical", 4_000_000, topo)
    assert over["step_s"] == pytest.approx(wl.compute_s + last)
    assert plain["step_s"] == pytest.approx(wl.compute_s + 10 * last)


def test_compressed_leaves_are_packed_and_pay_their_codec():
    topo = T.fat_tree(16, 4, None, oversubscription=2)
    wl = _wl([4_000_000] * 10 + [400] * 5, compute=1.0)  # the 5 small leaves stay f32
    int8 = cost.parse_compression("int8")
    kw = dict(algorithm="hierarchical", overlap=True, compression=int8, packing="allreduce")
    r = simulate.step_time(wl, topo, codec=cost.H200_CODEC, **kw)
    # one packed buffer of the 10 large leaves (ready at the end of the backward pass) and
    # one f32 buffer of the small ones
    assert r["collectives"] == 2 and r["algorithms"] == {int8.spec: 1, "hierarchical": 1}
    free = simulate.step_time(wl, topo, **kw)
    assert r["codec_s"] > 0 == free["codec_s"] and r["step_s"] > free["step_s"]
    buckets = simulate.step_time(wl, topo, bucket_bytes=(1 << 20, 8 << 20), **kw)
    assert buckets["algorithms"][int8.spec] == 6  # 1 MiB, then 8 MiB x 4, then the rest
    with pytest.raises(ValueError, match="packing"):
        simulate.step_time(wl, topo, algorithm="flat", overlap=False, packing="leaves")
    with pytest.raises(ValueError, match="compress_stage"):
        simulate.step_time(wl, topo, algorithm="flat", overlap=False, compress_stage="intra")
    with pytest.raises(ValueError, match="bucket_bytes"):
        simulate.step_time(wl, topo, algorithm="flat", overlap=False, bucket_bytes=(0, 5))


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
    res = simulate.simulate(rn50, lambda n: T.fat_tree(n, 16, 8, oversubscription=2), [16, 64],
                            compression=cost.parse_compression("adaptive(int4)"),
                            codec=cost.H200_CODEC)  # fmt: skip
    for n in ("16", "64"):
        node = res["nodes"][n]
        rows = node["rows"]
        assert [r["row"] for r in rows] == [name for name, _ in simulate.ROWS]
        assert rows[0]["speedup"] == 1.0
        assert rows[0]["collectives"] == 161 and rows[-1]["collectives"] < 161
        assert all(r["step_s"] >= rn50.compute_s for r in rows)
        assert rows[2]["step_s"] <= rows[1]["step_s"]  # overlap never hurts
        assert rows[3]["codec_s"] > 0 == rows[2]["codec_s"]
        # no row beats its bound, and no bound beats the baseline's ceiling
        for r in rows:
            assert r["speedup"] <= r["bound_speedup"] * (1 + 1e-9)
            assert r["bound_speedup"] <= node["ceiling_speedup"] * (1 + 1e-9)
        hops = node["ring_hops"]
        assert hops["aware"] <= hops["random"]
    assert res["nodes"]["64"]["devices"] == 512
    json.dumps(res)  # JSON-ready
    text = simulate.format_tables(res)
    assert "+batching" in text and "halving_doubling" in text and "(ceiling)" in text


@pytest.mark.parametrize("nodes", [1, 16, 128])
def test_sharded_f32_sends_a_hierarchical_all_reduce(nodes):
    # ZeRO's reduce-scatter + all-gather are the halves of the hierarchical all-reduce:
    # the same bytes per device, and about its time (the inter stage a ring, not NCCL's
    # faster of ring and tree)
    topo = T.fat_tree(nodes, 16, 8, oversubscription=2)
    n = 240e6
    f32 = cost.sharded_time(n, topo)
    g, m = topo.devices_per_node, topo.num_nodes
    assert f32["wire_bytes"] == pytest.approx(2 * ((g - 1) / g * n + (m - 1) / m * n / g))
    assert f32["comm_s"] == pytest.approx(cost.predict("hierarchical", n, topo), rel=0.05)
    assert f32["codec_s"] == 0.0
    # ZeRO++: int8 gradients and bf16 param gathers at most 0.4x of the bytes
    q = cost.sharded_time(n, topo, grad=cost.parse_compression("int8"),
                          params=cost.parse_compression("bf16"), codec=cost.H200_CODEC)  # fmt: skip
    assert q["wire_bytes"] <= 0.4 * f32["wire_bytes"]
    assert q["codec_s"] > 0 and q["comm_s"] < f32["comm_s"]


def test_sharded_rows_beside_the_stacked_ones(rn50):
    res = simulate.simulate(rn50, lambda n: T.fat_tree(n, 16, 8, oversubscription=2), [16, 64],
                            codec=cost.H200_CODEC)  # fmt: skip
    for n in ("16", "64"):
        node = res["nodes"][n]
        rows = node["sharded"]
        assert [r["row"] for r in rows] == [name for name, *_ in simulate.SHARDED_ROWS]
        assert rows[0]["wire_bytes"] == pytest.approx(node["dp_wire_bytes"])
        assert rows[1]["wire_bytes"] < 0.4 * node["dp_wire_bytes"]
        base = node["rows"][0]["step_s"]
        for r in rows:  # nothing overlapped: compute plus every collective and its codec
            assert r["step_s"] == pytest.approx(rn50.compute_s + r["comm_s"])
            assert r["speedup"] == pytest.approx(base / r["step_s"])
    text = simulate.format_tables(res)
    assert "sharded int8+bf16" in text and "x DP" in text


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "resnet9"], "resnet9"),
        (["--compression", "int3"], "unknown compressor 'int3'; allowed"),
        (["--compression", "int8", "--compression-ratio", "4"], "not both"),
        (["--compression-ratio", "0.5"], "must be >= 1"),
        (["--codec", "nope.json"], "nope.json"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert simulate.main(["--nodes", "16", "--model", "300000000", "--compute-ms", "100",
                          *argv]) == 2  # fmt: skip
    assert message in capsys.readouterr().err


def test_cli_compression_and_codec(tmp_path, capsys):
    argv = ["--model", "300000000", "--compute-ms", "100", "--nodes", "16", "--json"]
    assert simulate.main([*argv, str(tmp_path / "a.json"), "--compression", "int8"]) == 0
    assert simulate.main([*argv, str(tmp_path / "b.json"), "--compression", "int8",
                          "--codec", "none"]) == 0  # fmt: skip
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    ra, rb = a["nodes"]["16"]["rows"][3], b["nodes"]["16"]["rows"][3]
    assert a["compression"] == "int8(block=256, stochastic=True)"
    assert ra["codec_s"] > 0 == rb["codec_s"] and ra["step_s"] >= rb["step_s"]
    assert "codec h200" in capsys.readouterr().out
    # a codec file of this machine (as bench compression writes it) is read by --codec
    codec = {"codec": {"int8": {"encode_s_per_byte": 1e-9, "decode_s_per_byte": 1e-9}},
             "meta": {"machine": "test box"}}  # fmt: skip
    (tmp_path / "codec.json").write_text(json.dumps(codec))
    assert simulate.main([*argv, str(tmp_path / "c.json"), "--compression", "int8",
                          "--codec", str(tmp_path / "codec.json")]) == 0  # fmt: skip
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["nodes"]["16"]["rows"][3]["codec_s"] > ra["codec_s"]  # 1 ns/B > an H200's
    assert "test box" in c["codec"]


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
    # 4 devices share the node's one NIC (oversubscription 4): the per-device 1/beta
    # measured while all 4 send means a NIC of 4 / beta.
    assert topo.levels[1].bandwidth == pytest.approx(4 / 2e-9)
    own_nics = cal.apply(T.fat_tree(2, 2, None, devices_per_node=4, nics_per_node=4), c)
    assert own_nics.levels[1].bandwidth == pytest.approx(1 / 2e-9)


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
        ({"call_s": -1}, r"call_s: expected a number >= 0"),
        ({"call_s": {"broadcast": 1e-3}}, r"call_s\.broadcast: unknown kind; expected one of"),
        ({"codec": {"int9": {}}}, r"codec\.int9: unknown kernel; expected one of"),
        ({"codec": {"int8": {"encode_s_per_byte": 1e-9}}}, r"codec\.int8\.decode_s_per_byte"),
        (
            {
                "calls": [
                    {
                        "axis": "intra",
                        "bytes": 8,
                        "time_s": 1e-3,
                        "collective": "bcast",
                        "group_size": 2,
                    }
                ]
            },
            r"calls\[0\]\.collective",
        ),
        ({"meta": [1], "call_s": 0}, "meta: expected an object"),
    ],
)
def test_calibration_errors_name_field(doc, field):
    with pytest.raises(cal.CalibrationError, match=field):
        cal.from_dict(doc)


def test_measure_writes_loadable_points(mesh):
    doc = cal.measure(mesh, sizes=(4096, 65536), repeats=1, statistic="best")
    assert doc["inter"]["group_size"] == 2 and doc["intra"]["group_size"] == 4
    assert len(doc["points"]) == 4 and all(p["time_s"] > 0 for p in doc["points"])
    kinds = {(c["axis"], c["collective"]) for c in doc["calls"]}
    assert ("intra", "reduce-scatter") in kinds and ("inter", "all-to-all") in kinds
    fitted = cal.from_dict(json.loads(json.dumps(doc)))
    assert {"inter", "intra"} <= set(fitted.axes) and fitted.axes["intra"].fitted
    assert len(cal.prediction_errors(fitted)) == 4
    assert set(fitted.call_s) == {c["collective"] for c in doc["calls"]}
    assert all(v >= 0 for v in fitted.call_s.values())
    with pytest.raises(ValueError, match="statistic"):
        cal.measure(mesh, statistic="mean")


def test_call_costs_are_what_a_call_takes_beyond_its_axis_model():
    pts = _points(1e-4, 1e-9, "intra", 2, [1 << 16, 1 << 22])
    calls = [
        {"axis": "intra", "bytes": 8, "time_s": 5e-3, "group_size": 2, "collective": "all-gather"},
        {"axis": "intra", "bytes": 8, "time_s": 1e-5, "group_size": 2, "collective": "all-reduce"},
    ]
    c = cal.from_dict(
        {
            "points": pts,
            "calls": calls,
            "codec": {
                "int8": {"encode_s_per_byte": 2e-9, "decode_s_per_byte": 1e-9, "source": "here"}
            },
        }
    )
    # all-gather over 2: one step, alpha + 4 bytes beta; an all-reduce of 8 bytes is
    # slower in the model (2 alpha) than measured: clipped at 0.
    assert c.call_s["all-gather"] == pytest.approx(5e-3 - 1e-4 - 4e-9)
    assert c.call_s["all-reduce"] == 0.0
    assert c.codec["int8"] == cost.Codec(2e-9, 1e-9, "here")
    given = cal.from_dict({"call_s": 2e-3})
    assert set(given.call_s) == set(cost.CALL_KINDS) and not given.axes


def test_least_squares_follow_the_large_messages():
    # A jittery smallest point (5x its model) must not move beta: the large messages
    # carry the bandwidth term.
    sizes = [1 << k for k in range(12, 25, 3)]
    pts = _points(5e-4, 6.7e-8, "inter", 2, sizes)
    pts[0]["time_s"] *= 5
    fit = cal.from_dict({"points": pts}).axes["inter"]
    assert fit.beta == pytest.approx(6.7e-8, rel=0.01)


_ROW = {
    "status": "ok", "mesh": {"inter": 2, "intra": 2}, "link_bps": 250e6,
    "settings": {"sync_gradients": {"algorithm": "hierarchical"}},
}  # fmt: skip


def _row(config, technique, measured, compute, **sync):
    sett = {"sync_gradients": {**_ROW["settings"]["sync_gradients"], **sync}}
    return {**_ROW, "config": config, "technique": technique, "settings": sett,
            "step_time_median_s": measured, "compute_only_step_time_median_s": compute,
            "step_time_s": measured, "compute_only_step_time_s": compute}  # fmt: skip


def test_testbed_row_config_reads_the_rows_settings():
    ad = "jaxcomm.compression.adaptive[f32,bf16,int8,int4]"
    row = _row(
        "+compression",
        "adaptive (nearest, blocks of 64) on the inter stage",
        1,
        1,
        compression=ad,
        compress_stage="inter",
        bucket_bytes=[1 << 20, 10 << 20],
    )
    row["adaptive"] = {"level": "int4"}
    cfg = simulate.testbed_row_config(row)
    assert cfg == {"algorithm": "hierarchical",
                   "compression": "adaptive(int4, block=64, stochastic=False)",
                   "compress_stage": "inter", "bucket_bytes": (1 << 20, 10 << 20),
                   "overlap": False, "packing": "allreduce"}  # fmt: skip
    later = simulate.testbed_row_config(row, technique="gradient buckets")
    assert later["compression"] == "adaptive(int4, block=256, stochastic=True)"
    int8 = _row("+c", "int8 (stochastic rounding)", 1, 1, compression="jaxcomm.compression.int8")
    assert simulate.testbed_row_config(int8)["compression"] == "int8(block=256, stochastic=True)"
    with pytest.raises(ValueError, match="adaptive.level"):
        simulate.testbed_row_config({**row, "adaptive": None})


def test_check_compares_each_row_and_fails_outside_the_tolerance(tmp_path, capsys):
    calib = {"intra": {"alpha_s": 1e-4, "beta_s_per_byte": 2e-9, "group_size": 2},
             "inter": {"alpha_s": 5e-4, "beta_s_per_byte": 6.7e-8, "group_size": 2},
             "call_s": 1e-3}  # fmt: skip
    wl = simulate.workload(40_000_000, 1.0)
    c = cal.from_dict(calib)
    # one row as measured: flat, and its prediction from the same calibration, 10 % slower
    base = _row("baseline", "flat", 1.0, 0.3, algorithm="flat")
    first = simulate.check_testbed([base], c, wl, codec=None)["rows"][0]["predicted_s"]
    rows = [_row("baseline", "flat", first * 1.1, 0.3, algorithm="flat"),
            _row("+hierarchical", "hier", 0.5, 0.3)]  # fmt: skip
    res = simulate.check_testbed(rows, c, wl, codec=None)
    assert res["rows"][0]["ok"] and res["rows"][0]["error"] == pytest.approx(1 / 1.1 - 1)
    assert not res["rows"][1]["ok"] and not res["passed"]
    (tmp_path / "rows.json").write_text(json.dumps(rows[:1]))
    (tmp_path / "cal.json").write_text(json.dumps(calib))
    argv = ["--check", str(tmp_path / "rows.json"), "--calibration", str(tmp_path / "cal.json"),
            "--model", "40000000", "--json", str(tmp_path / "out.json")]  # fmt: skip
    assert simulate.main(argv) == 0 and "PASS" in capsys.readouterr().out
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert simulate.main(argv) == 1 and "OUT OF BOUNDS" in capsys.readouterr().out
    assert simulate.main(["--check", str(tmp_path / "rows.json")]) == 2
    with pytest.raises(ValueError, match="statistic"):
        simulate.check_testbed(rows, c, wl, codec=None, statistic="mean")


def test_the_committed_testbed_check_passes():
    # The check of docs/simulator.md: the committed calibrations of the testbed and of
    # this machine's codec predict every row of the committed ResNet-18 table within 15 %.
    results = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results"
    rows = json.loads(
        (results / "ablation_testbed_resnet18_250mbit_2026-12-02_s26.json").read_text()
    )
    c = cal.load(results / "calibration_testbed_250mbit_2026-12-02.json")
    codec, _ = simulate.codec_table(str(results / "codec_cpu_2026-12-02.json"))
    out = simulate.check_testbed(rows, c, simulate.workload("resnet18", 1.0, num_classes=10),
                                 codec=codec)  # fmt: skip
    assert [r["config"] for r in out["rows"]] == [r["config"] for r in rows]
    assert out["passed"], simulate.format_check(out)
    # without the codec the compressed rows fall out (the model the issue started from)
    bare = simulate.check_testbed(rows, c, simulate.workload("resnet18", 1.0, num_classes=10),
                                  codec=None)  # fmt: skip
    assert not bare["passed"] and all(r["ok"] for r in bare["rows"][:3])
