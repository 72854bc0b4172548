"""data_parallel(..., microbatches=N): accumulate='local' (reduce once) and 'overlap'."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal
from mlp import mlp_init, mlp_logits, mlp_loss

import jaxcomm
from jaxcomm.tools.wire import bus_bytes


def _init(key):
    return mlp_init(key, sizes=(12, 16, 3))


def _loss(params, batch):
    logits = mlp_logits(params, batch["x"])
    return mlp_loss(params, batch), {"acc": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 64, 12)).astype(np.float32)
    y = rng.integers(0, 3, size=(3, 64)).astype(np.int32)
    return [{"x": x[i], "y": y[i]} for i in range(3)]


@pytest.mark.parametrize("accumulate", ["local", "overlap"])
@pytest.mark.parametrize("algorithm,bucket_bytes", [("hierarchical", None), ("flat", (256, 512))])
def test_microbatched_step_equals_plain_step(mesh, batches, algorithm, bucket_bytes, accumulate):
    params = _init(jax.random.key(0))
    runs = {}
    for n in (1, 4):
        tx = optax.chain(
            jaxcomm.sync_gradients(algorithm=algorithm, bucket_bytes=bucket_bytes),
            optax.adam(1e-2),
        )
        dp = _data_parallel(tx, mesh, n, accumulate)
        state = dp.init(params)
        metrics = []
        for b in batches:
            state, m = dp(state, b)
            metrics.append(m)
        runs[n] = (state, metrics)
    (s1, m1), (s4, m4) = runs[1], runs[4]
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    for a, b in zip(m1, m4, strict=True):
        np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(a["acc"]), float(b["acc"]), rtol=1e-6)


def test_reductions_sit_in_the_scan(mesh, batches):
    tx = optax.chain(jaxcomm.sync_gradients(algorithm="flat"), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(_loss, tx, mesh, has_aux=True, microbatches=4, accumulate="overlap")
    state = dp.init(_init(jax.random.key(0)))
    batch = dp.shard_batch(batches[0])
    mod = jaxcomm.hlo.collectives(dp.step_fn(state), state, batch, mesh=mesh)
    grads_ar = [c for c in mod.collectives if c.kind == "all-reduce" and c.operand_elements > 2]
    in_loop = [c for c in grads_ar if c.computation != mod.entry]
    after = [c for c in grads_ar if c.computation == mod.entry]
    # one reduction per scan iteration (microbatches 0..2) and one for the last microbatch
    assert in_loop and after
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    assert sum(c.operand_elements for c in in_loop) == n_params
    assert sum(c.operand_elements for c in after) >= n_params
    body = jaxcomm.tools.schedule.parse_schedule(mod.text, mesh=mesh)
    assert body.collectives  # the report reads the loop body as well


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_microbatches(mesh, bad):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    with pytest.raises(ValueError, match="microbatches"):
        jaxcomm.data_parallel(_loss, tx, mesh, has_aux=True, microbatches=bad)


def test_indivisible_batch(mesh, batches):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(_loss, tx, mesh, has_aux=True, microbatches=3)
    state = dp.init(_init(jax.random.key(0)))
    with pytest.raises(ValueError, match="does not divide by 3"):
        dp(state, batches[0])  # 8 examples per device


def _run_readme(section: str) -> dict:
    """Runs the README's quick start, then the first python block of ``section`` of the
    overlap guide (docs/overlap.md)."""
    root = pathlib.Path(__file__).parent.parent
    namespace: dict = {}
    for path, title in (("README.md", "Quick start"), ("docs/overlap.md", section)):
        text = (root / path).read_text()
        block = re.search(rf"## {re.escape(title)}.*?```python\n(.*?)```", text, re.S).group(1)
        exec(compile(block, path, "exec"), namespace)
    return namespace


def test_readme_overlap_section_runs(capsys):
    namespace = _run_readme("Overlap and batching")
    assert int(namespace["state"].step) == 1
    out = capsys.readouterr().out
    assert "all collectives synchronous" in out and "reduce-scatter" in out


@pytest.mark.parametrize("bad", ["global", "", None, 1])
def test_bad_accumulate(mesh, bad):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"accumulate=.*'local', 'overlap'"):
        jaxcomm.data_parallel(_loss, tx, mesh, microbatches=2, accumulate=bad)


def test_model_state_refusal_names_the_alternative(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    with pytest.raises(ValueError, match="Use microbatches=1"):
        jaxcomm.data_parallel(_loss, tx, mesh, with_model_state=True, microbatches=2)


# -- accumulate='local' with every compressor -------------------------------------------
N = 4
COMPRESSORS = {
    "none": lambda: None,
    "int8": lambda: jaxcomm.compression.int8(stochastic=False),
    "bf16": lambda: jaxcomm.compression.bf16(),
    "powersgd": lambda: jaxcomm.compression.powersgd(2),
    "topk": lambda: jaxcomm.compression.topk(0.25),
}


def _dp(mesh, algorithm, compressor, n, accumulate="local", **kw):
    sync = jaxcomm.sync_gradients(
        algorithm=algorithm, compression=COMPRESSORS[compressor](), min_size=0
    )
    return _data_parallel(optax.chain(sync, optax.sgd(0.5)), mesh, n, accumulate, **kw)


def _data_parallel(tx, mesh, n, accumulate, **kw):
    """The MLP step with ``n`` microbatches, replicas compared by their bits every step."""
    return jaxcomm.data_parallel(
        _loss, tx, mesh, has_aux=True, microbatches=n, accumulate=accumulate,
        check_replicas=1, **kw,
    )  # fmt: skip


def _compile(dp, state, batch):
    """The step compiled once (ahead of time, run and read from the same executable) and
    its collectives."""
    compiled = dp.step_fn(state).lower(state, batch).compile()
    return compiled, jaxcomm.hlo.parse_collectives(compiled.as_text(), dp.mesh)


def _step_bytes(mod, trip_count):
    """Bytes one device sends per step: collectives in the scan body count once per
    iteration (``wire_bytes`` counts a loop body once)."""
    return sum(
        bus_bytes(c) * (1 if c.computation == mod.entry else trip_count) for c in mod.collectives
    )


def _run(compiled, dp, state, batches):
    for b in batches:  # one step in flight at a time on CPU, as DataParallel.__call__ does
        state, _ = jax.block_until_ready(compiled(state, dp.shard_batch(b)))
    return state


def _sync_count(state) -> int:
    is_sync = lambda x: isinstance(x, jaxcomm.SyncGradientsState)  # noqa: E731
    return int(jax.tree.leaves(state.opt_state, is_leaf=is_sync)[0].count)


@pytest.fixture(scope="module")
def metrics_bytes(mesh, batches):
    """Bytes of a step without gradient communication: the metrics' pmean alone."""
    dp = jaxcomm.data_parallel(_loss, optax.sgd(0.1), mesh, has_aux=True, require_sync=False)
    state = dp.init(_init(jax.random.key(0)))
    return jaxcomm.wire_bytes(dp.step_fn(state), state, dp.shard_batch(batches[0]))["total"]


@pytest.mark.parametrize("compressor", list(COMPRESSORS))
@pytest.mark.parametrize("algorithm", ["flat", "hierarchical"])
def test_local_accumulation_reduces_once(mesh, batches, metrics_bytes, algorithm, compressor):
    params = _init(jax.random.key(1))
    one, local = _dp(mesh, algorithm, compressor, 1), _dp(mesh, algorithm, compressor, N)
    overlap = _dp(mesh, algorithm, compressor, N, "overlap")
    batch = one.shard_batch(batches[0])
    s1, sl, so = one.init(params), local.init(params), overlap.init(params)

    (c1, mod1), (cl, modl) = _compile(one, s1, batch), _compile(local, sl, batch)
    co, modo = _compile(overlap, so, batch)

    # (a) bytes from the compiled HLO (jaxcomm.tools.wire.summarize, what wire_bytes returns):
    # local == microbatches=1 == 1/N of overlap in the gradient part (the metrics' pmean
    # is the same in all three).
    m = metrics_bytes
    b1 = jaxcomm.tools.wire.summarize(mod1)["total"]
    bl = jaxcomm.tools.wire.summarize(modl)["total"]
    bo = _step_bytes(modo, N - 1)
    assert bl == b1 and bl > m
    assert (bl - m) * N == pytest.approx(bo - m, rel=1e-9)

    # (b) same result as microbatches=1: the compressor sees the same mean gradient.
    s1, sl = _run(c1, one, s1, batches[:2]), _run(cl, local, sl, batches[:2])
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(sl.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert _sync_count(sl) == 2  # one synchronisation per step

    # (c) replicas agree bitwise after 2 steps, in both modes.
    assert_replicas_equal(sl)
    so = _run(co, overlap, so, batches[:2])
    assert_replicas_equal(so)
    assert _sync_count(so) == 2 * N  # overlap: one synchronisation per microbatch


def test_overlap_keeps_error_feedback_per_microbatch(mesh, batches):
    """topk with error feedback in 'overlap' mode: every microbatch sends C(g_i + e) and
    keeps e <- g_i + e - C(g_i + e), so over one step (e = 0 before it)
    sum_i mean_devices(sent_i) = N * full-batch gradient - mean_devices(e_N)."""
    params = _init(jax.random.key(2))
    lr = 1.0

    def run(compression, n, accumulate):
        sync = jaxcomm.sync_gradients(algorithm="flat", compression=compression, min_size=0)
        dp = jaxcomm.data_parallel(
            _loss,
            optax.chain(sync, optax.sgd(lr)),
            mesh,
            has_aux=True,
            microbatches=n,
            accumulate=accumulate,
            check_replicas=1,
        )
        state, _ = dp(dp.init(params), batches[0])
        return state

    ref = run(None, 1, "local")
    got = run(jaxcomm.compression.topk(0.25), N, "overlap")
    g_full = [
        (a - b) / lr
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref.params), strict=True)
    ]
    g_sent = [
        (a - b) / lr
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got.params), strict=True)
    ]
    residual = jax.tree.leaves(got.opt_state[0].compression)[0]  # (devices, buffer)
    assert residual.shape[0] == 8 and float(jnp.abs(residual).max()) > 0
    lhs = N * sum(float(jnp.sum(g)) for g in g_sent)
    rhs = N * sum(float(jnp.sum(g)) for g in g_full) - float(jnp.sum(residual)) / 8
    scale = N * sum(float(jnp.sum(jnp.abs(g))) for g in g_full)
    assert abs(lhs - rhs) < 1e-5 * scale
    # the same relation fails if the residual were dropped between microbatches
    assert abs(lhs - N * sum(float(jnp.sum(g)) for g in g_full)) > 1e-3 * scale


def test_bf16_params_keep_their_dtype(mesh, batches):
    """bf16 gradients are summed in f32 and handed to the optimizer in bf16."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _init(jax.random.key(5)))
    out = {}
    for n, accumulate in ((1, "local"), (N, "local"), (N, "overlap")):
        dp = _dp(mesh, "flat", "none", n, accumulate)
        state, _ = dp(dp.init(params), batches[0])
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
        out[n, accumulate] = state.params
    for key in ((N, "local"), (N, "overlap")):
        for a, b in zip(jax.tree.leaves(out[1, "local"]), jax.tree.leaves(out[key]), strict=True):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2
            )


@pytest.mark.parametrize("accumulate", ["local", "overlap"])
def test_compute_only_twin_has_no_gradient_collectives(mesh, batches, metrics_bytes, accumulate):
    """The profiler's twin (traced under sync.pre_reduced) keeps only the metrics' pmean in
    both modes: 'overlap' reduces through sync_gradients' own update, which passes through."""
    dp = _dp(mesh, "flat", "int8", N, accumulate)
    state = dp.init(_init(jax.random.key(4)))
    twin = jaxcomm.tools.profiler.compute_only_step(dp, state, batches[0])
    wire = jaxcomm.tools.wire.summarize(jaxcomm.hlo.parse_collectives(twin.as_text(), mesh))
    assert wire["total"] == metrics_bytes


def _typed_step(monkeypatch, dp, state, check_vma):
    """``dp.step_fn(state)`` built with shard_map's replication typing on or off (whatever
    the builder passes)."""
    shard_map = jax.shard_map

    def typed_shard_map(f, **kw):
        return shard_map(f, **{**kw, "check_vma": check_vma})

    with monkeypatch.context() as m:
        m.setattr(jax, "shard_map", typed_shard_map)
        return dp.step_fn(state)


# Every compressor on the hierarchical path; flat (one psum) with the plain and int8 syncs.
@pytest.mark.parametrize(
    ("algorithm", "compressor"),
    [("hierarchical", c) for c in COMPRESSORS] + [("flat", "none"), ("flat", "int8")],
)
def test_microbatch_step_type_checks_where_plain_step_does(
    monkeypatch, mesh, batches, algorithm, compressor
):
    """Under check_vma=True the accumulation adds no untyped value: the microbatches=1
    step and both modes are typed replicated for every compressor (no exemption), give the
    same bits as with check_vma=False, and (uncompressed) equal one SGD step of the whole
    batch on one device."""
    params = _init(jax.random.key(3))
    one = _dp(mesh, algorithm, compressor, 1)
    batch = one.shard_batch(batches[0])
    state = one.init(params)
    _typed_step(monkeypatch, one, state, True).lower(state, batch)  # typed, or it raises
    grads = jax.grad(mlp_loss)(params, batches[0])  # the independent reference
    reference = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    for accumulate in ("local", "overlap"):
        dp = _dp(mesh, algorithm, compressor, N, accumulate)
        state = dp.init(params)
        typed = jax.block_until_ready(_typed_step(monkeypatch, dp, state, True)(state, batch))
        plain = jax.block_until_ready(_typed_step(monkeypatch, dp, state, False)(state, batch))
        for a, b in zip(jax.tree.leaves(typed), jax.tree.leaves(plain), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert assert_replicas_equal(typed[0]) > 0
        if compressor == "none":
            for a, b in zip(
                jax.tree.leaves(typed[0].params), jax.tree.leaves(reference), strict=True
            ):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_readme_microbatch_section_runs(capsys):
    namespace = _run_readme("Microbatches: accumulate locally or overlap")
    assert int(namespace["state"].step) == 1
    assert namespace["wire_local"] == namespace["wire_one"] > 0
    assert "bytes per device per step" in capsys.readouterr().out
