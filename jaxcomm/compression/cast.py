"""Half-precision casts: ``bf16()`` and ``fp16()``, summed by an all-reduce in 16 bits.

Both halve the bytes of an f32 all-reduce and stay all-reduce compatible, so they run
through any registered algorithm (flat, hierarchical, ...) in the low precision.

* **bf16** keeps f32's exponent range, so it cannot overflow; it loses mantissa bits
  (relative error <= 2^-8 per element before the sum). It is a bf16 all-reduce through
  the configured algorithm (NCCL sums bf16 natively). XLA:CPU has no bf16 reductions: it
  promotes a bf16 all-reduce to f32 (the HLO shows ``f32`` all-reduces with
  ``*_promoted`` reducers), so the wire would carry 32 bits. Where the backend row's
  ``bf16_route`` is ``'all_to_all'`` (a CPU mesh; ``jaxcomm.backend``) bf16 therefore
  takes the two-phase route of the quantizers: an all-to-all of bf16 chunks (as raw 16-bit words),
  a local f32 sum, and an all-gather of the bf16 mean: the same ``(p-1)/p 2N`` bytes as
  a bf16 all-reduce, really in 16 bits. The two routes round differently (the two-phase
  mean is rounded to bf16 once, after an f32 sum), within bf16's precision.
* **fp16** has 3 more mantissa bits but a maximum of 65504. Following Horovod's
  ``gradient_predivide_factor``, each device divides by the world size *before* the cast,
  so the sum is the mean and only a mean above 65504 (or one pre-divided value above it)
  overflows. **Choice: skip and count** (like ``optax.apply_if_finite``). When the summed
  result holds an inf or NaN on any device (one ``pmin`` over every data axis of the
  step, so that with ``compress_stage='inter'``, where each device of a node sums a
  different shard, all devices still take one decision), ``sync_gradients`` returns an
  all-zero gradient for the whole step (every leaf, compressed or not) and
  ``Fp16State.overflow_steps`` is incremented. The update is never a silent inf.
  ``jaxcomm.data_parallel`` then skips the step whole, as ``optax.apply_if_finite`` does:
  params and optimizer state (momentum, Adam's moments, schedule counts, the sync's
  ``count``) stay as they were, and only the ``Fp16State`` counters move; the decision is
  the counter, which every device holds alike. Outside ``data_parallel`` (your own
  ``shard_map``) a zero gradient reaches the transforms after the sync: exact for plain
  SGD, but momentum and weight decay still move the params; compare ``overflow_steps``
  before and after the update and keep the old params and state where it grew.

References:
  Micikevicius et al., "Mixed Precision Training" (ICLR 2018); Horovod ``Compression.fp16``
  and ``gradient_predivide_factor``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm import backend, deprecated
from jaxcomm.collectives import all_gather_invariant
from jaxcomm.compression.base import (
    BufferCodec,
    Compressor,
    ReduceContext,
    all_to_all_rows,
    as_f32,
    axes_size,
    decision_axes,
    from_codec,
    gather_means,
    sum_over,
    sum_rows,
)

__all__ = [
    "Fp16State",
    "bf16",
    "bf16_all_gather",
    "bf16_codec",
    "bf16_exchange_mean",
    "bf16_mean",
    "bf16_reduce_scatter",
    "fp16",
]


def bf16_exchange_mean(x: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Mean of a 1-D ``x`` over ``axes``; bf16 on the wire in an all-to-all + all-gather.

    1. pad to ``p`` chunks, cast to bf16 and bitcast to uint16 (no backend can promote
       raw words); 2. all-to-all: device ``i`` gets chunk ``i`` of everyone; 3. sum in
    f32, divide by ``p``, cast to bf16; 4. all-gather the mean chunks.

    Returns:
      ``(mean, sent)`` as in ``quantize.two_phase_mean``: ``mean_devices(sent) == mean``.
    """
    p = axes_size(axes)
    n = x.shape[0]
    m = -(-n // p)
    xf = as_f32(x)
    if p * m > n:
        xf = jnp.pad(xf, (0, p * m - n))
    lo = xf.reshape(p, m).astype(jnp.bfloat16)
    words = all_to_all_rows(lax.bitcast_convert_type(lo, jnp.uint16), axes)
    # (1, m) from here on; the rows summed by adds (sum_rows), which fuse with their
    # decoding straight from the received rows
    chunk = sum_rows(as_f32(lax.bitcast_convert_type(words, jnp.bfloat16))) / p
    chunk_lo = chunk.astype(jnp.bfloat16)
    full = all_gather_invariant(lax.bitcast_convert_type(chunk_lo[0], jnp.uint16), axes)
    i = lax.axis_index(axes)
    sent = as_f32(lo)
    own = lax.dynamic_slice_in_dim(sent, i, 1)
    sent = lax.dynamic_update_slice(sent, own + p * (as_f32(chunk_lo) - chunk), (i, 0))
    return as_f32(lax.bitcast_convert_type(full, jnp.bfloat16))[:n], sent.reshape(-1)[:n]


def bf16_reduce_scatter(x: jax.Array, axis: str) -> jax.Array:
    """Reduce-scatter with bf16 on the wire: chunks cast to bf16 (as raw 16-bit words),
    all-to-all over ``axis``, summed in f32 and divided by the axis size ``p``.

    Returns:
      The f32 mean over ``axis`` of chunk ``lax.axis_index(axis)`` (``len(x) / p``).
    """
    p = lax.axis_size(axis)
    lo = as_f32(x).reshape(p, -1).astype(jnp.bfloat16)
    words = all_to_all_rows(lax.bitcast_convert_type(lo, jnp.uint16), (axis,))
    return (sum_rows(as_f32(lax.bitcast_convert_type(words, jnp.bfloat16))) / p)[0]


def bf16_all_gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """All-gather with bf16 on the wire: the shard cast to bf16 once, its 16-bit words
    gathered over each axis of ``axes`` in order, decoded to f32 on every device alike."""
    words = lax.bitcast_convert_type(as_f32(x).astype(jnp.bfloat16), jnp.uint16)
    for a in axes:
        words = all_gather_invariant(words, a)
    return as_f32(lax.bitcast_convert_type(words, jnp.bfloat16))


def bf16_mean(x: jax.Array, axes: tuple[str, ...], algorithm: str) -> tuple[jax.Array, jax.Array]:
    """Mean over ``axes`` with bf16 on the wire, by the backend row's ``bf16_route``: a
    bf16 all-reduce through ``algorithm``, or (XLA:CPU, which would sum a bf16 all-reduce
    in f32) the two-phase :func:`bf16_exchange_mean` (module docstring).

    Returns:
      ``(mean, sent)``; on the all-reduce route the bf16 sum's own rounding is not in
      ``sent`` (the backend sums in bf16), so error feedback is then approximate.
    """
    if backend.current().bf16_route == "all_to_all":
        mean, sent = bf16_exchange_mean(jnp.ravel(x), axes)
        return mean.reshape(jnp.shape(x)), sent.reshape(jnp.shape(x))
    lo = jnp.asarray(x).astype(jnp.bfloat16)
    s = sum_over(lo, axes, algorithm)
    return as_f32(s) / axes_size(axes), as_f32(lo)


def bf16(*, via: str | None = None) -> Compressor:
    """Casts to bfloat16 and sums in bfloat16 (2x fewer bytes than f32): a bf16
    all-reduce through the configured algorithm, or on a CPU mesh, whose bf16 all-reduce
    runs in f32, an all-to-all + all-gather of bf16 words (module docstring).

    Args:
      via: deprecated since 0.2.0 and ignored (it warns): the route is the platform's
        (``jaxcomm.backend``).

    Returns:
      A stateless :class:`~jaxcomm.compression.Compressor`.

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.bf16())
    """
    _deprecated_via("bf16", via)
    return from_codec(bf16_codec())


def _deprecated_via(name: str, via: str | None) -> None:
    if via is not None:
        deprecated.warn(
            f"jaxcomm.compression.{name}(via={via!r})",
            f"jaxcomm.compression.{name}() (the route is the platform's: jaxcomm.backend)",
            stacklevel=4,
        )


def bf16_codec(*, via: str | None = None) -> BufferCodec:
    """:func:`bf16`'s per-buffer mean (:func:`bf16_mean`), also an adaptive rung.
    ``via``: deprecated and ignored, as :func:`bf16`'s."""
    _deprecated_via("bf16_codec", via)

    def mean(c, ctx, i, seed):
        return bf16_mean(c, ctx.axes, ctx.algorithm)

    return BufferCodec(
        "bf16",
        mean,
        wire=lambda p: 0.5,
        compression=0.5,
        reduce_scatter=lambda x, axis, seed: bf16_reduce_scatter(x, axis),
        all_gather=bf16_all_gather,
    )


class Fp16State(NamedTuple):
    """State of :func:`fp16`.

    Attributes:
      overflow_steps: int32, steps whose fp16 sum overflowed and were skipped.
      finite: bool, whether the last step's sum was finite (replicated).
    """

    overflow_steps: jax.Array
    finite: jax.Array

    def skipped_since(self, before: Fp16State) -> jax.Array:
        """Whether the step from ``before`` overflowed, and so was skipped (its counter
        moved): ``jaxcomm.compression.skip.SkipsSteps``."""
        return self.overflow_steps > before.overflow_steps


def fp16() -> Compressor:
    """Pre-divides by the world size, casts to float16, all-reduces in float16.

    On overflow the step is skipped and counted (see the module docstring).

    Returns:
      A :class:`~jaxcomm.compression.Compressor` with state :class:`Fp16State`.

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.fp16())
      >>> # later: opt_state[0].compression.overflow_steps
    """

    def init(specs):
        del specs
        return Fp16State(jnp.zeros((), jnp.int32), jnp.ones((), jnp.bool_))

    def reduce(xs, state: Fp16State, ctx: ReduceContext):
        n = axes_size(ctx.axes)
        out, finite = [], jnp.ones((), jnp.bool_)
        for x in xs:
            s = sum_over((as_f32(x) / n).astype(jnp.float16), ctx.axes, ctx.algorithm)
            finite = finite & jnp.all(jnp.isfinite(s))
            out.append(s.astype(jnp.result_type(x)))
        # One decision for all devices: with compress_stage='inter' each device of a node
        # summed a different shard, so an overflow in one shard must skip the step
        # everywhere (a pmin over every data axis, not over ctx.axes alone).
        finite = lax.pmin(finite.astype(jnp.int32), decision_axes(ctx)) > 0
        out = [jnp.where(finite, o, jnp.zeros_like(o)) for o in out]
        new = Fp16State(state.overflow_steps + (~finite).astype(jnp.int32), finite)
        return gather_means(out, ctx), new

    return Compressor("fp16", init, reduce, finite=lambda s: s.finite)
