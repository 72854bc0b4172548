"""Gradient buckets: 1-D buffers of bounded size, in the order the backward pass makes them.

One all-reduce per gradient leaf pays the start-up latency hundreds of times (ResNet-152 has
467 leaves); one all-reduce of the whole gradient cannot start before the backward pass has
finished. Buckets sit between: the gradient leaves of one dtype, taken in *reverse*
parameter order (the last layer's gradient is ready first), are laid end to end and cut into
1-D buffers, so that the first bucket can travel while earlier layers still compute.

Layout (per dtype, leaves in reverse ``jax.tree`` order, each raveled):

1. the first bucket holds ``min_bytes`` (PyTorch DDP's small first bucket, 1 MiB there),
   so communication starts early;
2. every following bucket holds ``max_bytes``;
3. the last bucket holds the remainder (at most ``max_bytes``, possibly under ``min_bytes``).

A leaf may straddle a cut; buckets are plain 1-D arrays, so any elementwise operation
(an all-reduce, an elementwise compressor) applies to them unchanged, and
:meth:`BucketPlan.unpack` restores the leaves exactly. Buckets are the buffers of
``jaxcomm.packing`` (``Bucket`` and ``BucketPlan`` are its ``Buffer`` and ``BufferPlan``);
this module decides their order and sizes.

References:
  Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
  VLDB 2020 (gradient bucketing, reverse order, 25 MiB buckets, 1 MiB first bucket).
  Sergeev & Del Balso, "Horovod" (2018) (tensor fusion).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxcomm.packing import Buffer, BufferPlan, plan_streams
from jaxcomm.validate import check_int

__all__ = [
    "AutoBuckets",
    "Bucket",
    "BucketPlan",
    "check_bucket_bytes",
    "exposed_seconds",
    "plan_buckets",
]

MiB = 1 << 20


# A bucket is one buffer of the one packing abstraction (``jaxcomm.packing``); these names
# stay for users of ``jaxcomm.buckets``.
Bucket = Buffer
BucketPlan = BufferPlan


def check_bucket_bytes(bucket_bytes: Any) -> Any:
    """Validates ``bucket_bytes``: ``None``, ``(min_bytes, max_bytes)``, ``'auto'`` or
    :class:`AutoBuckets`. Returns it normalised (a tuple of ints, or an AutoBuckets)."""
    if bucket_bytes is None or isinstance(bucket_bytes, AutoBuckets):
        return bucket_bytes
    if isinstance(bucket_bytes, str):
        if bucket_bytes == "auto":
            return AutoBuckets()
        raise ValueError(
            f"bucket_bytes={bucket_bytes!r}: use None, 'auto', or (min_bytes, max_bytes) "
            "such as (1 << 20, 25 << 20)."
        )
    fix = (
        "bucket_bytes is (min_bytes, max_bytes) with 0 < min_bytes <= max_bytes, e.g. "
        "(1 << 20, 25 << 20) (PyTorch DDP) or (1_000_000, 10_000_000); or None (no buckets) "
        "or 'auto'"
    )
    try:
        lo, hi = bucket_bytes
    except (TypeError, ValueError):
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: {fix}.") from None
    lo = check_int("bucket_bytes[0]", lo, minimum=1, fix=fix)
    return (lo, check_int("bucket_bytes[1]", hi, minimum=lo, fix=fix))


def plan_buckets(
    leaves: Sequence[Any],
    *,
    min_bytes: int,
    max_bytes: int,
    reverse: bool = True,
    indices: Sequence[int] | None = None,
) -> BufferPlan:
    """Plans buckets for ``leaves`` (arrays or ``jax.ShapeDtypeStruct``).

    Args:
      leaves: gradient leaves in parameter (``jax.tree.leaves``) order.
      min_bytes: size of the first bucket of each dtype.
      max_bytes: size of every further bucket (the last holds the remainder).
      reverse: take leaves last-to-first, the order the backward pass produces them.
      indices: the leaves to bucket (ascending parameter order); ``None``: all. The plan
        still describes the whole list: :meth:`~jaxcomm.packing.BufferPlan.pack` takes it,
        :meth:`~jaxcomm.packing.BufferPlan.unpack_into` writes back only these leaves.

    Returns:
      A :class:`jaxcomm.packing.BufferPlan` (alias :class:`BucketPlan`) whose ``buckets``
      are in issue order (per dtype: reverse parameter order; dtypes in order of first
      appearance from the back).

    Example:
      >>> plan = plan_buckets(jax.tree.leaves(grads), min_bytes=1 << 20, max_bytes=25 << 20)
      >>> bufs = plan.pack(jax.tree.leaves(grads))       # list of 1-D arrays
      >>> leaves = plan.unpack([allreduce(b) for b in bufs])
    """
    min_bytes, max_bytes = check_bucket_bytes((min_bytes, max_bytes))
    order = list(range(len(leaves)) if indices is None else indices)
    if reverse:
        order.reverse()
    return plan_streams(leaves, order, first_bytes=min_bytes, max_bytes=max_bytes)


# --- bucket size from a cost model ---------------------------------------------------------


class AutoBuckets(NamedTuple):
    """``bucket_bytes`` chosen to minimise predicted exposed communication.

    Attributes:
      comm_seconds: ``nbytes -> seconds`` of one all-reduce of a bucket on this mesh, e.g.
        ``lambda n: jaxcomm.cost.predict('hierarchical', n, topology)``. ``None``: inside
        ``sync_gradients``, ``jaxcomm.cost.predict`` of its algorithm on its topology
        (given, or ``jaxcomm.topology.detect()``) fitted to the mesh.
      backward_seconds: duration of the backward pass. Gradients are taken to become ready
        at a uniform rate per byte in reverse parameter order (the usual first-order
        profile); pass ``ready_fraction`` to describe another profile. ``None``: the
        backward pass is assumed to take as long as one all-reduce of the whole gradient
        (compute and communication balanced; the case where overlap matters most).
      ready_fraction: optional ``bytes_done_fraction -> time_fraction`` map of the backward
        pass (monotone, 0 -> 0, 1 -> 1).
      min_bytes: first-bucket size (PyTorch DDP: 1 MiB).
      candidates: the ``max_bytes`` values tried.
    """

    comm_seconds: Callable[[int], float] | None = None
    backward_seconds: float | None = None
    ready_fraction: Callable[[float], float] | None = None
    min_bytes: int = MiB
    candidates: tuple[int, ...] = tuple(1 << k for k in range(18, 29))  # 256 KiB .. 256 MiB

    def choose(
        self,
        leaves: Sequence[Any],
        default_comm: Callable[[int], float] | None = None,
        *,
        overlap: bool = True,
    ) -> tuple[int, int]:
        """Returns the ``(min_bytes, max_bytes)`` with the least predicted exposed time
        (ties go to larger buckets: fewer collectives).

        Args:
          leaves: gradient leaves (arrays or ShapeDtypeStructs) in parameter order.
          default_comm: ``nbytes -> seconds`` used when ``comm_seconds`` is None
            (``sync_gradients`` passes ``jaxcomm.cost.predict`` for its algorithm).
          overlap: whether a collective can run while the backward pass computes
            (not ``jaxcomm.backend``'s ``synchronous_collectives``). Without overlap all
            of the communication is exposed, and the fewest collectives expose least:
            buckets of the largest candidate, the first one included.
        """
        if not overlap:
            largest = max(self.candidates)
            return largest, largest
        comm = self.comm_seconds or default_comm
        if comm is None:
            raise ValueError("AutoBuckets needs comm_seconds (nbytes -> seconds) to choose.")
        total = sum(int(np.prod(jnp.shape(x))) * jnp.dtype(jnp.result_type(x)).itemsize
                    for x in leaves)  # fmt: skip
        backward = self.backward_seconds if self.backward_seconds is not None else comm(total)
        best = None
        for cap in sorted(self.candidates):
            lo = min(self.min_bytes, cap)
            plan = plan_buckets(leaves, min_bytes=lo, max_bytes=cap)
            t = exposed_seconds(plan, comm, backward, self.ready_fraction)
            if best is None or t <= best[0] * (1 + 1e-9):
                best = (t, (lo, cap))
        return best[1]


def exposed_seconds(
    plan: BucketPlan,
    comm_seconds: Callable[[int], float],
    backward_seconds: float,
    ready_fraction: Callable[[float], float] | None = None,
) -> float:
    """Predicted communication left after the backward pass ends, for ``plan``.

    Model: 1. bucket k is ready when the backward pass has produced all bytes up to its end
    (reverse parameter order, all dtypes in one stream); 2. one collective runs at a time,
    in bucket order: ``start_k = max(ready_k, end_{k-1})``, ``end_k = start_k + comm(bytes_k)``;
    3. exposed time ``= end_last - backward_seconds`` (at least 0).

    Args:
      plan: the bucket plan.
      comm_seconds: ``nbytes -> seconds`` of one all-reduce.
      backward_seconds: backward pass duration.
      ready_fraction: ``bytes fraction -> time fraction``; identity when None.

    Returns:
      Seconds of communication not hidden behind the backward pass.
    """
    sizes = [
        int(np.prod(shape)) * dt.itemsize
        for shape, dt in zip(plan.shapes, plan.dtypes, strict=True)
    ]
    total = sum(sizes) or 1
    after = np.concatenate([np.cumsum(sizes[::-1])[::-1][1:], [0]])  # bytes of leaves > i
    frac = ready_fraction or (lambda f: f)
    # Bucket k is ready when the leaf of its last piece has been produced (a leaf's
    # gradient appears whole).
    ready = []
    for b in plan.buckets:
        i = b.pieces[-1][0]
        produced = after[i] + sizes[i]
        ready.append(backward_seconds * frac(float(produced) / total))
    end = 0.0
    for k in sorted(range(len(ready)), key=lambda k: (ready[k], k)):
        end = max(ready[k], end) + comm_seconds(plan.buckets[k].nbytes)
    return max(0.0, end - backward_seconds)
