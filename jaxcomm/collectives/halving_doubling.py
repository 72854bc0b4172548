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
    2. Reduce-scatter, ``k = 0 .. lg q - 1``: the buffer is ``q`` segments; exchange with
       new rank ``new XOR 2^k``; the rank whose bit ``k`` is 0 keeps the segments whose
       index has bit ``k`` 0 and sends the others (the partner does the opposite); add what
       arrives. Each survivor ends with segment ``new``: ``1/q`` of the sum.
    3. All-gather every rank's segment (typed invariant): the survivors' rows are the
       segments in order (for ``p`` a power of two, the gathered buffer is the sum).

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
    padded, _ = pad_to_multiple(x, q)
    # Row t of buf is segment (new mod 2^k) + 2^k t: at step k the rows split by the
    # parity of t (bit k of the segment index), so the survivor with new rank r ends with
    # segment r and the all-gather below needs no reorder (a bit-reversed assignment, from
    # splitting into contiguous halves, costs a permuting copy of the whole result).
    buf = padded.reshape(q, -1)
    bits = [(new >> k) & 1 for k in range(q.bit_length() - 1)]
    perms = [[(survivors[i], survivors[i ^ (1 << k)]) for i in range(q)] for k in range(len(bits))]
    for k, bit in enumerate(bits):  # step 2
        pairs = buf.reshape(-1, 2, buf.shape[1])
        even, odd = pairs[:, 0], pairs[:, 1]
        upper = bit == 1
        recv = lax.ppermute(jnp.where(upper, even, odd), axes, perms[k])
        buf = jnp.where(upper, odd, even) + recv
    gathered = all_gather_invariant(buf, axes)  # (p, n_pad / q), row = old rank
    if rem:  # step 3: the survivors' rows, in order (the folded ranks' rows are unused)
        gathered = gathered[np.asarray(survivors)]
    return gathered.reshape(-1)[:n]
