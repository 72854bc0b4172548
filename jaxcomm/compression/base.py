"""The compressor protocol shared by every gradient compressor in ``jaxcomm.compression``.

A compressor is an immutable :class:`Compressor` (a NamedTuple of functions, optax style)
that *pairs a lossy encoding with the collective that really moves fewer bytes*: bf16 is
summed by an all-reduce in bf16, int8 goes through an all-to-all and an all-gather of
int8 chunks, top-k through an all-gather of (index, value) pairs, PowerSGD through two
small all-reduces. ``reduce`` is called inside ``jax.shard_map`` on the per-device values
and returns the (approximate) **mean** over the data-parallel devices.

``sync_gradients(compression=...)`` decides which gradient leaves are compressed and hands
them to ``reduce``: elementwise compressors (``elementwise=True``) receive flat 1-D
buffers (all compressed leaves of one dtype concatenated, or buckets), matrix compressors
(PowerSGD) receive the leaves themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.collectives import ALGORITHMS
from jaxcomm.packing import runtime_ints

__all__ = [
    "Compressor",
    "ReduceContext",
    "all_to_all_rows",
    "axes_size",
    "check_range",
    "decision_axes",
    "lowbias32",
    "step_key",
    "sum_over",
    "sum_rows",
]


class ReduceContext(NamedTuple):
    """What a compressor's ``reduce`` gets besides the buffers and its state.

    Attributes:
      axes: mesh axes to reduce over, outermost first.
      algorithm: the all-reduce algorithm name for all-reduce-compatible payloads.
      step: int32 scalar, the number of synchronised steps before this one.
      key: a PRNG key that is the **same on every device** (derived from the sync seed and
        ``step``); hash it with the device's index for per-device randomness
        (``quantize.dither_seed(key, lax.axis_index(axes), ...)``: no threefry).
      data_axes: every data-parallel axis of the step (``()``: the same as ``axes``). With
        ``compress_stage='inter'``, ``axes`` are the outer axes only and each device of a
        node holds a different shard, so a decision that must be the same on every
        device (fp16's overflow skip, adaptive's level) is reduced over
        :func:`decision_axes`, never over ``axes`` alone.
      gather_axis: only for compressors with ``gathers=True``: after reducing over
        ``axes``, also all-gather the means over this (inner) axis, in its
        ``lax.axis_index`` order, so each device returns the whole buffer instead of its
        shard. The compressor gathers its encoded payload, which is cheaper than gathering
        the decoded f32 (``compress_stage='inter'``'s intra-node all-gather).
    """

    axes: tuple[str, ...]
    algorithm: str
    step: jax.Array
    key: jax.Array
    data_axes: tuple[str, ...] = ()
    gather_axis: str | None = None


def decision_axes(ctx: ReduceContext) -> tuple[str, ...]:
    """The axes over which a compressor reduces the signals of a shared decision: all data
    axes of the step, so that every device takes the same decision (same ``lax.switch``
    branch, same skip)."""
    return ctx.data_axes or ctx.axes


def _any_shape(shape: tuple[int, ...]) -> bool:
    del shape
    return True


class Compressor(NamedTuple):
    """A gradient compressor paired with its collective.

    Attributes:
      name: short name for tables and errors, e.g. ``'int8'``.
      init: ``init(specs) -> state`` where ``specs`` is a list of
        ``jax.ShapeDtypeStruct`` (or arrays) shaped like the buffers ``reduce`` will get.
        Per-device parts (error-feedback residuals) are wrapped in ``jaxcomm.PerDevice``.
      reduce: ``reduce(xs, state, ctx) -> (means, state)``: ``xs`` a list of per-device
        arrays, ``ctx`` a :class:`ReduceContext`; ``means`` the approximate mean over
        ``ctx.axes``, same shapes and dtypes as ``xs``, identical on every device.
      elementwise: accepts any flat 1-D buffer (concatenated leaves, buckets).
      supports: ``supports(shape) -> bool``; leaves it refuses stay uncompressed.
      finite: optional ``finite(state) -> bool scalar``, False when the last ``reduce``
        overflowed (fp16); ``sync_gradients`` then zeroes the whole step's update.
      wire_fraction: nominal payload this device contributes, relative to the f32 buffer
        (0.5 for bf16, 2 x ratio for top-k's index + value pairs, NaN where it depends on
        shapes); documentation only -- measured bytes come from ``jaxcomm.wire_bytes``.
      gathers: ``reduce`` honours ``ctx.gather_axis``: each returned mean is then the
        concatenation of the means of every device of that axis (``g`` times the length of
        the input shard), identical on every device of ``axes`` and ``gather_axis``.
      exact: optional ``exact(state, ctx) -> (is_exact, residual, state_after)`` for a
        compressor that sends some steps uncompressed (adaptive's ``'f32'`` rung):
        ``is_exact`` a bool scalar, the same on every device, True when this step's
        ``reduce`` would return the full-precision mean of ``xs + residual``;
        ``residual`` a list shaped like ``xs`` (per device; ``None``: nothing to add);
        ``state_after`` the state such a step leaves. ``sync_gradients`` (with
        ``compress_stage='all'``) then reduces the leaves themselves with its plain
        all-reduce, never packed into a buffer (on a CPU the packing copy costs as much as
        the all-reduce), and calls ``reduce`` only on the other steps (``lax.cond``).
    """

    name: str
    init: Callable[[Sequence[Any]], Any]
    reduce: Callable[[list, Any, ReduceContext], tuple[list, Any]]
    elementwise: bool = True
    supports: Callable[[tuple[int, ...]], bool] = _any_shape
    finite: Callable[[Any], jax.Array] | None = None
    wire_fraction: float = 1.0
    gathers: bool = False
    exact: Callable[[Any, ReduceContext], tuple[jax.Array, list | None, Any]] | None = None


def check_range(
    name: str,
    value: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
) -> float:
    """Raises ValueError unless ``low (<|<=) value (<|<=) high``; the message says which."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number.") from None
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    if not (ok_low and ok_high) or math.isnan(v):
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        tail = f" {fix}" if fix else ""
        raise ValueError(f"{name}={value!r} is out of range; allowed {lo}{low}, {high}{hi}.{tail}")
    return v


def all_to_all_rows(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``lax.all_to_all(x, axes, 0, 0, tiled=True)`` of a ``(p, ...)`` payload: device ``i``
    receives row ``i`` of every device, in device order.

    XLA:CPU runs an all-to-all as one operand per device, each cut from ``x`` by a slice
    at a constant offset, and compiles every such slice as a kernel of its own: 8 kernels
    per payload shape on 8 devices, 24 of adaptive's 131 on ResNet-152 (issue 17). On the
    CPU backend the rows are therefore cut at runtime offsets
    (:func:`jaxcomm.packing.runtime_ints`: one ``dynamic_slice`` kernel for all rows) and
    concatenated; XLA's own cuts of that concatenation fold back to the rows. The same
    collective, operands and bytes; other backends run the plain all-to-all.
    """
    if jax.default_backend() == "cpu" and x.shape[0] > 1:
        size = (1, *x.shape[1:])
        starts = runtime_ints(range(x.shape[0]))
        zeros = (0,) * (x.ndim - 1)
        x = jnp.concatenate(
            [lax.dynamic_slice(x, (i, *zeros), size, allow_negative_indices=False) for i in starts]
        )
    return lax.all_to_all(x, axes, 0, 0, tiled=True)


def axes_size(axes: tuple[str, ...]) -> int:
    """Number of devices over ``axes`` (inside shard_map)."""
    return int(np.prod([lax.axis_size(a) for a in axes]))


def lowbias32(h: jax.Array) -> jax.Array:
    """An integer hash with a low avalanche bias on uint32 (Wellons, "Prospecting for hash
    functions", 2018: the ``lowbias32`` constants); a bijection on uint32."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def step_key(seed: int, step: jax.Array) -> jax.Array:
    """The PRNG key of ``sync_gradients``' step ``step`` (:attr:`ReduceContext.key`).

    The words of ``jax.random.key(seed)`` (no generator runs) each hashed with the step
    and their lane: ``w_l = lowbias32(lowbias32(w_l ^ lowbias32(step ^ 0x9E3779B9)) ^ l)``,
    wrapped as a key of the default implementation. ``jax.random.fold_in`` would run
    threefry (20 rounds), which XLA:CPU compiles into a few scalar kernels of its own in
    every compressed sync (issue 17); a key only needs words that differ per step and look
    independent, and whatever draws from it (``jax.random`` or
    :func:`~jaxcomm.compression.quantize.dither_seed`) mixes them further.

    Args:
      seed: ``sync_gradients``' seed.
      step: int32 scalar, the number of synchronised steps before this one.

    Returns:
      A PRNG key (``jax.random.key``'s implementation), the same on every device.
    """
    base = jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)
    mix = lowbias32(jnp.asarray(step).astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    lanes = lax.iota(jnp.uint32, base.size).reshape(base.shape)
    return jax.random.wrap_key_data(lowbias32(lowbias32(base ^ mix) ^ lanes))


def sum_over(x: jax.Array, axes: tuple[str, ...], algorithm: str) -> jax.Array:
    """Sums a 1-D ``x`` over ``axes`` with the registered all-reduce ``algorithm``."""
    return ALGORITHMS[algorithm](x, axes)


def as_f32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def sum_rows(x: jax.Array) -> jax.Array:
    """Sum over the first axis as ``len(x) - 1`` elementwise adds, in index order, the axis
    kept (of size 1).

    ``jnp.sum(x, axis=0)`` over a few long rows is a reduction kernel on XLA:CPU (a
    YNNPACK fusion) that does not fuse its producer: it was the largest kernel of an int8
    step (2 rows of 2.9M dequantized values: 24-36 ms against 3.9 ms for the adds, which
    fuse with the dequantization and the re-quantization after it), and on rows received
    by an all-to-all it needs them concatenated first (a copy of the payload), where the
    adds read each received row where it lies.

    The rows are added as ``(1, ...)`` slices, never squeezed: with ``x[r]`` every add
    met a reshape, which XLA's reshape-mover moves past one add per round of its
    simplification pipeline, so the pipeline ran once more per row (7 more rounds of
    every simplification pass per int8/int4 mean on 8 devices, issue 17).

    Args:
      x: array ``(p, ...)`` with ``p >= 1``.

    Returns:
      ``x[0] + x[1] + ... + x[p - 1]`` (in that order), shaped ``(1, ...)``.

    Raises:
      ValueError: ``x`` has no rows.

    Example:
      >>> shard = sum_rows(decoded) / p   # the mean of the p received chunks
    """
    if jnp.ndim(x) < 1 or x.shape[0] < 1:
        raise ValueError(f"sum_rows: x needs at least one row, got shape {jnp.shape(x)}.")
    acc = x[:1]
    for r in range(1, x.shape[0]):
        acc = acc + x[r : r + 1]
    return acc
