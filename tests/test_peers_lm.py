"""``python -m experiments.bench peers --workload gpt``: its figures, table, argument checks
and the JAX -> PyTorch weight map, without a run (the bench needs root, a testbed and
PyTorch; the PyTorch check skips without it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.bench import peers, peers_lm


def _nats(*bits_per_byte):
    return [b * math.log(2) for b in bits_per_byte]


def _run():
    rows = {
        "jax-compute": {"times_s": [0.5, 0.6, 0.5], "bytes": [0.0] * 3},
        "jax-hsdp-f32": {"times_s": [2.5, 2.6, 2.5], "bytes": [3.4e6] * 3,
                         "sync_bytes": [3.37e6], "held_out_loss": _nats(2.0, 2.06)},
        "jax-hsdp-int8": {"times_s": [1.0, 1.2, 0.9], "bytes": [0.9e6] * 3,
                          "sync_bytes": [0.85e6], "held_out_loss": _nats(2.02, 2.04)},
        "jax-hsdp-powersgd": {"times_s": [0.7, 0.7, 0.7], "bytes": [0.1e6] * 3,
                              "sync_bytes": [0.1e6], "held_out_loss": _nats(2.3, 2.2)},
        "torch-compute": {"times_s": [0.2, 0.2, 0.2], "bytes": [0.0] * 3},
        "torch-hsdp-f32": {"times_s": [1.2, 1.2, 1.2], "bytes": [3.4e6] * 3,
                           "sync_bytes": [3.37e6] * 3, "held_out_loss": _nats(2.04, 2.05)},
        "torch-hsdp-bf16": {"times_s": [1.0, 1.0, 1.0], "bytes": [1.7e6] * 3,
                            "sync_bytes": [1.68e6] * 3, "held_out_loss": _nats(2.07, 2.09)},
        "torch-fsdp-int8": {"times_s": [], "bytes": [], "error": "RuntimeError: gloo"},
    }  # fmt: skip
    return {"rows": rows, "link_bps": 50_000_000}


def test_summary_band_and_table():
    s = peers_lm.summarize(_run())
    # the existing method: exposed = row - own twin of the same round (median)
    assert s["jax-hsdp-int8"]["exposed_comm_s"] == pytest.approx(0.5)  # .5 .6 .4
    assert s["torch-hsdp-bf16"]["exposed_comm_s"] == pytest.approx(0.8)
    assert s["jax-hsdp-int8"]["speedup"] == pytest.approx(2.5)  # vs its own f32 row
    assert s["jax-hsdp-int8"]["line_rate_s"] == pytest.approx(8 * 0.9e6 / 50e6)
    assert s["jax-hsdp-int8"]["over_line_rate_s"] == pytest.approx(0.5 - 0.144)
    assert s["jax-hsdp-int8"]["held_out_bpb"] == pytest.approx([2.02, 2.04])
    assert s["jax-hsdp-int8"]["mean_bpb"] == pytest.approx(2.03)
    assert s["jax-compute"]["exposed_comm_s"] is None and s["jax-compute"]["mean_bpb"] is None
    assert peers_lm.f32_band(s) == pytest.approx((2.0, 2.06))  # every seed of both f32 rows
    table = peers_lm.build_table(s)
    assert "failed: RuntimeError: gloo" in table
    assert (
        "| 0.500 | 0.144 | 0.356 | 0.900 | 0.850 | 2.0200 2.0400 | 2.0300 | inside | 2.50x |"
        in table
    )
    assert "| 2.3000 2.2000 | 2.2500 | over |" in table
    # PowerSGD exposes less but lies over the band: the int8 row is jaxcomm's best
    assert "least exposed jaxcomm row within the f32 band: jaxcomm shard_params, int8" in table
    assert "least exposed torch row within the f32 band: torch FSDP2 HSDP (2-D mesh), f32" in table
    assert "/ FSDP2 HSDP bf16 reduce: 0.62" in table  # 0.5 / 0.8 (bf16's mean is over)


def test_arguments_and_dispatch(capsys):
    def parse(*argv):
        args = peers_lm._parser().parse_args(list(argv))
        args.rows = [r for r in (args.rows or ",".join(peers_lm.default_rows())).split(",") if r]
        return peers_lm.validate(args)

    assert parse() is None
    rows = peers_lm.default_rows()
    assert rows[:2] == ["jax-compute", "torch-compute"] and len(rows) == len(peers_lm.labels())
    bad = {
        "--rows=jax-hsdp-f32,nope": "unknown ['nope']",
        "--batch=6": "a multiple of the 4 devices",
        "--model=gpt-huge": "one of",
        "--context=999": "--context 999: 1 to 256",
        "--seeds=0,0": "each once",
        "--rows=jax-hsdp-f32,jax-hsdp-int8": "need 'jax-hsdp-f32' and 'jax-compute'",
    }
    for arg, why in bad.items():
        assert why in parse(arg), arg
    with pytest.raises(SystemExit) as e:  # peers hands the GPT workload to peers_lm
        peers.main(["--workload", "gpt", "--help"])
    assert e.value.code == 0
    assert "PyTorch FSDP2 (HSDP f32 and bf16 reduce" in capsys.readouterr().out


@pytest.fixture(scope="module")
def gpt_test():
    from experiments.lm_step import make_model

    return make_model("gpt-test", context=16, seed=0)


def test_torch_state_maps_every_param(gpt_test):
    import jax

    from jaxcomm.models import gpt_config, param_count

    state = peers_lm.torch_state(jax.tree.map(np.asarray, gpt_test.params))
    assert sum(v.size for v in state.values()) == param_count(gpt_config("gpt-test", context=16))
    assert state["blocks.1.fc.weight"].shape == (256, 64)  # Linear(64, 256): (out, in)
    kernel = np.asarray(gpt_test.params["blocks"][1]["fc"]["kernel"][...])
    np.testing.assert_array_equal(state["blocks.1.fc.weight"], kernel.T)
    assert state["wte.weight"].shape == (256, 64) and state["ln_f.weight"].shape == (64,)


def test_torch_gpt_equals_the_jax_gpt(gpt_test):
    torch = pytest.importorskip("torch")
    import jax
    import torch.nn.functional as F

    from experiments.bench.peers_fsdp import TorchGPT
    from experiments.lm_step import next_byte_loss

    tokens = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)
    want = float(next_byte_loss(gpt_test.graphdef, gpt_test.params, gpt_test.batch_stats, tokens))
    config = {"layers": 2, "d_model": 64, "heads": 4, "context": 16, "vocab": 256, "mlp_ratio": 4}
    model = TorchGPT(config)
    state = peers_lm.torch_state(jax.tree.map(np.asarray, gpt_test.params))
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    t = torch.from_numpy(tokens).long()
    with torch.no_grad():
        logits = model(t[:, :-1])
        got = float(F.cross_entropy(logits.reshape(-1, 256), t[:, 1:].reshape(-1)))
    assert got == pytest.approx(want, rel=1e-5)
