"""Blockwise int8 / int4 quantization with a two-phase (all-to-all + all-gather) reduce.

Integers cannot be summed by an all-reduce without overflow or a shared scale, so a
quantized all-reduce takes two phases (ZeRO++ qgZ, Wang et al. 2023; 1-bit Adam's
compressed all-reduce, Tang et al. 2021). On ``p`` devices and a buffer of ``N`` elements:

1. Pad to ``p * m`` (``m`` a multiple of ``block``) and view as ``p`` chunks of ``m``.
2. Quantize every block of ``block`` elements with its own absmax scale (f32): values
   become integers in ``[-q, q]`` (q = 127 for int8, 7 for int4), with stochastic rounding
   (unbiased, ``E[Q(x)] = x``) keyed per device and step. int4 packs two values into one
   byte, so the wire really carries 4 bits per value.
3. **all-to-all**: device ``i`` receives chunk ``i`` of every device (quantized + scales).
4. Dequantize in f32, sum the ``p`` chunks, divide by ``p``: the mean of chunk ``i``.
5. Re-quantize that mean chunk, **all-gather** the quantized chunks and scales, and
   dequantize: every device holds the mean of the whole buffer.

Bytes per device (nccl-tests bus factors): ``2 (p-1)/p N (b/8 + 4/block)`` against
``2 (p-1)/p 4N`` for an f32 all-reduce, i.e. 0.254 (int8, block 256) and 0.129 (int4).

Optional error feedback stores what this device's quantizations lost (per device, in the
optimizer state): the phase-1 error of its buffer and ``p`` times the phase-5 error of the
chunk it owns, so that transmitted + residual is exactly the true gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import backend, deprecated
from jaxcomm.collectives import all_gather_invariant
from jaxcomm.compression.base import (
    BufferCodec,
    Compressor,
    all_to_all_rows,
    axes_size,
    from_codec,
    sum_rows,
)
from jaxcomm.compression.keys import (
    dither_seed,
    no_seeds,
    seeded_uniform,
    two_phase_buffer_seeds,
)
from jaxcomm.validate import check_int

__all__ = [
    "dequantize",
    "from_bytes",
    "gather_quantized",
    "int4",
    "int8",
    "int_codec",
    "quantize",
    "quantized",
    "reduce_scatter_mean",
    "to_bytes",
    "two_phase_mean",
]

_QMAX = {8: 127, 4: 7}


def _quantize_blocks(
    xb: jax.Array, bits: int, seed: jax.Array | None, inv_qmax: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize` on blocks: ``xb`` f32 ``(rows, blocks, block)`` -> ``q`` int8
    ``(rows, blocks, block)`` (uint8 ``(rows, blocks, block // 2)`` for 4 bits) and the
    scales ``(rows, blocks)``; ``inv_qmax``: ``1 / qmax`` as a runtime f32 scalar
    (``jaxcomm.backend.runtime_f32``), or None for the constant.

    Every kernel of the two-phase mean runs on this 3-D block layout. XLA:CPU indexes a
    fused kernel through each reshape and slice inside it (a division per element), so a
    kernel mixing the flat ``(rows, m)`` view with the blocks (decode, sum, re-quantize)
    is several times slower than the same kernel on blocks.
    """
    qmax = _QMAX[bits]
    absmax = jnp.max(jnp.abs(xb), axis=-1)
    # absmax * (1 / qmax): what XLA makes of absmax / qmax (the f32 reciprocal), written
    # out so that it may come in as a runtime value
    inv = _inv_qmax(bits) if inv_qmax is None else inv_qmax
    scales = jnp.where(absmax > 0, absmax * inv, 1.0)
    # Divide by a finite positive scale: zeros stay 0, huge finite values stay finite.
    v = xb / scales[..., None]
    if seed is None:
        v = jnp.round(v)
    else:
        v = jnp.floor(v + seeded_uniform(seed, v.shape))
    v = jnp.clip(v, -qmax, qmax)
    if bits == 8:
        return v.astype(jnp.int8), scales
    u = (v + 8).astype(jnp.uint8)  # [1, 15]; a block is even, so pairs never straddle one
    return u[..., 0::2] | (u[..., 1::2] << 4), scales


def _inv_qmax(bits: int) -> np.float32:
    """``1 / qmax`` rounded to f32 (as XLA folds ``x / qmax``)."""
    return np.float32(1) / np.float32(_QMAX[bits])


def _dequantize_blocks(q: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`_quantize_blocks`: f32 ``(rows, blocks, block)``."""
    if bits == 8:
        v = q.astype(jnp.float32)
    else:
        # value j sits in byte j // 2, its low nibble for an even j: each byte read twice
        # and shifted by 4 (j % 2), which fuses into the decoding (a stack of the two
        # nibbles would be a kernel, and a transposing copy, of its own)
        width = q.shape[-1] * 2
        b = jnp.broadcast_to(q[..., None], (*q.shape, 2)).reshape(*q.shape[:-1], width)
        shift = (lax.iota(jnp.uint8, width) & 1) << 2
        v = ((b >> shift) & 0xF).astype(jnp.float32) - 8
    return v * scales[..., None]


def quantize(
    x: jax.Array, bits: int, block: int, key: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Blockwise absmax quantization of ``x`` (shape ``(rows, m)``, ``m % block == 0``).

    Args:
      x: f32 array ``(rows, m)``.
      bits: 8 or 4.
      block: elements per scale.
      key: PRNG key for stochastic rounding, or None for round-to-nearest.

    Returns:
      ``(q, scales)``: ``q`` int8 ``(rows, m)`` for 8 bits, uint8 ``(rows, m // 2)`` (two
      nibbles per byte) for 4 bits; ``scales`` f32 ``(rows, m // block)``.
    """
    rows, m = x.shape
    seed = None if key is None else _in_buffers(lambda s: s, dither_seed(key))
    q, scales = _quantize_blocks(x.reshape(rows, m // block, block), bits, seed)
    return q.reshape(rows, -1), scales


def dequantize(q: jax.Array, scales: jax.Array, bits: int, block: int) -> jax.Array:
    """Inverse of :func:`quantize`: f32 ``(rows, m)``."""
    rows, blocks = scales.shape
    width = block if bits == 8 else block // 2
    return _dequantize_blocks(q.reshape(rows, blocks, width), scales, bits).reshape(rows, -1)


def to_bytes(q: jax.Array, scales: jax.Array) -> jax.Array:
    """``(rows, ...)`` int8/uint8 values and ``(rows, b)`` f32 scales -> ``(rows, a + 4b)``
    uint8 (``a`` value bytes per row)."""
    qb = lax.bitcast_convert_type(q, jnp.uint8) if q.dtype != jnp.uint8 else q
    sb = lax.bitcast_convert_type(scales, jnp.uint8).reshape(scales.shape[0], -1)
    return jnp.concatenate([qb.reshape(q.shape[0], -1), sb], axis=1)


def from_bytes(buf: jax.Array, shape: tuple[int, int], bits: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`to_bytes` for values of ``shape = (blocks, width)`` per row:
    ``q`` ``(rows, blocks, width)``, scales ``(rows, blocks)``."""
    rows, width = buf.shape[0], shape[0] * shape[1]
    q = buf[:, :width].reshape(rows, *shape)
    if bits == 8:
        q = lax.bitcast_convert_type(q, jnp.int8)
    sb = buf[:, width:].reshape(rows, -1, 4)
    return q, lax.bitcast_convert_type(sb, jnp.float32)


def _in_buffers(f: Callable[..., Any], *args: jax.Array) -> Any:
    """``f(*args)``; computed into buffers of its own where the backend row says
    ``materialize`` (``jaxcomm.backend.materialized``, XLA:CPU).

    XLA:CPU fuses a cheap elementwise producer into every consumer: the decoding of the
    gathered means would run once per gradient leaf cut from them (with a division per
    element through the row padding), and a dither seed's ``lowbias32`` chain (the key's
    words, device, buffer, phase) inside the encoding loop of every element. GPU kernels
    index cheaply, and a GPU conditional reads its predicate on the host: there ``f``
    runs plainly. A ``lax.switch`` branch's outputs are buffers already: adaptive traces
    its rungs under a row without ``materialize``.
    """
    return backend.materialized(f, *args) if backend.current().materialize else f(*args)


def two_phase_mean(
    x: jax.Array,
    axes: tuple[str, ...],
    *,
    bits: int,
    block: int,
    seeds: tuple[jax.Array, jax.Array] | None,
    gather_axis: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mean of a 1-D f32 ``x`` over ``axes`` through quantized all-to-all + all-gather.

    Args:
      x: 1-D f32 per-device buffer (inside ``jax.shard_map``).
      axes: mesh axes.
      bits: 8 or 4.
      block: quantization block (even for 4 bits).
      seeds: the dither seeds of the two phases for stochastic rounding
        (:func:`two_phase_seeds`, salted with the device), or None to round to nearest.
      gather_axis: an inner mesh axis over which every device holds a different ``x`` (a
        shard of one buffer, ``compress_stage='inter'``): the quantized means are
        all-gathered over it too and dequantized after, so the inner all-gather moves
        ``bits/32`` of the f32 bytes. The result is then the concatenation of the means
        of every device of ``gather_axis`` (in its index order), bit for bit what an f32
        all-gather of each device's mean would give.

    Returns:
      ``(mean, sent)``: the mean (same on all devices; shape of ``x``, or ``g`` times its
      length with ``gather_axis`` of size ``g``) and what this
      device effectively contributed (its dequantized phase-1 payload plus ``p`` times
      the re-quantization error of the chunk it owns), so that the mean of ``sent`` over
      devices equals ``mean``: error feedback on ``x - sent`` loses nothing.
    """
    p = axes_size(axes)
    n = x.shape[0]
    blocks = -(-n // (p * block))  # per chunk; every kernel below runs on (rows, blocks, block)
    chunk = (blocks, block if bits == 8 else block // 2)  # value bytes of one chunk
    xb = jnp.pad(x, (0, p * blocks * block - n)).reshape(p, blocks, block)
    if seeds is not None:  # into buffers where the row says so (_in_buffers)
        seeds = _in_buffers(lambda *s: s, *seeds)
    seed1, seed2 = (None, None) if seeds is None else seeds
    # 1 / qmax as a runtime value where the row says so, so that the scale kernels of
    # int8 and int4 (which differ only in this constant) are one (jaxcomm.backend).
    runtime = backend.current().runtime_constants
    inv_qmax = backend.runtime_f32(_inv_qmax(bits)) if runtime else None
    q, s = _quantize_blocks(xb, bits, seed1, inv_qmax)
    local = _dequantize_blocks(q, s, bits)  # (p, blocks, block): what this device sends
    # Phase 1: chunk i of every device goes to device i; values and scales travel as one
    # byte buffer, so each phase is a single collective.
    recv = all_to_all_rows(to_bytes(q, s), axes)
    # (1, blocks, block) from here on: a reshape (x[0], x[None]) in an elementwise chain
    # costs XLA a round of its simplification pipeline per operation it is moved past
    shard = sum_rows(_dequantize_blocks(*from_bytes(recv, chunk, bits), bits)) / p
    # Phase 2: re-quantize the mean chunk, gather all chunks.
    q2, s2 = _quantize_blocks(shard, bits, seed2, inv_qmax)
    # This device owns chunk i; its re-quantization error enters its own "sent" record
    # (times p, since the result is a mean), so that mean_devices(sent) == result exactly
    # and error feedback conserves the gradient through both phases (1-bit Adam's
    # worker + server error, folded into one residual).
    err2 = _dequantize_blocks(q2, s2, bits) - shard
    i = lax.axis_index(axes)
    own = lax.dynamic_slice_in_dim(local, i, 1)
    local = lax.dynamic_update_slice(local, own + p * err2, (i, 0, 0))
    gathered = all_gather_invariant(to_bytes(q2, s2), axes)  # (p, bytes), typed invariant
    rows = 1
    if gather_axis is not None:
        # (g * p, bytes): row j * p + i is chunk i of inner device j's shard
        gathered = all_gather_invariant(gathered, gather_axis)
        rows = lax.axis_size(gather_axis)

    def decode(gathered: jax.Array, local: jax.Array) -> tuple[jax.Array, jax.Array]:
        mean = _dequantize_blocks(*from_bytes(gathered, chunk, bits), bits)
        return mean.reshape(rows, -1)[:, :n].reshape(-1), local.reshape(-1)[:n]

    # ``sent`` into a buffer too: error feedback's ``c - sent`` on the flat view, fused with
    # the block layout's decoding and update, would index through both layouts (a
    # division per element), where a buffer costs a copy
    return _in_buffers(decode, gathered, local)


def reduce_scatter_mean(
    x: jax.Array, axis: str, *, bits: int, block: int, seed: jax.Array | None
) -> jax.Array:
    """Quantized reduce-scatter (ZeRO++ qgZ, one hop): phase 1 of :func:`two_phase_mean`.

    1. View the 1-D f32 ``x`` (length a multiple of the size ``p`` of ``axis``) as ``p``
       chunks, each padded to whole blocks; quantize every block (stochastic rounding
       with ``seed``, else nearest).
    2. all-to-all over ``axis``: device ``i`` receives chunk ``i`` of every device.
    3. Dequantize in f32, sum the ``p`` chunks, divide by ``p``.

    Args:
      x: 1-D f32 per-device buffer (inside ``jax.shard_map``).
      axis: a mesh axis name.
      bits: 8 or 4.
      block: elements per scale.
      seed: a uint32 dither seed (per device, step, buffer, stage) or None.

    Returns:
      The mean over ``axis`` of chunk ``lax.axis_index(axis)``, f32, ``len(x) / p``.
    """
    p = lax.axis_size(axis)
    c = x.shape[0] // p
    blocks = -(-c // block)
    chunk = (blocks, block if bits == 8 else block // 2)
    xb = jnp.pad(x.reshape(p, c), ((0, 0), (0, blocks * block - c))).reshape(p, blocks, block)
    q, s = _quantize_blocks(xb, bits, seed)
    recv = all_to_all_rows(to_bytes(q, s), (axis,))
    shard = sum_rows(_dequantize_blocks(*from_bytes(recv, chunk, bits), bits)) / p
    return shard.reshape(-1)[:c]


def gather_quantized(x: jax.Array, axes: tuple[str, ...], *, bits: int, block: int) -> jax.Array:
    """Quantized all-gather (ZeRO++ qwZ): every device's 1-D f32 ``x`` quantized once
    (blockwise, round to nearest), the bytes gathered over each axis of ``axes`` in order,
    decoded in f32 on every device (its owner too), so all hold the same bits.

    Args:
      x: 1-D f32 shard (inside ``jax.shard_map``).
      axes: mesh axes, gathered in this order (the first innermost in the result).
      bits: 8 or 4.
      block: elements per scale.

    Returns:
      The decoded concatenation of every device's shard, typed invariant over ``axes``.
    """
    c = x.shape[0]
    blocks = -(-c // block)
    chunk = (blocks, block if bits == 8 else block // 2)
    q, s = _quantize_blocks(
        jnp.pad(x, (0, blocks * block - c)).reshape(1, blocks, block), bits, None
    )
    enc = to_bytes(q, s)
    for a in axes:
        enc = all_gather_invariant(enc, a)
    values = _dequantize_blocks(*from_bytes(enc, chunk, bits), bits)
    return values.reshape(enc.shape[0], -1)[:, :c].reshape(-1)


def int_codec(
    bits: int, block: int, *, stochastic: bool, materialize: bool | None = None
) -> BufferCodec:
    """The per-buffer mean of :func:`int8` / :func:`int4` (:func:`two_phase_mean`), also
    an adaptive rung; its halves are the sharded step's quantized reduce-scatter
    (:func:`reduce_scatter_mean`) and param gather (:func:`gather_quantized`).

    Args:
      bits: 8 or 4.
      block: elements per scale (even for 4 bits).
      stochastic: stochastic rounding from the two phases' dither seeds, else nearest.
      materialize: deprecated since 0.2.0 and ignored (it warns): the platform's row
        (``jaxcomm.backend``) decides.

    Returns:
      A :class:`~jaxcomm.compression.base.BufferCodec` that gathers its encoded means.

    Raises:
      ValueError: ``bits`` not in (4, 8), ``block < 1``, or odd for 4 bits.
    """
    if materialize is not None:
        deprecated.warn(
            f"jaxcomm.compression.quantize.int_codec(..., materialize={materialize!r})",
            "int_codec(bits, block, stochastic=...) (the platform's row decides: jaxcomm.backend)",
        )
    if bits not in _QMAX:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {sorted(_QMAX)} (int4, int8).")
    block = _check_block(block, bits)

    def mean(c, ctx, i, seeds):
        m, sent = two_phase_mean(
            c.reshape(-1), ctx.axes, bits=bits, block=block, seeds=seeds,
            gather_axis=ctx.gather_axis,
        )  # fmt: skip
        return m.reshape(c.shape if ctx.gather_axis is None else (-1,)), sent.reshape(c.shape)

    def scatter(x, axis, seed):
        seed = seed if stochastic else None
        return reduce_scatter_mean(x, axis, bits=bits, block=block, seed=seed)

    def gather(x, axes):
        return gather_quantized(x, axes, bits=bits, block=block)

    frac = (bits / 8 + 4 / block) / 4  # values and one f32 scale per block, two phases
    return BufferCodec(
        f"int{bits}",
        mean,
        seeds=two_phase_buffer_seeds if stochastic else no_seeds,
        wire=lambda p: frac,
        compression=1.0 - bits / 32,
        gathers=True,
        reduce_scatter=scatter,
        all_gather=gather,
    )


def _check_block(block: int, bits: int) -> int:
    block = check_int("block", block, minimum=1, fix="elements per scale, e.g. 256")
    if bits == 4 and block % 2:
        raise ValueError(
            f"block={block} must be even for int4 (two 4-bit values share a byte); use {block + 1}."
        )
    return block


def int8(block: int = 256, stochastic: bool = True, *, error_feedback: bool = False) -> Compressor:
    """Blockwise int8 quantization with a two-phase reduce (about 0.25x the f32 bytes).

    Args:
      block: elements per f32 absmax scale (>= 1).
      stochastic: unbiased stochastic rounding keyed per device and step (else nearest).
      error_feedback: keep this device's phase-1 quantization error and add it next step.

    Returns:
      A :class:`~jaxcomm.compression.Compressor`.

    Raises:
      ValueError: ``block < 1``.

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.int8(block=256))
    """
    codec = int_codec(8, block, stochastic=bool(stochastic))
    return from_codec(codec, error_feedback=bool(error_feedback))


def int4(block: int = 256, stochastic: bool = True, *, error_feedback: bool = False) -> Compressor:
    """Blockwise int4 quantization, two values per byte, two-phase reduce (about 0.13x).

    Args:
      block: elements per f32 absmax scale (even, >= 2).
      stochastic: unbiased stochastic rounding keyed per device and step.
      error_feedback: keep this device's phase-1 quantization error and add it next step.

    Returns:
      A :class:`~jaxcomm.compression.Compressor`.

    Raises:
      ValueError: ``block < 1`` or odd.

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.int4(block=128))
    """
    codec = int_codec(4, block, stochastic=bool(stochastic))
    return from_codec(codec, error_feedback=bool(error_feedback))


def quantized(bits: int, **kwargs) -> Compressor:
    """``int8(**kwargs)`` or ``int4(**kwargs)`` by ``bits``.

    Raises:
      ValueError: ``bits`` not in (4, 8).
    """
    if bits not in _QMAX:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {sorted(_QMAX)} (int4, int8).")
    return (int8 if bits == 8 else int4)(**kwargs)
