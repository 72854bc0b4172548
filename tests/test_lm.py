"""The transformer reference: GPT shape and causality, the stdlib text corpus, LM training
through data_parallel, and the experiment's command line."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, assert_replicas_equal

from experiments import lm_step
from experiments import step as steplib
from experiments.rows import Row, resolve_rows
from experiments.text import TextWindows, corpus_files, load_corpus
from jaxcomm.models import GPT_CONFIGS, gpt, gpt_config, gpt_param_shapes, param_count


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("gpt-test", {}),
        ("gpt-test", {"tied": False}),
        ("gpt-mini", {}),
        ("gpt2-small", {}),
        ("gpt-200m", {}),
    ],
)
def test_parameter_count_is_the_closed_formula(name, overrides):
    shapes = gpt_param_shapes(name, **overrides)  # no arrays allocated
    counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert counted == param_count(gpt_config(name, **overrides))


def test_gpt2_small_with_gpt2_vocabulary_has_124m_parameters():
    # GPT-2 small (Radford et al., 2019; Hugging Face's gpt2): 124,439,808 parameters
    shapes = gpt_param_shapes("gpt2-small", vocab=50257)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == 124_439_808
    assert param_count(dataclasses.replace(GPT_CONFIGS["gpt2-small"], vocab=50257)) == 124_439_808


def test_logits_depend_only_on_earlier_tokens():
    parts = lm_step.make_model("gpt-test", context=32, seed=0)  # the training test's model
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32)).astype(np.int32)
    changed = tokens.copy()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    forward = jax.jit(lambda x: nnx.merge(parts.graphdef, parts.params, parts.batch_stats)(x))
    both = np.asarray(forward(np.concatenate([tokens, changed])))
    a, b = both[:2], both[2:]
    assert a.shape == (2, 32, 256) and a.dtype == np.float32
    np.testing.assert_allclose(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert np.abs(a[:, 20:] - b[:, 20:]).max(axis=-1).min() > 1e-4  # every later position


def test_a_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="longer than the context"):
        jax.eval_shape(lambda: gpt("gpt-test")(jnp.zeros((1, 65), jnp.int32)))
    with pytest.raises(ValueError, match="choose one of"):
        gpt_config("gpt-9000")


def _write_files(root, n):
    for i in range(n):
        sub = os.path.join(root, "pkg" if i % 3 else "")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"m{i:02d}.py"), "w") as f:
            f.write(f"# file {i}\n" + "x = 1\n" * (i + 1))
    os.makedirs(os.path.join(root, "site-packages"), exist_ok=True)
    with open(os.path.join(root, "site-packages", "other.py"), "w") as f:
        f.write("not in the corpus\n")


def test_held_out_split_is_by_file_disjoint_and_deterministic(tmp_path):
    _write_files(tmp_path, 45)
    files = corpus_files(str(tmp_path))
    assert len(files) == 45 and not any("site-packages" in f for f in files)
    a = load_corpus.__wrapped__(str(tmp_path), held_out_every=20)
    b = load_corpus.__wrapped__(str(tmp_path), held_out_every=20)
    assert a.held_out_files == (files[19], files[39])
    assert set(a.train_files) | set(a.held_out_files) == set(files)
    assert not set(a.train_files) & set(a.held_out_files)
    assert a.digest == b.digest and np.array_equal(a.train, b.train)
    held_text = a.held_out.tobytes()
    for name in a.train_files:  # no training file's text is held out (each one is unique)
        assert (tmp_path / name).read_bytes() not in held_text


def test_stdlib_corpus_and_windows():
    corpus = load_corpus()
    assert corpus.train.size > 1_000_000 and corpus.held_out.size > 50_000
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    data = TextWindows(corpus.train, None, global_batch=4, context=16, seed=3)
    x, y = data.host_batch(7)["tokens"], data.host_batch(7)["tokens"]
    assert x.shape == (4, 17) and x.dtype == np.int32 and np.array_equal(x, y)
    assert not np.array_equal(x, data.host_batch(8)["tokens"])
    text = corpus.train.tobytes()
    assert all(row.astype(np.uint8).tobytes() in text for row in x)


@pytest.fixture(scope="module")
def lm_run(mesh):
    parts = lm_step.make_model("gpt-test", context=32, seed=0)
    tx = lm_step.make_optimizer({"algorithm": "hierarchical"}, 3e-3)
    dp, state = steplib.build_step(
        parts, tx, mesh, loss_fn=lm_step.make_loss_fn(parts.graphdef), donate=False
    )
    data = TextWindows(load_corpus().train, dp.batch_sharding, global_batch=16, context=32)
    losses = []
    for _, batch in data.iterate(0, 12):
        state, metrics = dp(state, batch)
        losses.append(float(metrics["loss"]))
    return parts, dp, state, losses, metrics


def test_training_lowers_the_loss_on_eight_devices(lm_run):
    parts, dp, state, losses, metrics = lm_run
    assert dp.mesh.devices.size == 8
    assert losses[0] > 5.0  # about ln 256 = 5.55 at the start
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
    assert float(metrics["bits_per_byte"]) == pytest.approx(losses[-1] / np.log(2), rel=1e-5)
    assert_replicas_equal(state.params)


def test_held_out_loss_is_the_mean_over_the_mesh(lm_run):
    parts, dp, state, _, _ = lm_run
    held = TextWindows(load_corpus().held_out, dp.batch_sharding, global_batch=16, context=32)
    got = lm_step.evaluate(parts, state.params, held, batches=2)
    host = jax.tree.map(np.asarray, state.params)  # one device, no mesh
    loss = jax.jit(lambda p, t: lm_step.next_byte_loss(parts.graphdef, p, parts.batch_stats, t))
    want = np.mean([float(loss(host, held.host_batch(p)["tokens"])) for p in range(2)])
    assert got == pytest.approx(want, rel=1e-5)


def test_a_rows_layout_accumulates_and_is_described():
    rows = resolve_rows([
        Row("baseline", "flat", sync={"algorithm": "flat"}),
        Row("+zero", "sharded state", data_parallel={"shard_optimizer": True}),
        Row("+hier", "hierarchical", sync={"algorithm": "hierarchical"}),
    ])  # fmt: skip
    assert [dict(r.data_parallel) for r in rows] == [{}, *[{"shard_optimizer": True}] * 2]
    assert rows[2].describe()["data_parallel"] == {"shard_optimizer": True}


def test_hybrid_row_follows_the_resnet_rows_on_overlaps_settings():
    from experiments.lm import lm_rows

    rows = lm_rows()
    assert [r.row.config for r in rows[:-1]] == [r.row.config for r in resolve_rows()]
    hybrid = rows[-1]
    assert hybrid.row.config == "hybrid-sharded" and hybrid.local is None
    assert hybrid.techniques == ("baseline", "+hierarchical", "+overlap", "hybrid-sharded")
    assert dict(hybrid.data_parallel) == {"shard_params": True}
    assert hybrid.sync["algorithm"] == "hierarchical" and hybrid.sync["compression"].name == "int8"
    assert all(not r.data_parallel for r in rows[:-1])
    per_layer = lm_rows("layer")[-1]  # --gather layer
    assert dict(per_layer.data_parallel) == {"shard_params": True, "gather": "layer"}


def test_hybrid_line_puts_memory_beside_the_baseline():
    from experiments.lm import _hybrid_line

    row = dict(step_time_s=0.1, speedup=1.5, speedup_range=[1.2, 1.8], rounds=3,
               mesh={"inter": 2, "intra": 4}, program_memory={"temp": 3e6})  # fmt: skip
    rows = [
        {**row, "config": "baseline", "state_bytes_per_device": 4e6, "speedup": 1.0},
        {**row, "config": "hybrid-sharded", "state_bytes_per_device": 1e6},
    ]
    line = _hybrid_line(rows)
    assert "state 1.00 MB per device against the replicated baseline's 4.00 MB (0.25x" in line
    assert "1.50x the baseline's speed (1.20-1.80x over 3 paired rounds)" in line
    assert _hybrid_line(rows[:1]) is None


def test_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.lm", "--help"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "--ablation" in out.stdout and "bits" in out.stdout
