"""Adaptive compression: a ladder of levels, chosen from the error and the measured network.

The compressor holds one level index (the *rung*); every step it compresses with that
rung through ``lax.switch`` (one compiled branch per rung, no host round trip, works under
``jit`` and inside ``lax.scan``; ``jaxcomm.wire_bytes`` counts the largest branch).

**Ladder**, least compression first (``ladder=``, names below; default
:data:`DEFAULT_LADDER` ``('f32', 'bf16', 'int8', 'int4')``). Each rung has a nominal
*compression* (fraction of f32 bytes saved) and a *wire fraction* (bytes relative to an
f32 all-reduce on ``p`` devices, used by the network model):

========================  =================  ==========================================
rung                      compression        wire fraction on ``p`` devices
========================  =================  ==========================================
``'f32'``                 0                  1
``'bf16'``                0.5                0.5
``'int8'`` / ``'int4'``   0.75 / 0.875       ``(bits/8 + 4/block) / 4`` (two-phase)
``'topk:R'``              ``1 - 2R``         ``p R`` (all-gather of index/value pairs)
``'random_k:R'``          ``1 - R``          ``R`` (all-reduce of shared-seed values)
========================  =================  ==========================================

The rungs whose compression lies in ``[min_compression, max_compression]`` form the ladder
(the seed's range 0.1-0.9 with e.g. ``ladder=('bf16', 'int8', 'int4', 'random_k:0.1')``);
the start is the one nearest ``initial_compression_ratio``. All rungs share one
per-device error-feedback residual ``e``: every rung sends ``C(g + e)`` and keeps
``e <- g + e - sent``, so switching rungs never drops gradient.

**Error signal** (every step; one value on every device): the relative error of the mean
the optimizer receives, ``||out - mean_dev(c)|| / ||mean_dev(c)||`` with ``c = g + e``,
estimated without moving the gradient (an exact ``mean_dev(c)`` would be an f32
all-reduce, the traffic compression avoids):

1. Each device folds its ``out - c`` and its ``c`` into ``sketch_size`` buckets: element
   ``j`` goes to bucket ``j mod sketch_size`` with a random sign ``s_j = +-1`` (hashed
   from a seed shared by all devices, :func:`~jaxcomm.compression.quantize.dither_seed`).
   A buffer of more than ``64 x sketch_size`` elements is folded on a strided sample of
   its rows of ``sketch_size`` (one in up to 8; the same rows for ``out - c`` and ``c``):
   the ratio of step 3 is then that of the sample.
2. One all-reduce of the ``2 x sketch_size`` sums over every data axis (8 KiB): the
   sketch is linear, so the sums are the sketches of ``out - mean_dev(c)`` and
   ``mean_dev(c)``.
3. ``E ||sketch(x)||^2 = ||x||^2`` (independent signs), so the ratio of the two sketch
   norms estimates the error; its relative spread is about ``sqrt(2/sketch_size)``
   (0.04 at 1021), and the window mean averages it further.

The ``'f32'`` rung's mean is exact (to f32 rounding), so its signal is 0 and it skips the
sketch: on a CPU the sketch's signs cost about as much as a 1 Gbit/s all-reduce. Under
``sync_gradients`` (``compress_stage='all'``, f32 leaves) it skips the packing and the
``lax.switch`` too (``Compressor.exact``): a ``lax.cond`` on the rung all-reduces the
leaves plus the residual as ``sync_gradients()`` without compression does, and the
residual is zero after it. That step costs what a plain f32 step costs; through the
switch it cost ~1.6x on a CPU (the copy of the leaves into one buffer is an elementwise
``concatenate`` there, slower than the all-reduce itself; docs/benchmarks.md, issue 11).

The old signal, the mean over devices of each device's own ``||c - sent|| / ||c||``,
counted every device's quantization error in full although the mean averages them
(for identical gradients on 8 devices it read 2.8x the true error).

**Network signal**: ``comm_share``, the exposed communication share of the step time
(``-1``: unknown), an input of the step written into the state between steps by
:func:`with_comm_share`; ``jaxcomm.CommProfiler.drive`` measures it (step time of each
window against the compute-only twin) and passes it, with no code of the user's.

**Rule** (:class:`Controller`), applied at the first step of every window of
``adjustment_step`` steps, from the window-mean error ``e`` and the last measured share
``s`` (measured over the previous window, at the current rung):

1. ``e > error_high``: one rung down (reason *error*); no climbing for
   ``cooldown * 2**strikes`` windows, then ``strikes += 1`` (at most 6): a rung that is
   too lossy is retried ever more rarely.
2. else, ``s`` known and the share predicted one rung down is ``< comm_low``: one rung
   down (reason *network*; ``strikes`` reset). The prediction scales the measured
   communication time by the rungs' wire fractions:
   ``s' = s r / (s r + 1 - s)``, ``r = wire[level - 1] / wire[level]``.
3. else, ``e < error_low``, no hold, and (``s > comm_high`` (reason *network*) or ``s``
   unknown (reason *error*)): one rung up.
4. else stay. ``hold`` decreases by one every window.

**Hysteresis**: the error band ``[error_low, error_high]`` and the comm band
``[comm_low, comm_high]`` are dead zones, and the down move compares the *predicted*
share of the rung below with ``comm_low``: after a climb (``s > comm_high``) the rung
below is predicted at about ``s``, above ``comm_low``, so the controller does not step
straight back; after a descent the share is about its prediction, below ``comm_high``, so
it does not climb straight back. It holds while the prediction errs by less than
``comm_high / comm_low`` (3x by default).

Sparse rungs lose most of each step's gradient by design (error feedback delivers it
later): their error is 0.3-0.95, so a ladder with them needs ``error_low``/``error_high``
above it, or the error guard steps down at once.

References:
  Agarwal et al., "Accordion: Adaptive Gradient Communication via Critical Learning
  Regime Identification" (MLSys 2021); Abdelmoniem et al., "An Efficient Statistical-based
  Gradient Compression Technique for Distributed Training Systems" (MLSys 2021);
  Charikar, Chen & Farach-Colton, "Finding Frequent Items in Data Streams" (ICALP 2002:
  the count sketch); Seide et al., "1-Bit Stochastic Gradient Descent and its Application
  to Data-Parallel Distributed Training of Speech DNNs" (Interspeech 2014) and Karimireddy
  et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML 2019:
  biased rounding with error feedback, ``stochastic=False``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import all_gather_invariant
from jaxcomm.compression import error_feedback as ef
from jaxcomm.compression.base import (
    Compressor,
    ReduceContext,
    axes_size,
    check_range,
    decision_axes,
    sum_over,
)
from jaxcomm.compression.cast import bf16_mean
from jaxcomm.compression.quantize import (
    dither_seed,
    seeded_uniform,
    two_phase_mean,
    two_phase_seeds,
)
from jaxcomm.compression.sparse import random_k_mean, topk_mean
from jaxcomm.packing import runtime_ints
from jaxcomm.state import PerDevice
from jaxcomm.validate import check_int

__all__ = [
    "DEFAULT_LADDER",
    "LADDER",
    "REASONS",
    "Ladder",
    "AdaptiveState",
    "Controller",
    "adaptive",
    "adaptive_states",
    "error_of_mean",
    "ladder_probe",
    "with_comm_share",
]

# (name, compression = fraction of f32 bytes saved) of the fixed rungs.
LADDER: tuple[tuple[str, float], ...] = (
    ("f32", 0.0),
    ("bf16", 0.5),
    ("int8", 0.75),
    ("int4", 0.875),
)
DEFAULT_LADDER: tuple[str, ...] = tuple(n for n, _ in LADDER)
SPARSE = ("topk", "random_k")
# Why the level last moved: AdaptiveState.last_reason indexes this.
REASONS = ("none", "error", "network")
_MAX_STRIKES = 6

# Trace-time record of the ladders of traced adaptive compressors, in trace order (for
# logging level names; the state holds indices only).
_LADDERS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxcomm_ladders", default=None
)


class Ladder(tuple):
    """The rung names of one traced adaptive compressor (a tuple), with ``wire``: each
    rung's wire fraction on the compressor's reduce axes."""

    wire: tuple[float, ...]

    def __new__(cls, names: Sequence[str], wire: Sequence[float]):
        out = super().__new__(cls, names)
        out.wire = tuple(float(w) for w in wire)
        return out


@contextlib.contextmanager
def ladder_probe():
    """Context manager yielding a list that gets the :class:`Ladder` (rung names and wire
    fractions) of each adaptive compressor whose ``reduce`` is traced inside it (in trace
    order)."""
    token = _LADDERS.set([])
    try:
        yield _LADDERS.get()
    finally:
        _LADDERS.reset(token)


class AdaptiveState(NamedTuple):
    """State of :func:`adaptive` (everything replicated except the residual).

    Attributes:
      level: int32 index into the compressor's ladder (``levels`` in its name).
      residual: ``PerDevice`` tuple of f32 error-feedback residuals, shared by all rungs.
      error_sum: f32, sum of the error signals of the current window's steps.
      window_steps: int32, steps in the current window.
      hold: int32, windows left before the ladder may be climbed again.
      strikes: int32, steps down for error since the last network step down (the hold
        after a step down for error is ``cooldown * 2**strikes``).
      comm_share: f32, the exposed communication share of the step time measured over the
        last window (``-1``: unknown), written by :func:`with_comm_share`.
      last_error: f32, the window-mean error of the last decision.
      last_reason: int32, why the last decision moved (index into :data:`REASONS`).
      window: int32, ``adjustment_step`` (constant; drivers read it to align windows).
    """

    level: jax.Array
    residual: Any
    error_sum: jax.Array
    window_steps: jax.Array
    hold: jax.Array
    strikes: jax.Array
    comm_share: jax.Array
    last_error: jax.Array
    last_reason: jax.Array
    window: jax.Array


class Controller(NamedTuple):
    """The decision rule of :func:`adaptive` (module docstring, steps 1-4), in ``jnp`` so
    that it runs inside the step and, for tests, on its own.

    Attributes:
      error_low, error_high: the error band.
      comm_low, comm_high: the communication-share band.
      cooldown: base hold (windows) after a step down for error.
    """

    error_low: float
    error_high: float
    comm_low: float
    comm_high: float
    cooldown: int

    def decide(
        self,
        level: jax.Array,
        hold: jax.Array,
        strikes: jax.Array,
        error: jax.Array,
        share: jax.Array,
        wire: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """One decision.

        Args:
          level, hold, strikes: as in :class:`AdaptiveState`.
          error: the window-mean error signal.
          share: the measured communication share (negative: unknown).
          wire: f32 ``(levels,)``, each rung's wire fraction.

        Returns:
          ``(level, hold, strikes, reason)``, int32 scalars; ``reason`` indexes
          :data:`REASONS`.
        """
        top = wire.shape[0] - 1
        known = share >= 0
        s = jnp.clip(share, 0.0, 1.0)
        r = wire[jnp.maximum(level - 1, 0)] / wire[level]
        below = s * r / jnp.maximum(s * r + 1.0 - s, 1e-12)  # predicted share one rung down
        down_err = (error > self.error_high) & (level > 0)
        down_net = ~down_err & known & (level > 0) & (below < self.comm_low)
        up = (
            ~down_err
            & ~down_net
            & (level < top)
            & (hold == 0)
            & (error < self.error_low)
            & (~known | (s > self.comm_high))
        )
        move = jnp.where(down_err | down_net, -1, jnp.where(up, 1, 0))
        reason = jnp.where(
            down_err, 1, jnp.where(down_net, 2, jnp.where(up, jnp.where(known, 2, 1), 0))
        )
        new_hold = jnp.where(
            down_err, self.cooldown * jnp.left_shift(1, strikes), jnp.maximum(hold - 1, 0)
        )
        new_strikes = jnp.where(
            down_err, jnp.minimum(strikes + 1, _MAX_STRIKES), jnp.where(down_net, 0, strikes)
        )
        i32 = jnp.int32
        return (
            (level + move).astype(i32),
            new_hold.astype(i32),
            new_strikes.astype(i32),
            reason.astype(i32),
        )


class _Rung(NamedTuple):
    name: str
    compression: float
    wire: Callable[[int], float]  # p -> wire fraction
    mean: Callable  # (c, ctx, key, i, seeds) -> (mean, sent); seeds: two_phase_seeds or None
    gathers: bool = False  # mean honours ctx.gather_axis (gathers its encoded payload)


def _parse_ratio(name: str, kind: str) -> float:
    try:
        r = float(name.split(":", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(
            f"ladder rung {name!r}: write {kind}:R with R the fraction sent, e.g. '{kind}:0.1'."
        ) from None
    return check_range(f"ladder rung {name!r}: ratio", r, 0.0, 1.0, low_open=True)


def _rung(name: str, block: int, method: str, switched: bool = True) -> _Rung:
    """Rung ``name``; ``switched``: it runs as a ``lax.switch`` branch, whose outputs are
    buffers already (a one-rung ladder has no switch: JAX inlines it). The int rungs
    round stochastically when their ``mean`` gets dither seeds, to nearest without."""
    if name == "f32":
        return _Rung(
            name, 0.0, lambda p: 1.0, lambda c, ctx, key, i, seeds: (
                sum_over(c, ctx.axes, ctx.algorithm) / axes_size(ctx.axes), c)
        )  # fmt: skip
    if name == "bf16":
        return _Rung(
            name, 0.5, lambda p: 0.5,
            lambda c, ctx, key, i, seeds: bf16_mean(c, ctx.axes, ctx.algorithm, "auto"),
        )  # fmt: skip
    if name in ("int8", "int4"):
        bits = int(name[3:])

        def quant(c, ctx, key, i, seeds):
            # with ctx.gather_axis the int8/int4 means travel over it quantized (gathers)
            mean, local = two_phase_mean(
                c.reshape(-1), ctx.axes, bits=bits, block=block, seeds=seeds,
                gather_axis=ctx.gather_axis, materialize=not switched,
            )  # fmt: skip
            return mean.reshape(c.shape if ctx.gather_axis is None else (-1,)), local.reshape(
                c.shape
            )

        frac = (bits / 8 + 4 / block) / 4
        return _Rung(name, dict(LADDER)[name], lambda p: frac, quant, gathers=True)
    kind = name.split(":", 1)[0]
    if kind == "topk":
        r = _parse_ratio(name, kind)

        def top(c, ctx, key, i, seeds):
            seed = dither_seed(key, lax.axis_index(ctx.axes), i)  # as topk() seeds it
            return topk_mean(c, ctx.axes, ratio=r, method=method, sample_ratio=0.01, seed=seed)

        return _Rung(f"topk:{r:g}", max(0.0, 1.0 - 2 * r), lambda p: p * r, top)
    if kind == "random_k":
        r = _parse_ratio(name, kind)

        def rand(c, ctx, key, i, seeds):
            k = jax.random.fold_in(key, i)  # shared: the same positions on every device
            return random_k_mean(c, ctx.axes, ctx.algorithm, ratio=r, key=k)

        return _Rung(f"random_k:{r:g}", 1.0 - r, lambda p: r, rand)
    raise ValueError(
        f"ladder rung {name!r} is not known; use {list(DEFAULT_LADDER)} or "
        f"{[f'{k}:R' for k in SPARSE]} (R the fraction sent, e.g. 'topk:0.1')."
    )


#: The sketch reads one row of ``sketch_size`` values in every ``_SKETCH_STRIDE``,
_SKETCH_STRIDE = 8
#: but keeps at least this many rows (a smaller buffer is sketched whole).
_SKETCH_MIN_ROWS = 64


def _sketch(x: jax.Array, seed: jax.Array, size: int) -> jax.Array:
    """``size`` signed bucket sums of a flat ``x``: bucket ``j mod size``, sign hashed from
    ``seed`` (a :func:`~jaxcomm.compression.quantize.dither_seed`).

    ``x`` is viewed as rows of ``size``; a large ``x`` is sketched on every
    ``_SKETCH_STRIDE``-th row only (at least ``_SKETCH_MIN_ROWS`` rows kept). The error
    is a ratio of two norms over the same rows, and a strided sample of a packed gradient
    covers every leaf in proportion; the whole sketch cost about 70 ms of a 1 s ResNet-18
    step on a CPU (docs/benchmarks.md, issue 12), the sample an eighth of that.
    """
    x = x.reshape(-1)
    rows = -(-x.shape[0] // size)
    x = jnp.pad(x, (0, rows * size - x.shape[0])).reshape(rows, size)
    x = x[:: min(_SKETCH_STRIDE, max(1, rows // _SKETCH_MIN_ROWS))]
    signs = jnp.where(seeded_uniform(seed, x.shape) < 0.5, -1.0, 1.0)
    return (x * signs).sum(0)


def error_of_mean(
    cs: Sequence[jax.Array],
    outs: Sequence[jax.Array],
    ctx: ReduceContext,
    *,
    sketch_size: int = 1021,
) -> jax.Array:
    """Estimated ``||out - mean_dev(c)|| / ||mean_dev(c)||`` over all buffers (module
    docstring, steps 1-3), the same on every device.

    Args:
      cs: per-device f32 buffers that were reduced (``g + e``).
      outs: the means the compressor returned for them (the same on every device of a
        ``ctx.axes`` group).
      ctx: the reduce context; the sums are reduced over ``decision_axes(ctx)``. With
        ``compress_stage='inter'`` every intra-node position holds its own shard: its
        signs differ, and the sum over it adds the shards' sketches.
      sketch_size: buckets per sketch; ``||x||^2`` is exact for buffers up to this size.

    Returns:
      f32 scalar, invariant over every data axis (0 when ``mean_dev(c)`` is zero).

    Example:
      >>> err = error_of_mean(cs, outs, ctx)   # inside a compressor's reduce
    """
    dec = decision_axes(ctx)
    others = tuple(a for a in dec if a not in ctx.axes)
    # one shard per position on the other axes: independent signs per shard
    salts = (0x5E7C, lax.axis_index(others)) if others else (0x5E7C,)
    num = jnp.zeros((sketch_size,), jnp.float32)
    den = jnp.zeros((sketch_size,), jnp.float32)
    for i, (c, o) in enumerate(zip(cs, outs, strict=True)):
        seed = dither_seed(ctx.key, *salts, i)
        num = num + _sketch(o.astype(jnp.float32) - c, seed, sketch_size)
        den = den + _sketch(c, seed, sketch_size)
    both = lax.psum(jnp.concatenate([num, den]), dec) / axes_size(ctx.axes)
    num, den = both[:sketch_size], both[sketch_size:]
    # Divide by max |den| so that huge finite gradients do not overflow the squares.
    scale = jnp.max(jnp.abs(den))
    scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0)
    n2 = jnp.sum(jnp.square(num / scale))
    d2 = jnp.sum(jnp.square(den / scale))
    return jnp.where(d2 > 0, jnp.sqrt(n2 / jnp.where(d2 > 0, d2, 1.0)), 0.0)


def adaptive_states(opt_state: Any) -> list[AdaptiveState]:
    """The :class:`AdaptiveState` nodes of ``opt_state`` (any pytree), in tree order.

    Example:
      >>> (ad,) = adaptive_states(state.opt_state)   # one adaptive compressor
      >>> int(ad.level)
    """
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, AdaptiveState))
    return [n for n in nodes if isinstance(n, AdaptiveState)]


def with_comm_share(opt_state: Any, share: jax.Array) -> Any:
    """``opt_state`` with ``share`` as the measured communication share of every
    :class:`AdaptiveState` in it.

    Called inside the step (``jaxcomm.data_parallel`` does, with the share that
    ``jaxcomm.CommProfiler.drive`` passes as an explicit input), so a measurement reaches
    the controller without a host round trip per step.

    Args:
      opt_state: an optimizer state (any pytree).
      share: f32 scalar in ``[0, 1]``, or negative for unknown; replicated.

    Returns:
      The new optimizer state.

    Example:
      >>> opt_state = with_comm_share(opt_state, share)   # inside the jitted step
    """

    def visit(node):
        if isinstance(node, AdaptiveState):
            return node._replace(comm_share=jnp.asarray(share, jnp.float32))
        return node

    return jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, AdaptiveState))


def _check_ladder(ladder: Sequence[str]) -> tuple[str, ...]:
    if isinstance(ladder, str) or not isinstance(ladder, Sequence) or not ladder:
        raise ValueError(
            f"ladder={ladder!r} must be a non-empty sequence of rung names, least "
            f"compression first, e.g. {DEFAULT_LADDER}."
        )
    return tuple(ladder)


def adaptive(
    initial_compression_ratio: float = 0.5,
    *,
    min_compression: float = 0.1,
    max_compression: float = 0.9,
    adjustment_step: int = 100,
    ladder: Sequence[str] = DEFAULT_LADDER,
    error_low: float = 0.05,
    error_high: float = 0.25,
    comm_low: float = 0.1,
    comm_high: float = 0.3,
    cooldown: int = 3,
    block: int = 256,
    stochastic: bool = True,
    topk_method: str = "auto",
    sketch_size: int = 1021,
) -> Compressor:
    """Adaptive compressor that walks a ladder of rungs (see the module docstring).

    Args:
      initial_compression_ratio: start at the rung nearest this compression (fraction of
        f32 bytes saved), in ``[min_compression, max_compression]``.
      min_compression: least compression allowed, in [0, 1].
      max_compression: most compression allowed, in [min_compression, 1].
      adjustment_step: steps per decision window (>= 1); ``CommProfiler.drive`` measures
        the step time over the same windows.
      ladder: rung names, least compression first (nominal compression strictly
        increasing): ``'f32'``, ``'bf16'``, ``'int8'``, ``'int4'``, ``'topk:R'``,
        ``'random_k:R'`` (``R`` the fraction of entries sent). Default
        :data:`DEFAULT_LADDER`; the rungs outside ``[min_compression,
        max_compression]`` are dropped.
      error_low: below this window-mean error the ladder may be climbed.
      error_high: above it the compressor steps down; ``0 < error_low < error_high``.
      comm_low: step down when the share predicted for the rung below is under this.
      comm_high: a measured share above this climbs; ``0 <= comm_low <= comm_high <= 1``.
      cooldown: windows without climbing after a step down for error (>= 0), doubled
        for every further step down for error (up to 64x).
      block: quantization block of the int8/int4 rungs (even, >= 2).
      stochastic: the int8/int4 rungs round stochastically (unbiased, keyed per device
        and step); ``False`` rounds to nearest. The shared residual feeds every rounding
        error into the next step, so nearest rounding loses nothing (error feedback,
        Seide et al. 2014; Karimireddy et al. 2019) and its error of the mean is about
        ``1/sqrt(2)`` of the stochastic one (variance ``d^2/12`` against up to ``d^2/6``
        for a step ``d``): on ResNet-18, int4 with ``block=64`` reads 0.18 against 0.27
        stochastic (0.34 at ``block=256``), inside the default ``error_high``
        (docs/benchmarks.md, issue 12).
      topk_method: selection of the top-k rungs ('auto', 'exact', 'sampled'; see
        :func:`~jaxcomm.compression.topk`).
      sketch_size: buckets of the error estimate (>= 16; relative spread about
        ``sqrt(2 / sketch_size)``).

    Returns:
      A :class:`~jaxcomm.compression.Compressor` with state :class:`AdaptiveState`.

    Raises:
      ValueError: a value out of range, an unknown or out-of-order rung,
        ``min_compression > max_compression``, or no rung inside
        ``[min_compression, max_compression]``.

    Example:
      >>> c = jaxcomm.compression.adaptive(
      ...     0.5, adjustment_step=20, ladder=('bf16', 'int8', 'int4', 'random_k:0.1'),
      ...     error_low=0.95, error_high=1.0)
      >>> tx = jaxcomm.sync_gradients(compression=c)
    """
    lo = check_range("min_compression", min_compression, 0.0, 1.0)
    hi = check_range("max_compression", max_compression, 0.0, 1.0)
    if lo > hi:
        raise ValueError(
            f"min_compression={min_compression} > max_compression={max_compression}; "
            "need 0 <= min_compression <= max_compression <= 1."
        )
    init_c = check_range(
        "initial_compression_ratio", initial_compression_ratio, lo, hi,
        fix="It must lie between min_compression and max_compression.",
    )  # fmt: skip
    adjustment_step = check_int("adjustment_step", adjustment_step, minimum=1)
    check_range("error_low", error_low, 0.0, float("inf"), low_open=True)
    check_range("error_high", error_high, error_low, float("inf"), low_open=True)
    check_range("comm_low", comm_low, 0.0, 1.0)
    check_range("comm_high", comm_high, comm_low, 1.0)
    cooldown = check_int("cooldown", cooldown, minimum=0)
    sketch_size = check_int("sketch_size", sketch_size, minimum=16, fix="e.g. 1021")
    if check_int("block", block, minimum=2, fix="an even number, e.g. 256") % 2:
        raise ValueError(f"block={block!r} must be an even int >= 2, e.g. 256.")
    if topk_method not in ("auto", "exact", "sampled"):
        raise ValueError(
            f"topk_method={topk_method!r} is not known; choose one of ['auto', 'exact', 'sampled']."
        )
    rungs = [_rung(n, block, topk_method) for n in _check_ladder(ladder)]
    for a, b in zip(rungs, rungs[1:], strict=False):
        if not a.compression < b.compression:
            raise ValueError(
                f"ladder={tuple(ladder)!r}: rung {b.name!r} (compression {b.compression:g}) "
                f"does not compress more than {a.name!r} ({a.compression:g}); list the rungs "
                "least compression first."
            )
    levels = [r for r in rungs if lo <= r.compression <= hi]
    if not levels:
        raise ValueError(
            f"no compression level lies in [min_compression={lo}, max_compression={hi}]; "
            f"the ladder is {dict((r.name, r.compression) for r in rungs)}. Widen the range."
        )
    if len(levels) == 1:  # no lax.switch: the rung's result must be made a buffer itself
        levels = [_rung(levels[0].name, block, topk_method, switched=False)]
    start = min(range(len(levels)), key=lambda i: abs(levels[i].compression - init_c))
    names = tuple(r.name for r in levels)
    control = Controller(float(error_low), float(error_high), float(comm_low), float(comm_high),
                         cooldown)  # fmt: skip

    def init(specs):
        f0, i0 = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        return AdaptiveState(
            level=jnp.asarray(start, jnp.int32),
            residual=ef.init_residuals(specs),
            error_sum=f0,
            window_steps=i0,
            hold=i0,
            strikes=i0,
            comm_share=jnp.asarray(-1.0, jnp.float32),
            last_error=f0,
            last_reason=i0,
            window=jnp.asarray(adjustment_step, jnp.int32),
        )

    def decision(state: AdaptiveState, p: int):
        """This step's ``(decide, level, hold, strikes, reason, window-mean error)``: the
        decision at the first step of a window, from the last window's error and the share
        measured over it (every input is replicated: one branch everywhere)."""
        wire = jnp.asarray([r.wire(p) for r in levels], jnp.float32)
        decide = state.window_steps >= adjustment_step
        mean_err = state.error_sum / jnp.maximum(state.window_steps, 1).astype(jnp.float32)
        level, hold, strikes, reason = control.decide(
            state.level, state.hold, state.strikes, mean_err, state.comm_share, wire
        )
        return decide, jnp.where(decide, level, state.level), hold, strikes, reason, mean_err

    def advance(state: AdaptiveState, d, residual: PerDevice, err: jax.Array) -> AdaptiveState:
        """The state after a step that took decision ``d`` and measured ``err``."""
        decide, level, hold, strikes, reason, mean_err = d
        f32, i32 = jnp.float32, jnp.int32
        zero_f, zero_i = jnp.zeros((), f32), jnp.zeros((), i32)
        as_i32 = lambda x: lax.bitcast_convert_type(x.astype(f32), i32)  # noqa: E731
        # The new scalar fields as one int32 vector (the f32 ones bit-cast, exactly), read
        # back at runtime indices: XLA:CPU compiles every scalar output as a kernel of its
        # own (~25 ms each), the vector as one, and its reads share one (issue 17).
        fields = jnp.stack([
            level.astype(i32),
            as_i32(jnp.where(decide, zero_f, state.error_sum) + err),
            jnp.where(decide, zero_i, state.window_steps) + 1,
            jnp.where(decide, hold, state.hold),
            jnp.where(decide, strikes, state.strikes),
            as_i32(jnp.where(decide, mean_err, state.last_error)),
            jnp.where(decide, reason, state.last_reason),
        ])  # fmt: skip
        # every entry is int32 (a float among them would promote the vector and round the
        # bit-cast floats)
        assert fields.dtype == i32, fields.dtype
        (lvl, err_sum, steps, hold, strikes, last_err, last_reason) = (
            lax.dynamic_index_in_dim(fields, k, keepdims=False) for k in runtime_ints(range(7))
        )
        as_f32 = lambda x: lax.bitcast_convert_type(x, f32)  # noqa: E731
        return AdaptiveState(
            level=lvl,
            residual=residual,
            error_sum=as_f32(err_sum),
            window_steps=steps,
            hold=hold,
            strikes=strikes,
            comm_share=state.comm_share,
            last_error=as_f32(last_err),
            last_reason=last_reason,
            window=state.window,
        )

    def on_f32(level: jax.Array) -> jax.Array:
        """Whether rung ``level`` is the exact ``'f32'`` rung (a replicated bool)."""
        return jnp.asarray([r.name == "f32" for r in levels])[level]

    def reduce(xs, state: AdaptiveState, ctx: ReduceContext):
        # 1. The decision (at the first step of a window).
        p = axes_size(ctx.axes)
        probe = _LADDERS.get()
        if probe is not None:
            probe.append(Ladder(names, [r.wire(p) for r in levels]))
        d = decision(state, p)
        # 2. Compress g + e with the rung; one shared residual.
        cs = ef.corrected(xs, state.residual)
        # The int rungs dither from the same seeds, hashed once before the switch (as
        # int8()/int4() hash them: a fixed rung sends the fixed compressor's bits).
        seeds = [None] * len(cs)
        if stochastic and any(r.name in ("int8", "int4") for r in levels):
            device = lax.axis_index(ctx.axes)
            seeds = [two_phase_seeds(ctx.key, device, i) for i in range(len(cs))]

        def branch(rung):
            def run(cs):
                pairs = [rung.mean(c, ctx, ctx.key, i, seeds[i]) for i, c in enumerate(cs)]
                means = [m for m, _ in pairs]
                if ctx.gather_axis is not None and not rung.gathers:
                    # gathers=True: every rung returns the node's means; the int rungs
                    # gather theirs quantized inside two_phase_mean, the others in f32
                    means = [all_gather_invariant(m, ctx.gather_axis) for m in means]
                # the residual inside the branch: it fuses with the kernel that computes
                # what was sent, where a ``sent`` output would be one more buffer pass
                return means, ef.new_residuals(cs, [s for _, s in pairs])

            return run

        out, residual = lax.switch(d[1], [branch(r) for r in levels], cs)
        # this device's own means (the sketch compares them with its own c)
        own = out
        if ctx.gather_axis is not None:
            at = lax.axis_index(ctx.gather_axis)
            own = [
                lax.dynamic_slice_in_dim(o, at * c.size, c.size)
                for o, c in zip(out, cs, strict=True)
            ]

        # 3. The error of the mean, over every data axis (not ctx.axes, the outer axes only
        #    with compress_stage='inter'): all devices must pick the same branch. Once,
        #    after the switch: a sketch per rung would be compiled once per rung (issue 17).
        #    The f32 rung's mean is exact (to f32 rounding, ~1e-7), so it skips the sketch,
        #    whose signs cost as much as a 1 Gbit/s all-reduce on a CPU (docs/benchmarks.md,
        #    issue 11).
        def sketched():
            return error_of_mean(cs, own, ctx, sketch_size=sketch_size)

        if "f32" in names:
            err = lax.cond(on_f32(d[1]), lambda: jnp.zeros((), jnp.float32), sketched)
        else:
            err = sketched()
        new = advance(state, d, residual, err)
        out = [o.astype(jnp.result_type(x)) for o, x in zip(out, xs, strict=True)]
        return out, new

    def exact(state: AdaptiveState, ctx: ReduceContext):
        # The 'f32' rung sends g + e whole: its mean is exact, the residual after it zero.
        d = decision(state, axes_size(ctx.axes))
        zeros = ef.init_residuals(state.residual.value)
        return on_f32(d[1]), list(state.residual.value), advance(state, d, zeros, jnp.zeros(()))

    return Compressor(
        f"adaptive[{','.join(names)}]", init, reduce,
        wire_fraction=1.0 - levels[0].compression,
        gathers=True,
        exact=exact if "f32" in names else None,
    )  # fmt: skip
