"""``python -m experiments.bench peers``: its figures, table and argument checks, without a
run (the bench itself needs root, a testbed and PyTorch; it is not part of the suite)."""

from __future__ import annotations

import json

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


def test_budget_verdicts_exposure_and_table():
    accs = {
        "jax-f32": [0.90, 0.94, 0.92],
        "torch-f32": [0.91, 0.95, 0.93],
        "jax-stacked": [0.93, 0.93, 0.93],  # mean 0.93: inside the band
        "jax-powersgd": [0.80, 0.95, 0.90],  # mean 0.883: below 0.90
        "torch-fp16": [0.96, 0.96, 0.96],  # above 0.95
        "torch-bf16": [0.90, 0.90, 0.90],  # on the band's lower end: equal
        "torch-powersgd": [],  # failed
    }
    b = peers.budget_summary(accs)
    # the band: min-max over every seed of both frameworks' f32 rows
    assert b["band"] == pytest.approx([0.90, 0.95])
    assert b["band_rows"] == ["jax-f32", "torch-f32"]
    verdicts = {n: r["verdict"] for n, r in b["rows"].items()}
    assert verdicts == {
        "jax-f32": "equal",
        "torch-f32": "equal",
        "jax-stacked": "equal",
        "jax-powersgd": "below",
        "torch-fp16": "above",
        "torch-bf16": "equal",
        "torch-powersgd": None,
    }
    ps = b["rows"]["jax-powersgd"]
    assert ps["mean"] == pytest.approx(0.8833333)
    assert ps["std"] == pytest.approx(0.0763763, rel=1e-5)
    assert ps["range"] == pytest.approx([0.80, 0.95])
    assert b["rows"]["jax-stacked"]["std"] == pytest.approx(0.0, abs=1e-12)
    # one seed: no standard deviation; no f32 row: no band
    assert peers.budget_summary({"jax-f32": [0.9]})["rows"]["jax-f32"]["std"] is None
    with pytest.raises(ValueError, match="needs at least one"):
        peers.budget_summary({"jax-stacked": [0.9]})

    timed = {  # summarize()'s figures of a timed run
        "jax-compute": {"exposed_comm_s": None},
        "jax-f32": {"exposed_comm_s": 2.4},
        "jax-stacked": {"exposed_comm_s": 0.7},
        "jax-powersgd": {"exposed_comm_s": 0.2},  # faster, but below the band
        "torch-f32": {"exposed_comm_s": 1.5},
        "torch-f32-tuned": {"exposed_comm_s": 1.4},  # takes torch-f32's verdict
        "torch-fp16": {"exposed_comm_s": 2.1},
        "torch-bf16": {"exposed_comm_s": 0.8},
        "torch-powersgd": {"exposed_comm_s": 0.1},  # failed in the budget: no verdict
        "torch-zero1": {"exposed_comm_s": 0.05},  # not in the budget: no verdict
    }
    e = peers.equal_accuracy_exposure(b, timed)
    assert e["rows"]["torch-f32-tuned"] == {
        "exposed_comm_s": 1.4, "verdict": "equal", "verdict_of": "torch-f32"
    }  # fmt: skip
    assert e["rows"]["torch-zero1"]["verdict"] is None
    assert "jax-compute" not in e["rows"]
    assert e["best"] == {"jaxcomm": "jax-stacked", "torch": "torch-bf16"}
    assert e["ratio"] == pytest.approx(0.7 / 0.8)

    table = peers.build_budget_table(b, e)
    lines = table.splitlines()
    assert len([x for x in lines if x.startswith("| ")]) == 1 + len(accs)
    assert "| 0.800 0.950 0.900 | 0.883 | 0.076 (0.800-0.950) | below | 0.200 |" in table
    assert "| torch DDP powerSGD_hook | failed |" in table
    assert "f32 band: [0.900, 0.950]" in table
    assert "best jaxcomm row at equal accuracy (exposed comm): jaxcomm stacked" in table
    assert "jaxcomm's best / PyTorch's best at equal accuracy: 0.875" in table
    assert "torch DDP f32, tuned buckets: equal (the update of torch-f32)" in table


def test_budget_json_stopped_early(tmp_path, capsys):
    run = {
        "seeds": [0, 1, 2],
        "rows": {
            "jax-f32": {"accuracy": [0.9, 0.92, 0.94]},
            "torch-f32": {"accuracy": [0.91, 0.93, 0.95]},
            "jax-powersgd": {"accuracy": [0.5]},  # stopped after one seed: cut
            "torch-bf16": {"accuracy": []},
        },
    }
    complete, cut = peers.complete_rows(run)
    assert list(complete) == ["jax-f32", "torch-f32"]
    assert cut == {"jax-powersgd": [0.5], "torch-bf16": []}
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(run))
    assert peers.main(["--table-of", str(path)]) == 0
    out = capsys.readouterr().out
    assert "f32 band: [0.900, 0.950]" in out
    assert "cut (not every seed ran): jaxcomm PowerSGD; seeds done: 0.500" in out
    assert "| jaxcomm PowerSGD |" not in out
    # a second run's rows join (a row from the first file that ran every seed)
    more = {"seeds": [0, 1, 2], "rows": {"jax-powersgd": {"accuracy": [0.9, 0.91, 0.92]},
                                         "jax-f32": {"accuracy": [0.1, 0.1, 0.1]}}}  # fmt: skip
    path2 = tmp_path / "more.json"
    path2.write_text(json.dumps(more))
    assert peers.main(["--table-of", f"{path},{path2}"]) == 0
    out = capsys.readouterr().out
    assert "| jaxcomm PowerSGD | 0.900 0.910 0.920 | 0.910 |" in out
    assert "f32 band: [0.900, 0.950]" in out  # jax-f32 from the first file


def test_budget_arguments():
    names = list(peers.labels())

    def why(*argv):
        return peers.validate(peers._parser().parse_args(["--budget=300", *argv]), names)

    assert why() is None
    assert peers.default_rows(300) == list(peers.BUDGET_ROWS)
    assert "jax-compute" in peers.default_rows(0)
    bad = {
        ("--seeds=0,x",): "comma-separated integers",
        ("--seeds=1,1",): "each once",
        ("--torch-ranks-per-node=3", "--devices-per-node=3"): "a multiple of the 6 devices",
        ("--rows=jax-f32,jax-local", "--sync-every=7"): "a multiple of --sync-every 7",
        ("--powersgd-start=300",): "below --budget 300",
    }
    for argv, msg in bad.items():
        assert msg in (why(*argv) or ""), argv
    # the timed rounds' checks do not apply to the budget (no twins needed)
    assert why("--rows=jax-f32,torch-f32", "--warmup=1") is None
