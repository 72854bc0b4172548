"""Adaptive compression: the error signal against numpy, the controller on a synthetic
network, sparse rungs, and the measured network in the loop (``CommProfiler.drive``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, per_device, sharded, state_specs
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.state import stack_local

C = jaxcomm.compression
N = 1 << 16  # 64k elements, as in issue 11's measurement


@functools.cache
def _mesh(p: int):
    return jaxcomm.make_mesh(intra=min(p, 4), devices=jax.devices()[:p])


def _grads(kind: str, p: int, seed: int = 0) -> np.ndarray:
    """(p, N) per-device gradients: the same vector, a shared part plus noise, or iid."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=N)
    if kind == "identical":
        g = np.broadcast_to(common, (p, N))
    elif kind == "correlated":
        g = common + 0.5 * rng.normal(size=(p, N))
    else:
        g = rng.normal(size=(p, N))
    return np.ascontiguousarray(g, dtype=np.float32)


@functools.cache
def _one_step(p: int, stage: str):
    """One sync_gradients update with an int8-only adaptive ladder: (out, state)."""
    comp = C.adaptive(ladder=("int8",), adjustment_step=100)
    tx = jaxcomm.sync_gradients(compression=comp, min_size=1, compress_stage=stage)
    mesh = _mesh(p)
    example = jnp.zeros(N)
    sspecs = state_specs(lambda: tx.init(example), mesh)

    def local(g):
        state = tx.init(g[0])
        out, state = tx.update(g[0], state)
        return out[None], stack_local(state)

    return sharded(local, mesh, out_specs=(P(AX), sspecs))


def _signals(kind: str, p: int, stage: str = "all"):
    """(the adaptive error signal, the true error of the mean, the old bookkeeping)."""
    g = _grads(kind, p)
    out, state = _one_step(p, stage)(per_device(_mesh(p), g))
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0], out[-1])
    mean = g.astype(np.float64).mean(0)
    true = np.linalg.norm(out[0] - mean) / np.linalg.norm(mean)
    cs = state.compression
    assert int(cs.window_steps) == 1
    signal = float(cs.error_sum)
    # The old signal: the mean over devices of each device's ||c - sent|| / ||c||.
    res = np.asarray(cs.residual.value[0]).reshape(p, -1)
    old = np.mean(np.linalg.norm(res, axis=1) / np.linalg.norm(g, axis=1))
    return signal, true, old


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("kind", ["identical", "correlated", "independent"])
def test_error_signal_is_the_error_of_the_mean(kind, p):
    signal, true, _ = _signals(kind, p)
    # the sketch's relative spread is about sqrt(2 / 1021) on the squared norms
    assert signal == pytest.approx(true, rel=0.1), (kind, p, signal, true)


def test_error_signal_does_not_grow_with_the_device_count():
    # Identical gradients: the true error of the mean is the same at p = 2, 4, 8 (0.010,
    # int8); the old bookkeeping read 0.014, 0.020, 0.028 (sqrt(1 + p) times one rounding).
    got = {p: _signals("identical", p) for p in (2, 4, 8)}
    signals = [s for s, _, _ in got.values()]
    assert max(signals) / min(signals) < 1.15, got
    signal, true, old = got[8]
    assert old > 2.5 * true  # what the per-device sum of errors reported


@pytest.mark.parametrize("kind", ["identical", "independent"])
def test_error_signal_with_the_inter_stage(kind):
    # compress_stage='inter': every intra position reduces its own shard across nodes;
    # the signal adds the shards' sketches over the intra axis.
    signal, true, _ = _signals(kind, 8, "inter")
    assert signal == pytest.approx(true, rel=0.1), (kind, signal, true)
