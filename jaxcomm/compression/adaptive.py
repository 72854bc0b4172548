"""Adaptive compression: a ladder of codecs, one rung per step, chosen from the error and
the measured network.

The compressor holds a level index (the *rung*) into a ladder of codecs, least compression
first (default :data:`DEFAULT_LADDER`: ``('f32', 'bf16', 'int8', 'int4')``). The step
builders of jaxcomm run one program per rung, chosen on the host (``host_choice``: the
state's rung, read once per window; ``jaxcomm.phase_clock``), so the step holds no
conditional for it; called without that choice (under a plain ``jit``, inside
``lax.scan``, the profiler's driven step) it runs the rung through ``lax.switch``, one
compiled branch per rung (``jaxcomm.wire_bytes`` then counts the largest branch). Every
``adjustment_step`` steps a :class:`Controller` moves the level by at most one rung, from
two signals that are the same on every device:

* the **error of the mean** the optimizer receives, estimated by a count sketch
  (:func:`error_of_mean`: one small all-reduce, no gradient moved);
* the **communication share** of the step time, measured outside the step
  (``jaxcomm.CommProfiler.drive``) and written into the state between steps by
  :func:`with_comm_share` (``-1``: unknown).

All rungs share one per-device error-feedback residual ``e``: every rung sends
``C(g + e)`` and keeps ``e <- g + e - sent``, so switching rungs never drops gradient.

**The rungs**, each with its nominal *compression* (fraction of the f32 bytes saved) and
its *wire fraction* (bytes relative to an f32 all-reduce on ``p`` devices, which the
network rule uses):

========================  =================  ==========================================
rung                      compression        wire fraction on ``p`` devices
========================  =================  ==========================================
``'f32'``                 0                  1
``'bf16'``                0.5                0.5
``'int8'`` / ``'int4'``   0.75 / 0.875       ``(bits/8 + 4/block) / 4`` (two-phase)
``'topk:R'``              ``1 - 2R``         ``p R`` (all-gather of index/value pairs)
``'random_k:R'``          ``1 - R``          ``R`` (all-reduce of shared-seed values)
========================  =================  ==========================================

Each rung reduces as the fixed compressor of that name does (``bf16()``,
``int8(block, stochastic)``, ``topk(R, method=topk_method)``, ...), with the shared
residual as its error feedback. Under ``sync_gradients`` (``compress_stage='all'``)
the ``'f32'`` rung's steps are an uncompressed sync of the leaves plus the residual
(``Compressor.exact``). Sparse rungs leave most of each step's gradient in the
residual by design: their error reads 0.3-0.95, so a ladder with them needs
``error_low``/``error_high`` above that, or the error rule steps down at once.

Reading order: :func:`adaptive` (the factory), ``_reduce`` (one step: decision, rung
switch, error of the mean, new state), :class:`Controller` (the rule),
:func:`error_of_mean` (the signal), :func:`ladder` (rung names and wire fractions, for
drivers and logs).

References:
  Agarwal et al., "Accordion: Adaptive Gradient Communication via Critical Learning
  Regime Identification" (MLSys 2021); Abdelmoniem et al., "An Efficient Statistical-based
  Gradient Compression Technique for Distributed Training Systems" (MLSys 2021);
  Charikar, Chen & Farach-Colton, "Finding Frequent Items in Data Streams" (ICALP 2002:
  the count sketch); Seide et al., "1-Bit Stochastic Gradient Descent and its Application
  to Data-Parallel Distributed Training of Speech DNNs" (Interspeech 2014) and Karimireddy
  et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML 2019:
  error feedback, and biased rounding with it, ``stochastic=False``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import backend
from jaxcomm.compression import error_feedback as ef
from jaxcomm.compression.base import (
    BufferCodec,
    Compressor,
    ReduceContext,
    axes_size,
    check_range,
    codec_means,
    decision_axes,
    full_precision,
)
from jaxcomm.compression.cast import bf16_codec
from jaxcomm.compression.keys import dither_seed, seeded_uniform
from jaxcomm.compression.quantize import int_codec
from jaxcomm.compression.sparse import random_k_codec, topk_codec
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
    "error_sketch",
    "ladder",
    "map_adaptive",
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


class Ladder(tuple):
    """The rung names of one adaptive compressor (a tuple), with ``wire``: each rung's wire
    fraction (bytes relative to an f32 all-reduce) on the compressor's reduce axes."""

    wire: tuple[float, ...]

    def __new__(cls, names: Sequence[str], wire: Sequence[float]):
        out = super().__new__(cls, names)
        out.wire = tuple(float(w) for w in wire)
        return out


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
    """The decision rule of :func:`adaptive`, in ``jnp`` so that it runs inside the step
    and, for tests, on its own.

    At the first step of every window, from the window-mean error ``e`` and the share
    ``s`` measured over the previous window (at the current rung):

    1. ``e > error_high``: one rung down (reason *error*); no climbing for
       ``cooldown * 2**strikes`` windows, then ``strikes += 1`` (at most 6): a rung that
       is too lossy is retried ever more rarely.
    2. else, ``s`` known and the share predicted one rung down is ``< comm_low``: one
       rung down (reason *network*; ``strikes`` reset). The prediction scales the
       measured communication time by the rungs' wire fractions:
       ``s' = s r / (s r + 1 - s)``, ``r = wire[level - 1] / wire[level]``.
    3. else, ``e < error_low``, no hold, and ``s > comm_high`` (reason *network*) or
       ``s`` unknown (reason *error*): one rung up.
    4. else stay. ``hold`` decreases by one every window.

    Hysteresis: both bands are dead zones, and the down move compares the *predicted*
    share of the rung below with ``comm_low``. After a climb (``s > comm_high``) the rung
    below is predicted at about ``s``, above ``comm_low``, so the controller does not step
    straight back; after a descent the share is about its prediction, below
    ``comm_high``, so it does not climb straight back. This holds while the prediction
    errs by less than ``comm_high / comm_low`` (3x by default).

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
        """One decision (steps 1-4 of the class docstring).

        Args:
          level, hold, strikes: as in :class:`AdaptiveState`.
          error: the window-mean error signal.
          share: the measured communication share (negative: unknown).
          wire: f32 ``(levels,)``, each rung's wire fraction.

        Returns:
          ``(level, hold, strikes, reason)``, int32 scalars; ``reason`` indexes
          :data:`REASONS`.

        Example:
          >>> control = Controller(0.05, 0.25, 0.1, 0.3, cooldown=3)
          >>> level, hold, strikes, reason = control.decide(
          ...     jnp.int32(1), jnp.int32(0), jnp.int32(0), jnp.float32(0.01),
          ...     jnp.float32(0.6), jnp.asarray([1.0, 0.5, 0.25]))   # climbs to 2
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


# -- the rungs --------------------------------------------------------------------------
# Each rung is the BufferCodec of a public compressor: 'f32' the plain mean
# (base.full_precision), 'bf16' bf16()'s, 'int8'/'int4' int8()/int4()'s, 'topk:R'
# topk(R)'s, 'random_k:R' random_k(R)'s (with the shared residual, unscaled).


def _parse_ratio(name: str, kind: str) -> float:
    try:
        r = float(name.split(":", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(
            f"ladder rung {name!r}: write {kind}:R with R the fraction sent, e.g. '{kind}:0.1'."
        ) from None
    return check_range(f"ladder rung {name!r}: ratio", r, 0.0, 1.0, low_open=True)


def _rung(name: str, block: int, topk_method: str, stochastic: bool) -> BufferCodec:
    """The codec of the rung named ``name`` (``'f32'``, ``'bf16'``, ``'int8'``,
    ``'int4'``, ``'topk:R'``, ``'random_k:R'``)."""
    if name == "f32":
        return full_precision()
    if name == "bf16":
        return bf16_codec()
    if name in ("int8", "int4"):
        return int_codec(int(name[3:]), block, stochastic=stochastic)
    kind = name.split(":", 1)[0]
    if kind == "topk":
        return topk_codec(_parse_ratio(name, kind), method=topk_method)
    if kind == "random_k":
        return random_k_codec(_parse_ratio(name, kind))
    raise ValueError(
        f"ladder rung {name!r} is not known; use {list(DEFAULT_LADDER)} or "
        f"{[f'{k}:R' for k in SPARSE]} (R the fraction sent, e.g. 'topk:0.1')."
    )


# -- the error of the mean --------------------------------------------------------------
#: The sketch reads one row of ``sketch_size`` values in every ``_SKETCH_STRIDE``,
_SKETCH_STRIDE = 8
#: but keeps at least this many rows (a smaller buffer is sketched whole).
_SKETCH_MIN_ROWS = 64


def error_sketch(x: jax.Array, seed: jax.Array, size: int) -> jax.Array:
    """``size`` signed bucket sums of a flat ``x``: bucket ``j mod size``, sign hashed from
    ``seed`` (a :func:`~jaxcomm.compression.keys.dither_seed`).

    ``x`` is viewed as rows of ``size``; a large ``x`` is sketched on every
    ``_SKETCH_STRIDE``-th row only (at least ``_SKETCH_MIN_ROWS`` rows kept). The error
    is a ratio of two norms over the same rows, and a strided sample of a packed gradient
    covers every leaf in proportion, at a fraction of the cost of the whole sketch.
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
    """Estimated ``||out - mean_dev(c)|| / ||mean_dev(c)||`` over all buffers, the same on
    every device, without moving the gradient (an exact ``mean_dev(c)`` would be the f32
    all-reduce that compression avoids).

    1. Each device folds its ``out - c`` and its ``c`` into ``sketch_size`` buckets:
       element ``j`` goes to bucket ``j mod sketch_size`` with a random sign ``+-1``
       hashed from a seed shared by all devices (:func:`error_sketch`; a buffer of more than
       ``64 x sketch_size`` elements is folded on a strided sample of its rows, the same
       rows for both).
    2. One all-reduce of the ``2 x sketch_size`` sums over every data axis: the sketch is
       linear, so the sums are the sketches of ``out - mean_dev(c)`` and ``mean_dev(c)``.
    3. ``E ||sketch(x)||^2 = ||x||^2`` (independent signs), so the ratio of the two
       sketch norms estimates the error, with a relative spread of about
       ``sqrt(2 / sketch_size)`` (Charikar et al. 2002).

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
        num = num + error_sketch(o.astype(jnp.float32) - c, seed, sketch_size)
        den = den + error_sketch(c, seed, sketch_size)
    both = lax.psum(jnp.concatenate([num, den]), dec) / axes_size(ctx.axes)
    num, den = both[:sketch_size], both[sketch_size:]
    # Divide by max |den| so that huge finite gradients do not overflow the squares.
    scale = jnp.max(jnp.abs(den))
    scale = jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0)
    n2 = jnp.sum(jnp.square(num / scale))
    d2 = jnp.sum(jnp.square(den / scale))
    return jnp.where(d2 > 0, jnp.sqrt(n2 / jnp.where(d2 > 0, d2, 1.0)), 0.0)


# -- the compressor ---------------------------------------------------------------------
class _Config(NamedTuple):
    """One adaptive compressor: the checked arguments of :func:`adaptive`.

    ``Compressor.init``/``reduce``/``exact`` are ``functools.partial`` s of ``_init``,
    ``_reduce`` and ``_exact`` over it, so that :func:`ladder` can read it back.
    """

    rungs: tuple[BufferCodec, ...]  # the ladder within [min_compression, max_compression]
    start: int  # the first level
    window: int  # adjustment_step
    control: Controller
    stochastic: bool
    sketch_size: int


def _check_ladder(ladder: Sequence[str]) -> tuple[str, ...]:
    if isinstance(ladder, str) or not isinstance(ladder, Sequence) or not ladder:
        raise ValueError(
            f"ladder={ladder!r} must be a non-empty sequence of rung names, least "
            f"compression first, e.g. {DEFAULT_LADDER}."
        )
    return tuple(ladder)


def _levels(
    ladder: Sequence[str], lo: float, hi: float, block: int, topk_method: str, stochastic: bool
) -> tuple[BufferCodec, ...]:
    """The rungs of ``ladder`` whose compression lies in ``[lo, hi]``.

    Raises:
      ValueError: an unknown or out-of-order rung, or none in ``[lo, hi]``.
    """
    rungs = [_rung(n, block, topk_method, stochastic) for n in _check_ladder(ladder)]
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
    return tuple(levels)


def _check_compression(initial: float, low: float, high: float) -> tuple[float, float, float]:
    """``(min_compression, max_compression, initial_compression_ratio)`` as floats, checked:
    ``0 <= low <= initial <= high <= 1``."""
    lo = check_range("min_compression", low, 0.0, 1.0)
    hi = check_range("max_compression", high, 0.0, 1.0)
    if lo > hi:
        raise ValueError(
            f"min_compression={low} > max_compression={high}; "
            "need 0 <= min_compression <= max_compression <= 1."
        )
    init_c = check_range(
        "initial_compression_ratio", initial, lo, hi,
        fix="It must lie between min_compression and max_compression.",
    )  # fmt: skip
    return lo, hi, init_c


def _check_bands(
    error_low: float, error_high: float, comm_low: float, comm_high: float, cooldown: int
) -> Controller:
    check_range("error_low", error_low, 0.0, float("inf"), low_open=True)
    check_range("error_high", error_high, error_low, float("inf"), low_open=True)
    check_range("comm_low", comm_low, 0.0, 1.0)
    check_range("comm_high", comm_high, comm_low, 1.0)
    cooldown = check_int("cooldown", cooldown, minimum=0)
    return Controller(float(error_low), float(error_high), float(comm_low), float(comm_high),
                      cooldown)  # fmt: skip


def _check_codecs(block: int, topk_method: str) -> None:
    if check_int("block", block, minimum=2, fix="an even number, e.g. 256") % 2:
        raise ValueError(f"block={block!r} must be an even int >= 2, e.g. 256.")
    if topk_method not in ("auto", "exact", "sampled"):
        raise ValueError(
            f"topk_method={topk_method!r} is not known; choose one of ['auto', 'exact', 'sampled']."
        )


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
    """Adaptive compressor that walks a ladder of codecs (see the module docstring).

    The rungs and their wire fractions are in the module docstring.

    Args:
      initial_compression_ratio: start at the rung nearest this compression, in
        ``[min_compression, max_compression]``.
      min_compression: least compression allowed, in [0, 1].
      max_compression: most compression allowed, in [min_compression, 1].
      adjustment_step: steps per decision window (>= 1); ``CommProfiler.drive`` measures
        the step time over the same windows.
      ladder: rung names, least compression first (nominal compression strictly
        increasing), from the table above (``R`` the fraction of entries sent). The rungs
        outside ``[min_compression, max_compression]`` are dropped.
      error_low: below this window-mean error the ladder may be climbed.
      error_high: above it the compressor steps down; ``0 < error_low < error_high``.
      comm_low: step down when the share predicted for the rung below is under this.
      comm_high: a measured share above this climbs; ``0 <= comm_low <= comm_high <= 1``.
      cooldown: windows without climbing after a step down for error (>= 0), doubled
        for every further step down for error (up to 64x).
      block: quantization block of the int8/int4 rungs (even, >= 2).
      stochastic: the int8/int4 rungs round stochastically (unbiased, keyed per device
        and step); ``False`` rounds to nearest. The shared residual feeds every rounding
        error into the next step, so nearest rounding loses nothing (Seide et al. 2014;
        Karimireddy et al. 2019), and its error of the mean is about ``1/sqrt(2)`` of the
        stochastic one (variance ``d^2/12`` against up to ``d^2/6`` for a step ``d``).
      topk_method: selection of the top-k rungs ('auto', 'exact', 'sampled'; see
        :func:`~jaxcomm.compression.topk`).
      sketch_size: buckets of the error estimate (>= 16; relative spread about
        ``sqrt(2 / sketch_size)``).

    Returns:
      A :class:`~jaxcomm.compression.Compressor` named ``adaptive[<rungs>]`` with state
      :class:`AdaptiveState`.

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
    lo, hi, init_c = _check_compression(initial_compression_ratio, min_compression,
                                        max_compression)  # fmt: skip
    adjustment_step = check_int("adjustment_step", adjustment_step, minimum=1)
    control = _check_bands(error_low, error_high, comm_low, comm_high, cooldown)
    sketch_size = check_int("sketch_size", sketch_size, minimum=16, fix="e.g. 1021")
    _check_codecs(block, topk_method)
    levels = _levels(ladder, lo, hi, block, topk_method, bool(stochastic))
    start = min(range(len(levels)), key=lambda i: abs(levels[i].compression - init_c))
    cfg = _Config(levels, start, adjustment_step, control, bool(stochastic), sketch_size)
    names = [r.name for r in levels]
    exact = functools.partial(_exact, cfg) if "f32" in names else None
    init, reduce = functools.partial(_init, cfg), functools.partial(_reduce, cfg)
    return Compressor(
        f"adaptive[{','.join(names)}]",
        init,
        reduce,
        exact=exact,
        host_choice=functools.partial(_host_choice, cfg),
        check_choice=_check_choice,
    )


def _init(cfg: _Config, specs: Sequence[Any]) -> AdaptiveState:
    """``Compressor.init``: the start level, zero residuals, an empty window."""
    f0, i0 = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
    return AdaptiveState(
        level=jnp.asarray(cfg.start, jnp.int32),
        residual=ef.init_residuals(specs),
        error_sum=f0,
        window_steps=i0,
        hold=i0,
        strikes=i0,
        comm_share=jnp.asarray(-1.0, jnp.float32),
        last_error=f0,
        last_reason=i0,
        window=jnp.asarray(cfg.window, jnp.int32),
    )


class _Decision(NamedTuple):
    """This step's decision (every field replicated: one switch branch everywhere)."""

    decide: jax.Array  # bool: the step opens a window, the controller decided
    level: jax.Array  # the rung this step runs
    hold: jax.Array  # the controller's outputs (used where ``decide``)
    strikes: jax.Array
    reason: jax.Array
    mean_error: jax.Array  # the closed window's mean error


def _decision(cfg: _Config, state: AdaptiveState, p: int) -> _Decision:
    """The decision at the first step of a window, from the last window's mean error and
    the share measured over it (``p``: devices over the reduce axes, for the wire
    fractions); the current level on the other steps."""
    wire = jnp.asarray([r.wire(p) for r in cfg.rungs], jnp.float32)
    decide = state.window_steps >= cfg.window
    mean_err = state.error_sum / jnp.maximum(state.window_steps, 1).astype(jnp.float32)
    level, hold, strikes, reason = cfg.control.decide(
        state.level, state.hold, state.strikes, mean_err, state.comm_share, wire
    )
    level = jnp.where(decide, level, state.level)
    return _Decision(decide, level, hold, strikes, reason, mean_err)


def _advance(
    state: AdaptiveState, d: _Decision, residual: PerDevice, err: jax.Array
) -> AdaptiveState:
    """The state after a step that took decision ``d`` and measured error ``err``: a new
    window where ``d.decide``, else this step's error added to the current one."""
    new = AdaptiveState(
        level=d.level.astype(jnp.int32),
        residual=residual,
        error_sum=(jnp.where(d.decide, 0.0, state.error_sum) + err).astype(jnp.float32),
        window_steps=jnp.where(d.decide, 0, state.window_steps) + 1,
        hold=jnp.where(d.decide, d.hold, state.hold),
        strikes=jnp.where(d.decide, d.strikes, state.strikes),
        comm_share=state.comm_share,
        last_error=jnp.where(d.decide, d.mean_error, state.last_error).astype(jnp.float32),
        last_reason=jnp.where(d.decide, d.reason, state.last_reason),
        window=state.window,
    )
    return _scalars_in_one_vector(new) if backend.current().runtime_offsets else new


_SCALARS = ("level", "error_sum", "window_steps", "hold", "strikes", "last_error", "last_reason")


def _scalars_in_one_vector(state: AdaptiveState) -> AdaptiveState:
    """``state`` with the same values, its new scalars read back out of one int32 vector at
    runtime indices (the backend row's ``runtime_offsets``): XLA:CPU compiles every scalar
    output of a step as a kernel of its own, the vector as one and its reads as one. The
    f32 fields travel bit-cast, exactly."""
    f32, i32 = jnp.float32, jnp.int32
    fields = [getattr(state, k) for k in _SCALARS]
    words = jnp.stack([
        lax.bitcast_convert_type(x, i32) if x.dtype == f32 else x.astype(i32) for x in fields
    ])  # fmt: skip
    assert words.dtype == i32, words.dtype  # a float would promote and round the words
    reads = [
        lax.dynamic_index_in_dim(words, k, keepdims=False)
        for k in backend.runtime_ints(range(len(fields)))
    ]
    back = {
        k: lax.bitcast_convert_type(w, f32) if x.dtype == f32 else w
        for k, x, w in zip(_SCALARS, fields, reads, strict=True)
    }
    return state._replace(**back)


def _on_f32(cfg: _Config, level: jax.Array | int) -> jax.Array | bool:
    """Whether rung ``level`` is the exact ``'f32'`` rung (a replicated bool; a Python
    bool for a level chosen on the host)."""
    if isinstance(level, int):
        return cfg.rungs[level].name == "f32"
    return jnp.asarray([r.name == "f32" for r in cfg.rungs])[level]


def _host_scalar(x: Any) -> Any:
    """The value of a replicated scalar leaf (or of its first row, where a front end
    holds it once per device), as a numpy scalar; waits for the step that wrote it."""
    return np.asarray(jax.device_get(x)).reshape(-1)[0]


def _host_choice(cfg: _Config, state: AdaptiveState, p: int) -> tuple[int, int]:
    """``Compressor.host_choice``: the rung of the step that starts from ``state``, and
    for how many steps it holds.

    1. Inside a window (``window_steps < adjustment_step``) the rung is the state's, and
       it holds until the window ends: read once per window, not per step.
    2. At a window's first step, the controller's decision (:func:`_decision`, the same
       function the step runs) on the state's scalars, computed on the host's CPU: the
       step computes it again from the same values and writes its level into the state,
       which :func:`_check_choice` compares at the next read.
    """
    names = ("level", "window_steps", "error_sum", "hold", "strikes", "comm_share")
    values = jax.device_get(tuple(getattr(state, k) for k in names))  # one wait
    read = {k: np.asarray(v).reshape(-1)[0] for k, v in zip(names, values, strict=True)}
    steps = int(read["window_steps"])
    if steps < cfg.window:
        return int(read["level"]), cfg.window - steps
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        d = _decision(cfg, state._replace(**read), p)
        return int(d.level), cfg.window


def _check_choice(state: AdaptiveState, choice: int) -> None:
    """``Compressor.check_choice``: raises if the step that wrote ``state`` ran a rung
    other than ``choice`` (the host's decision and the step's disagreed)."""
    level = int(_host_scalar(state.level))
    if level != choice:
        raise RuntimeError(
            f"adaptive: the host chose rung {choice} for a step whose own decision was "
            f"rung {level}; the host's copy of the controller disagrees with the step's. "
            "This is a bug in jaxcomm: please report it with the compressor's arguments."
        )


def _switch(
    cfg: _Config, level: jax.Array | int, cs: list[jax.Array], ctx: ReduceContext
) -> tuple[list[jax.Array], PerDevice]:
    """Rung ``level``'s means of ``cs`` (``g + e``) and the new shared residual.

    1. The rungs' random operands (``BufferCodec.seeds``), each kind hashed once before
       the switch, as the fixed compressors hash them: a rung sends what the fixed
       compressor would, and the branches get them as operands.
    2. ``lax.switch`` over the rungs; each branch computes every buffer's
       ``(mean, sent)`` with its codec (``codec_means``: means gathered over
       ``ctx.gather_axis``, so every branch returns the same shapes), and returns the
       residual ``c - sent``. The residual is computed inside the branch, where it fuses
       with the kernel that computes ``sent``. A branch's outputs are buffers already:
       the branches are traced under the backend row without ``materialize`` (one rung
       is no switch, and keeps the row).
    """
    seeds: dict[Any, list] = {}
    for rung in cfg.rungs:
        if rung.seeds not in seeds:
            seeds[rung.seeds] = rung.seeds(ctx, len(cs))

    def branch(rung: BufferCodec) -> Callable:
        def run(cs):
            means, sent = codec_means(rung, cs, ctx, seeds[rung.seeds])
            return means, ef.new_residuals(cs, sent)

        return run

    branches = [branch(r) for r in cfg.rungs]
    if len(branches) == 1:  # lax.switch calls a lone branch directly
        return branches[0](cs)
    if isinstance(level, int):  # chosen on the host: that rung alone, as a fixed compressor
        return branches[level](cs)
    with backend.use(dataclasses.replace(backend.current(), materialize=False)):
        return lax.switch(level, branches, cs)


def _own_means(outs: list[jax.Array], cs: list[jax.Array], ctx: ReduceContext) -> list:
    """This device's own means in ``outs`` (with ``ctx.gather_axis`` each holds every
    device of that axis: the slice at this device's index), to compare with its ``cs``."""
    if ctx.gather_axis is None:
        return outs
    at = lax.axis_index(ctx.gather_axis)
    return [lax.dynamic_slice_in_dim(o, at * c.size, c.size) for o, c in zip(outs, cs, strict=True)]


def _reduce(
    cfg: _Config, xs: list[jax.Array], state: AdaptiveState, ctx: ReduceContext
) -> tuple[list[jax.Array], AdaptiveState]:
    """``Compressor.reduce``: one step.

    1. The decision (at the first step of a window; :func:`_decision`).
    2. Compress ``c = g + e`` with this step's rung (:func:`_switch`); one shared residual.
    3. The error of the mean (:func:`error_of_mean`), once after the switch, over every
       data axis (not ``ctx.axes``, the outer axes only with ``compress_stage='inter'``):
       every device must take the same decision. The ``'f32'`` rung's mean is exact (to
       f32 rounding), so its error is 0 and its steps skip the sketch (a ``lax.cond``).
    4. The new state (:func:`_advance`); the means cast back to the buffers' dtypes.
    """
    d = _decision(cfg, state, axes_size(ctx.axes))
    level = d.level if ctx.choice is None else ctx.choice  # the host's: one rung, no switch
    cs = ef.corrected(xs, state.residual)
    out, residual = _switch(cfg, level, cs, ctx)
    own = _own_means(out, cs, ctx)

    def sketched() -> jax.Array:
        return error_of_mean(cs, own, ctx, sketch_size=cfg.sketch_size)

    if ctx.choice is not None:
        err = jnp.zeros((), jnp.float32) if _on_f32(cfg, level) else sketched()
    elif any(r.name == "f32" for r in cfg.rungs):
        err = lax.cond(_on_f32(cfg, d.level), lambda: jnp.zeros((), jnp.float32), sketched)
    else:
        err = sketched()
    new = _advance(state, d, residual, err)
    out = [o.astype(jnp.result_type(x)) for o, x in zip(out, xs, strict=True)]
    return out, new


def _exact(
    cfg: _Config, state: AdaptiveState, ctx: ReduceContext
) -> tuple[jax.Array, list[jax.Array], AdaptiveState]:
    """``Compressor.exact``: whether this step runs the ``'f32'`` rung, which sends
    ``g + e`` whole (the residual to add), and the state after such a step (its mean is
    exact, its error 0, the residual after it zero)."""
    d = _decision(cfg, state, axes_size(ctx.axes))
    zeros = ef.init_residuals(state.residual.value)
    return (
        _on_f32(cfg, d.level if ctx.choice is None else ctx.choice),
        list(state.residual.value),
        _advance(state, d, zeros, jnp.zeros(())),
    )


# -- for drivers and logs ---------------------------------------------------------------
def ladder(compressor: Compressor, devices: int) -> Ladder | None:
    """The rung names and wire fractions of an adaptive compressor; None for any other.

    The state holds the level as an index; this names it, and gives the wire fractions
    that ``jaxcomm.CommProfiler.drive`` scales measured times with.

    Args:
      compressor: any :class:`~jaxcomm.compression.Compressor` (e.g. the one passed as
        ``sync_gradients(compression=...)``).
      devices: devices over the axes the compressor reduces over (with
        ``compress_stage='inter'``, the outer axes only); the top-k rungs' wire fraction
        grows with it.

    Returns:
      A :class:`Ladder` (the rung names, with ``wire``), or None when ``compressor`` was
      not made by :func:`adaptive`.

    Raises:
      ValueError: ``devices < 1``.

    Example:
      >>> ladder(adaptive(), 8)
      ('bf16', 'int8', 'int4')
      >>> ladder(adaptive(), 8).wire
      (0.5, 0.25390625, 0.12890625)
    """
    reduce = getattr(compressor, "reduce", None)
    if not (isinstance(reduce, functools.partial) and reduce.func is _reduce):
        return None
    devices = check_int("devices", devices, minimum=1)
    cfg: _Config = reduce.args[0]
    return Ladder([r.name for r in cfg.rungs], [r.wire(devices) for r in cfg.rungs])


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
    share = jnp.asarray(share, jnp.float32)
    return map_adaptive(opt_state, lambda node: node._replace(comm_share=share))


def map_adaptive(opt_state: Any, fn: Callable[[AdaptiveState], AdaptiveState]) -> Any:
    """``opt_state`` (any pytree) with ``fn`` applied to each :class:`AdaptiveState` in it.

    Example:
      >>> opt_state = map_adaptive(opt_state, lambda a: a._replace(hold=jnp.int32(0)))
    """
    is_adaptive = lambda x: isinstance(x, AdaptiveState)  # noqa: E731
    visit = lambda x: fn(x) if is_adaptive(x) else x  # noqa: E731
    return jax.tree.map(visit, opt_state, is_leaf=is_adaptive)
