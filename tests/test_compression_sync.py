"""sync_gradients(compression=...): policy, warm-up, inter-node stage, fp16 skip, adaptive
decisions, per-device state in the optimizer state, lax.scan over steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    AX,
    abstract_per_device,
    assert_replicas_equal,
    assert_rows_equal,
    assert_trees_bitwise_equal,
    per_device,
    sharded,
    state_specs,
)
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.state import stack_local, unstack_local

C = jaxcomm.compression


def _grads(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "w": (scale * rng.normal(size=(8, 64, 48))).astype(np.float32),
        "b": (scale * rng.normal(size=(8, 48))).astype(np.float32),
    }


def _runner(mesh, tx, steps=1):
    """jit(shard_map) running ``steps`` updates in a lax.scan; returns (outs, state)."""
    example = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    sspecs = state_specs(lambda: tx.init(example), mesh)

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        state = tx.init(g)

        def body(state, _):
            out, state = tx.update(g, state)
            return state, out

        state, outs = jax.lax.scan(body, state, None, length=steps)
        return jax.tree.map(lambda x: x[None], outs), stack_local(state)

    return sharded(local, mesh, out_specs=(P(AX), sspecs))


def _call(fn, *args):
    """Runs ``fn``; its per-device outputs (the reduced gradients) must agree bitwise."""
    outs, state = fn(*args)
    assert_rows_equal(outs)
    return jax.tree.map(np.asarray, outs), state


def test_policy_small_leaves_uncompressed_and_predicate(mesh):
    g = _grads()
    # min_size: 'b' (48 elements) goes in full precision, 'w' through int4
    fn = _runner(mesh, jaxcomm.sync_gradients(compression=C.int4(), min_size=1024))
    outs, _ = _call(fn, per_device(mesh, g))
    np.testing.assert_allclose(outs["b"][0, 0], g["b"].mean(0), rtol=1e-5, atol=1e-6)
    w_err = np.abs(outs["w"][0, 0] - g["w"].mean(0)).max()
    assert 1e-3 < w_err < 0.5  # compressed: int4 error, bounded
    # a predicate compressing only 'b' (min_size ignored): the reverse
    pred = jaxcomm.sync_gradients(compression=C.int4(), compress_leaf=lambda path, x: "b" in path)
    outs, _ = _call(_runner(mesh, pred), per_device(mesh, g))
    np.testing.assert_allclose(outs["w"][0, 0], g["w"].mean(0), rtol=1e-5, atol=1e-6)
    assert np.abs(outs["b"][0, 0] - g["b"].mean(0)).max() > 1e-3


def test_warmup_zero_compiles_no_uncompressed_branch(mesh):
    args = ({"w": abstract_per_device(mesh, (64, 48)), "b": abstract_per_device(mesh, (48,))},)
    no_warm = _runner(mesh, jaxcomm.sync_gradients(compression=C.int8(), min_size=1024))
    mod = jaxcomm.hlo.collectives(no_warm, *args, mesh=mesh)
    # no collective under a conditional (int8 keeps one on CPU, without collectives, to
    # compute its decoded mean once)
    assert not any(mod.branch_chain(c.computation) for c in mod.collectives)
    # the compressed leaf never goes through an f32 collective of its size
    big_f32 = [c for c in mod.collectives if c.dtype == "f32" and c.operand_elements >= 64 * 48]
    assert not big_f32
    warm = _runner(mesh, jaxcomm.sync_gradients(compression=C.int8(), warmup_steps=5))
    wb = jaxcomm.wire_bytes(warm, *args)
    (branches,) = wb["branches"].values()
    assert len(branches) == 2
    small, large = sorted(branches.values())
    assert large > 2.5 * small  # f32 warm-up branch vs int8 branch (3072 elements, padded)
    assert wb["total"] == pytest.approx(wb["unconditional"] + large)


def test_warmup_sends_uncompressed_then_compressed(mesh):
    g = _grads(1)
    fn = _runner(mesh, jaxcomm.sync_gradients(compression=C.int4(), warmup_steps=2), steps=3)
    outs, state = _call(fn, per_device(mesh, g))
    ref = g["w"].mean(0)
    np.testing.assert_allclose(outs["w"][0, 0], ref, rtol=1e-5, atol=1e-6)  # step 0
    np.testing.assert_allclose(outs["w"][0, 1], ref, rtol=1e-5, atol=1e-6)  # step 1
    assert np.abs(outs["w"][0, 2] - ref).max() > 1e-3  # step 2: int4
    assert int(state.count) == 3


def test_inter_stage_only_compresses_across_nodes(mesh):
    g = _grads(2)
    tx = jaxcomm.sync_gradients(compression=C.int8(), compress_stage="inter")
    fn = _runner(mesh, tx)
    outs, _ = _call(fn, per_device(mesh, g))
    ref = g["w"].mean(0)
    rel = np.linalg.norm(outs["w"][0, 0] - ref) / np.linalg.norm(ref)
    assert rel < 0.02
    np.testing.assert_array_equal(outs["w"][0, 0], outs["w"][5, 0])
    mod = jaxcomm.hlo.collectives(fn, per_device(mesh, g), mesh=mesh)
    by = {(c.kind, c.axes, c.dtype) for c in mod.collectives if c.operand_elements >= 600}
    # full precision into the inter stage, int8 bytes between nodes; the intra all-gather
    # moves the quantized means (the result), not their f32 decoding
    assert ("reduce-scatter", ("intra",), "f32") in by
    assert ("all-gather", ("intra",), "u8") in by
    assert ("all-to-all", ("inter",), "u8") in by
    assert not any(axes == AX for _, axes, _ in by)
    assert not any(k == "all-gather" and t == "f32" for k, _, t in by)


def _adaptive_at(rung: str) -> C.Compressor:
    """An adaptive compressor that starts at ``rung`` and stays there (no window ends)."""
    start = dict(C.LADDER)[rung]
    return C.adaptive(start, min_compression=0.0, max_compression=1.0, adjustment_step=100)


@pytest.mark.parametrize(
    "comp",
    [C.int8(), C.int4(block=128), C.int8(error_feedback=True)]
    + [_adaptive_at(r) for r in ("f32", "int4")],
    ids=["int8", "int4", "int8_ef", "adaptive@f32", "adaptive@int4"],
)
def test_inter_stage_gathers_encoded_means_bit_for_bit(mesh, comp):
    # gathering the quantized means over the node and decoding after gives the same bits
    # (and the same error-feedback state) as gathering each device's decoded f32 mean
    def gathering_f32(reduce):
        def run(xs, state, ctx):
            means, state = reduce(xs, state, ctx._replace(gather_axis=None))
            return C.gather_means(means, ctx), state

        return run

    g = _grads(4)
    runs = []
    for c in (comp, comp._replace(reduce=gathering_f32(comp.reduce))):
        tx = jaxcomm.sync_gradients(compression=c, compress_stage="inter", min_size=1)
        runs.append(_call(_runner(mesh, tx, steps=2), per_device(mesh, g)))
    (outs, state), (outs2, state2) = runs
    np.testing.assert_array_equal(outs["w"], outs2["w"])
    np.testing.assert_array_equal(outs["b"], outs2["b"])
    assert_trees_bitwise_equal(state, state2)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [8, 4])
def test_adaptive_int_rung_is_the_fixed_compressor_with_error_feedback(mesh, bits, stochastic):
    # at a fixed rung the means and the residual are those of int8/int4(stochastic=...,
    # error_feedback=True): bit for bit when rounding to nearest; stochastic, the same
    # dither seeds (adaptive hashes them once before its switch, the fixed compressor per
    # buffer) give the same integers, and the two programs' floats differ by at most one
    # rounding (1.2e-7 on values of ~1) where another dither would move a value by a
    # quantization step (1e-2 to 1e-1 here)
    rung = f"int{bits}"
    comp = C.adaptive(
        dict(C.LADDER)[rung], min_compression=0.0, max_compression=1.0, adjustment_step=100,
        block=64, stochastic=stochastic,
    )  # fmt: skip
    fixed = C.quantized(bits, block=64, stochastic=stochastic, error_feedback=True)
    g = _grads(5)
    runs = []
    for c in (comp, fixed):
        tx = jaxcomm.sync_gradients(compression=c, compress_stage="inter", min_size=1)
        runs.append(_call(_runner(mesh, tx, steps=3), per_device(mesh, g)))
    (outs, state), (outs2, state2) = runs
    res = jax.tree.leaves(C.adaptive_states(state)[0].residual.value)
    res2 = jax.tree.leaves(state2.compression)
    assert len(res) == len(res2)
    assert int(C.adaptive_states(state)[0].level) == C.DEFAULT_LADDER.index(rung)
    atol = 0.0 if not stochastic else 4 * np.finfo(np.float32).eps * np.abs(g["w"]).max()
    for a, b in [(outs["w"], outs2["w"]), (outs["b"], outs2["b"]), *zip(res, res2, strict=True)]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@pytest.mark.parametrize("stage", ["all", "inter"])
def test_from_codec_builds_a_compressor_with_error_feedback(mesh, stage):
    # a codec written outside the library: its means gathered over the node by from_codec
    # with compress_stage='inter', and error feedback keeps c - sent, so that after each
    # step the mean of the residuals plus the sum of the means is the sum of the gradients
    sizes = {"all": 8, "inter": 2}

    def mean(c, ctx, i, seed):
        sent = jnp.round(c * 64) / 64
        return jax.lax.psum(sent, ctx.axes) / sizes[stage], sent

    comp = C.from_codec(C.BufferCodec("grid", mean), error_feedback=True)
    g = _grads(6)
    tx = jaxcomm.sync_gradients(compression=comp, compress_stage=stage, min_size=1)
    outs, state = _call(_runner(mesh, tx, steps=3), per_device(mesh, g))
    for res in jax.tree.leaves(state.compression):  # per device: less than half a step
        assert res.shape[0] == 8 and 0 < np.abs(res).max() <= 0.5 / 64 + 1e-6
    w = outs["w"][0]  # (steps, 64, 48), the same on every device (_call)
    flat_mean = g["w"].mean(0)
    # every step's mean is within half a grid step of the true mean (plus what was kept)
    np.testing.assert_allclose(w[0], flat_mean, atol=0.5 / 64 + 1e-6)
    assert not np.array_equal(w[0], flat_mean)  # it really was rounded


def test_fp16_overflow_skips_the_whole_step_and_counts(mesh):
    g = _grads(3)
    g["w"][3, 0, 0] = 1e9  # 1e9 / 8 > 65504: the fp16 sum overflows
    tx = jaxcomm.sync_gradients(compression=C.fp16(), min_size=1024)
    outs, state = _call(_runner(mesh, tx, steps=2), per_device(mesh, g))
    np.testing.assert_array_equal(outs["w"], 0.0)
    np.testing.assert_array_equal(outs["b"], 0.0)  # the uncompressed leaf is skipped too
    assert int(state.compression.overflow_steps) == 2
    g["w"][3, 0, 0] = 1.0
    outs, state = _call(_runner(mesh, tx, steps=1), per_device(mesh, g))
    np.testing.assert_allclose(outs["w"][0, 0], g["w"].mean(0), rtol=2e-3, atol=2e-3)
    assert int(state.compression.overflow_steps) == 0


def _adaptive_levels(mesh, comp, steps, comm_share=None, scale=1.0):
    tx = jaxcomm.sync_gradients(compression=comp, min_size=1024)
    example = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    sspecs = state_specs(lambda: tx.init(example), mesh)

    def local(g, share):
        g = jax.tree.map(lambda x: x[0], g)
        state = tx.init(g)
        state = state._replace(compression=C.with_comm_share(state.compression, share))

        def body(state, _):
            _, state = tx.update(g, state)
            return state, state.compression.level

        state, levels = jax.lax.scan(body, state, None, length=steps)
        return levels[None], stack_local(state)

    fn = sharded(local, mesh, in_specs=(P(AX), P()), out_specs=(P(AX), sspecs))
    share = jnp.float32(-1.0 if comm_share is None else comm_share)
    levels, state = fn(per_device(mesh, _grads(4, scale)), share)
    levels = np.asarray(levels)
    assert_rows_equal(levels)  # every device took the same decisions (replicated signals)
    return levels[0], state


def test_adaptive_climbs_while_error_is_low(mesh):
    comp = C.adaptive(
        0.5, min_compression=0.1, max_compression=0.9, adjustment_step=2, error_high=0.3
    )
    levels, state = _adaptive_levels(mesh, comp, 8)
    # Decisions at the first step of each window (steps 2, 4, 6): bf16 -> int8 -> int4
    # (ladder [bf16, int8, int4]); int4's error of the mean (0.26 on independent
    # gradients, 8 devices, block 256) stays in the band [error_low, error_high].
    assert list(levels) == [0, 0, 1, 1, 2, 2, 2, 2]
    assert 0.05 < float(state.compression.last_error) < 0.3


def test_adaptive_steps_down_with_hysteresis(mesh):
    # int4's error (~0.15) is over error_high=0.1: step down to int8, then hold for
    # `cooldown`=2 windows (int8's error is low) before trying int4 again, and twice as
    # long after the second strike, instead of oscillating every window.
    comp = C.adaptive(
        0.875, min_compression=0.5, max_compression=0.9, adjustment_step=1,
        error_low=0.05, error_high=0.1, cooldown=2,
    )  # fmt: skip
    levels, state = _adaptive_levels(mesh, comp, 12)
    assert list(levels) == [2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2, 1], levels
    assert int(state.compression.strikes) == 3
    assert C.REASONS[int(state.compression.last_reason)] == "error"


def test_adaptive_cheap_network_steps_down_and_dead_band_holds(mesh):
    comp = C.adaptive(0.75, min_compression=0.0, max_compression=0.9, adjustment_step=1)
    # Communication is cheap: the share predicted one rung down stays under comm_low.
    levels, state = _adaptive_levels(mesh, comp, 4, comm_share=0.01)
    assert list(levels) == [2, 1, 0, 0]
    assert C.REASONS[int(state.compression.last_reason)] == "none"  # f32: nowhere to go
    # int8 at a share of 0.2: bf16 is predicted at 0.33 (twice the bytes), over
    # comm_low, and 0.2 is under comm_high: stay.
    levels, _ = _adaptive_levels(mesh, comp, 3, comm_share=0.2)
    assert list(levels) == [2, 2, 2]
    # Communication-bound and the error low: climb (bf16 -> int8 -> int4). int4's error
    # of the mean on this gradient reads 0.23-0.27 per step (mean 0.247, 40 steps): at
    # the default error_high of 0.25 the error rule would step back on about half of the
    # steps, so the band is set above it and the network rule alone decides here.
    comp = C.adaptive(
        0.5, min_compression=0.0, max_compression=0.9, adjustment_step=1, error_high=0.4
    )
    levels, state = _adaptive_levels(mesh, comp, 4, comm_share=0.6)
    assert list(levels) == [1, 2, 3, 3]
    assert C.REASONS[int(state.compression.last_reason)] in ("network", "none")


def test_per_device_state_in_the_train_state(mesh):
    """Error-feedback residuals are PerDevice: sharded (8, ...) along the data axes."""

    def loss(p, batch):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

    params = {"w": jnp.zeros((32, 64))}
    tx = optax.chain(jaxcomm.sync_gradients(compression=C.topk(0.1)), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(loss, tx, mesh, check_replicas=1)
    state = dp.init(params)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 32)), "y": rng.normal(size=(16, 64))}
    batch = jax.tree.map(lambda a: a.astype(np.float32), batch)
    state, _ = dp(state, batch)
    jax.block_until_ready(state)  # one execution in flight (XLA:CPU rendezvous)
    state, m = dp(state, batch)
    (res,) = state.opt_state[0].compression.value
    assert res.shape == (8, 32 * 64)
    assert res.sharding.spec[0] == AX
    assert np.abs(np.asarray(res)).max() > 0
    res_np = np.asarray(res)
    assert not np.allclose(res_np[0], res_np[1])  # per device
    assert np.isfinite(float(m["loss"]))
    # the params (and all other replicated leaves) hold the same bits on every device
    assert assert_replicas_equal(state) > 0


def test_scan_equals_separate_jitted_steps(mesh):
    """Several steps in one lax.scan equal the same steps through separate jit calls."""
    tx = jaxcomm.sync_gradients(compression=C.powersgd(rank=2), min_size=16)
    g = _grads(5)
    outs_scan, state_scan = _call(_runner(mesh, tx, steps=3), per_device(mesh, g))

    sspecs = state_specs(lambda: tx.init({"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}), mesh)
    init = sharded(
        lambda g: stack_local(tx.init(jax.tree.map(lambda x: x[0], g))), mesh, out_specs=sspecs
    )

    def one(g, s):
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), unstack_local(s))
        return jax.tree.map(lambda x: x[None], out), stack_local(s)

    step = sharded(one, mesh, in_specs=(P(AX), sspecs), out_specs=(P(AX), sspecs))
    gs = per_device(mesh, g)
    s = init(gs)
    for t in range(3):
        out, s = step(gs, s)
        np.testing.assert_allclose(np.asarray(out["w"]), outs_scan["w"][:, t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(s.compression.q[0]),
        np.asarray(state_scan.compression.q[0]),
        rtol=1e-5,
        atol=1e-5,
    )
