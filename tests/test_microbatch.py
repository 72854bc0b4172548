"""data_parallel(..., microbatches=N): same step as N=1, reductions inside the scan."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mlp import mlp_init, mlp_logits, mlp_loss

import jaxcomm


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


@pytest.mark.parametrize("algorithm,bucket_bytes", [("hierarchical", None), ("flat", (256, 512))])
def test_microbatched_step_equals_plain_step(mesh, batches, algorithm, bucket_bytes):
    params = _init(jax.random.key(0))
    runs = {}
    for n in (1, 4):
        tx = optax.chain(
            jaxcomm.sync_gradients(algorithm=algorithm, bucket_bytes=bucket_bytes),
            optax.adam(1e-2),
        )
        dp = jaxcomm.data_parallel(_loss, tx, mesh, has_aux=True, microbatches=n)
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
    dp = jaxcomm.data_parallel(_loss, tx, mesh, has_aux=True, microbatches=4)
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
    body = jaxcomm.schedule.parse_schedule(mod.text, mesh=mesh)
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


def test_readme_overlap_section_runs(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = [
        re.search(rf"## {title}.*?```python\n(.*?)```", text, re.S).group(1)
        for title in ("Quick start", "Overlap and batching")
    ]
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert int(namespace["state"].step) == 1
    out = capsys.readouterr().out
    assert "all collectives synchronous" in out and "reduce-scatter" in out


def test_microbatches_with_compression_are_refused(mesh, batches):
    tx = optax.chain(jaxcomm.sync_gradients(compression=jaxcomm.compression.int8()), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(_loss, tx, mesh, has_aux=True, microbatches=2)
    state = dp.init(_init(jax.random.key(0)))
    with pytest.raises(NotImplementedError, match="microbatches=N"):
        dp(state, batches[0])
