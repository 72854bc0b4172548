"""The experiment's command line, its ablation rows and their outputs (results.json, PNG)."""

import json

import jax
import numpy as np
import pytest
from PIL import Image

import jaxcomm
from experiments import report, resnet152, runtime
from experiments.presets import PRESETS, default_preset_name
from experiments.rows import ROWS, Row, resolve_rows

SPEED_KEYS = {"config", "step_time_s", "speedup", "comm_fraction", "images_per_s", "status"}


def test_rows_follow_the_seed_table_and_accumulate(monkeypatch):
    assert [r.config for r in ROWS] == [
        "baseline", "+hierarchical", "+overlap", "+compression", "+topology", "+batching",
        "+local steps",
    ]  # fmt: skip
    (local,) = [r for r in resolve_rows() if r.row.config == "+local steps"]
    assert local.local["sync_every"] == "link" and local.local["compression"].name == "int8"
    assert all(r.local is None for r in resolve_rows()[:-1])
    (compression,) = [r for r in ROWS if r.config == "+compression"]
    assert compression.sync["compression"].name.startswith("adaptive[")  # the seed's dynamic bits
    assert compression.sync["compress_stage"] == "inter"
    topo = jaxcomm.topology.from_dict({"preset": "dgx_h100", "nodes": 2})
    monkeypatch.setattr(jaxcomm.topology, "detect", lambda: topo)
    calls = []
    rows = resolve_rows(
        [
            Row("baseline", "flat", sync={"algorithm": "flat"}),
            Row("+hier", "hierarchical", sync={"algorithm": "hierarchical"},
                compiler_options=lambda: calls.append(1) or {"opt": 1}),
            Row("+int8", "int8", sync={"compression": jaxcomm.compression.int8()}),
            Row("+topo", "topology", sync={"algorithm": "auto"}, topology=True),
        ]
    )  # fmt: skip
    assert [r.techniques for r in rows][-1] == ("baseline", "+hier", "+int8", "+topo")
    assert rows[0].build() == ({"algorithm": "flat"}, {}, {})
    assert calls == []  # option functions run when a row is built, not before
    sync, options, mesh = rows[2].build()
    assert sync["algorithm"] == "hierarchical" and sync["compression"].name == "int8"
    assert options == {"opt": 1} and mesh == {} and calls == [1]
    sync, options, mesh = rows[3].build()
    assert sync["algorithm"] == "auto" and sync["topology"] is topo and mesh == {"topology": topo}
    described = rows[3].describe()
    assert described["sync_gradients"]["compression"] == "jaxcomm.compression.int8"
    assert described["topology"] == "jaxcomm.topology.detect()"
    assert described["compiler_options"][0].endswith(
        "test_rows_follow_the_seed_table_and_accumulate.<locals>.<lambda>"
    )


def test_default_preset_follows_the_machine():
    assert default_preset_name("cpu", 1, testbed=True) == "testbed"
    assert default_preset_name("cpu", 1, testbed=False) == "cpu-smoke"
    assert default_preset_name("cpu", 2, testbed=True) == "cpu-smoke"  # already distributed
    assert default_preset_name("gpu", 1, testbed=True) == "gpu-node"
    assert default_preset_name("gpu", 4) == "cluster"
    assert PRESETS["testbed"].link == "50mbit" and PRESETS["testbed-resnet18"].link == "250mbit"
    assert PRESETS["testbed"].modes == ("ablation", "accuracy")


def test_adapt_windows_must_be_a_count():
    args = resnet152.build_parser().parse_args(["--preset", "testbed", "--adapt-windows", "-1"])
    with pytest.raises(ValueError, match=r"--adapt-windows=-1 must be an integer >= 0"):
        resnet152._preset(args, jax)
    args = resnet152.build_parser().parse_args(["--preset", "testbed", "--adapt-windows", "0"])
    assert resnet152._preset(args, jax).adapt_windows == 0
    args = resnet152.build_parser().parse_args(["--preset", "testbed", "--accuracy-seeds", "0"])
    with pytest.raises(ValueError, match=r"--accuracy-seeds=0 must be an integer >= 1"):
        resnet152._preset(args, jax)


def test_quality_guard_averages_its_seeds(monkeypatch):
    # every row runs the guard once per seed (seed, seed + 1, ...) and reports the mean
    from experiments import ablation

    calls = []

    def fake(sync, *, steps, seed, mesh, compiler_options):
        calls.append(seed)
        return {"accuracy": 0.9 + 0.01 * seed, "final_loss": 0.1 * seed}

    monkeypatch.setattr(ablation, "digits_accuracy", fake)
    rows = resolve_rows(ROWS[:2])
    got = ablation.run_accuracy(rows, intra=4, steps=5, seed=2, seeds=3)
    assert calls == [2, 3, 4, 2, 3, 4]
    for g in got:
        assert g["accuracy_status"] == "ok"
        assert g["accuracy_per_seed"] == pytest.approx([0.92, 0.93, 0.94])
        assert g["accuracy"] == pytest.approx(0.93) and g["final_loss"] == pytest.approx(0.3)


def test_without_a_testbed_the_default_falls_back_and_says_why(monkeypatch, capsys):
    import jaxcomm.tools.testbed

    monkeypatch.setattr(
        jaxcomm.tools.testbed, "available", lambda: (False, "the testbed needs root")
    )
    args = resnet152.build_parser().parse_args([])
    testbed = resnet152._testbed_status(jax)
    assert testbed == (False, "the testbed needs root")
    assert resnet152._preset(args, jax, testbed=testbed[0]).name == "cpu-smoke"
    assert resnet152._launch_testbed(args, [], PRESETS["testbed"], testbed) == 2
    err = capsys.readouterr().err
    assert "cannot here: the testbed needs root" in err and "--preset cpu-smoke" in err
    note = report.fake_devices_note(8, "the testbed needs root").splitlines()
    assert len(note) == 2 and "8 fake CPU devices" in note[0]
    assert "--preset testbed" in note[1] and "the testbed needs root" in note[1]


def _row(config, step, twin, acc=None):
    return {"config": config, "step_time_s": step, "compute_only_step_time_s": twin,
            "exposed_comm_s": step - twin, "comm_fraction": (step - twin) / step,
            "accuracy": acc}  # fmt: skip


def test_summary_line_reads_the_table():
    rows = [_row("baseline", 4.0, 1.0, 0.950), _row("+a", 2.0, 1.0, 0.948),
            _row("+b", 1.25, 1.0, 0.952)]  # fmt: skip
    line = report.summary_line(rows)
    assert line.startswith("stacked 3.20x (+b vs baseline)")
    assert "exposed communication 75% -> 20% of the step, 3 s -> 0.25 s" in line
    assert "quality unchanged (digits within 0.2 points of baseline)" in line
    rows[1]["accuracy"] = 0.90
    rows.append(_row("+c", 5.0, 1.0))
    line = report.summary_line(rows)
    assert "stacked 0.80x (+c vs baseline)" in line and "slower than the baseline: +c" in line
    assert "quality changed: +a digits 0.900 vs baseline 0.950" in line
    assert report.summary_line(rows[:1]) is None


def test_table_gives_ranges_and_does_not_rank_overlapping_rows():
    rows = [_row("baseline", 4.0, 1.0), _row("+a", 2.0, 1.0), _row("+b", 1.9, 1.0)]
    for r, rng in zip(rows, ([3.9, 4.2], [1.8, 2.1], [1.85, 2.0]), strict=True):
        r.update(status="ok", step_time_range_s=rng, rounds=5)
    rows[2].update(speedup=2.1, speedup_range=[1.95, 2.2])
    table = report.format_table(rows)
    assert "4000.0 [3900.0-4200.0]" in table and "2.10x [1.95-2.20]" in table
    assert "+a and +b: step times overlap over the rounds" in table
    assert "baseline and +a" not in table
    line = report.summary_line(rows)
    assert line.startswith("stacked 2.10x (1.95-2.20x over 5 paired rounds) (+b vs baseline)")


def test_cpu_devices_are_set_only_when_absent(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    monkeypatch.delenv("JAXCOMM_LOCAL_DEVICES", raising=False)
    assert runtime.ensure_cpu_devices(8) == 8
    assert runtime.os.environ["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=8")
    assert runtime.ensure_cpu_devices(4) is None  # already set: unchanged
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("JAXCOMM_LOCAL_DEVICES", "2")  # the launcher sets the devices
    assert runtime.ensure_cpu_devices(8) is None and runtime.os.environ["XLA_FLAGS"] == ""
    for key in ("JAXCOMM_COORDINATOR", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert not runtime.distributed_requested()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert runtime.distributed_requested()


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        resnet152.main(["--help"])
    assert e.value.code == 0
    parser = resnet152.build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings


# Every row runs in two processes in tests/test_testbed.py (the make-run path); here, in one
# process on 8 devices, the first two (the speedup column) and the last (local steps).
# The baseline and the last row (every technique stacked); the two-process test of the
# make-run path (tests/test_testbed.py) runs every row.
SMOKE_ROWS = [ROWS[0].config, ROWS[-1].config]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One CLI run of every mode on ResNet-micro (the paths of cpu-smoke's ResNet-tiny in
    half the compile time): 16 px images, 1-2 steps per row, a generated JPEG folder (20
    images) for the training run, checkpoints on."""
    root = tmp_path_factory.mktemp("smoke")
    data = root / "data"
    # 10 classes, as the synthetic data of cpu-smoke: the model initialisation is shared.
    for c in range(10):
        (data / f"class{c}").mkdir(parents=True)
        for i in range(2):
            rgb = (25 * c, 200 - 20 * c, 40 + 10 * i)
            Image.new("RGB", (20 + i, 18), rgb).save(data / f"class{c}" / f"{i}.jpg")
    out = root / "out"
    argv = [
        "--preset", "cpu-smoke", "--train", "--ablation", "--accuracy",
        "--model", "resnet-micro", "--image-size", "16", "--per-device-batch", "2", "--steps", "2",
        "--warmup-steps", "1", "--timing-steps", "1", "--repeats", "1", "--accuracy-steps", "5",
        "--data-dir", str(data), "--checkpoint-dir", str(root / "ckpt"),
        "--out", str(out), "--no-progress", "--rows", ",".join(SMOKE_ROWS),
    ]  # fmt: skip
    rc = resnet152.main(argv)
    return rc, out, root


def test_smoke_ablation_writes_results_and_chart(smoke_run, capsys):
    rc, out, _ = smoke_run
    assert rc == 0  # no row raised
    rows = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in rows] == SMOKE_ROWS
    for r in rows:
        assert SPEED_KEYS <= set(r) and "accuracy" in r
        assert r["status"] == "ok", r.get("error")
        assert r["step_time_s"] > 0 and r["compute_only_step_time_s"] > 0
        assert r["comm_fraction"] == pytest.approx(
            1 - r["compute_only_step_time_s"] / r["step_time_s"]
        )
        assert r["images_per_s"] == pytest.approx(16 / r["step_time_s"])
        assert r["devices"] == 8 and r["mesh"] == {"inter": 2, "intra": 4}
        assert np.isfinite(r["loss"])
        # bytes from the compiled program; no link rate on fake devices, so no bound
        assert r["wire_bytes"] > 0 and r["link_bytes"] > 0 and r["link_bound_s"] is None
    base = rows[0]
    assert base["speedup"] == 1.0 and base["settings"]["sync_gradients"] == {"algorithm": "flat"}
    assert rows[1]["speedup"] == pytest.approx(base["step_time_s"] / rows[1]["step_time_s"])
    png = (out / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    meta = json.loads((out / "meta.json").read_text())
    assert meta["devices"] == 8 and meta["modes"] == ["train", "ablation", "accuracy"]
    assert meta["summary"] == report.summary_line(rows)


def test_smoke_training_reads_the_folder_and_checkpoints(smoke_run):
    rc, out, root = smoke_run
    train = json.loads((out / "train.json").read_text())
    assert train["position"] == 2 and train["step"] == 2 and train["data"].endswith("data")
    assert set(train["losses"]) == {"1", "2"}
    assert all(np.isfinite(v) for v in train["losses"].values())
    assert (root / "ckpt" / "2").is_dir()


def test_training_drives_the_adaptive_compressor(tmp_path):
    # --train with the last row of the seed's table (adaptive on the inter stage) and
    # --adapt-windows: the step runs under CommProfiler.drive, whose windows and level
    # changes land in adapt.jsonl.
    out = tmp_path / "out"
    argv = [
        "--preset", "cpu-smoke", "--train", "--config", "+batching", "--adapt-windows", "1",
        "--model", "resnet-micro", "--image-size", "16",
        "--per-device-batch", "2", "--steps", "4", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    assert resnet152.main(argv) == 0
    train = json.loads((out / "train.json").read_text())
    assert train["step"] == 4 and train["config"] == "+batching"
    events = [json.loads(x) for x in (out / "adapt.jsonl").read_text().splitlines()]
    windows = [e for e in events if e["event"] == "adapt_window"]
    assert [w["step"] for w in windows] == [2, 4]  # adjustment_step=2 of the row's compressor
    assert all(w["levels"][0] in ("f32", "bf16", "int8", "int4") for w in windows)
    assert all(0.0 <= w["comm_share"] <= 1.0 for w in windows)


def test_sync_period_amortizes_the_link_over_compute():
    from experiments.ablation import sync_period

    assert sync_period(0.08, 0.065) == 13  # 80 ms of link per sync, 65 ms of compute
    assert sync_period(0.0, 0.065) == 1
    assert sync_period(10.0, 0.01) == 64  # capped
    assert sync_period(0.08, 0.065, share=0.5) == 3
    with pytest.raises(ValueError, match=r"compute_s > 0.*compute_s=0"):
        sync_period(0.08, 0.0)


def test_local_steps_optimizer_carries_the_rows_algorithm():
    from experiments import step as steplib

    calls = {}
    real = jaxcomm.local_sgd

    def spy(inner, **kwargs):
        calls.update(kwargs)
        return real(inner, **kwargs)

    sync = {"algorithm": "ring", "compression": jaxcomm.compression.bf16(), "bucket_bytes": None}
    local = {"sync_every": 4, "compression": jaxcomm.compression.int8()}
    import unittest.mock

    with unittest.mock.patch.object(jaxcomm, "local_sgd", spy):
        steplib.make_optimizer(sync, 0.1, local=local)
    assert calls["algorithm"] == "ring" and calls["sync_every"] == 4
    assert calls["compression"].name == "int8"  # the row's own, not the sync's bf16


def test_a_broken_collective_ends_the_run_with_one_line(monkeypatch, capsys):
    from experiments import ablation

    err = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Timed out waiting")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert ablation._breaks_processes(err)
    assert not ablation._breaks_processes(ValueError("bad setting"))
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
    assert not ablation._breaks_processes(oom)  # the others can go on

    def main():
        raise ablation.ProcessesBroken("+compression", "timing round 2", err)

    monkeypatch.setattr(resnet152, "main", main)
    assert resnet152._main() == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "row '+compression' failed while timing round 2 on process 0" in lines[0]
    assert "Gloo all-reduce failed" in lines[0]


def test_a_hidden_share_outside_zero_to_one_is_not_printed():
    rows = [_row("baseline", 4.0, 1.0), _row("+a", 2.0, 1.0)]
    for r, hidden in zip(rows, (0.25, -0.21), strict=True):
        r.update(status="ok", link_bound_s=0.5, sync_alone_s=0.8, hidden_share=hidden)
    table = report.format_table(rows)
    assert "-21" not in table
    assert "+a: hidden share not printed: exposed 1000.0 ms against the sync alone's 800.0" in table
    assert "baseline: hidden share" not in table


def test_pin_adaptive_refuses_another_compressor():
    from experiments import rows

    with pytest.raises(ValueError, match="does not compress with rows.ADAPTIVE"):
        rows.pin_adaptive({"compression": jaxcomm.compression.int8()}, "int4")
    pinned = rows.pin_adaptive({"compression": rows.ADAPTIVE, "algorithm": "auto"}, "int4")
    assert pinned["compression"].name == "adaptive[int4]" and pinned["algorithm"] == "auto"
