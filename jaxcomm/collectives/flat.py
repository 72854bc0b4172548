"""Flat all-reduce: one ``psum`` over all data axes; XLA and the backend (NCCL, gloo) pick
the algorithm."""

from __future__ import annotations

import jax
from jax import lax

from jaxcomm.collectives.base import register_algorithm


@register_algorithm("flat")
def flat_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums ``x`` over ``axes`` with a single all-reduce.

    Args:
      x: the per-device array (inside ``jax.shard_map``).
      axes: mesh axis names to reduce over.

    Returns:
      The sum over all devices of ``axes``, on every device.
    """
    return lax.psum(x, axes)
