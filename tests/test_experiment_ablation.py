"""The experiment's command line, its ablation rows and their outputs (results.json, PNG)."""

import json

import numpy as np
import pytest
from PIL import Image

from experiments import resnet152, runtime
from experiments.rows import ROWS, Call, Row, resolve_rows

SPEED_KEYS = {"config", "step_time_s", "speedup", "comm_fraction", "images_per_s", "status"}


def test_rows_follow_the_seed_table_and_accumulate():
    assert [r.config for r in ROWS] == [
        "baseline", "+hierarchical", "+overlap", "+compression", "+topology", "+batching",
    ]  # fmt: skip
    rows = resolve_rows(
        [
            Row("baseline", "flat", sync={"algorithm": "flat"}),
            Row("+ghost", "absent module", sync={"compression": Call("no_such_module.make")}),
            Row("+kwarg", "absent argument", sync={"no_such_argument": 1}),
            Row("+alg", "absent algorithm", sync={"algorithm": "no_such_algorithm"}),
            Row("+req", "absent attribute", requires=("collectives.NO_SUCH",)),
            Row(
                "+hier",
                "hierarchical",
                sync={"algorithm": "hierarchical"},
                compiler_options={"opt": 1},
            ),  # fmt: skip
        ]
    )
    missing = {r.row.config: r.missing for r in rows}
    assert missing["baseline"] is None and missing["+hier"] is None
    assert missing["+ghost"] == "jaxcomm.no_such_module does not exist"
    assert missing["+kwarg"] == "jaxcomm.sync_gradients has no argument no_such_argument"
    assert "'no_such_algorithm' is not registered" in missing["+alg"]
    assert missing["+req"] == "jaxcomm.collectives.NO_SUCH does not exist"
    last = rows[-1]
    # missing rows drop out of the later rows' settings
    assert last.techniques == ("baseline", "+hier")
    assert last.sync == {"algorithm": "hierarchical"}
    assert last.build() == ({"algorithm": "hierarchical"}, {"opt": 1}, {})
    assert rows[1].sync == {"algorithm": "flat"}


def test_call_resolves_jaxcomm_paths():
    from jaxcomm.collectives import ALGORITHMS

    assert Call("collectives.base.ALGORITHMS", call=False).lookup() is ALGORITHMS
    assert Call("make_mesh", {"intra": 4})().shape == {"inter": 2, "intra": 4}
    assert str(Call("compression.int8", {"block": 256})) == "jaxcomm.compression.int8(block=256)"


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


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One CLI run of every mode on the tiny model: 16 px images, 1-2 steps per row, a
    generated JPEG folder (20 images) for the training run, checkpoints on."""
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
        "--image-size", "16", "--per-device-batch", "2", "--steps", "2",
        "--warmup-steps", "1", "--timing-steps", "1", "--repeats", "2", "--accuracy-steps", "5",
        "--data-dir", str(data), "--checkpoint-dir", str(root / "ckpt"),
        "--out", str(out), "--no-progress",
    ]  # fmt: skip
    rc = resnet152.main(argv)
    return rc, out, root


def test_smoke_ablation_writes_results_and_chart(smoke_run, capsys):
    rc, out, _ = smoke_run
    assert rc == 0  # no row raised
    rows = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in rows] == [r.config for r in ROWS]
    expected_missing = {r.row.config: r.missing for r in resolve_rows()}
    for r in rows:
        assert SPEED_KEYS <= set(r) and "accuracy" in r
        if expected_missing[r["config"]]:
            assert r["status"] == "missing" and r["missing"] == expected_missing[r["config"]]
            assert r["step_time_s"] is None and r["speedup"] is None
        else:
            assert r["status"] == "ok", r.get("error")
            assert r["step_time_s"] > 0 and r["compute_only_step_time_s"] > 0
            assert r["comm_fraction"] == pytest.approx(
                1 - r["compute_only_step_time_s"] / r["step_time_s"]
            )
            assert r["images_per_s"] == pytest.approx(16 / r["step_time_s"])
            assert r["devices"] == 8 and r["mesh"] == {"inter": 2, "intra": 4}
            assert np.isfinite(r["loss"])
    base = rows[0]
    assert base["speedup"] == 1.0 and base["settings"]["sync_gradients"] == {"algorithm": "flat"}
    assert rows[1]["speedup"] == pytest.approx(base["step_time_s"] / rows[1]["step_time_s"])
    png = (out / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    meta = json.loads((out / "meta.json").read_text())
    assert meta["devices"] == 8 and meta["modes"] == ["train", "ablation", "accuracy"]


def test_smoke_training_reads_the_folder_and_checkpoints(smoke_run):
    rc, out, root = smoke_run
    train = json.loads((out / "train.json").read_text())
    assert train["position"] == 2 and train["step"] == 2 and train["data"].endswith("data")
    assert set(train["losses"]) == {"1", "2"}
    assert all(np.isfinite(v) for v in train["losses"].values())
    assert (root / "ckpt" / "2").is_dir()
