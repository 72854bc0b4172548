"""Binomial-tree all-reduce from ``lax.ppermute``: reduce to rank 0, then broadcast.

``ceil(lg p)`` steps each way, every step moving the whole buffer: latency-optimal
(``2 lg p`` messages) but not bandwidth-optimal (``2 lg p * n`` bytes on the busiest link),
so it pays off only for small buffers. Ranks are ``lax.axis_index(axes)`` over the axes
taken together (row-major).

The result is equal on every device but "varying" in shard_map's type system: call it under
``jax.shard_map(..., check_vma=False)``.

References:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
  MPICH" (IJHPCA 2005), binomial reduce and broadcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives.base import axes_size, register_algorithm

__all__ = ["tree_allreduce"]


@register_algorithm("tree")
def tree_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums ``x`` over ``axes`` with a binomial tree.

    1. Reduce: for ``k = 1, 2, 4, ...`` every rank ``r`` with ``r mod 2k == k`` sends its
       partial sum to ``r - k``, which adds it. A rank that sent never receives again, so
       adding what ``ppermute`` returns (zeros where nothing arrives) is safe everywhere.
       Rank 0 ends with the full sum.
    2. Broadcast: the same pairs in reverse order; receivers (``r mod 2k == k``) replace
       their value with the one received.

    Args:
      x: per-device array (inside ``jax.shard_map``).
      axes: mesh axis names, taken together as one group of ``p`` ranks.

    Returns:
      The sum over all devices of ``axes``, same shape and dtype as ``x``.
    """
    p = axes_size(axes)
    if p == 1:
        return x
    rank = lax.axis_index(axes)
    ks = []
    k = 1
    while k < p:
        ks.append(k)
        k *= 2
    for k in ks:
        perm = [(r, r - k) for r in range(k, p, 2 * k)]
        x = x + lax.ppermute(x, axes, perm)
    for k in reversed(ks):
        perm = [(r - k, r) for r in range(k, p, 2 * k)]
        recv = lax.ppermute(x, axes, perm)
        x = jnp.where((rank % (2 * k)) == k, recv, x)
    return x
