"""Shared pieces of the all-reduce algorithms: validation, which leaves share a buffer, the
algorithm registry.

An *algorithm* is a function ``fn(x, axes) -> y`` that sums a 1-D array over the named
mesh axes (called inside ``jax.shard_map``) and returns an array of the same shape. The
public :func:`jaxcomm.allreduce` validates the pytree, packs its leaves into 1-D buffers
(:func:`allreduce_plan`, a ``jaxcomm.packing`` plan), calls the algorithm on each and
unpacks the results. An algorithm registered with ``packed=True`` gets one buffer per dtype
holding all its leaves (see :func:`register_algorithm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import backend
from jaxcomm.packing import BufferPlan, plan_groups

AlgorithmFn = Callable[[jax.Array, tuple[str, ...]], jax.Array]

OPS: tuple[str, ...] = ("sum", "mean")
ALGORITHMS: dict[str, AlgorithmFn] = {}
# Algorithms registered with packed=True: allreduce hands them one buffer per dtype.
PACKED: set[str] = set()

# Leaves below this many elements are concatenated into one buffer per dtype, so that a
# model's biases and norm scales cost one collective instead of hundreds (the per-call
# latency dominates them).
SMALL_LEAF_ELEMENTS = 1 << 14


def register_algorithm(name: str, fn: AlgorithmFn | None = None, *, packed: bool = False):
    """Registers ``fn`` under ``name`` for ``allreduce(..., algorithm=name)``.

    Usable as a decorator: ``@register_algorithm('ring', packed=True)``.

    Args:
      name: the ``algorithm=`` name.
      fn: the algorithm; None to use this as a decorator.
      packed: True: :func:`allreduce_plan` gives it one buffer per dtype holding all the
        leaves it reduces, instead of one buffer per large leaf. For algorithms built from
        ``lax.ppermute`` steps: XLA compiles every call's steps separately (its combiner
        merges all-reduces, not collective-permutes), so one call per leaf multiplies the
        program by the leaf count (ResNet-152's 155 large leaves: 2170 collective-permutes
        for a ring on 8 devices), and one call per dtype keeps it at one algorithm's worth.
        The wire bytes are the same up to the padding of one buffer instead of many.
    """

    def _register(f: AlgorithmFn) -> AlgorithmFn:
        ALGORITHMS[name] = f
        if packed:
            PACKED.add(name)
        else:
            PACKED.discard(name)
        return f

    return _register if fn is None else _register(fn)


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm={algorithm!r} is not known; choose one of {sorted(ALGORITHMS)}."
        )
    return algorithm


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not supported; choose one of {list(OPS)}.")
    return op


def check_axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"axes={axes!r} must be a non-empty tuple of mesh axis names.")
    return axes


def check_bound(axes: tuple[str, ...], caller: str, fix: str) -> None:
    """Raises ValueError unless every mesh axis in ``axes`` is bound here, i.e. the caller
    runs inside ``jax.shard_map`` over a mesh that has these axes.

    Without it, an all-reduce traced outside ``shard_map`` (or over an axis the mesh lacks)
    fails deep inside JAX with ``NameError: unbound axis name``.

    Args:
      axes: the mesh axis names.
      caller: what the user called, e.g. ``'jaxcomm.allreduce'``; named in the message.
      fix: what to do instead (one sentence).
    """
    for a in axes:
        try:
            lax.axis_size(a)
        except NameError as e:
            raise ValueError(
                f"{caller}(axes={axes}) was called where mesh axis {a!r} is not bound. {fix}"
            ) from e


def check_float_tree(tree: Any) -> None:
    """Raises TypeError naming the first leaf that is not a real floating-point array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"gradient leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}; "
                "jaxcomm all-reduces real floating-point leaves only (float32, bfloat16, "
                "float16, float64). Cast it, or keep integer/complex state out of the tree."
            )


def axes_size(axes: tuple[str, ...]) -> int:
    """Product of the sizes of ``axes`` (inside shard_map)."""
    return int(np.prod([lax.axis_size(a) for a in axes]))


def reduce_scatter(x: jax.Array, axis: str) -> jax.Array:
    """``psum_scatter(x, axis, tiled=True)`` on a 1-D ``x`` whose length divides by the
    axis size, correct on every backend.

    Where the transport's reduce-scatter is known to return wrong values (gloo, in a
    program of several processes: the backend row's ``ring_reduce_scatter``,
    jax-ml/jax#40830) it is computed as a ring of ``lax.ppermute`` s
    (:func:`ring_reduce_scatter`): the same sum and the bytes of a reduce-scatter.

    Args:
      x: 1-D per-device array (inside ``jax.shard_map``), length a multiple of the size
        of ``axis``.
      axis: a mesh axis name.

    Returns:
      This device's chunk of the sum over ``axis``, length ``len(x) / size``.
    """
    if backend.current().ring_reduce_scatter and jax.process_count() > 1:
        return ring_reduce_scatter(x, (axis,))
    return lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)


def ring_reduce_scatter(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Ring reduce-scatter of a 1-D ``x`` (length divisible by ``p``) from ``lax.ppermute`` s.

    Rank ``r`` (``lax.axis_index(axes)``, row-major over ``axes``) ends with the sum of chunk
    ``r``, as ``psum_scatter(..., tiled=True)`` would give. Each device sends ``(p-1)/p`` of
    ``x``, the bytes of a reduce-scatter.

    1. Split ``x`` into ``p`` chunks and index them so that local position ``j`` holds chunk
       ``(rank + j - 1) mod p``; every rank then sends and adds at the same static positions.
    2. At step ``s`` send position ``-s`` to the next rank and add the received chunk into
       position ``-s-1``. After ``p-1`` steps position ``1`` holds the full sum of chunk
       ``rank``.

    Args:
      x: 1-D per-device array (inside ``jax.shard_map``), length a multiple of ``p``.
      axes: mesh axis names, taken together as one ring.

    Returns:
      This rank's chunk of the sum, length ``len(x) / p``.

    References:
      Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
      workstations" (JPDC 2009).
    """
    p = axes_size(axes)
    rows = x.reshape(p, -1)
    if p == 1:
        return rows[0]
    rank = lax.axis_index(axes)
    # A Python list of chunks keeps every position static (plain adds, no
    # dynamic-update-slice per step), which XLA compiles faster. Position j is read once by
    # a dynamic slice (rolling the whole buffer would copy it twice over).
    chunks = [lax.dynamic_index_in_dim(rows, (rank + j - 1) % p, keepdims=False) for j in range(p)]
    perm = [(i, (i + 1) % p) for i in range(p)]
    for s in range(p - 1):
        j = (-s - 1) % p
        chunks[j] = chunks[j] + lax.ppermute(chunks[(-s) % p], axes, perm)
    return chunks[1]


def pad_to_multiple(x: jax.Array, multiple: int) -> tuple[jax.Array, int]:
    """Pads a 1-D array with zeros to a multiple of ``multiple``; returns (padded, pad)."""
    pad = (-x.shape[0]) % multiple
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad,), x.dtype)])
    return x, pad


def allreduce_plan(
    leaves: Sequence[jax.Array],
    small_elements: int = SMALL_LEAF_ELEMENTS,
    *,
    algorithm: Callable[[int], str] | None = None,
) -> tuple[BufferPlan, list[str]]:
    """The buffers :func:`jaxcomm.allreduce` reduces, and the algorithm of each.

    First a large leaf alone (no copy), the leaves under ``small_elements`` elements
    concatenated per dtype, in the order given; each of these buffers gets the algorithm
    ``algorithm(nbytes)`` names ('auto' picks by size). Then the buffers of each algorithm
    registered with ``packed=True`` are merged into one buffer per dtype (their leaves in
    the same order), so that algorithm runs once per dtype.

    Args:
      leaves: arrays or ``jax.ShapeDtypeStruct`` s.
      small_elements: leaves under this many elements share a buffer per dtype.
      algorithm: buffer bytes -> registered algorithm name; None: 'flat' for every buffer.

    Returns:
      ``(plan, names)``: a ``jaxcomm.packing.BufferPlan`` and one algorithm name per buffer.
    """
    groups: list[list[int]] = []
    small: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if int(np.prod(jnp.shape(x))) < small_elements:
            small.setdefault(jnp.result_type(x), []).append(i)
        else:
            groups.append([i])
    plan = plan_groups(leaves, [*groups, *small.values()])
    names = [("flat" if algorithm is None else algorithm(b.nbytes)) for b in plan.buffers]
    if not PACKED.intersection(names):
        return plan, names
    merged: dict[Any, list[int]] = {}  # (name, dtype) -> leaves, or buffer index -> leaves
    for k, (b, name) in enumerate(zip(plan.buffers, names, strict=True)):
        key = (name, b.dtype) if name in PACKED else k
        merged.setdefault(key, []).extend(i for i, _, _ in b.pieces)
    names = [key[0] if isinstance(key, tuple) else names[key] for key in merged]
    return plan_groups(leaves, merged.values()), names
