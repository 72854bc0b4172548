"""Adaptive compression: a discrete ladder of levels chosen from all-device signals.

The compressor holds one level index; every step it compresses with that level, through
``lax.switch`` (one compiled branch per level, no host round trip, works under ``jit``
and inside ``lax.scan``; ``jaxcomm.wire_bytes`` counts the largest branch).

**Ladder** (fraction of f32 bytes *saved* = "compression"): ``f32`` 0.0, ``bf16`` 0.5,
``int8`` 0.75, ``int4`` 0.875 (blockwise, two-phase; see ``quantize.py``). The levels
whose compression lies in ``[min_compression, max_compression]`` form the ladder; the
start is the one nearest ``initial_compression_ratio``. All levels share one per-device
error-feedback residual, so switching levels never drops gradient.

**Signals**, reduced with ``pmean`` over *every* data axis of the step (also with
``compress_stage='inter'``, where the compressed reduction spans the outer axes only) so
every device sees the same numbers and picks the same level:

* ``error``: the relative norm of the residual, ``||c - C(c)|| / ||c||`` with ``c = g + e``,
  averaged over the window of ``adjustment_step`` steps;
* ``comm_ratio``: communication time / computation time, when the user measured it on
  the host and stored it with :func:`set_comm_ratio` (``-1`` = unknown).

**Rule**, applied at the end of every window of ``adjustment_step`` steps:

1. ``error > error_high``: one level *less* compression, and ``hold <- cooldown``.
2. else, if ``comm_ratio`` is known and ``< comm_low`` (communication is cheap): one
   level less compression.
3. else, if ``error < error_low``, ``hold == 0`` and (``comm_ratio`` unknown or
   ``> comm_high``): one level *more* compression.
4. else stay. ``hold`` decreases by one every window.

**Hysteresis**: the error band ``[error_low, error_high]`` and the comm band
``[comm_low, comm_high]`` are dead zones (no move), and after a move down for too much
error the ladder is not climbed again for ``cooldown`` windows, so a level that is just
over the error bound cannot make the ladder oscillate every window.

References:
  Agarwal et al., "Accordion: Adaptive Gradient Communication via Critical Learning
  Regime Identification" (MLSys 2021); Abdelmoniem et al., "An Efficient Statistical-based
  Gradient Compression Technique for Distributed Training Systems" (MLSys 2021).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.compression import error_feedback as ef
from jaxcomm.compression.base import (
    Compressor,
    ReduceContext,
    axes_size,
    check_range,
    decision_axes,
    device_key,
    sum_over,
)
from jaxcomm.compression.cast import bf16_mean
from jaxcomm.compression.quantize import two_phase_mean
from jaxcomm.validate import check_int

__all__ = ["LADDER", "AdaptiveState", "adaptive", "set_comm_ratio"]

# (name, compression = fraction of f32 bytes saved)
LADDER: tuple[tuple[str, float], ...] = (
    ("f32", 0.0),
    ("bf16", 0.5),
    ("int8", 0.75),
    ("int4", 0.875),
)


class AdaptiveState(NamedTuple):
    """State of :func:`adaptive` (everything replicated except the residual).

    Attributes:
      level: int32 index into the compressor's ladder (``levels`` in its name).
      residual: ``PerDevice`` tuple of f32 error-feedback residuals.
      error_sum: f32, sum of the pmean-ed relative errors in the current window.
      window_steps: int32, steps in the current window.
      hold: int32, windows left before the ladder may be climbed again.
      comm_ratio: f32, measured communication/computation time ratio (-1: unknown).
      last_error: f32, the window-mean error of the last decision (for logging).
    """

    level: jax.Array
    residual: Any
    error_sum: jax.Array
    window_steps: jax.Array
    hold: jax.Array
    comm_ratio: jax.Array
    last_error: jax.Array


def _level_fn(name: str, block: int):
    def f32(cs, ctx):
        n = axes_size(ctx.axes)
        return [sum_over(c, ctx.axes, ctx.algorithm) / n for c in cs], list(cs)

    def bf16(cs, ctx):
        pairs = [bf16_mean(c, ctx.axes, ctx.algorithm, "auto") for c in cs]
        return [m for m, _ in pairs], [s for _, s in pairs]

    def quant(bits):
        def f(cs, ctx):
            key = device_key(ctx.key, ctx.axes)
            out, sent = [], []
            for i, c in enumerate(cs):
                mean, local = two_phase_mean(
                    c.reshape(-1), ctx.axes, bits=bits, block=block, key=jax.random.fold_in(key, i)
                )
                out.append(mean.reshape(c.shape))
                sent.append(local.reshape(c.shape))
            return out, sent

        return f

    return {"f32": f32, "bf16": bf16, "int8": quant(8), "int4": quant(4)}[name]


def adaptive(
    initial_compression_ratio: float = 0.5,
    min_compression: float = 0.1,
    max_compression: float = 0.9,
    adjustment_step: int = 100,
    *,
    error_low: float = 0.05,
    error_high: float = 0.25,
    comm_low: float = 0.1,
    comm_high: float = 0.3,
    cooldown: int = 3,
    block: int = 256,
) -> Compressor:
    """Adaptive compressor that walks a ladder of levels (see the module docstring).

    Args:
      initial_compression_ratio: start at the ladder level nearest this compression
        (fraction of f32 bytes saved), in ``[min_compression, max_compression]``.
      min_compression: least compression allowed, in [0, 1].
      max_compression: most compression allowed, in [min_compression, 1].
      adjustment_step: steps per decision window (>= 1).
      error_low: below this window-mean relative error the ladder may be climbed.
      error_high: above it the compressor steps down; ``0 < error_low < error_high``.
      comm_low: a measured comm/compute ratio below this steps down.
      comm_high: a measured comm/compute ratio above this allows climbing;
        ``0 <= comm_low <= comm_high``.
      cooldown: windows without climbing after a step down for error (>= 0).
      block: quantization block for the int8/int4 levels (even, >= 2).

    Returns:
      A :class:`~jaxcomm.compression.Compressor` with state :class:`AdaptiveState`.

    Raises:
      ValueError: a value out of range, ``min_compression > max_compression``, or no
        ladder level inside ``[min_compression, max_compression]``.

    Example:
      >>> c = jaxcomm.compression.adaptive(0.5, min_compression=0.1, max_compression=0.9,
      ...                                  adjustment_step=100)
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
    check_range("error_low", error_low, 0.0, 1.0, low_open=True)
    check_range("error_high", error_high, error_low, float("inf"), low_open=True)
    check_range("comm_low", comm_low, 0.0, float("inf"))
    check_range("comm_high", comm_high, comm_low, float("inf"))
    cooldown = check_int("cooldown", cooldown, minimum=0)
    if check_int("block", block, minimum=2, fix="an even number, e.g. 256") % 2:
        raise ValueError(f"block={block!r} must be an even int >= 2, e.g. 256.")
    levels = [(n, c) for n, c in LADDER if lo <= c <= hi]
    if not levels:
        raise ValueError(
            f"no compression level lies in [min_compression={lo}, max_compression={hi}]; "
            f"the ladder is {dict(LADDER)}. Widen the range."
        )
    start = min(range(len(levels)), key=lambda i: abs(levels[i][1] - init_c))
    fns = [_level_fn(n, block) for n, _ in levels]
    top = len(levels) - 1

    def init(specs):
        f0, i0 = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        return AdaptiveState(
            level=jnp.asarray(start, jnp.int32),
            residual=ef.init_residuals(specs),
            error_sum=f0,
            window_steps=i0,
            hold=i0,
            comm_ratio=jnp.asarray(-1.0, jnp.float32),
            last_error=f0,
        )

    def reduce(xs, state: AdaptiveState, ctx: ReduceContext):
        cs = ef.corrected(xs, state.residual)
        branches = [lambda cs, f=f: f(cs, ctx) for f in fns]
        out, sent = lax.switch(state.level, branches, cs)
        # Over every data axis (not ctx.axes, the outer axes only with
        # compress_stage='inter'): all devices must pick the same lax.switch branch.
        err = lax.pmean(ef.relative_error(cs, sent), decision_axes(ctx))
        err_sum = state.error_sum + err
        steps = state.window_steps + 1
        decide = steps >= adjustment_step
        mean_err = err_sum / steps.astype(jnp.float32)
        known = state.comm_ratio >= 0
        down_err = mean_err > error_high
        down_comm = known & (state.comm_ratio < comm_low)
        up = (mean_err < error_low) & (state.hold == 0) & (~known | (state.comm_ratio > comm_high))
        move = jnp.where(down_err | down_comm, -1, jnp.where(up, 1, 0))
        level = jnp.clip(state.level + move, 0, top).astype(jnp.int32)
        hold = jnp.where(down_err, cooldown, jnp.maximum(state.hold - 1, 0)).astype(jnp.int32)
        new = AdaptiveState(
            level=jnp.where(decide, level, state.level),
            residual=ef.new_residuals(cs, sent),
            error_sum=jnp.where(decide, 0.0, err_sum),
            window_steps=jnp.where(decide, 0, steps).astype(jnp.int32),
            hold=jnp.where(decide, hold, state.hold),
            comm_ratio=state.comm_ratio,
            last_error=jnp.where(decide, mean_err, state.last_error),
        )
        out = [o.astype(jnp.result_type(x)) for o, x in zip(out, xs, strict=True)]
        return out, new

    names = ",".join(n for n, _ in levels)
    return Compressor(f"adaptive[{names}]", init, reduce, wire_fraction=1.0 - levels[0][1])


def set_comm_ratio(opt_state: Any, ratio: float) -> Any:
    """Stores a host-measured communication/computation time ratio in every adaptive state.

    Call it between steps (e.g. from ``jaxcomm.CommProfiler`` numbers); the next decision
    window uses it. Returns a new optimizer state (the old one is not modified).

    Example:
      >>> state = state._replace(opt_state=set_comm_ratio(state.opt_state, 0.8))
    """

    def visit(node):
        if isinstance(node, AdaptiveState):
            old = node.comm_ratio
            new = jnp.asarray(ratio, jnp.float32)
            if isinstance(old, jax.Array) and hasattr(old, "sharding"):
                new = jax.device_put(new, old.sharding)
            return node._replace(comm_ratio=new)
        return node

    return jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, AdaptiveState))
