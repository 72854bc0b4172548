"""Packing: gradient leaves -> flat 1-D buffers of one dtype each, and back.

The one packing abstraction of jaxcomm. A :class:`BufferPlan` lists buffers; each buffer is
a run of *pieces* ``(leaf_index, start, stop)``, element ranges of raveled leaves laid end
to end. :meth:`BufferPlan.pack` builds the buffers (one concatenate per buffer, static
slices only where a leaf is cut), :meth:`BufferPlan.unpack` restores the leaves exactly,
by static slices; where the backend row says ``runtime_offsets`` (XLA:CPU) at runtime
offsets instead, so that the slices of one size compile as one kernel (``jaxcomm.backend``).

Callers decide *which* leaves go where and build the plan with one of two functions:

- :func:`plan_groups`: given groups of leaf indices, one buffer per group holding its whole
  leaves (``jaxcomm.allreduce``: a large leaf alone, the small ones of a dtype together,
  or all of a dtype for the ppermute algorithms;
  ``sync_gradients``' compressed leaves: one buffer per dtype).
- :func:`plan_streams`: leaves in a given order, one stream per dtype, cut at element
  counts (``jaxcomm.buckets.plan_buckets``: reverse parameter order, ``min_bytes`` then
  ``max_bytes``).

Packing keeps replication types: a buffer of leaves that vary over a mesh axis varies over
it (``jnp.concatenate`` under ``shard_map(check_vma=True)``), and an unpacked leaf has the
type of the buffers it came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import backend

__all__ = ["Buffer", "BufferPlan", "plan_groups", "plan_streams"]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One flat buffer: a 1-D array of one dtype.

    Attributes:
      dtype: element type.
      pieces: ``(leaf_index, start, stop)`` element ranges of raveled leaves, in buffer order.
      elements: buffer length.
      nbytes: buffer size in bytes.
    """

    dtype: Any
    pieces: tuple[tuple[int, int, int], ...]
    elements: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """How a list of leaves maps to flat buffers; build it with :func:`plan_groups` or
    :func:`plan_streams`.

    Attributes:
      buffers: the buffers, in the order :meth:`pack` returns them.
      shapes: shapes of all leaves of the list (also those in no buffer).
      dtypes: dtypes of all leaves.

    Example:
      >>> plan = plan_groups(leaves, [[0, 2], [1]])
      >>> bufs = plan.pack(leaves)                         # two 1-D arrays
      >>> leaves = plan.unpack([jax.lax.psum(b, 'intra') for b in bufs])
    """

    buffers: tuple[Buffer, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @property
    def buckets(self) -> tuple[Buffer, ...]:
        """The buffers, by their name in ``jaxcomm.buckets`` (gradient buckets)."""
        return self.buffers

    def pack(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """Leaves -> list of 1-D buffers (``leaves`` as in the plan; only the leaves of
        some piece are read)."""
        flat: dict[int, jax.Array] = {}  # one ravel per leaf, also when cut
        out = []
        for b in self.buffers:
            parts = []
            for i, s, e in b.pieces:
                if i not in flat:
                    flat[i] = jnp.ravel(leaves[i])
                whole = (s, e) == (0, flat[i].shape[0])
                parts.append(flat[i] if whole else flat[i][s:e])
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return out

    def unpack(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
        """List of 1-D buffers -> leaves, with the shapes and dtypes of the plan.

        Buffers with leading axes (``(..., elements)``, all alike: e.g. each device's
        buffer as a row, from ``lax.all_gather(buf, axis)``) give leaves with the same
        leading axes, ``(..., *shape)``.

        A leaf in no buffer (left out of the plan, or an empty leaf of
        :func:`plan_streams`) comes back as zeros; :meth:`unpack_into` restores only the
        leaves the plan holds.
        """
        return self._unpack(buffers, range(len(self.shapes)))

    def leaves(self) -> list[int]:
        """Indices of the leaves some buffer holds, in ascending order."""
        return sorted({i for b in self.buffers for i, _, _ in b.pieces})

    def unpack_into(self, buffers: Sequence[jax.Array], out: list) -> None:
        """Writes the leaves this plan holds into ``out[i]`` (other entries untouched)."""
        idx = self.leaves()
        for i, leaf in zip(idx, self._unpack(buffers, idx), strict=True):
            out[i] = leaf

    def _unpack(self, buffers: Sequence[jax.Array], idx: Iterable[int]) -> list[jax.Array]:
        if len(buffers) != len(self.buffers):
            raise ValueError(f"expected {len(self.buffers)} buffers, got {len(buffers)}.")
        want = set(idx)
        ranges = []  # (buffer, offset, stop) of each piece that needs a slice
        owners = []  # (leaf, start) of each such piece
        parts: dict[int, list[tuple[int, jax.Array]]] = {}
        lead = tuple(buffers[0].shape[:-1]) if buffers else ()
        for b, buf in zip(self.buffers, buffers, strict=True):
            if len(b.pieces) == 1 and b.pieces[0][2] - b.pieces[0][1] == buf.shape[-1]:
                i, s, _ = b.pieces[0]  # the buffer is one piece: no slice
                parts.setdefault(i, []).append((s, buf))
                continue
            offset = 0
            for i, s, e in b.pieces:
                if i in want:
                    ranges.append((buf, offset, offset + e - s))
                    owners.append((i, s))
                offset += e - s
        # Static slices; at runtime offsets where the backend row says so (XLA:CPU), for
        # 1-D buffers (rows of buffers are sliced statically).
        if backend.current().runtime_offsets and not lead:
            pieces = backend.slices_at_runtime_offsets(ranges)
        else:
            pieces = [lax.slice_in_dim(buf, o, stop, axis=-1) for buf, o, stop in ranges]
        for (i, s), piece in zip(owners, pieces, strict=True):
            parts.setdefault(i, []).append((s, piece))
        out = []
        for i in idx:
            shape, dtype = self.shapes[i], self.dtypes[i]
            if i not in parts:
                out.append(jnp.zeros(lead + shape, dtype))
                continue
            ps = [p for _, p in sorted(parts[i], key=lambda t: t[0])]
            flat = ps[0] if len(ps) == 1 else jnp.concatenate(ps, axis=-1)
            leaf = flat.reshape(lead + shape)
            out.append(leaf if leaf.dtype == dtype else leaf.astype(dtype))
        return out

    def specs(self, divisor: int | None = None) -> list[jax.ShapeDtypeStruct]:
        """Shapes of the buffers; with ``divisor``, of one of ``divisor`` equal shards of
        each (length rounded up), e.g. a device's intra-node share."""
        return [
            jax.ShapeDtypeStruct(
                (b.elements if divisor is None else -(-b.elements // divisor),), b.dtype
            )
            for b in self.buffers
        ]


def _shapes_dtypes(leaves: Sequence[Any]) -> tuple[tuple, tuple]:
    """``(shapes, dtypes)`` of arrays or ``jax.ShapeDtypeStruct`` s, as plans hold them."""
    shapes = tuple(tuple(int(d) for d in jnp.shape(x)) for x in leaves)
    return shapes, tuple(jnp.dtype(jnp.result_type(x)) for x in leaves)


def plan_groups(leaves: Sequence[Any], groups: Iterable[Sequence[int]]) -> BufferPlan:
    """One buffer per group of leaf indices, holding the group's whole leaves in order.

    Args:
      leaves: arrays or ``jax.ShapeDtypeStruct`` s.
      groups: non-empty lists of indices into ``leaves``; the leaves of one group share a
        dtype, a leaf is in one group at most. Leaves in no group are not packed.

    Returns:
      A :class:`BufferPlan`.

    Example:
      >>> plan = plan_groups(leaves, [[0], [1, 2]])  # leaf 0 alone; 1 and 2 together
    """
    shapes, dtypes = _shapes_dtypes(leaves)
    groups = [list(g) for g in groups]
    taken = [i for g in groups for i in g]
    if len(set(taken)) != len(taken):
        raise ValueError(f"groups={groups}: a leaf is in more than one group.")
    buffers = []
    for g in groups:
        dtype = dtypes[g[0]]
        if any(dtypes[i] != dtype for i in g):
            raise ValueError(
                f"leaves {list(g)} of one buffer have dtypes {[dtypes[i] for i in g]}."
            )
        pieces, n = [], 0
        for i in g:
            size = int(np.prod(shapes[i]))
            pieces.append((i, 0, size))
            n += size
        buffers.append(Buffer(dtype, tuple(pieces), n, n * dtype.itemsize))
    return BufferPlan(tuple(buffers), shapes, dtypes)


def plan_streams(
    leaves: Sequence[Any],
    order: Iterable[int],
    *,
    first_bytes: int | None = None,
    max_bytes: int | None = None,
) -> BufferPlan:
    """Leaves in ``order``, laid end to end per dtype, cut into buffers of bounded size.

    Each dtype is one stream (streams in order of their first leaf in ``order``); its first
    buffer holds ``first_bytes``, every further one ``max_bytes``, the last the remainder. A
    leaf may straddle a cut. ``None`` bounds: one buffer per dtype. Empty leaves are in no
    buffer.

    Args:
      leaves: arrays or ``jax.ShapeDtypeStruct`` s.
      order: indices into ``leaves``, the order in which they are laid out; leaves not
        listed are not packed.
      first_bytes: size of each stream's first buffer (default ``max_bytes``).
      max_bytes: size of every further buffer (``None``: no cut).

    Returns:
      A :class:`BufferPlan`.
    """
    if first_bytes is not None and max_bytes is None:
        raise ValueError(f"first_bytes={first_bytes} needs max_bytes (the later buffers).")
    shapes, dtypes = _shapes_dtypes(leaves)
    streams: dict[Any, list[int]] = {}
    for i in order:
        if int(np.prod(shapes[i])) > 0:
            streams.setdefault(dtypes[i], []).append(i)
    first_bytes = max_bytes if first_bytes is None else first_bytes
    buffers: list[Buffer] = []
    for dtype, idx in streams.items():
        itemsize = dtype.itemsize
        cap = None if first_bytes is None else max(1, first_bytes // itemsize)
        pieces: list[tuple[int, int, int]] = []
        filled = 0
        for i in idx:
            size, start = int(np.prod(shapes[i])), 0
            while start < size:
                take = size - start if cap is None else min(size - start, cap - filled)
                pieces.append((i, start, start + take))
                filled += take
                start += take
                if filled == cap:
                    buffers.append(Buffer(dtype, tuple(pieces), filled, filled * itemsize))
                    pieces, filled = [], 0
                    cap = max(1, max_bytes // itemsize)
        if pieces:
            buffers.append(Buffer(dtype, tuple(pieces), filled, filled * itemsize))
    return BufferPlan(tuple(buffers), shapes, dtypes)
