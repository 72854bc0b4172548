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

The elementwise compressors are built from one protocol, a :class:`BufferCodec`: the mean of
one flat buffer and what this device sent (``mean(c, ctx, i, seed) -> (mean, sent)``).
:func:`from_codec` makes a :class:`Compressor` of a codec, with error feedback as its one
option (the residual ``c - sent``); ``adaptive`` switches between the same codecs
(``bf16_codec``, ``int_codec``, ``topk_codec``, ...) that ``bf16()``, ``int8()``,
``topk()`` are made of.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import backend
from jaxcomm.collectives import ALGORITHMS, all_gather_invariant
from jaxcomm.compression import error_feedback as ef
from jaxcomm.compression.keys import no_seeds

__all__ = [
    "BufferCodec",
    "Compressor",
    "ReduceContext",
    "all_to_all_rows",
    "codec_means",
    "from_codec",
    "full_precision",
    "gather_means",
    "axes_size",
    "check_range",
    "decision_axes",
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
        (``keys.dither_seed(key, lax.axis_index(axes), ...)``: no threefry).
      data_axes: every data-parallel axis of the step (``()``: the same as ``axes``). With
        ``compress_stage='inter'``, ``axes`` are the outer axes only and each device of a
        node holds a different shard, so a decision that must be the same on every
        device (fp16's overflow skip, adaptive's level) is reduced over
        :func:`decision_axes`, never over ``axes`` alone.
      choice: the compressor's choice for this step, taken on the host by
        ``host_choice`` (a Python int: the program holds only that choice's branch); None:
        the compressor decides on the devices.
      gather_axis: after reducing over ``axes``, also all-gather the means over this
        (inner) axis, in its ``lax.axis_index`` order, so each device returns the whole
        buffer instead of its shard (``compress_stage='inter'``'s intra-node all-gather).
        A codec that can gathers its encoded payload (``BufferCodec.gathers``: cheaper
        than the decoded f32); :func:`gather_means` gathers the others' means.
    """

    axes: tuple[str, ...]
    algorithm: str
    step: jax.Array
    key: jax.Array
    data_axes: tuple[str, ...] = ()
    gather_axis: str | None = None
    choice: int | None = None


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
        An elementwise compressor honours ``ctx.gather_axis``: each returned mean is then
        the concatenation of the means of every device of that axis (``g`` times the
        length of the input shard), identical on every device of ``axes`` and
        ``gather_axis`` (:func:`from_codec` does; :func:`gather_means` for others).
      finite: optional ``finite(state) -> bool scalar``, False when the last ``reduce``
        overflowed (fp16); ``sync_gradients`` then zeroes the whole step's update.
      exact: optional ``exact(state, ctx) -> (is_exact, residual, state_after)`` for a
        compressor that sends some steps uncompressed (adaptive's ``'f32'`` rung):
        ``is_exact`` a bool scalar, the same on every device, True when this step's
        ``reduce`` would return the full-precision mean of ``xs + residual``;
        ``residual`` a list shaped like ``xs`` (per device; ``None``: nothing to add);
        ``state_after`` the state such a step leaves. ``sync_gradients`` (with
        ``compress_stage='all'``) then reduces the leaves themselves with its plain
        all-reduce, never packed into a buffer (on a CPU the packing copy costs as much as
        the all-reduce), and calls ``reduce`` only on the other steps (``lax.cond``).
      codec: the :class:`BufferCodec` it is made of (:func:`from_codec`); None for a
        compressor written whole (fp16, PowerSGD, adaptive).
      host_choice: optional ``host_choice(state, p) -> (choice, steps)`` for a compressor
        whose choice changes rarely (adaptive's rung): taken on the host from ``state``
        (the compressor state before a step, of which it reads replicated scalars only;
        the read waits for the step that produced them), ``p`` the devices over
        ``ctx.axes``. ``choice`` is this step's, ``steps`` how many steps it holds for,
        this one included, counting only steps that run ``reduce``; a step builder asks
        again after them and passes ``ctx.choice`` to ``reduce`` and ``exact``, whose
        programs then hold that choice's branch only. ``check_choice(state, choice)``
        raises if ``state`` (after a step) did not take ``choice``.
      check_choice: see ``host_choice``.
    """

    name: str
    init: Callable[[Sequence[Any]], Any]
    reduce: Callable[[list, Any, ReduceContext], tuple[list, Any]]
    elementwise: bool = True
    supports: Callable[[tuple[int, ...]], bool] = _any_shape
    finite: Callable[[Any], jax.Array] | None = None
    exact: Callable[[Any, ReduceContext], tuple[jax.Array, list | None, Any]] | None = None
    codec: BufferCodec | None = None
    host_choice: Callable[[Any, int], tuple[int, int]] | None = None
    check_choice: Callable[[Any, int], None] | None = None


class BufferCodec(NamedTuple):
    """One lossy mean of one flat buffer over ``ctx.axes``: what compressors are made of.

    Attributes:
      name: as written in an adaptive ladder, e.g. ``'int8'``, ``'topk:0.01'``.
      mean: ``mean(c, ctx, i, seed) -> (mean, sent)``: ``c`` this device's f32 buffer
        (number ``i`` of the step), ``seed`` its operand from ``seeds``; ``mean`` the
        same on every device (honouring ``ctx.gather_axis`` when ``gathers``), ``sent``
        what this device contributed, shaped like ``c``: the mean of ``sent`` over the
        devices is ``mean``, so error feedback on ``c - sent`` loses nothing.
      seeds: ``seeds(ctx, n) -> list``: the ``n`` buffers' random operands, computed
        before any mean (``jaxcomm.compression.keys``: ``no_seeds``, ``device_seeds``,
        ``two_phase_buffer_seeds``, ``shared_keys``), so that a switch over codecs
        hashes each kind once, outside its branches.
      wire: ``wire(p)``: bytes relative to an f32 all-reduce on ``p`` devices.
      compression: the nominal fraction of the f32 bytes saved (orders a ladder).
      gathers: ``mean`` all-gathers its encoded payload over ``ctx.gather_axis`` itself;
        the other codecs get ``ctx`` without it and their f32 means are gathered after.
      reduce_scatter: optional ``reduce_scatter(x, axis, seed) -> chunk`` for sharded
        optimizer state (``jaxcomm.sharded``): ``x`` a 1-D f32 buffer whose length divides
        by the size ``p`` of mesh axis ``axis``; returns the (approximate) mean over
        ``axis`` of this device's chunk ``lax.axis_index(axis)`` (length ``len(x) / p``),
        f32. ``seed`` a uint32 dither seed (per device, step, buffer and stage) or None.
      all_gather: optional ``all_gather(x, axes) -> full`` for sharded optimizer state's
        parameter gathers: ``x`` a 1-D f32 shard, encoded once, gathered over each axis of
        ``axes`` in order (tiled; the first axis innermost in the result) and decoded in
        f32 on every device alike (its owner too), so the result is typed invariant and
        bitwise equal on every device.
    """

    name: str
    mean: Callable[[jax.Array, ReduceContext, int, Any], tuple[jax.Array, jax.Array]]
    seeds: Callable[[ReduceContext, int], list] = no_seeds
    wire: Callable[[int], float] = lambda p: 1.0
    compression: float = 0.0
    gathers: bool = False
    reduce_scatter: Callable[[jax.Array, str, jax.Array | None], jax.Array] | None = None
    all_gather: Callable[[jax.Array, tuple[str, ...]], jax.Array] | None = None


def gather_means(means: list[jax.Array], ctx: ReduceContext) -> list[jax.Array]:
    """``means`` all-gathered over ``ctx.gather_axis`` (as they are without one)."""
    if ctx.gather_axis is None:
        return means
    return [all_gather_invariant(m, ctx.gather_axis) for m in means]


def codec_means(
    codec: BufferCodec, cs: list[jax.Array], ctx: ReduceContext, seeds: list, dtypes=None
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Every buffer's ``(mean, sent)`` by ``codec``, the means gathered over
    ``ctx.gather_axis`` (by the codec, encoded, where it ``gathers``; else after).

    Args:
      codec: the codec.
      cs: this device's f32 buffers (``g + e`` with error feedback).
      ctx: the sync's context.
      seeds: ``codec.seeds(ctx, len(cs))``, computed by the caller.
      dtypes: per buffer, the dtype of its mean (cast before a gather, which then moves
        that dtype); None keeps f32.

    Returns:
      ``(means, sents)``, one each per buffer.
    """
    inner = ctx if codec.gathers else ctx._replace(gather_axis=None)
    pairs = [codec.mean(c, inner, i, seeds[i]) for i, c in enumerate(cs)]
    means = [m for m, _ in pairs]
    if dtypes is not None:
        means = [m.astype(t) for m, t in zip(means, dtypes, strict=True)]
    if not codec.gathers:
        means = gather_means(means, ctx)
    return means, [s for _, s in pairs]


def from_codec(codec: BufferCodec, *, error_feedback: bool = False, name: str = "") -> Compressor:
    """The elementwise :class:`Compressor` of ``codec``, with or without error feedback.

    Each step, for this device's buffers ``x``:

    1. ``c = x + e`` in f32 (``e`` the residual; ``x`` alone without error feedback);
    2. the codec's ``(mean, sent)`` of every buffer (:func:`codec_means`);
    3. ``e <- c - sent`` (Seide et al. 2014; Karimireddy et al. 2019): what was not sent
       is added next step, so nothing is dropped;
    4. the means in the buffers' dtypes.

    Args:
      codec: the per-buffer mean.
      error_feedback: keep the residual (per device, ``jaxcomm.PerDevice``).
      name: the compressor's name (default: the codec's).

    Returns:
      A :class:`Compressor` whose state is the residuals (or ``()``).

    Raises:
      TypeError: ``codec`` is not a :class:`BufferCodec`.

    Example:
      >>> codec = int_codec(8, 256, stochastic=True)
      >>> tx = jaxcomm.sync_gradients(compression=from_codec(codec, error_feedback=True))
    """

    if not isinstance(codec, BufferCodec):
        raise TypeError(
            f"from_codec(codec={codec!r}): expected a BufferCodec, e.g. int_codec(8, 256, "
            "stochastic=True) or BufferCodec('name', mean); a compressor such as int8() is "
            "one already (pass it to sync_gradients(compression=...) as it is)."
        )

    def init(specs):
        return ef.init_residuals(specs) if error_feedback else ()

    def reduce(xs, state, ctx: ReduceContext):
        cs = ef.corrected(xs, state if error_feedback else None)
        dtypes = [jnp.result_type(x) for x in xs]
        out, sent = codec_means(codec, cs, ctx, codec.seeds(ctx, len(cs)), dtypes)
        return out, ef.new_residuals(cs, sent) if error_feedback else state

    return Compressor(name or codec.name, init, reduce, codec=codec)


def full_precision() -> BufferCodec:
    """The f32 mean by the sync's all-reduce algorithm; ``c`` is sent whole."""

    def mean(c, ctx, i, seed):
        return sum_over(c, ctx.axes, ctx.algorithm) / axes_size(ctx.axes), c

    return BufferCodec("f32", mean)


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

    Where the backend row says ``all_to_all_rows_at_runtime_offsets`` (XLA:CPU) the rows
    are first cut at runtime offsets, so that its per-device operands compile as one
    kernel (``jaxcomm.backend``): the same collective, operands and bytes.

    Args:
      x: per-device payload (inside ``jax.shard_map``), ``p`` rows over ``axes``.
      axes: mesh axes of the exchange.

    Returns:
      ``(p, ...)``: row ``j`` is row ``i`` of device ``j``'s payload on device ``i``.
    """
    if backend.current().all_to_all_rows_at_runtime_offsets:
        x = backend.rows_at_runtime_offsets(x)
    return lax.all_to_all(x, axes, 0, 0, tiled=True)


def axes_size(axes: tuple[str, ...]) -> int:
    """Number of devices over ``axes`` (inside shard_map)."""
    return int(np.prod([lax.axis_size(a) for a in axes]))


def sum_over(x: jax.Array, axes: tuple[str, ...], algorithm: str) -> jax.Array:
    """Sums a 1-D ``x`` over ``axes`` with the registered all-reduce ``algorithm``."""
    return ALGORITHMS[algorithm](x, axes)


def as_f32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def sum_rows(x: jax.Array) -> jax.Array:
    """Sum over the first axis as ``len(x) - 1`` elementwise adds, in index order, the axis
    kept (of size 1).

    ``jnp.sum(x, axis=0)`` over a few long rows is a reduction kernel on XLA:CPU that
    does not fuse its producer, while the adds fuse with the dequantization before them
    and the re-quantization after them; and on rows received by an all-to-all a
    reduction needs them concatenated first (a copy of the payload), where the adds read
    each received row where it lies.

    The rows are added as ``(1, ...)`` slices, never squeezed: with ``x[r]`` every add
    meets a reshape, which XLA's reshape-mover moves past one add per round of its
    simplification pipeline, so the pipeline would run once more per row.

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
