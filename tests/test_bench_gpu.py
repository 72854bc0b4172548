"""``python -m jaxcomm.bench gpu``: what can be checked without a GPU.

The no-GPU exit, the part registry and its time plan, the report formatting and the schedule
goals on synthetic results, the option sets of the mocked-schedule part, a part that fails
or overruns its limit. The GPU parts themselves run end to end on CPU with ``--allow-cpu``
(tiny sizes; minutes on 2 cores, so not here).
"""

from __future__ import annotations

import json
import os

import pytest

from jaxcomm.bench import gpu
from jaxcomm.bench import schedule as sched

MiB = 1 << 20


def test_no_gpu_exits_2_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "_gpu_plugin", lambda: False)
    out = tmp_path / "out"
    assert gpu.main(["--out", str(out)]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert not out.exists()  # nothing was run, nothing written


class _FakeRun:
    """Stands in for ``gpu._Running``: records the start order, reports a platform."""

    started: list[str] = []
    platform = "gpu"

    def __init__(self, part, args, argv, limit):
        self.name, self.limit = part.name, limit
        _FakeRun.started.append(part.name)
        self.proc = self  # .poll(): background parts are still running

    def poll(self):
        return None

    def finish(self):
        data = {"platform": _FakeRun.platform} if self.name == "versions" else {}
        return {"status": "ok", "data": data, "seconds": 1.0, "timeout_s": self.limit}


@pytest.fixture
def fake_run(monkeypatch):
    monkeypatch.setattr(gpu, "_gpu_plugin", lambda: True)
    monkeypatch.setattr(gpu, "_Running", _FakeRun)
    _FakeRun.started, _FakeRun.platform = [], "gpu"
    return _FakeRun


def test_plugin_without_gpu_stops_after_the_probe(tmp_path, fake_run, capsys):
    fake_run.platform = "cpu"
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert fake_run.started == ["versions"]
    assert "platform 'cpu'" in capsys.readouterr().err
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(saved["parts"]) == ["versions"]


def test_run_order_and_background_schedule(tmp_path, fake_run, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 0
    # The probe first, then the compile-only schedule part in the background, then the
    # timed parts, which record that it ran alongside them.
    assert fake_run.started == ["versions", "schedule", "kernels", "step"]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert list(parts) == fake_run.started
    assert parts["schedule"]["background"] is True
    assert parts["kernels"]["concurrent_with"] == ["schedule"]
    assert "concurrent_with" not in parts["versions"]
    assert all(p["timeout_s"] <= gpu.BUDGET_S for p in parts.values())
    assert "== step: ok" in capsys.readouterr().out
    fake_run.started = []
    assert gpu.main(["--out", str(tmp_path), "--sequential", "--parts", "step,schedule"]) == 0
    assert fake_run.started == ["versions", "step", "schedule"]


def test_unknown_part_is_refused(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path), "--parts", "kernels,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_part_registry_and_time_plan():
    names = [p.name for p in gpu.PARTS]
    assert names == ["versions", "kernels", "schedule", "step"]
    assert set(gpu._TABLES) == set(names)
    # The whole run is capped by the budget, which leaves the 8-minute plan some slack.
    assert gpu.BUDGET_S <= 7.5 * 60
    assert all(0 < p.timeout_s <= gpu.BUDGET_S for p in gpu.PARTS)
    assert gpu.PARTS[0].timeout_s + gpu.PARTS[1].timeout_s < gpu.BUDGET_S / 2
    assert set(gpu.SCHEDULE_SETS) <= set(sched.OPTION_SETS)
    assert set(gpu.SCHEDULE_SETS_QUICK) <= set(gpu.SCHEDULE_SETS)


def test_peak_bandwidth_table():
    assert gpu.peak_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert gpu.peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert gpu.peak_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert gpu.peak_bandwidth("NVIDIA GH200 480GB")[0] is None  # not the H200 entry
    bw, why = gpu.peak_bandwidth("cpu")
    assert bw is None and "cpu" in why


def test_mocked_schedule_option_sets():
    sets = sched.option_sets("gpu", gpu.SCHEDULE_SETS)
    assert list(sets) == list(gpu.SCHEDULE_SETS)
    assert sets["defaults"] == {}
    assert sets["overlap"] == {"xla_gpu_enable_latency_hiding_scheduler": True}
    thr = "xla_gpu_all_reduce_combine_threshold_bytes"
    assert sets["combine=0"] == {thr: 0}
    assert sets["combine=1MiB"] == {thr: MiB}
    assert sets["combine=30MiB"] == {thr: 30 * MiB}
    cpu = sched.option_sets("cpu", ["overlap"])
    assert cpu["overlap"]["xla_disable_hlo_passes"] == "cpu-all-reduce-combiner"
    assert cpu["cpu-combiner-on"] == {}
    with pytest.raises(ValueError, match="unknown option sets"):
        sched.option_sets("gpu", ["overlap", "combine=2MiB"])


def _raw_set(options, ars, extra=()):
    """A ``bench schedule --json`` entry with the given all-reduces (bytes, async, between)."""
    rows = [
        {"kind": "all-reduce", "axes": ["inter", "intra"], "bytes": b, "async": a,
         "ops_between": o, "dtype": "f32"}
        for b, a, o in ars
    ] + list(extra)  # fmt: skip
    summary = [{"kind": "all-reduce", "axes": ["inter", "intra"], "count": len(ars),
                "bytes": sum(b for b, _, _ in ars), "async": sum(a for _, a, _ in ars),
                "overlapped": sum(bool(o) for _, _, o in ars), "ops_between": 0}]  # fmt: skip
    return {
        "options": options,
        "collectives": len(rows),
        "async": sum(r["async"] for r in rows),
        "overlapped": sum(bool(r["ops_between"]) for r in rows),
        "compile_s": 3.0,
        "report": {"collectives": rows, "summary": summary},
    }


def _raw(overlap_between):
    ag = {"kind": "all-gather", "axes": ["intra"], "bytes": 8, "async": True, "ops_between": 0}
    return {
        "header": "variant=gpu devices=8",
        "results": {
            "defaults": _raw_set({}, [(30 * MiB, True, 0)] * 4),
            "overlap": _raw_set({"lhs": True}, [(30 * MiB, True, o) for o in overlap_between]),
            "combine=0": _raw_set({}, [(MiB // 2, True, 0)] * 161, [ag]),
            "combine=1MiB": _raw_set({}, [(MiB, True, 0)] * 90 + [(9 * MiB, True, 0)]),
            "combine=30MiB": _raw_set({}, [(30 * MiB, True, 0)] * 4),
        },
    }


def test_schedule_summary_and_goals():
    s = gpu.summarize_schedule(_raw([12, 40, 7, 0]))
    assert s["sets"]["combine=0"]["all_reduces"] == 161
    assert s["sets"]["combine=0"]["collectives"] == 162
    assert s["sets"]["overlap"]["all_reduce_ops_between"] == [12, 40, 7, 0]
    goals = s["goals"]
    assert goals["overlap: async pairs with compute between, all but the last all-reduce"]
    assert goals["combine: fewer all-reduces as the threshold grows"]
    assert goals["combine: all-reduce counts"] == {
        "combine=0": 161, "combine=1MiB": 91, "combine=30MiB": 4,
    }  # fmt: skip
    assert goals["combine=1MiB: all-reduces above 1 MiB (single buffers only)"] == 1
    # A bucket before the last with nothing scheduled between start and done fails the goal.
    bad = gpu.summarize_schedule(_raw([12, 0, 7, 0]))["goals"]
    assert not bad["overlap: async pairs with compute between, all but the last all-reduce"]


def _synthetic_result():
    return {
        "total_s": 231.0,
        "budget_s": 420.0,
        "out": "/tmp/x",
        "parts": {
            "versions": {
                "status": "ok", "seconds": 6.0, "timeout_s": 60, "what": "versions",
                "data": {"device_kind": "NVIDIA H200", "jax": "0.11.2", "jaxlib": "0.11.2",
                         "packages": {"jax-cuda13-plugin": "0.11.2"},
                         "nvidia_smi": "NVIDIA H200, 570.1, 143771 MiB"},
            },
            "kernels": {
                "status": "ok", "seconds": 40.0, "timeout_s": 120,
                "concurrent_with": ["schedule"],
                "data": {
                    "model": "resnet152", "elements": 60192808, "padded_elements": 60194816,
                    "device_kind": "NVIDIA H200", "peak_bandwidth_bytes_per_s": 4.8e12,
                    "kernels": {
                        "int8 dequantize": {"best_s": 1.1e-4, "median_s": 1.2e-4,
                                            "bytes": 301e6, "gb_per_s": 2736.0,
                                            "fraction_of_peak": 0.57},
                        "top-k 0.01 selection, exact": {"error": "XlaRuntimeError: oom"},
                    },
                },
            },
            "schedule": {
                "status": "timeout", "seconds": 180.0, "timeout_s": 180, "background": True,
                "error": "killed after 180 s", "data": gpu.summarize_schedule(_raw([3, 0])),
            },
            "step": {
                "status": "failed", "seconds": 2.0, "timeout_s": 189,
                "error": "ValueError: boom", "traceback": "Traceback ...",
                "data": {
                    "preset": {"model": "resnet152", "image_size": 224, "dtype": "bfloat16",
                               "per_device_batch": 64},
                    "rows": {
                        "baseline": {"status": "ok", "step_time_s": 0.21, "images_per_s": 304.8,
                                     "warmup_s": 70.0},
                        "+hierarchical": {"status": "skipped", "reason": "needs a second device"},
                    },
                },
            },
        },
    }  # fmt: skip


def test_format_report_on_synthetic_result():
    text = gpu.format_report(_synthetic_result())
    assert "== versions: ok" in text and "NVIDIA H200" in text
    assert "int8 dequantize" in text and "0.57" in text and "2736.0" in text
    assert "FAILED: XlaRuntimeError: oom" in text
    assert "[alongside schedule]" in text and "[in the background]" in text
    assert "== schedule: timeout" in text and "killed after 180 s" in text
    assert "combine=0" in text and "161" in text and "512.0K[0]" in text and "30.0M[3]" in text
    assert "== step: failed" in text and "ValueError: boom" in text
    assert "210.000 ms" in text and "needs a second device" in text
    # A malformed part is shown as such; the others still print.
    broken = _synthetic_result()
    broken["parts"]["kernels"]["data"]["kernels"] = {"x": {"best_s": "?"}}
    text = gpu.format_report(broken)
    assert "table failed" in text and "== step: failed" in text


def test_failing_part_reports_its_traceback(tmp_path, monkeypatch):
    def boom(args, emit):
        emit(first=1)
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(gpu._BY_NAME, "boom", gpu.Part("boom", "test", 5, boom))
    assert gpu.main(["--out", str(tmp_path), "--child", "boom"]) == 1
    saved = json.loads((tmp_path / "parts" / "boom.json").read_text())
    assert saved["status"] == "failed"
    assert saved["data"] == {"first": 1}  # what it finished before failing is kept
    assert "RuntimeError: kernel exploded" in saved["error"]
    assert "kernel exploded" in saved["traceback"] and "boom" in saved["traceback"]


def test_versions_part_in_process(tmp_path):
    assert gpu.main(["--out", str(tmp_path), "--allow-cpu", "--child", "versions"]) == 0
    saved = json.loads((tmp_path / "parts" / "versions.json").read_text())
    assert saved["status"] == "ok", saved
    d = saved["data"]
    import jax

    assert d["jax"] == jax.__version__ and d["platform"] == "cpu"
    assert d["peak_bandwidth_bytes_per_s"] is None


def test_part_over_its_limit_is_killed_and_reported(tmp_path):
    args = gpu._parse(["--out", str(tmp_path), "--allow-cpu"])
    os.makedirs(tmp_path / "parts")
    res = gpu._run_part(gpu.PARTS[0], args, ["--out", str(tmp_path), "--allow-cpu"], 0.3)
    assert res["status"] == "timeout"
    assert res["seconds"] < 10
    assert "killed after" in res["error"]


def test_limit_overrides_one_part(tmp_path, fake_run, capsys):
    assert gpu.main(["--out", str(tmp_path), "--parts", "step", "--limit", "step=300"]) == 0
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["step"]["timeout_s"] == 300
    with pytest.raises(SystemExit):
        gpu.main(["--out", str(tmp_path), "--limit", "nope=3"])
    assert "PART=SECONDS" in capsys.readouterr().err
