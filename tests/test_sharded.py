"""Sharded optimizer state (``data_parallel(shard_optimizer=True)``): equal to data
parallelism in f32, compressed within the codec's error, no more bytes (fewer compressed).
The state's size and the refusals: tests/test_sharded_build.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm
from jaxcomm.compression import bf16, int4, int8
from jaxcomm.compression.quantize import dequantize, quantize
from jaxcomm.sharded import ShardedState, make_shard_plan

# 72200 elements: divisible by the 8 devices, so neither step pads (the byte test).
SIZES = (16, 256, 256, 8)


def _batches(n):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(32, SIZES[0])).astype(np.float32),
            "y": rng.integers(0, SIZES[-1], 32).astype(np.int32),
        }
        for _ in range(n)
    ]


def _adam_state(opt_state):
    found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    return next(x for x in found if isinstance(x, optax.ScaleByAdamState))


def _step_pair(mesh, tx, **kw):
    c = kw.pop("c", None)
    chain = lambda: optax.chain(jaxcomm.sync_gradients(compression=c), *tx())  # noqa: E731
    dp = jaxcomm.data_parallel(mlp_loss, chain(), mesh)
    zp = jaxcomm.data_parallel(mlp_loss, chain(), mesh, shard_optimizer=True, **kw)
    return dp, zp


OPTIMIZERS = {
    "adam": lambda: (optax.adam(1e-2),),
    "adamw": lambda: (optax.adamw(1e-2, weight_decay=0.1),),
    # max_norm far below the gradient's norm: every step clips (the norm of all the
    # updates: summed over the devices' pieces where the step is sharded)
    "clip_adamw": lambda: (
        jaxcomm.sharded.clip_by_global_norm(0.05),
        optax.adamw(1e-2, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_f32_sharded_equals_data_parallel(mesh, name):
    p0 = mlp_init(jax.random.key(0))
    dp, zp = _step_pair(mesh, OPTIMIZERS[name], check_replicas=5)
    a, b = dp.init(p0), zp.init(p0)
    assert zp.per_device_paths and all(".mu" in p or ".nu" in p for p in zp.per_device_paths)
    for batch in mlp_batches(20, size=32):
        a, ma = dp(a, batch)
        b, mb = zp(b, batch)
        np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-5, atol=1e-6)
        assert assert_replicas_equal(b) > 0
    for x, y in zip(jax.tree.leaves(b.params), jax.tree.leaves(a.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    # the stored pieces, in the params' tree, read row after row are data parallelism's
    # moments, flattened
    mu_dp, mu = _adam_state(a.opt_state).mu, _adam_state(b.opt_state.inner).mu
    assert jax.tree.structure(mu) == jax.tree.structure(mu_dp)
    for x, y in zip(jax.tree.leaves(mu), jax.tree.leaves(mu_dp), strict=True):
        assert x.shape == (8, -(-y.size // 8))
        np.testing.assert_allclose(np.asarray(x).reshape(-1)[: y.size], y.reshape(-1), atol=1e-6)


def test_microbatches_accumulate_locally_then_reduce_scatter_once(mesh):
    """microbatches=4 (accumulate='local') equals one batch within f32 rounding: the mean
    of the microbatches' gradients is reduce-scattered once (the HLO holds the same
    reduce-scatters), replicas agree."""
    p0 = mlp_init(jax.random.key(0))
    one = _step_pair(mesh, OPTIMIZERS["adamw"], check_replicas=1)[1]
    four = _step_pair(mesh, OPTIMIZERS["adamw"], microbatches=4, check_replicas=1)[1]
    a, b = one.init(p0), four.init(p0)
    for batch in mlp_batches(5, size=64):
        a, ma = one(a, batch)
        b, mb = four(b, batch)
        np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(b.params), jax.tree.leaves(a.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    batch = one.shard_batch(mlp_batches(1, size=64)[0])
    kinds = [
        jaxcomm.wire_bytes(dp.step_fn(s), s, batch)["by_kind"] for dp, s in ((one, a), (four, b))
    ]
    assert kinds[0] == kinds[1]


def _first_update(mesh, c, *, shard_optimizer=True, wire=False, **sync_kw):
    """One SGD step's update (lr 1) with gradient codec ``c``, flat (and with ``wire``
    the step's ``wire_bytes``)."""
    p0 = mlp_init(jax.random.key(0), sizes=SIZES)
    # data parallelism compresses every leaf too (min_size=0), as the sharded step does
    kw = {} if shard_optimizer else {"min_size": 0}
    tx = optax.chain(jaxcomm.sync_gradients(compression=c, **kw, **sync_kw), optax.sgd(1.0))
    zp = jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_optimizer=shard_optimizer)
    s0, batch = zp.init(p0), zp.shard_batch(_batches(1)[0])
    s, _ = zp(s0, batch)
    assert assert_replicas_equal(s) > 0
    new, old = jax.tree.leaves(s.params), jax.tree.leaves(p0)
    u = np.concatenate([(np.asarray(x) - y).ravel() for x, y in zip(new, old, strict=True)])
    return (u, jaxcomm.wire_bytes(zp.step_fn(s), s, batch)) if wire else u


@pytest.fixture(scope="module")
def exact_update(mesh):
    return _first_update(mesh, None)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_compressed_gradient_within_codec_error(mesh, exact_update, codec):
    make = {"bf16": bf16, "int8": int8, "int4": int4}[codec]
    exact = exact_update
    err = lambda u: np.linalg.norm(u - exact) / np.linalg.norm(exact)  # noqa: E731
    sharded = err(_first_update(mesh, make()))
    # the codec's error in data parallelism (its two-phase mean): one rounding on the way
    # in and one on the way out, where the sharded step rounds once per reduce-scatter stage
    replicated = err(_first_update(mesh, make(), shard_optimizer=False))
    assert 0 < sharded < 1.5 * replicated, (sharded, replicated)


def test_compress_stage_inter_keeps_the_node_in_f32(mesh, exact_update):
    """int8 with compress_stage='inter': the reduce-scatter inside the node in f32, the
    one across nodes in int8. The same bytes cross a node's link as with 'all' (read from
    the HLO), more inside it, and one rounding fewer: closer to the exact update."""
    err = lambda u: np.linalg.norm(u - exact_update) / np.linalg.norm(exact_update)  # noqa: E731
    u_all, w_all = _first_update(mesh, int8(), wire=True)
    u_inter, w_inter = _first_update(mesh, int8(), wire=True, compress_stage="inter")
    assert w_inter["crossing"]["inter"] == pytest.approx(w_all["crossing"]["inter"], rel=0.02)
    assert w_inter["total"] > 1.5 * w_all["total"]
    assert "reduce-scatter" in w_inter["by_kind"] and "reduce-scatter" not in w_all["by_kind"]
    assert 0 < err(u_inter) < err(u_all)


@pytest.fixture(scope="module")
def f32_losses(mesh):
    """Losses of 20 steps of f32 data parallelism (Adam) on the SIZES MLP."""
    dp = jaxcomm.data_parallel(
        mlp_loss, optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-2)), mesh
    )
    s, out = dp.init(mlp_init(jax.random.key(0), sizes=SIZES)), []
    for batch in _batches(20):
        s, m = dp(s, batch)
        out.append(float(m["loss"]))
    return out


@pytest.mark.parametrize("gather", ["bf16", "int8"])
def test_param_gather_decodes_the_master_on_every_device(mesh, f32_losses, gather):
    p0 = mlp_init(jax.random.key(0), sizes=SIZES)
    codec = {"bf16": bf16(), "int8": int8(block=256)}[gather]
    _, zp = _step_pair(mesh, lambda: (optax.adam(1e-2),), c=int8(), param_gather=codec)
    b, losses = zp.init(p0), []
    for batch in _batches(20):
        b, mb = zp(b, batch)
        losses.append(float(mb["loss"]))
        assert assert_replicas_equal(b) > 0
    # training follows f32 data parallelism (int8 gradients, lossy params)
    gap = max(abs(x - y) for x, y in zip(f32_losses, losses, strict=True))
    assert gap < 0.02, (f32_losses, losses)
    # params are the decoded f32 master chunks, bit for bit (the owner computes with them too)
    assert isinstance(b.opt_state, ShardedState)
    # row r of a stacked master leaf is device r's piece; one bucket: device r's chunk is
    # its pieces side by side, and that chunk is what the gather encodes
    splan = make_shard_plan(jax.tree.leaves(p0), 8, ("inter", "intra"))
    assert len(splan.plan.buffers) == 1
    master = np.concatenate([np.asarray(x) for x in jax.tree.leaves(b.opt_state.master)], 1)
    if gather == "bf16":
        decoded = master.astype(jnp.bfloat16).astype(np.float32)
    else:
        m = master.shape[1]
        blocks = -(-m // 256)
        rows = np.pad(master, ((0, 0), (0, blocks * 256 - m)))
        decoded = np.asarray(dequantize(*quantize(rows, 8, 256, None), 8, 256))[:, :m]
    packed = np.asarray(splan.padded(jax.tree.leaves(b.params))[0]).reshape(8, -1)
    assert not np.array_equal(decoded, master)  # the gather is lossy ...
    np.testing.assert_array_equal(packed, decoded)  # ... and exact


def test_wire_bytes(mesh):
    p0 = mlp_init(jax.random.key(0), sizes=SIZES)
    batch = _batches(1)[0]

    def total(dp):
        s = dp.init(p0)
        return jaxcomm.wire_bytes(dp.step_fn(s), s, dp.shard_batch(batch))

    adam = lambda: (optax.adam(1e-3),)  # noqa: E731
    dp, f32 = _step_pair(mesh, adam)
    _, low = _step_pair(mesh, adam, c=int8(), param_gather=bf16())
    base, wf, wl = total(dp), total(f32), total(low)
    # reduce-scatter + all-gather = all-reduce: no more bytes
    assert set(wf["by_kind"]) == {"reduce-scatter", "all-gather", "all-reduce"}
    assert wf["by_kind"]["all-reduce"] < 16  # the loss's mean only
    assert wf["total"] <= base["total"]
    # int8 gradients (all-to-all) + bf16 params (all-gather)
    assert wl["total"] <= 0.4 * base["total"], wl["total"] / base["total"]


def _by_path(p):
    """True for every leaf but the biases, chosen by path (as Flax scripts do)."""
    return jax.tree_util.tree_map_with_path(lambda k, _: "'b'" not in jax.tree_util.keystr(k), p)


PATH_OPTIMIZERS = {
    "adamw_mask": lambda: (optax.adamw(1e-2, weight_decay=0.5, mask=_by_path),),
    "masked": lambda: (optax.masked(optax.sgd(0.1), _by_path), optax.adam(1e-2)),
    "partition": lambda: (
        optax.partition(
            {"decay": optax.adamw(1e-2, weight_decay=0.5), "plain": optax.adam(1e-2)},
            lambda p: jax.tree.map(lambda d: "decay" if d else "plain", _by_path(p)),
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(PATH_OPTIMIZERS))
def test_masks_chosen_by_path_equal_data_parallel(mesh, name):
    """The transforms see each device's pieces in the params' own tree, so a weight-decay
    mask or a label chosen by path picks the same leaves as in data parallelism (biases
    of 1.0 make a decay of them show: 0.05 per step)."""
    p0 = [{**layer, "b": jnp.ones_like(layer["b"])} for layer in mlp_init(jax.random.key(0))]
    dp, zp = _step_pair(mesh, PATH_OPTIMIZERS[name], check_replicas=5)
    a, b = dp.init(p0), zp.init(p0)
    for batch in mlp_batches(10, size=32):
        a, _ = dp(a, batch)
        b, _ = zp(b, batch)
    assert assert_replicas_equal(b) > 0
    for x, y in zip(jax.tree.leaves(b.params), jax.tree.leaves(a.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
