"""Recursive halving-doubling all-reduce (Rabenseifner) from ``lax.ppermute``.

Reduce-scatter by recursive halving (``lg q`` ppermutes), then one all-gather
(``all_gather_invariant``) in place of recursive doubling: ``2(p-1)/p n`` bytes per device
(bandwidth-optimal, like a ring). Partners are ``rank XOR 2^k`` with the distance
doubling, so the first and largest exchange (``n/2`` bytes) is between neighbours in the
mesh (the same node), and only the small late exchanges cross the network.

Why an all-gather and not recursive doubling: a value built from ppermutes is typed
*varying* by shard_map's replication check (``check_vma=True``); the all-gather moves the
same ``(p-1)/p n`` bytes per device and its result is typed invariant (see
docs/architecture.md, "Replication invariant"). The backend picks its schedule.

For ``p`` not a power of two, ``rem = p - 2^floor(lg p)`` ranks fold first: among the first
``2 rem`` ranks each even rank sends its buffer to the odd rank after it and sits out; the
survivors run the halving; the all-gather then spans all ``p`` ranks (the folded ranks
send a segment nobody uses, ``rem/q n`` bytes extra, in place of the unfold's ``n``).

References:
  Rabenseifner, "Optimization of Collective Reduction Operations" (ICCS 2004);
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
  MPICH" (IJHPCA 2005), section 4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.collectives.base import axes_size, pad_to_multiple, register_algorithm
from jaxcomm.collectives.hierarchical import all_gather_invariant

__all__ = ["halving_doubling_allreduce"]


@register_algorithm("halving_doubling", packed=True)
def halving_doubling_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums a 1-D ``x`` over ``axes`` by recursive halving then an all-gather.

    1. (p not a power of two) Fold: even ranks ``< 2 rem`` send ``x`` to ``rank + 1``,
       which adds it. The ``q = 2^floor(lg p)`` survivors get new ranks ``0..q-1``.
    2. Reduce-scatter, ``k = 0 .. lg q - 1``: exchange with new rank ``new XOR 2^k``; the
       rank whose bit ``k`` is 0 keeps the lower half of its current segment and sends the
       upper half (the partner does the opposite); add what arrives. Each survivor ends
       with ``1/q`` of the sum.
    3. All-gather every rank's segment (typed invariant); survivor ``new`` holds segment
       ``bitreverse(new)``, so a static reorder of the gathered segments gives the sum.

    Args:
      x: 1-D per-device array (inside ``jax.shard_map``).
      axes: mesh axis names, taken together as one group of ``p`` ranks.

    Returns:
      The sum over all devices of ``axes``, same shape and dtype as ``x``.
    """
    p = axes_size(axes)
    if p == 1:
        return x
    n = x.shape[0]
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    rank = lax.axis_index(axes)
    survivors = [2 * i + 1 for i in range(rem)] + list(range(2 * rem, p))
    new_of_old = np.zeros(p, np.int32)
    new_of_old[survivors] = np.arange(q)
    new = jnp.asarray(new_of_old)[rank]
    if rem:  # step 1
        x = x + lax.ppermute(x, axes, [(2 * i, 2 * i + 1) for i in range(rem)])
    buf, _ = pad_to_multiple(x, q)
    bits = [(new >> k) & 1 for k in range(q.bit_length() - 1)]
    perms = [[(survivors[i], survivors[i ^ (1 << k)]) for i in range(q)] for k in range(len(bits))]
    for k, bit in enumerate(bits):  # step 2
        half = buf.shape[0] // 2
        lo, hi = buf[:half], buf[half:]
        upper = bit == 1
        recv = lax.ppermute(jnp.where(upper, lo, hi), axes, perms[k])
        buf = jnp.where(upper, hi, lo) + recv
    # Step 3. Segment s (in address order) was kept by the survivor whose new rank is s
    # with its lg q bits reversed (bit k of new rank picks the half at halving step k).
    lg = len(bits)
    owner = [survivors[int(format(s, f"0{lg}b")[::-1], 2) if lg else 0] for s in range(q)]
    gathered = all_gather_invariant(buf[None], axes)  # (p, n_pad / q), row = old rank
    return gathered[np.asarray(owner)].reshape(-1)[:n]
