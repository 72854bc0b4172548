"""Recursive halving-doubling all-reduce (Rabenseifner) from ``lax.ppermute``.

Reduce-scatter by recursive halving, all-gather by recursive doubling: ``2 lg p`` messages
(latency-optimal, like a tree) and ``2(p-1)/p n`` bytes per device (bandwidth-optimal, like
a ring). Partners are ``rank XOR 2^k`` with the distance doubling, so the first and largest
exchange (``n/2`` bytes) is between neighbours in the mesh (the same node), and only the
small late exchanges cross the network.

For ``p`` not a power of two, ``rem = p - 2^floor(lg p)`` ranks fold first: among the first
``2 rem`` ranks each even rank sends its buffer to the odd rank after it and sits out; the
survivors run the power-of-two algorithm and hand the result back at the end (two extra
messages of ``n`` bytes).

The result is equal on every device but "varying" in shard_map's type system: call it under
``jax.shard_map(..., check_vma=False)``.

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

__all__ = ["halving_doubling_allreduce"]


@register_algorithm("halving_doubling")
def halving_doubling_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums a 1-D ``x`` over ``axes`` by recursive halving then recursive doubling.

    1. (p not a power of two) Fold: even ranks ``< 2 rem`` send ``x`` to ``rank + 1``,
       which adds it. The ``q = 2^floor(lg p)`` survivors get new ranks ``0..q-1``.
    2. Reduce-scatter, ``k = 0 .. lg q - 1``: exchange with new rank ``new XOR 2^k``; the
       rank whose bit ``k`` is 0 keeps the lower half of its current segment and sends the
       upper half (the partner does the opposite); add what arrives. Each survivor ends
       with ``1/q`` of the sum.
    3. All-gather, ``k = lg q - 1 .. 0``: exchange segments with the same partners and
       concatenate in bit order, doubling the segment each step.
    4. (p not a power of two) Unfold: the odd ranks ``< 2 rem`` send the result back.

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
    for k in reversed(range(len(bits))):  # step 3
        recv = lax.ppermute(buf, axes, perms[k])
        upper = bits[k] == 1
        buf = jnp.where(upper, jnp.concatenate([recv, buf]), jnp.concatenate([buf, recv]))
    out = buf[:n]
    if rem:  # step 4
        back = lax.ppermute(out, axes, [(2 * i + 1, 2 * i) for i in range(rem)])
        folded = (rank < 2 * rem) & (rank % 2 == 0)
        out = jnp.where(folded, back, out)
    return out
