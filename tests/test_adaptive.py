"""Adaptive compression: the error signal against numpy, the controller on a synthetic
network, the ladder's names and wire fractions, and the measured network in the loop
(``CommProfiler.drive``)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, assert_rows_equal, per_device, sharded, state_specs
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.state import stack_local

C = jaxcomm.compression
N = 1 << 16  # 64k elements per device


@functools.cache
def _mesh(p: int):
    return jaxcomm.make_mesh(intra=min(p, 4), devices=jax.devices()[:p])


def _grads(kind: str, p: int, seed: int = 0, n: int = N) -> np.ndarray:
    """(p, n) per-device gradients: the same vector, a shared part plus noise, or iid;
    ``'layers'``: correlated, in 37 segments whose scales span 1e-3..10 (a packed
    gradient's leaves)."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=n)
    if kind == "identical":
        g = np.broadcast_to(common, (p, n))
    elif kind in ("correlated", "layers"):
        g = common + 0.5 * rng.normal(size=(p, n))
        if kind == "layers":
            cuts = np.sort(rng.choice(np.arange(1, n), 36, replace=False))
            scale = np.repeat(10.0 ** rng.uniform(-3, 1, 37), np.diff(np.r_[0, cuts, n]))
            g = g * scale
    else:
        g = rng.normal(size=(p, n))
    return np.ascontiguousarray(g, dtype=np.float32)


@functools.cache
def _one_step(p: int, stage: str, n: int = N, ladder: tuple[str, ...] = ("int8",)):
    """One sync_gradients update with a one-rung adaptive ladder: (out, state)."""
    comp = C.adaptive(ladder=ladder, adjustment_step=100)
    tx = jaxcomm.sync_gradients(compression=comp, min_size=1, compress_stage=stage)
    mesh = _mesh(p)
    example = jnp.zeros(n)
    sspecs = state_specs(lambda: tx.init(example), mesh)

    def local(g):
        state = tx.init(g[0])
        out, state = tx.update(g[0], state)
        return out[None], stack_local(state)

    return sharded(local, mesh, out_specs=(P(AX), sspecs))


def _signals(kind: str, p: int, stage: str = "all", n: int = N, ladder=("int8",)):
    """(the adaptive error signal, the true error of the mean, the per-device signal)."""
    g = _grads(kind, p, n=n)
    out, state = _one_step(p, stage, n, ladder)(per_device(_mesh(p), g))
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0], out[-1])
    mean = g.astype(np.float64).mean(0)
    true = np.linalg.norm(out[0] - mean) / np.linalg.norm(mean)
    cs = state.compression
    assert int(cs.window_steps) == 1
    signal = float(cs.error_sum)
    # The per-device signal: the mean over devices of each device's ||c - sent|| / ||c||,
    # which counts every device's quantization error in full although the mean averages them.
    res = np.asarray(cs.residual.value[0]).reshape(p, -1)
    naive = np.mean(np.linalg.norm(res, axis=1) / np.linalg.norm(g, axis=1))
    return signal, true, naive


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("kind", ["identical", "correlated", "independent"])
def test_error_signal_is_the_error_of_the_mean(kind, p):
    signal, true, _ = _signals(kind, p)
    # the sketch's relative spread is about sqrt(2 / 1021) on the squared norms
    assert signal == pytest.approx(true, rel=0.1), (kind, p, signal, true)


def test_error_signal_does_not_grow_with_the_device_count():
    # Identical gradients: the true error of the mean is the same at p = 2, 4, 8 (0.010,
    # int8); the per-device signal reads 0.014, 0.020, 0.028 (sqrt(1 + p) times one rounding).
    got = {p: _signals("identical", p) for p in (2, 4, 8)}
    signals = [s for s, _, _ in got.values()]
    assert max(signals) / min(signals) < 1.15, got
    signal, true, naive = got[8]
    assert naive > 2.5 * true  # what the per-device signal reads


@pytest.mark.parametrize("kind", ["identical", "independent"])
def test_error_signal_with_the_inter_stage(kind):
    # compress_stage='inter': every intra position reduces its own shard across nodes;
    # the signal adds the shards' sketches over the intra axis.
    signal, true, _ = _signals(kind, 8, "inter")
    assert signal == pytest.approx(true, rel=0.1), (kind, signal, true)


@pytest.mark.parametrize("stage", ["all", "inter"])
def test_error_signal_of_a_large_buffer_reads_a_sample_of_it(stage):
    # 2M elements (over 64 rows of 1021 per device even as an inter-stage shard): the
    # sketch folds every 8th row only, and still reads the error of the whole mean, with
    # leaves of very different scales packed in the buffer
    n = 1 << 21
    assert n // 4 > 8 * 64 * 1021
    for ladder in (("int8",), ("int4",)):
        signal, true, _ = _signals("layers", 8, stage, n=n, ladder=ladder)
        assert signal == pytest.approx(true, rel=0.1), (ladder, signal, true)


def _primitives(jaxpr) -> set[str]:
    """Names of every primitive in ``jaxpr`` and the jaxprs nested in it."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def _conds(jaxpr) -> list:
    """The ``cond`` equations of ``jaxpr``, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _conds(inner)
    return out


def test_f32_rung_reduces_the_leaves_unpacked_and_keeps_the_residual(mesh):
    # int4 for one step (its residual holds what it did not send), then the network is
    # cheap: down to f32 (ladder f32, int4), which sends g + e whole and empties the residual.
    comp = C.adaptive(0.875, min_compression=0.0, adjustment_step=1, ladder=("f32", "int4"))
    tx = jaxcomm.sync_gradients(compression=comp, min_size=1024)
    example = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    sspecs = state_specs(lambda: tx.init(example), mesh)

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        state = tx.init(g)
        state = state._replace(compression=C.with_comm_share(state.compression, 0.01))

        def body(state, _):
            out, state = tx.update(g, state)
            return state, (out["w"], state.compression.level)

        state, (outs, levels) = jax.lax.scan(body, state, None, length=3)
        return outs[None], levels[None], stack_local(state)

    fn = sharded(local, mesh, out_specs=(P(AX), P(AX), sspecs))
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(8, 64, 48)).astype(np.float32),
         "b": rng.normal(size=(8, 48)).astype(np.float32)}  # fmt: skip
    args = per_device(mesh, g)
    outs, levels, state = fn(args)
    outs, levels = np.asarray(outs), np.asarray(levels)
    assert_rows_equal(outs)  # the same bits on every device
    assert list(levels[0]) == [1, 0, 0]
    mean = g["w"].astype(np.float64).mean(0)
    assert np.abs(outs[0, 0] - mean).max() > 1e-3  # int4 kept part of it back
    # nothing lost: the f32 step sent int4's residual too; after it the residual is zero
    np.testing.assert_allclose(outs[0, 0] + outs[0, 1], 2 * mean, atol=1e-5)
    np.testing.assert_allclose(outs[0, 2], mean, atol=1e-6)
    assert not np.asarray(state.compression.residual.value[0]).any()
    # The step branches before the compressor: one branch only all-reduces the leaves (no
    # copy into a buffer), the other holds the compressor's lax.switch over its rungs.
    conds = _conds(jax.make_jaxpr(fn)(args).jaxpr)
    plain = {"psum_invariant", "reduce_scatter", "all_gather_invariant"}
    pairs = [[_primitives(b.jaxpr) for b in c.params["branches"]] for c in conds]
    assert any(
        any(plain <= b and not b & {"cond", "concatenate"} for b in bs)
        and any("cond" in b for b in bs)
        for bs in pairs
    )


# -- the controller on a synthetic network ------------------------------------------------
WIRE = np.array([1.0, 0.5, (1 + 4 / 256) / 4, (0.5 + 4 / 256) / 4], np.float32)  # f32..int4


def _share(level: int, link: float, rng) -> float:
    """Exposed comm share of a step with 1 s of compute and ``link`` s of f32 traffic,
    +-10% measurement noise."""
    comm = link * WIRE[level] * rng.uniform(0.9, 1.1)
    return comm / (comm + 1.0)


def _closed_loop(control, links, start, seed=0):
    """Runs the controller window by window: the share measured at window w (at its
    level) decides window w + 1, as with CommProfiler.drive. Returns (levels, reasons)."""
    rng = np.random.default_rng(seed)
    level, hold, strikes = jnp.int32(start), jnp.int32(0), jnp.int32(0)
    levels, reasons = [], []
    decide = jax.jit(control.decide)
    for link in links:
        levels.append(int(level))
        share = jnp.float32(_share(int(level), link, rng))
        level, hold, strikes, reason = decide(
            level, hold, strikes, jnp.float32(0.01), share, jnp.asarray(WIRE)
        )
        reasons.append(C.REASONS[int(reason)])
    return levels, reasons


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_controller_follows_a_link_drop_and_recovery(seed):
    # 10 windows on a fast link (f32 traffic 0.25 s per 1 s of compute), 15 on a 10x
    # slower one, 15 fast again. Start at bf16.
    control = C.Controller(error_low=0.05, error_high=0.25, comm_low=0.15, comm_high=0.3,
                           cooldown=3)  # fmt: skip
    links = [0.25] * 10 + [2.5] * 15 + [0.25] * 15
    levels, reasons = _closed_loop(control, links, start=1, seed=seed)
    assert levels[:11] == [1] * 11  # bf16 holds on the fast link (share 0.11, f32 0.2)
    # Up within 3 windows of the drop (window 10), to int4, then no move while slow.
    top = levels.index(3)
    assert top <= 10 + 3
    assert levels[top:26] == [3] * (26 - top)
    # Down within 3 windows of the recovery (window 25), back to bf16, and it stays.
    back = 25 + levels[25:].index(1)
    assert back <= 25 + 3
    assert levels[back:] == [1] * (40 - back)
    # Monotone in between: no oscillation, and every move was for the network.
    moves = np.diff(levels)
    assert list(moves[moves != 0]) == [1, 1, -1, -1]
    assert {r for r in reasons if r != "none"} == {"network"}


def test_controller_error_guard_backs_off_instead_of_oscillating():
    # The network asks for more, but the top rung's error is over error_high: each retry
    # of the top rung comes after twice as many windows as the one before.
    control = C.Controller(0.05, 0.25, 0.1, 0.3, cooldown=2)
    level, hold, strikes = jnp.int32(2), jnp.int32(0), jnp.int32(0)
    levels = []
    for _ in range(40):
        levels.append(int(level))
        error = jnp.float32(0.4 if int(level) == 3 else 0.01)
        level, hold, strikes, _ = control.decide(
            level, hold, strikes, error, jnp.float32(0.6), jnp.asarray(WIRE)
        )
    tops = [i for i, v in enumerate(levels) if v == 3]
    gaps = np.diff(tops)
    # 1 window at the top, then the hold (2, 4, 8, 16 windows) and the window that climbs
    assert list(gaps[:4]) == [4, 6, 10, 18], tops


# -- the ladder: rung names and wire fractions ---------------------------------------------
def test_ladder_names_the_rungs_and_their_wire_fractions():
    comp = C.adaptive(
        0.5, min_compression=0.0, ladder=("f32", "bf16", "int8", "topk:0.05"), block=64
    )
    got = C.ladder(comp, 4)
    assert got == ("f32", "bf16", "int8", "topk:0.05")
    assert got.wire == pytest.approx((1.0, 0.5, (1 + 4 / 64) / 4, 4 * 0.05))
    # top-k's all-gather grows with the devices; the other rungs' fractions do not
    assert C.ladder(comp, 8).wire == pytest.approx((1.0, 0.5, (1 + 4 / 64) / 4, 8 * 0.05))
    # the rungs outside [min_compression, max_compression] are not in it
    assert C.ladder(C.adaptive(), 8) == ("bf16", "int8", "int4") == C.DEFAULT_LADDER[1:]
    # what the compressor carries once in a sync (no trace needed)
    assert C.ladder(comp._replace(name="renamed"), 2) == got
    for other in (C.int8(), C.bf16(), C.topk(0.1), None):
        assert C.ladder(other, 8) is None
    with pytest.raises(ValueError, match="devices=0"):
        C.ladder(comp, 0)


def test_state_scalars_through_one_vector_keep_their_bits():
    # On a CPU mesh the new scalar fields are read back out of one int32 vector (an
    # XLA:CPU compile-time workaround): every value, NaN and -0.0 included, is unchanged.
    from jaxcomm.compression.adaptive import _scalars_in_one_vector

    f, i = jnp.float32, jnp.int32
    state = C.AdaptiveState(
        level=i(2), residual=(), error_sum=f(-0.0), window_steps=i(7), hold=i(-3),
        strikes=i(6), comm_share=f(0.25), last_error=f(np.nan), last_reason=i(1),
        window=i(100),
    )  # fmt: skip
    got = jax.jit(_scalars_in_one_vector)(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# -- the measured network in the loop: CommProfiler.drive ---------------------------------
def _mlp_setup(mesh, comp, **dp_kwargs):
    import optax
    from mlp import mlp_init, mlp_loss

    tx = optax.chain(jaxcomm.sync_gradients(compression=comp, min_size=64), optax.sgd(0.05))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, **dp_kwargs)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.integers(0, 3, 16)}
    return dp, dp.init(mlp_init(jax.random.key(0))), batch


def test_drive_follows_a_synthetic_link_and_logs_every_change(mesh, tmp_path):
    import json

    from helpers import assert_replicas_equal

    comp = C.adaptive(
        0.5, min_compression=0.0, adjustment_step=2, ladder=("f32", "bf16", "int8"),
        comm_low=0.15, comm_high=0.3,
    )  # fmt: skip
    dp, state, batch = _mlp_setup(mesh, comp, check_replicas=1)
    log = tmp_path / "adapt.jsonl"
    prof = jaxcomm.CommProfiler(log_file=str(log), tensorboard_dir=str(tmp_path / "tb"))
    prof.drive(dp, state, batch, twin_reps=1, calibrate=False, retime_twin=0)
    assert prof.compute_time > 0 and prof.wire["total"] > 0 and prof.kernel_times == [0.0] * 3
    # A synthetic clock: 1 s of compute per step, plus f32 traffic of 0.25 s (fast link)
    # or 2.5 s (10x slower) scaled by the wire fraction of the level the step ran.
    prof.compute_time = 1.0
    wire = [1.0, 0.5, (1 + 4 / 256) / 4]
    now, link = [0.0], [0.25]
    dp._feedback._clock = lambda: now[0]
    step = dp._compiled_step

    def timed_step(*args):  # the clock advances by the step's synthetic time
        out = step(*args)
        now[0] += 1.0 + link[0] * wire[int(out[0].opt_state[0].compression.level)]
        return out

    dp._compiled_step = timed_step
    levels = []
    for fast in [True] * 6 + [False] * 8 + [True] * 8:  # 3 fast windows, 4 slow, 4 fast
        link[0] = 0.25 if fast else 2.5
        state, metrics = dp(state, batch)
        levels.append(int(state.opt_state[0].compression.level))
        assert assert_replicas_equal(state) > 0
    assert np.isfinite(float(metrics["loss"]))
    per_window = levels[::2]
    # bf16, bf16, bf16 | (drop) bf16, int8, int8, int8 | (recovery) int8, bf16, bf16, bf16
    assert per_window == [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1], per_window
    changes = [(c["from"], c["to"], c["reason"], c["step"]) for c in prof.level_changes]
    assert changes == [("bf16", "int8", "network", 8), ("int8", "bf16", "network", 16)]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [{k: v for k, v in r.items() if k != "time"} for r in records]
    assert [r for r in logged if r["event"] == "level_change"] == prof.level_changes
    windows = [r for r in records if r["event"] == "adapt_window"]
    assert len(windows) == 11
    assert windows[3]["comm_share"] == pytest.approx(1.25 / 2.25)  # bf16 on the slow link
    assert windows[3]["levels"] == ["bf16"]
    tb = list((tmp_path / "tb").iterdir())
    assert len(tb) == 1 and tb[0].stat().st_size > 200


def test_calibrated_kernels_are_not_communication_so_the_ladder_comes_down(mesh, monkeypatch):
    # int8's kernels cost 0.8 s per step (a CPU's quantization), more than the 0.25 s of f32
    # traffic on the fast link. Counted as communication, they would hold int8 on the fast
    # link for good (share 0.46, predicted 0.76 at f32); calibrated, the share is the traffic.
    comp = C.adaptive(
        0.0, min_compression=0.0, adjustment_step=2, ladder=("f32", "int8"),
        comm_low=0.15, comm_high=0.3,
    )  # fmt: skip
    dp, state, batch = _mlp_setup(mesh, comp)
    prof = jaxcomm.CommProfiler(log_file=os.devnull)
    # Known timings for the calibration: the twin 1.0 s, the step at f32 1.5 s (0.5 s of
    # f32 traffic), at int8 2.0 s. int8's kernels: 2.0 - 1.0 - wire_int8 / wire_f32 * 0.5.
    fake = iter([1.0, 1.5, 2.0])
    monkeypatch.setattr(jaxcomm.tools.profiler, "median_time", lambda fn, args, reps: next(fake))
    prof.drive(dp, state, batch, twin_reps=1)  # calibrates: one timed step per rung
    monkeypatch.undo()
    assert prof.compute_time == 1.0
    assert prof.kernel_times == pytest.approx([0.0, 1.0 - (1 + 4 / 256) / 4 * 0.5])
    driver = dp._feedback
    assert driver.twin is not None and driver.compute0 == prof.compute_time
    # The synthetic clock: the twin's time stays 1 s (it does not advance the clock).
    prof.compute_time, driver.kernel, driver.twin, driver.compute0 = 1.0, [0.0, 0.8], None, 1.0
    wire = [1.0, (1 + 4 / 256) / 4]
    now, link = [0.0], [0.25]
    dp._feedback._clock = lambda: now[0]
    step = dp._compiled_step

    def timed_step(*args):
        out = step(*args)
        lv = int(out[0].opt_state[0].compression.level)
        now[0] += 1.0 + [0.0, 0.8][lv] + link[0] * wire[lv]
        return out

    dp._compiled_step = timed_step
    levels = []
    for fast in [True] * 4 + [False] * 6 + [True] * 6:
        link[0] = 0.25 if fast else 2.5
        state, _ = dp(state, batch)
        levels.append(int(state.opt_state[0].compression.level))
    assert levels[::2] == [0, 0, 0, 1, 1, 1, 0, 0], levels  # (slow: windows 2-4)
    fast_int8 = prof.windows[5]  # the first fast window, still at int8
    assert fast_int8["levels"] == ["int8"] and fast_int8["kernel_time"] == 0.8
    step_time = 1.8 + 0.25 * wire[1]
    assert fast_int8["comm_share"] == pytest.approx(1 - 1.8 / step_time, rel=1e-5)


def test_error_guard_change_is_logged_with_its_reason(mesh):
    # An error band under int8's error: the controller steps down for error.
    comp = C.adaptive(0.75, min_compression=0.0, adjustment_step=1, ladder=("bf16", "int8"),
                      error_low=1e-4, error_high=2e-3)  # fmt: skip
    dp, state, batch = _mlp_setup(mesh, comp)
    prof = jaxcomm.CommProfiler(log_file=os.devnull)
    prof.drive(dp, state, batch, twin_reps=1, retime_twin=2)
    for _ in range(3):
        state, _ = dp(state, batch)
    assert [(c["from"], c["to"], c["reason"]) for c in prof.level_changes] == [
        ("int8", "bf16", "error")
    ]
    assert prof.level_changes[0]["error"] > 2e-3
    # The twin was timed again after window 2 (of 3): the median of its two timed runs.
    recent = dp._feedback.recent
    assert len(recent) == 2 and prof.compute_time == pytest.approx(float(np.median(recent)))


def test_drive_needs_an_adaptive_compressor(mesh):
    dp, state, batch = _mlp_setup(mesh, C.int8())
    with pytest.raises(ValueError, match="no adaptive compressor"):
        jaxcomm.CommProfiler().drive(dp, state, batch)
    # the calibration runs steps on the given state several times; donation consumes it
    dp, state, batch = _mlp_setup(mesh, C.adaptive(adjustment_step=1), donate=True)
    with pytest.raises(ValueError, match="donate=False"):
        jaxcomm.CommProfiler().drive(dp, state, batch)
    dp, state, batch = _mlp_setup(mesh, C.adaptive(adjustment_step=1))
    with pytest.raises(ValueError, match="retime_twin"):
        jaxcomm.CommProfiler().drive(dp, state, batch, retime_twin=-1)


def test_without_a_driver_the_share_stays_unknown(mesh):
    dp, state, batch = _mlp_setup(mesh, C.adaptive(adjustment_step=1))
    state, _ = dp(state, batch)
    assert float(state.opt_state[0].compression.comm_share) == -1.0
