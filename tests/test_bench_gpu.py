"""``python -m experiments.bench gpu``: what can be checked without a GPU.

The no-GPU exit, the part registry and its time plan, the report formatting and the schedule
goals on synthetic results, the option sets of the mocked-schedule part, a part that fails
or overruns its limit. The GPU parts themselves run end to end on CPU with ``--allow-cpu``
(tiny sizes; minutes on 2 cores, so not here).
"""

from __future__ import annotations

import json
import os

import pytest

from experiments.bench import gpu
from experiments.bench import schedule as sched

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
    assert fake_run.started == ["versions", "schedule", "kernels", "options", "step", "overhead"]
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
    assert names == ["versions", "kernels", "schedule", "options", "step", "overhead"]
    assert set(gpu._TABLES) == set(names)
    # The whole run is capped by the budget, which leaves the 8-minute plan some slack.
    assert gpu.BUDGET_S <= 7.5 * 60
    assert all(0 < p.timeout_s <= gpu.BUDGET_S for p in gpu.PARTS)
    assert gpu.PARTS[0].timeout_s + gpu.PARTS[1].timeout_s < gpu.BUDGET_S / 2
    # The timed parts before step (schedule runs in the background) leave step at least
    # 150 s even when each of them uses its whole limit.
    by = {p.name: p for p in gpu.PARTS}
    before_step = sum(by[n].timeout_s for n in ("versions", "kernels", "options"))
    assert gpu.BUDGET_S - before_step >= 150
    assert by["options"].timeout_s == gpu.OPTIONS_LIMIT_S and not by["options"].background


def test_help_lists_every_part(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for p in gpu.PARTS:
        assert f"{p.name} (" in text and f"limit {p.timeout_s:.0f} s" in text
    assert "--options" in text
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


# --------------------------------------------------------------------------- options part

_HLO = """HloModule m, is_scheduled=true

%fused_add (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} add(%p0, %p0)
}

%add_reducer (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%branch_a (pa: f32[4]) -> f32[4] {
  %pa = f32[4]{0} parameter(0)
  ROOT %fa = f32[4]{0} fusion(%pa), kind=kLoop, calls=%fused_add
}

%branch_b (pb: f32[4]) -> f32[4] {
  %pb = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%pb), replica_groups={{0,1}}, to_apply=%add_reducer
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %pr = pred[] compare(%i, %i), direction=EQ
  %c = f32[4]{0} conditional(%pr, %v, %v), true_computation=%branch_a, false_computation=%branch_b
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (ct: (s32[], f32[4])) -> pred[] {
  %ct = (s32[], f32[4]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%ct), index=0
  ROOT %lt = pred[] compare(%ci, %ci), direction=LT
}

%plain_body (u: (s32[], f32[4])) -> (s32[], f32[4]) {
  %u = (s32[], f32[4]{0}) parameter(0)
  ROOT %m = (s32[], f32[4]{0}) multiply(%u, %u)
}

ENTRY %main (e0: (s32[], f32[4]), k: s32[]) -> f32[4] {
  %e0 = (s32[], f32[4]{0}) parameter(0)
  %k = s32[] parameter(1)
  %w1 = (s32[], f32[4]{0}) while(%e0), condition=%cond, body=%body, TRIP3
  %w2 = (s32[], f32[4]{0}) while(%w1), condition=%cond, body=%plain_body
  %g = f32[4]{0} get-tuple-element(%w2), index=1
  ROOT %sw = f32[4]{0} conditional(%k, %g, %g), branch_computations={%branch_a, %branch_b}
}
""".replace("TRIP3", 'backend_config={"known_trip_count":{"n":"3"}}')


def test_host_round_trips_rule():
    from experiments.bench import gpu_options as go

    rt = go.host_round_trips(_HLO)
    # w1: 3 known iterations x (its conditional: 1) = 3; w2 (trip count unknown): 1; the
    # entry's conditional: 1.
    assert rt["per_step"] == 5
    assert rt["conditionals"] == 2
    assert (rt["whiles_known_trip"], rt["whiles_unknown_trip"]) == (1, 1)
    assert rt["lower_bound"] is True
    assert sorted(s.split(":")[1].split()[0] for s in rt["sites"]) == ["c", "sw", "w2"]
    # Without control flow: no round trip at all.
    flat = _HLO.split("ENTRY")[0] + (
        "ENTRY %main (q: f32[4]) -> f32[4] {\n  %q = f32[4]{0} parameter(0)\n"
        "  ROOT %f = f32[4]{0} fusion(%q), kind=kLoop, calls=%fused_add\n}\n"
    )
    assert go.host_round_trips(flat) == {
        "per_step": 0, "conditionals": 0, "whiles_unknown_trip": 0, "whiles_known_trip": 0,
        "lower_bound": False, "sites": [],
    }  # fmt: skip


def test_count_kernels_skips_fused_and_reducer_bodies():
    from experiments.bench import gpu_options as go

    # fusion in branch_a (1), compare in body (1), compare in cond (1), multiply in
    # plain_body (1); fused_add's and add_reducer's adds are not launches, the all-reduce
    # is communication, while/conditional are control flow.
    assert go.count_kernels(_HLO) == {"kernels": 4, "fusions": 1}
    # A call's body (XLA:GPU's command buffers) runs its kernels: they count.
    called = _HLO.split("%add_reducer")[0] + (
        "%cmd (a: f32[4]) -> f32[4] {\n  %a = f32[4]{0} parameter(0)\n"
        "  ROOT %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_add\n}\n\n"
        "ENTRY %main (q: f32[4]) -> f32[4] {\n  %q = f32[4]{0} parameter(0)\n"
        "  ROOT %c = f32[4]{0} call(%q), to_apply=%cmd\n}\n"
    )
    assert go.count_kernels(called) == {"kernels": 1, "fusions": 1}
    assert go.analyze(_HLO)["in_branches"] == 1  # branch_b's all-reduce


def test_repeat_bits_catches_a_nondeterministic_step():
    import numpy as np

    from experiments.bench import gpu_options as go

    state = {"w": np.zeros(5, np.float32), "n": np.zeros((), np.int32)}
    batches = [np.ones(5, np.float32)] * 3

    def exact(s, b):
        return {"w": s["w"] + b * 0.1, "n": s["n"] + 1}, {}

    rng = np.random.default_rng(0)

    def racy(s, b):  # an order-dependent sum: last bits change from run to run
        noise = rng.normal(size=5).astype(np.float32) * 1e-7
        return {"w": s["w"] + b * 0.1 + noise, "n": s["n"] + 1}, {}

    assert go.repeat_bits(exact, state, batches) == {"equal": True, "leaves": 2, "differing": []}
    bad = go.repeat_bits(racy, state, batches)
    assert bad["equal"] is False and bad["differing"] == ["['w']"]


def test_options_summary_computes_goals():
    from experiments.bench import gpu_options as go

    def comp(trips, n, n_async):
        rows = [{"async": i < n_async, "ops_between": 5 if i < n_async else None}
                for i in range(n)]  # fmt: skip
        return {"compile_s": 1.0, "kernels": 9, "fusions": 7, "collectives": n,
                "async": n_async, "in_branches": 0, "collective_rows": rows,
                "round_trips": {"per_step": trips, "lower_bound": False, "sites": []}}  # fmt: skip

    def run(step, equal=True):
        return {"compile_s": 1.0, "step_best_s": step, "step_median_s": step,
                "images_per_s": 256 / step,
                "repeat": {"equal": equal, "differing": [] if equal else ["x"]}}  # fmt: skip

    compiled = {"flat": comp(0, 2, 2), "int8": comp(1, 4, 3), "local_sgd": comp(1, 3, 3)}
    # Steady state: flat's one program (analyzed already), local SGD's two host-picked
    # branches (none left), int8's still one round trip.
    trips = lambda n: {"per_step": n, "lower_bound": False, "sites": []}  # noqa: E731
    compiled["flat"]["steady"] = {"phases": [{"phase": "HostPhase()", "round_trips": None}]}
    compiled["local_sgd"]["steady"] = {
        "phases": [{"phase": f"b{b}", "round_trips": trips(0)} for b in (0, 1)]
    }
    compiled["int8"]["steady"] = {"phases": [{"phase": "x", "round_trips": trips(1)}]}
    runs = {"flat": run(0.010), "int8": run(0.020, equal=False), "local_sgd": run(0.008)}
    s = go.summarize(compiled, runs, async_expected=True)
    assert list(s["rows"]) == ["flat", "int8", "local_sgd"]  # table order, not dict order
    assert s["rows"]["int8"]["speed_vs_flat"] == pytest.approx(0.5)
    assert s["rows"]["local_sgd"]["speed_vs_flat"] == pytest.approx(1.25)
    assert s["rows"]["int8"]["ops_between"] == [5, 5, 5]
    g = s["goals"]
    assert g["no host round trip on an option that does not need one"] is False
    assert g["options over the round-trip goal"] == ["int8"]  # local_sgd needs its branch
    assert g["every collective async"] is False
    assert g["options with a synchronous collective"] == ["int8"]
    assert g["options whose bits differ"] == ["int8"]
    assert g["no host round trip in any option's steady-state programs"] is False
    assert g["options with a round trip in steady state"] == ["int8"]
    assert [s["rows"][n]["steady_round_trips"] for n in ("flat", "int8", "local_sgd")] == [0, 1, 0]
    cpu = go.summarize(compiled, runs, async_expected=False)["goals"]
    assert cpu["every collective async"] is None  # XLA:CPU has no async collectives
    text = "\n".join(go.format_table({"rows": s["rows"], "goals": g}))
    assert "DIFF" in text and "0.50x" in text and "1.25x" in text and "20.000 ms" in text


def test_options_dry_run_on_cpu(tmp_path, capsys):
    """The options part end to end on CPU (``--allow-cpu``): compiled for the 8 fake CPU
    devices in a 2 x 4 mesh, run on one; every figure read back is recomputed here."""
    from experiments.bench import gpu_options as go

    assert gpu.main(["--out", str(tmp_path), "--allow-cpu", "--parts", "options"]) == 0
    printed = capsys.readouterr().out
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["options"]
    assert part["status"] == "ok", part.get("error") or part.get("log_tail")
    d = part["data"]
    info = d["compile_info"]
    assert info["variant"] == "cpu" and info["devices"] == 8
    assert info["mesh"] == {"inter": 2, "intra": 4}
    rows = d["rows"]
    assert list(rows) == list(go.OPTION_NAMES)
    flat = rows["flat"]["step_best_s"]
    for name, r in rows.items():
        assert "compile_error" not in r and "run_error" not in r, (name, r)
        assert r["compile_s"] > 0 and r["kernels"] >= r["fusions"] >= 1
        assert r["collectives"] >= 1 and r["async_pairs"] == 0  # CPU: synchronous
        assert r["bits_equal"] is True, (name, r["bits_differing"])
        assert 0 < r["step_best_s"] <= r["step_median_s"]
        assert r["images_per_s"] == pytest.approx(go.TINY.per_device_batch / r["step_best_s"])
        assert r["speed_vs_flat"] == pytest.approx(flat / r["step_best_s"])
        assert r["ok_round_trips"] == (r["round_trips"] == 0 or name in go.NEEDS_ROUND_TRIP)
    for name in ("flat", "hierarchical", "powersgd", "topk", "buckets", "microbatches"):
        assert rows[name]["round_trips"] == 0, (name, rows[name]["round_trip_sites"])
    # local_sgd's sync and adaptive's codec are branches: their collectives sit inside.
    for name in ("local_sgd", "adaptive"):
        assert rows[name]["round_trips"] >= 1 and rows[name]["in_branches"] >= 1
    assert rows["buckets"]["collectives"] > rows["hierarchical"]["collectives"]
    goals = d["goals"]
    assert goals["every collective async"] is None
    assert goals["two runs from the same state: equal bits"] is True
    assert goals["no host round trip on an option that does not need one"] == all(
        r["ok_round_trips"] for r in rows.values()
    )
    assert "== options: ok" in printed and "goal: every collective async: None" in printed
    for name in go.OPTION_NAMES:
        assert f"\n  {name} " in printed


def test_options_not_started_past_the_deadline():
    import jax

    from experiments.bench import gpu_options as go

    seen = []
    out = go.run_options(["flat", "int8"], go.TINY, jax.devices()[0], on_result=seen.append,
                         deadline=0.0)  # fmt: skip
    assert list(out) == ["flat", "int8"] and len(seen) == 2
    assert all(r["error"].startswith("not run") for r in out.values())
    rows = go.summarize({}, out, async_expected=True)["rows"]
    assert rows["flat"]["run_error"].startswith("not run")
    assert "FAILED: not run" in "\n".join(go.format_table({"rows": rows}))
