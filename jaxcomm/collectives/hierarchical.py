"""Hierarchical all-reduce over nested mesh axes.

References:
  Jia et al., "Highly Scalable Deep Learning Training System with Mixed-Precision" (2018);
  Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``; NCCL's tree/ring split inside a node.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from jaxcomm.collectives.base import pad_to_multiple, reduce_scatter, register_algorithm


def all_gather_invariant(x: jax.Array, axes: str | tuple[str, ...], *, axis: int = 0) -> jax.Array:
    """Tiled all-gather of ``x`` over ``axes`` whose result shard_map types as invariant.

    ``lax.all_gather(..., to='invarying')`` tells shard_map's replication check
    (``check_vma=True``) that the gathered value is the same on every device of ``axes``
    (it is), so callers may return it with ``out_specs=P()``. Pieces are concatenated in
    the order of ``lax.axis_index(axes)`` (row-major over ``axes``). The wire is that of a
    plain all-gather.

    Args:
      x: the per-device piece (inside ``jax.shard_map``).
      axes: a mesh axis name or a tuple of them.
      axis: the dimension along which the pieces are concatenated.

    Returns:
      The concatenation of every device's ``x`` along ``axis``.
    """
    return lax.all_gather(x, axes, axis=axis, tiled=True, to="invarying")


@register_algorithm("hierarchical")
def hierarchical_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums a 1-D ``x`` over ``axes``, innermost (fastest) axis first.

    With ``axes=('inter', 'intra')``, ``g`` devices per node and ``m`` nodes:

    1. reduce-scatter over ``'intra'``: each device keeps the sum of 1/g of the buffer
       (fast links only);
    2. all-reduce over ``'inter'`` on that 1/g shard (each slow link carries 1/g of the
       data of a flat ring over all devices' traffic per node);
    3. all-gather over ``'intra'`` to rebuild the full sum on every device.

    More than two axes recurse: step 2 is itself hierarchical over the outer axes. A
    buffer whose length does not divide by the inner group sizes is zero-padded. On CPU
    with several processes (gloo), step 1 is a ring of ppermutes (jax-ml/jax#40830).

    Args:
      x: 1-D per-device array (inside ``jax.shard_map``).
      axes: mesh axis names, outermost first, e.g. ``('inter', 'intra')``.

    Returns:
      The sum over all devices of ``axes``, same shape as ``x``.
    """
    if len(axes) == 1:
        return lax.psum(x, axes[0])
    inner = axes[-1]
    inner_sizes = int(np.prod([lax.axis_size(a) for a in axes[1:]]))
    n = x.shape[0]
    padded, _ = pad_to_multiple(x, inner_sizes)
    shard = reduce_scatter(padded, inner)
    shard = hierarchical_allreduce(shard, axes[:-1])
    full = all_gather_invariant(shard, inner)
    return full[:n]
