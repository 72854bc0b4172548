"""Which gradient leaves ``sync_gradients`` compresses, and how they are packed.

Step 1 of :func:`jaxcomm.sync_gradients` with ``compression=``: every leaf is *compressed*
(``min_size`` elements or more, or what the ``compress_leaf`` predicate says, and a shape
the compressor supports) or *plain*. Compressed leaves of an elementwise compressor are
packed into one flat buffer per dtype, or into the gradient buckets of ``bucket_bytes``;
matrix compressors (PowerSGD) get the leaves themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.buckets import plan_buckets
from jaxcomm.compression.base import Compressor

__all__ = ["LeafPlan"]


class LeafPlan:
    """Which leaves are compressed, and how they are packed for the compressor.

    Args:
      tree: the gradient (or params) tree.
      compressor: the compressor.
      min_size: leaves with fewer elements stay plain (unless ``predicate`` decides).
      predicate: optional ``(path, leaf) -> bool``.
      stage: ``'all'`` or ``'inter'`` (``compress_stage`` of ``sync_gradients``).
      bucket_bounds: optional ``leaves -> (min_bytes, max_bytes)``: elementwise compressors
        then get gradient buckets instead of one buffer per dtype.
    """

    def __init__(
        self,
        tree: Any,
        compressor: Compressor,
        min_size: int,
        predicate,
        stage: str,
        bucket_bounds=None,
    ):
        paths_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.compressed: list[int] = []
        self.plain: list[int] = []
        self.shapes = [tuple(jnp.shape(x)) for _, x in paths_leaves]
        self.dtypes = [jnp.result_type(x) for _, x in paths_leaves]
        for i, (path, leaf) in enumerate(paths_leaves):
            shape = self.shapes[i]
            if predicate is not None:
                want = bool(predicate(jax.tree_util.keystr(path), leaf))
            else:
                want = int(np.prod(shape)) >= min_size
            if want and int(np.prod(shape)) > 0 and compressor.supports(shape):
                self.compressed.append(i)
            else:
                self.plain.append(i)
        self.elementwise = compressor.elementwise
        self.stage = stage
        # Elementwise compressors get one flat buffer per dtype, or the gradient buckets of
        # ``bucket_bounds`` (leaves -> buckets -> compressor); matrix compressors get the
        # leaves.
        self.groups: list[list[int]] = []
        self.buckets = None
        if self.elementwise and bucket_bounds is not None and self.compressed:
            specs = [jax.ShapeDtypeStruct(self.shapes[i], self.dtypes[i]) for i in self.compressed]
            lo, hi = bucket_bounds(specs)
            self.buckets = plan_buckets(specs, min_bytes=lo, max_bytes=hi)
        elif self.elementwise:
            by_dtype: dict[Any, list[int]] = {}
            for i in self.compressed:
                by_dtype.setdefault(self.dtypes[i], []).append(i)
            self.groups = list(by_dtype.values())
        else:
            self.groups = [[i] for i in self.compressed]

    def pack(self, leaves: list) -> list[jax.Array]:
        if self.buckets is not None:
            return self.buckets.pack([leaves[i] for i in self.compressed])
        if not self.elementwise:
            return [leaves[g[0]] for g in self.groups]
        return [jnp.concatenate([jnp.ravel(leaves[i]) for i in g]) for g in self.groups]

    def unpack(self, buffers: list[jax.Array], out: list) -> None:
        if self.buckets is not None:
            for i, r in zip(self.compressed, self.buckets.unpack(buffers), strict=True):
                out[i] = r
            return
        for g, buf in zip(self.groups, buffers, strict=True):
            if not self.elementwise:
                out[g[0]] = buf.reshape(self.shapes[g[0]])
                continue
            offset = 0
            for i in g:
                size = int(np.prod(self.shapes[i]))
                out[i] = buf[offset : offset + size].reshape(self.shapes[i])
                offset += size

    def buffer_specs(self, inner_size: int | None) -> list[jax.ShapeDtypeStruct]:
        if self.buckets is not None:
            return [
                jax.ShapeDtypeStruct(
                    (b.elements if inner_size is None else -(-b.elements // inner_size),),
                    b.dtype,
                )
                for b in self.buckets.buckets
            ]
        specs = []
        for g in self.groups:
            dtype = self.dtypes[g[0]]
            if not self.elementwise:
                specs.append(jax.ShapeDtypeStruct(self.shapes[g[0]], dtype))
                continue
            n = sum(int(np.prod(self.shapes[i])) for i in g)
            if inner_size is not None:  # compress_stage='inter': the intra shard
                n = -(-n // inner_size)
            specs.append(jax.ShapeDtypeStruct((n,), dtype))
        return specs
