"""python -m experiments.bench compile: structure of the results, table and JSON; op counts."""

import json
import re

import numpy as np
import pytest

from experiments.bench import compile as bc

KEYS = {"trace_s", "lower_s", "compile_s", "total_s", "cpu_s"}
KEYS |= {"jaxpr_eqns", "hlo_ops_pre", "hlo_ops_post", "kernels"}


def test_run_table_and_json(mesh, tmp_path, capsys):
    path = tmp_path / "compile.json"
    argv = [
        "--model",
        "resnet-tiny",
        "--options",
        "flat,ring",
        "--json",
        str(path),
        "--repeat",
        "2",
    ]
    assert bc.main(argv) == 0
    out = json.loads(path.read_text())
    assert out["config"]["model"] == "resnet-tiny"
    assert out["config"]["leaves"] == 38 and out["config"]["mesh"] == {"inter": 2, "intra": 4}
    assert list(out["results"]) == ["flat", "ring"]
    flat, ring = (out["results"][o]["sync"] for o in ("flat", "ring"))
    for m in (flat, ring):
        assert set(m) == KEYS
        assert all(m[k] > 0 for k in KEYS)
        assert np.isclose(m["total_s"], m["trace_s"] + m["lower_s"] + m["compile_s"])
    # two rounds, each a real compile (a fresh jit, no cache hit); the table's value is
    # their median
    for o in ("flat", "ring"):
        runs = [r["sync"] for r in out["results"][o]["runs"]]
        assert len(runs) == 2 and runs[1]["compile_s"] > 0.1 * runs[0]["compile_s"]
        assert out["results"][o]["sync"]["cpu_s"] == np.median([r["cpu_s"] for r in runs])
    assert out["config"]["repeat"] == 2
    # a ring is built from ppermutes: more equations and instructions than one psum per buffer
    assert ring["jaxpr_eqns"] > flat["jaxpr_eqns"]
    assert ring["hlo_ops_pre"] > flat["hlo_ops_pre"]
    text = capsys.readouterr().out
    lines = text.strip().splitlines()
    # one progress line per compile, naming the option and round it reports
    progress = [line.split(":")[0] for line in lines if "(round " in line]
    assert progress == [
        "flat (round 1/2)",
        "ring (round 1/2)",
        "flat (round 2/2)",
        "ring (round 2/2)",
    ]
    assert "x flat" in lines[-3] and lines[-2].split()[0] == "flat"
    assert lines[-2].split()[5] == lines[-2].split()[7] == "1.00"  # flat's ratios to itself
    assert lines[-1].split()[0] == "ring"


def test_unknown_option_is_rejected(capsys):
    assert bc.main(["--options", "flat,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(ValueError, match="choose from"):
        bc.sync_kwargs("nope")


def test_powersgd_batches_matrices_of_one_shape(mesh):
    """Twelve matrices of one shape are one batch (4 products: P, Q, the result and the
    residual's); twelve of different shapes are twelve batches without padding, one when
    zero padding may merge them. The QRs of batches of similar rows are stacked into one
    (two stacks: the warm-start Qs', then the Ps').
    The twelve of one shape are cut out of their batch by one kernel (runtime indices)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import jaxcomm
    from jaxcomm import backend

    f32 = jnp.float32
    same = {f"w{i}": jax.ShapeDtypeStruct((64, 48), f32) for i in range(12)}
    diff = {f"w{i}": jax.ShapeDtypeStruct((64, 40 + i), f32) for i in range(12)}
    counts, dots, cuts = [], [], []
    # One batched QR per stack, as on GPU: the CPU row's loop of single QRs (backend item
    # 9) would add its own slicing kernel to the count below.
    batched_qr = dataclasses.replace(backend.CPU, qr_one_at_a_time=False)
    for tree, pad in ((same, 0.0), (diff, 0.0), (diff, 0.5)):
        tx = jaxcomm.sync_gradients(
            compression=jaxcomm.compression.powersgd(rank=4, max_padding=pad)
        )
        fn, args = bc.sync_program(tx, tree, mesh)
        with backend.use(batched_qr):
            text = fn.lower(*args).compile().as_text()
        # the QR factorizations (LAPACK custom calls on CPU) of the optimized module
        counts.append(len(re.findall(r'custom_call_target="lapack_sgeqrf', text)))
        dots.append(len(re.findall(r" dot\(", text)))
        bodies = {
            re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}", "", b.split("\n", 1)[1])
            for b in text.split("\n\n")
            if "dynamic-slice(" in b and not b.lstrip().startswith("ENTRY")
        }
        cuts.append(len(bodies))
    assert dots == [4, 48, 4] and counts == [2, 2, 2], (dots, counts)
    assert cuts[0] == 1, cuts  # distinct kernels that cut the 12 matrices out


def test_step_compiles_the_whole_train_step(mesh):
    out = bc.run(["flat"], model="resnet-tiny", step=True, step_model="resnet-tiny", mesh=mesh)
    r = out["results"]["flat"]
    assert set(r["step"]) == KEYS
    # forward + backward + sync + SGD: far more than the sync alone
    assert r["step"]["jaxpr_eqns"] > 2 * r["sync"]["jaxpr_eqns"]
    assert r["step"]["hlo_ops_post"] > r["sync"]["hlo_ops_post"]
    assert out["config"]["step_model"] == "resnet-tiny"
    assert "step compile s" in bc.table(out).splitlines()[0]
