"""Binomial-tree all-reduce: reduce to rank 0 along a binomial tree (``lax.ppermute``),
then broadcast the sum back.

The reduce is ``ceil(lg p)`` steps, each moving the whole buffer: latency-optimal
(``lg p`` messages) but not bandwidth-optimal, so it pays off only for small buffers.
Ranks are ``lax.axis_index(axes)`` over the axes taken together (row-major).

The broadcast is a scatter along the same binomial edges (step ``k`` moves ``k`` of the
``2^ceil(lg p)`` chunks) followed by one all-gather (``all_gather_invariant``): van de
Geijn's broadcast. A broadcast by ppermutes alone would leave the result typed *varying*
in shard_map's replication check, and only a collective can make a value invariant (see
docs/architecture.md, "Replication invariant"). Per device it receives at most ``n`` bytes
in the scatter plus ``(p-1)/p n`` in the all-gather, against ``n`` per binomial step
(``lg p n`` at the leaves of a binomial broadcast); it costs ``lg p`` permutes plus the
all-gather's latency instead of ``lg p`` permutes.

References:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
  MPICH" (IJHPCA 2005), binomial reduce and the scatter + all-gather broadcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives.base import axes_size, pad_to_multiple, register_algorithm
from jaxcomm.collectives.hierarchical import all_gather_invariant

__all__ = ["tree_allreduce"]


@register_algorithm("tree", packed=True)
def tree_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums ``x`` over ``axes`` with a binomial-tree reduce and a scatter + all-gather
    broadcast.

    1. Reduce: for ``k = 1, 2, 4, ...`` every rank ``r`` with ``r mod 2k == k`` sends its
       partial sum to ``r - k``, which adds it. A rank that sent never receives again, so
       adding what ``ppermute`` returns (zeros where nothing arrives) is safe everywhere.
       Rank 0 ends with the full sum.
    2. Scatter: rank 0's sum is cut into ``Q = 2^ceil(lg p)`` chunks; for ``k = Q/2, ...,
       1`` every rank ``r`` with ``r mod 2k == 0`` sends the upper ``k`` chunks of its
       ``2k`` to ``r + k`` (the reduce's edges, reversed). Rank ``r`` ends with chunk ``r``.
    3. All-gather the chunks (typed invariant) and drop the padding.

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
    shape, n = x.shape, x.size
    chunk = -(-n // p)
    buf, _ = pad_to_multiple(x.reshape(-1), 2 * ks[-1] * chunk)
    for k in reversed(ks):
        perm = [(r - k, r) for r in range(k, p, 2 * k)]
        recv = lax.ppermute(buf[k * chunk :], axes, perm)
        buf = jnp.where((rank % (2 * k)) == k, recv, buf[: k * chunk])
    return all_gather_invariant(buf, axes)[:n].reshape(shape)
