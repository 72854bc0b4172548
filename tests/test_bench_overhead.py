"""python -m experiments.bench overhead: every entry and its hand-written twin compute the
same step; the table and JSON carry each row's times."""

import json

import pytest

from experiments.bench import overhead


def test_entries_and_twins_compute_the_same_and_the_json_holds_the_rows(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    only = (
        "data_parallel,linen_data_parallel,nnx_data_parallel,pmap_data_parallel rows,"
        "pmap_data_parallel optax"
    )
    assert (
        overhead.main(["--rounds", "1", "--steps", "2", "--only", only, "--json", str(path)]) == 0
    )
    out = json.loads(path.read_text())
    assert list(out["rows"]) == only.split(",")
    for name, row in out["rows"].items():
        # The twin is the same step written by hand: the same loss over the first steps.
        assert row["loss_gap"] < 1e-5, (name, row["loss_gap"])
        assert row["step_ms"] > 0 and row["twin_step_ms"] > 0 and row["program_ms"] > 0
        assert row["ratio"] == pytest.approx(row["step_ms"] / row["twin_step_ms"], rel=1e-9)
        assert row["cpu_ms"] > 0 and row["twin_cpu_ms"] > 0
        assert row["cpu_ratio"] == pytest.approx(row["cpu_ms"] / row["twin_cpu_ms"], rel=1e-9)
    assert "| pmap_data_parallel rows |" in capsys.readouterr().out


def test_unknown_entries_and_compressions_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        overhead.main(["--only", "data_parallel,jax.jit"])
    assert "only=['jax.jit'] are not entries; choose from ['data_parallel'" in (
        capsys.readouterr().err
    )
    with pytest.raises(ValueError, match=r"compression='fp8' must be one of \('none', 'int8'"):
        overhead.run(rounds=1, steps=1, compression="fp8")
