"""Ring all-reduce: a ``lax.ppermute`` ring reduce-scatter (p-1 steps), then one all-gather.

The mesh axes passed in are one linearised ring of ``p`` devices (rank
``lax.axis_index(axes)``, row-major over the axes), so with ``('inter', 'intra')`` the ring
walks the devices of a node before crossing to the next node: ``p/g`` edges of the ring
leave a node, and with ``make_mesh(topology=...)`` consecutive nodes share a leaf.

The reduce-scatter phase is ``p-1`` ppermutes; the all-gather phase is one all-gather
(``all_gather_invariant``) instead of ``p-1`` more ppermutes: the same ``(p-1)/p n`` bytes
per device, and its result is typed *invariant* by shard_map's replication check
(``check_vma=True``), which a value built from ppermutes can never be (see
docs/architecture.md, "Replication invariant"). The backend picks the all-gather's own
schedule (NCCL: a ring; XLA:CPU: direct copies).

References:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations" (JPDC 2009); Baidu's ring all-reduce (Gibiansky, 2017).
"""

from __future__ import annotations

import jax

from jaxcomm.collectives.base import (
    axes_size,
    pad_to_multiple,
    register_algorithm,
    ring_reduce_scatter,
)
from jaxcomm.collectives.hierarchical import all_gather_invariant

__all__ = ["ring_allreduce"]


@register_algorithm("ring", packed=True)
def ring_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums a 1-D ``x`` over ``axes``: a ring reduce-scatter (``p-1`` neighbour exchanges),
    then an all-gather.

    1. Pad ``x`` to ``p`` equal chunks.
    2. Reduce-scatter (:func:`~jaxcomm.collectives.base.ring_reduce_scatter`): ``p-1``
       neighbour exchanges leave rank ``r`` with the full sum of chunk ``r``.
    3. All-gather those chunks: row ``r`` is chunk ``r``, so the gathered buffer
       is the sum in order; drop the padding. The result is identical on every device and
       typed invariant over ``axes``.

    Args:
      x: 1-D per-device array (inside ``jax.shard_map``).
      axes: mesh axis names, taken together as one ring.

    Returns:
      The sum over all devices of ``axes``, same shape and dtype as ``x``.
    """
    p = axes_size(axes)
    if p == 1:
        return x
    n = x.shape[0]
    padded, _ = pad_to_multiple(x, p)
    # Rank r ends the reduce-scatter with chunk r, so the all-gather's rows are already in
    # order: no rotation afterwards.
    return all_gather_invariant(ring_reduce_scatter(padded, axes), axes)[:n]
