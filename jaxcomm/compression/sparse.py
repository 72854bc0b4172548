"""Sparsifiers: ``topk`` (exact or sampled-threshold DGC) and same-seed ``random_k``.

* **top-k** sends the ``k = ceil(ratio N)`` largest-magnitude entries of ``g + e`` as
  (int32 index, f32 value) pairs. Different devices pick different indices, so the pairs
  cannot be summed by an all-reduce: they are **all-gathered** and summed device by device
  (:func:`sum_pairs_in_device_order`: the same bits on every device and every backend). Per
  device that is ``(p-1) 8k`` bytes against ``2 (p-1)/p 4N`` for an f32 all-reduce, a
  ratio of ``p * ratio`` -- it only wins below density ``1/p``.
  Exact ``lax.top_k`` is slow on large buffers on CPU; the DGC variant estimates the
  threshold from a strided sample, masks, and takes the first ``k`` indices above it
  (those beyond ``k`` stay in the residual). With error feedback nothing is dropped.
* **random-k** picks indices from a key shared by all devices (one random element per
  stratum of ``N/k`` elements, no duplicates), so every device selects the same
  positions and a plain all-reduce of the ``k`` values is enough (``ratio`` of the bytes).

References:
  Lin et al., "Deep Gradient Compression" (ICLR 2018); Stich et al., "Sparsified SGD
  with Memory" (NeurIPS 2018); Aji & Heafield, "Sparse Communication for Distributed
  Gradient Descent" (EMNLP 2017).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import all_gather_invariant
from jaxcomm.compression.base import (
    BufferCodec,
    Compressor,
    axes_size,
    check_range,
    from_codec,
    sum_over,
)
from jaxcomm.compression.keys import device_seeds, shared_keys
from jaxcomm.validate import check_int

__all__ = [
    "first_true",
    "random_k",
    "random_k_codec",
    "random_k_mean",
    "select_topk",
    "sum_pairs_in_device_order",
    "topk",
    "topk_codec",
    "topk_mean",
]

METHODS = ("auto", "exact", "sampled")
# 'auto' uses exact top-k below this many elements (fast enough, exact), sampled above.
EXACT_MAX_ELEMENTS = 1 << 16


def _k(n: int, ratio: float) -> int:
    return max(1, min(n, math.ceil(ratio * n)))


def first_true(mask: jax.Array, k: int) -> jax.Array:
    """Indices of the first ``k`` true entries of a 1-D ``mask``, in increasing order;
    ``len(mask)`` in the slots past the last one.

    ``jnp.nonzero(mask, size=k, fill_value=len(mask))``, computed with one prefix sum and
    one scatter: ``nonzero`` runs two prefix sums and a full-length sum for its fill, which
    XLA:CPU compiles as trees of reduce-window kernels (a level per factor of 16 or 32 of
    the length).

    1. ``rank = cumsum(mask) - 1``: the slot of each true entry.
    2. Scatter each true entry's index into its slot; those of rank ``k`` and more, and
       the false entries, fall outside the ``k`` slots and are dropped.

    Args:
      mask: 1-D bool array of length ``N < 2**31``.
      k: slots (>= 1).

    Returns:
      int32 ``(k,)``.

    Raises:
      ValueError: ``mask`` not 1-D bool, ``N >= 2**31`` or ``k < 1``.

    Example:
      >>> first_true(jnp.array([False, True, True, False, True]), 2)   # [1, 2]
    """
    if jnp.ndim(mask) != 1 or jnp.result_type(mask) != jnp.bool_ or mask.shape[0] >= 2**31:
        raise ValueError(
            f"first_true: mask must be a 1-D bool array shorter than 2**31, got "
            f"{jnp.result_type(mask)}{tuple(jnp.shape(mask))}; pass e.g. x != 0."
        )
    k = check_int("k", k, minimum=1)
    n = mask.shape[0]
    rank = jnp.cumsum(mask, dtype=jnp.int32) - 1
    slot = jnp.where(mask, rank, k)  # k: out of range, dropped
    return jnp.full((k,), n, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def select_topk(
    c: jax.Array, k: int, *, method: str, sample: int, seed: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Indices and values of (about) the ``k`` largest ``|c|`` of a 1-D f32 ``c``.

    Args:
      c: 1-D f32 array of length ``N``.
      k: entries to select.
      method: 'exact' (``lax.top_k``) or 'sampled' (DGC threshold from a sample).
      sample: sample size for 'sampled'.
      seed: uint32 scalar that differs per device and step (a
        :func:`~jaxcomm.compression.keys.dither_seed`): the strided sample's offset.

    Returns:
      ``(idx, vals)`` of length ``k``; unused slots (sampled, fewer than ``k`` above the
      threshold) have index ``N`` and value 0.
    """
    n = c.shape[0]
    a = jnp.abs(c)
    if method == "exact" or sample >= n:
        _, idx = lax.top_k(a, k)
        return idx.astype(jnp.int32), c[idx]
    # DGC: 1. strided sample with a random offset; 2. its top ratio-quantile is the
    # threshold; 3. mask; 4. the first k indices of the mask (fixed size for the gather).
    stride = n // sample
    off = (seed % jnp.uint32(stride)).astype(jnp.int32)  # a hash: no threefry kernels
    s = lax.dynamic_slice(a, (off,), (stride * (sample - 1) + 1,))[::stride]
    ks = max(1, math.ceil(k * sample / n))
    thr = lax.top_k(s, ks)[0][-1]
    idx = first_true((a >= thr) & (a > 0), k)
    vals = jnp.where(idx < n, jnp.take(c, jnp.minimum(idx, n - 1)), 0.0)
    return idx, vals


def sum_pairs_in_device_order(idx: jax.Array, vals: jax.Array, n: int) -> jax.Array:
    """Dense f32 sum of every device's sparse (index, value) pairs, one device at a time.

    Indices picked by several devices collide. One scatter-add of all ``p x k`` pairs
    leaves the order of the colliding additions to the backend: on GPU they are atomics,
    so the float sum (not associative) can differ by bits between runs and between the
    devices that each decode the same gathered pairs, and "replicated" params drift.
    Here row ``d`` is added by its own scatter, after row ``d - 1``: within a
    row the in-range indices are distinct (one device's top-k), so no scatter has a
    collision, and each entry is ``((v_0 + v_1) + v_2) + ...`` in device order on every
    backend. Cost: ``p`` scatters of ``k`` updates each (``O(p k)``, a ``fori_loop``, the
    buffer updated in place), the same additions as one big scatter.

    Args:
      idx: int32 ``(p, k)``, row ``d`` the indices of device ``d``: distinct within a row,
        except entries ``>= n`` (unused slots), which are dropped.
      vals: ``(p, k)`` values matching ``idx``.
      n: length of the dense result.

    Returns:
      f32 ``(n,)``: entry ``i`` the sum over devices, in device order, of their values at
      ``i``.

    Example:
      >>> sum_pairs_in_device_order(jnp.array([[0, 2], [2, 1]]), jnp.ones((2, 2)), 3)
      Array([1., 1., 2.], dtype=float32)
    """
    vals = vals.astype(jnp.float32)

    def add_row(d, total):
        return total.at[idx[d]].add(vals[d], mode="drop")

    # Row 0 starts the sum (outside the loop: the carry then has the rows' type under
    # shard_map's replication check, e.g. varying over 'intra' with compress_stage='inter').
    first = add_row(0, jnp.zeros((n,), jnp.float32))
    return lax.fori_loop(1, idx.shape[0], add_row, first)


def topk_mean(
    c: jax.Array,
    axes: tuple[str, ...],
    *,
    ratio: float,
    method: str,
    sample_ratio: float,
    seed: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Mean over ``axes`` of the top-k entries of each device's ``c`` (all-gather of pairs).

    1. Select about ``k = ceil(ratio N)`` largest ``|c|`` (:func:`select_topk`).
    2. All-gather the ``p x k`` (index, value) pairs; sum them device by device
       (:func:`sum_pairs_in_device_order`, the same bits on every backend); divide by ``p``.

    Args:
      c: per-device f32 buffer (any shape; flattened).
      axes: mesh axes to average over.
      ratio: fraction of entries sent, in (0, 1].
      method: 'exact', 'sampled' or 'auto' (see :func:`topk`).
      sample_ratio: sample fraction for 'sampled'.
      seed: uint32 scalar, different per device and step (the sample's offset; see
        :func:`select_topk`).

    Returns:
      ``(mean, sent)``, both shaped like ``c``: ``mean`` the same on every device,
      ``sent`` what this device contributed (``mean_devices(sent) == mean``).
    """
    flat = c.reshape(-1)
    n = flat.shape[0]
    k = _k(n, ratio)
    if method == "auto":
        method = "exact" if n <= EXACT_MAX_ELEMENTS else "sampled"
    sample = max(k, math.ceil(sample_ratio * n), min(n, 1024))
    idx, vals = select_topk(flat, k, method=method, sample=sample, seed=seed)
    # The wire: p x k indices and values.
    all_idx = all_gather_invariant(idx, axes)
    all_vals = all_gather_invariant(vals, axes)
    total = sum_pairs_in_device_order(
        all_idx.reshape(-1, k), all_vals.reshape(-1, k), n
    )  # not one scatter-add: its collisions would sum in a backend-chosen order
    mine = jnp.zeros((n + 1,), jnp.float32).at[idx].set(vals)[:n]
    return (total / axes_size(axes)).reshape(c.shape), mine.reshape(c.shape)


def random_k_mean(
    c: jax.Array,
    axes: tuple[str, ...],
    algorithm: str,
    *,
    ratio: float,
    key: jax.Array,
    scale: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Mean over ``axes`` of the same random ``k`` entries on every device (an all-reduce).

    1. One uniformly random position per stratum of ``ceil(N/k)`` entries, drawn from
       ``key`` (the same on every device, so every device selects the same positions).
    2. All-reduce the ``k`` values with ``algorithm``; divide by ``p``.

    Args:
      c: per-device f32 buffer (any shape; flattened).
      axes: mesh axes to average over.
      algorithm: the all-reduce algorithm.
      ratio: fraction of entries sent, in (0, 1].
      key: a key that is the same on every device.
      scale: multiply the sent values by the stratum size (unbiased without error
        feedback).

    Returns:
      ``(mean, sent)`` as in :func:`topk_mean`.
    """
    flat = c.reshape(-1)
    n = flat.shape[0]
    k = _k(n, ratio)
    seg = -(-n // k)
    k = -(-n // seg)
    idx = jnp.arange(k, dtype=jnp.int32) * seg + jax.random.randint(key, (k,), 0, seg)
    valid = idx < n
    idx = jnp.where(valid, idx, n)
    vals = jnp.where(valid, jnp.take(flat, jnp.minimum(idx, n - 1)), 0.0)
    if scale:
        vals = vals * seg
    summed = sum_over(vals, axes, algorithm) / axes_size(axes)
    total = jnp.zeros((n + 1,), jnp.float32).at[idx].set(summed)[:n]
    mine = jnp.zeros((n + 1,), jnp.float32).at[idx].set(vals)[:n]
    return total.reshape(c.shape), mine.reshape(c.shape)


def topk(
    ratio: float,
    *,
    error_feedback: bool = True,
    method: str = "auto",
    sample_ratio: float = 0.01,
) -> Compressor:
    """Top-k sparsification: all-gather of (index, value) pairs, summed in device order.

    ``sync_gradients`` hands it one flat buffer per dtype (all compressed leaves
    concatenated), so the selection is global across layers; leaves that must keep their
    own share can be kept out with ``min_size`` / ``compress_leaf``.

    Args:
      ratio: fraction of entries sent per buffer, in (0, 1].
      error_feedback: keep the unsent part per device and add it next step (recommended:
        without it top-k is biased and drops most of the gradient).
      method: 'exact' (``lax.top_k``), 'sampled' (DGC threshold from a sample of
        ``sample_ratio`` of the entries; fast on CPU), or 'auto' (exact up to 65536
        entries, sampled above).
      sample_ratio: sample fraction for 'sampled', in (0, 1].

    Returns:
      A :class:`~jaxcomm.compression.Compressor`.

    Raises:
      ValueError: ``ratio`` or ``sample_ratio`` not in (0, 1], unknown ``method``.

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.topk(0.01))
    """
    codec = topk_codec(ratio, method=method, sample_ratio=sample_ratio)
    return from_codec(codec, error_feedback=bool(error_feedback), name=f"topk({ratio:g})")


def topk_codec(ratio: float, *, method: str = "auto", sample_ratio: float = 0.01) -> BufferCodec:
    """:func:`topk`'s per-buffer mean (:func:`topk_mean`, the sample's offset from a
    per-device seed), also an adaptive rung; arguments as :func:`topk`'s.

    Raises:
      ValueError: ``ratio`` or ``sample_ratio`` not in (0, 1], unknown ``method``.
    """
    ratio = check_range("ratio", ratio, 0.0, 1.0, low_open=True, fix="e.g. ratio=0.01")
    sample_ratio = check_range("sample_ratio", sample_ratio, 0.0, 1.0, low_open=True)
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not known; choose one of {list(METHODS)}.")

    def mean(c, ctx, i, seed):
        return topk_mean(
            c, ctx.axes, ratio=ratio, method=method, sample_ratio=sample_ratio, seed=seed
        )

    compression = max(0.0, 1.0 - 2 * ratio)  # an int32 index beside every value
    return BufferCodec(
        f"topk:{ratio:g}", mean, seeds=device_seeds, wire=lambda p: p * ratio,
        compression=compression,
    )  # fmt: skip


def random_k(ratio: float, *, error_feedback: bool = True) -> Compressor:
    """Random-k sparsification with a shared seed: a plain all-reduce of ``k`` values.

    Every device draws the same indices (one uniformly random position per stratum of
    ``ceil(N/k)`` consecutive entries, from the step key shared by all devices), so the
    selected values can be summed by any all-reduce algorithm.

    Args:
      ratio: fraction of entries sent, in (0, 1].
      error_feedback: keep the unsent part per device (else the sent values are scaled
        by the stratum size, which makes the estimate unbiased but noisy).

    Returns:
      A :class:`~jaxcomm.compression.Compressor`.

    Raises:
      ValueError: ``ratio`` not in (0, 1].

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.random_k(0.05))
    """
    codec = random_k_codec(ratio, scale=not error_feedback)
    return from_codec(codec, error_feedback=bool(error_feedback), name=f"random_k({ratio:g})")


def random_k_codec(ratio: float, *, scale: bool = False) -> BufferCodec:
    """:func:`random_k`'s per-buffer mean (:func:`random_k_mean`, positions from a key
    shared by every device), also an adaptive rung.

    Args:
      ratio: fraction of entries sent, in (0, 1].
      scale: scale the sent values by the stratum size (unbiased without error feedback).

    Raises:
      ValueError: ``ratio`` not in (0, 1].
    """
    ratio = check_range("ratio", ratio, 0.0, 1.0, low_open=True, fix="e.g. ratio=0.05")

    def mean(c, ctx, i, key):
        return random_k_mean(c, ctx.axes, ctx.algorithm, ratio=ratio, key=key, scale=scale)

    return BufferCodec(
        f"random_k:{ratio:g}", mean, seeds=shared_keys, wire=lambda p: ratio,
        compression=1.0 - ratio,
    )  # fmt: skip
