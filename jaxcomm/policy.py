"""Which gradient leaves ``sync_gradients`` compresses, and into which buffers.

Step 1 of :func:`jaxcomm.sync_gradients` with ``compression=``: every leaf is *compressed*
(``min_size`` elements or more, or what the ``compress_leaf`` predicate says, and a shape
the compressor supports) or *plain*. Compressed leaves of an elementwise compressor are
packed into one flat buffer per dtype, or into the gradient buckets of ``bucket_bytes``;
matrix compressors (PowerSGD) get the leaves themselves. The packing itself is a
``jaxcomm.packing.BufferPlan``; this module only decides which leaves and which layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.buckets import plan_buckets
from jaxcomm.compression.base import Compressor
from jaxcomm.packing import plan_streams

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
        # ``bucket_bounds`` (leaves -> buckets -> compressor): a ``jaxcomm.packing`` plan over
        # all leaves that packs only the compressed ones. Matrix compressors get the leaves.
        self.packing = None
        leaves = [x for _, x in paths_leaves]
        if self.elementwise and bucket_bounds is not None and self.compressed:
            lo, hi = bucket_bounds([leaves[i] for i in self.compressed])
            self.packing = plan_buckets(leaves, min_bytes=lo, max_bytes=hi, indices=self.compressed)
        elif self.elementwise:
            self.packing = plan_streams(leaves, self.compressed)

    def pack(self, leaves: list) -> list[jax.Array]:
        """All leaves -> the compressor's buffers (flat buffers, or the matrix leaves)."""
        if self.packing is None:
            return [leaves[i] for i in self.compressed]
        return self.packing.pack(leaves)

    def unpack(self, buffers: list[jax.Array], out: list) -> None:
        """Writes the compressed leaves restored from ``buffers`` into ``out``."""
        if self.packing is not None:
            self.packing.unpack_into(buffers, out)
            return
        for i, buf in zip(self.compressed, buffers, strict=True):
            out[i] = buf.reshape(self.shapes[i])

    def buffer_specs(self, inner_size: int | None) -> list[jax.ShapeDtypeStruct]:
        """Shapes of the compressor's buffers; with ``inner_size``
        (``compress_stage='inter'``), of one device's intra-node shard of each."""
        if self.packing is None:
            return [jax.ShapeDtypeStruct(self.shapes[i], self.dtypes[i]) for i in self.compressed]
        return self.packing.specs(inner_size)
