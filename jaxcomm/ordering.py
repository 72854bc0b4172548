"""The order of collectives across control flow, fixed by data dependencies (XLA:CPU).

XLA:CPU runs a computation as a dataflow graph and chains its collectives only by
*scheduling* edges: the next may start once the previous one's ``Execute`` returned. A
``lax.cond`` / ``lax.switch`` / ``lax.scan`` runs its body on a nested executor that can
return before the collectives inside it finish, so a later collective that does not depend
on its result may run concurrently with them. Gloo, XLA:CPU's transport between
processes, pairs the operations of one communicator in the order they are issued (one tag
for all of them): two devices that interleave them differently exchange the wrong buffers
or wait for each other until the collective timeout. In one process the devices meet at a
rendezvous keyed by the operation, so nothing shows there.

:func:`after` gives a value a data dependency on others that XLA cannot remove: a
collective computed from ``after(x, y)`` waits until ``y`` is complete. It is applied
only when the program is compiled for the CPU (``lax.platform_dependent``); elsewhere it
returns ``x`` untouched, and the compiled program is the plain one.
``jaxcomm.hlo.ordering_hazards`` finds what is left in a compiled module.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.state import varying_axes

__all__ = ["after"]


def _word(x: jax.Array) -> jax.Array:
    """One int32 read from ``x`` (its first element's bits): a read of ``x``'s buffer."""
    first = jnp.ravel(x)[:1]
    size = np.dtype(first.dtype).itemsize
    if first.dtype == jnp.bool_:
        return first[0].astype(jnp.int32)
    if size == 8:
        return lax.bitcast_convert_type(first, jnp.int32)[0, 0]
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}[size]
    return lax.bitcast_convert_type(first[0], ints).astype(jnp.int32)


def _zero(deps: list[jax.Array]) -> jax.Array:
    """An int32 zero that XLA cannot fold, computed from one element of each of ``deps``.

    The rows ``(0, 1)`` sorted stably on two equal runtime keys stay in place: the first
    is 0 whatever the keys hold, and no XLA pass knows it.
    """
    key = sum((_word(d) for d in deps), jnp.zeros((), jnp.int32))
    _, rows = lax.sort([jnp.stack([key, key]), jnp.arange(2, dtype=jnp.int32)], num_keys=1)
    return rows[0]


def _plus(x: jax.Array, zero: jax.Array) -> jax.Array:
    """``x`` with ``zero`` added to its bits (the same bits, now computed from ``zero``)."""
    if x.dtype == jnp.bool_:
        return x ^ (zero != 0)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x + zero.astype(x.dtype)
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[np.dtype(x.dtype).itemsize]
    if ints == jnp.int64 and not jax.config.jax_enable_x64:
        return lax.bitcast_convert_type(
            lax.bitcast_convert_type(x, jnp.int32) + zero, x.dtype
        )  # f64 as pairs of words
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, ints) + zero.astype(ints), x.dtype)


def after(x: Any, *deps: Any) -> Any:
    """``x`` (a pytree), made to depend on every array of ``deps`` when compiled for a CPU.

    Every array of ``x`` keeps its value, bit for bit; on the CPU it is computed from an
    int32 zero read out of ``deps`` (one element of each), so whatever consumes it runs
    after ``deps`` are complete. Use it on the inputs of a collective that must not start
    while a conditional or loop holding collectives (``deps`` are its outputs) may still be
    running (module docstring). The replication type of ``x`` must cover that of ``deps``
    (inside ``shard_map``, a varying dependency would make an invariant ``x`` varying):
    an array of ``x`` depends on the arrays of ``deps`` that vary over no more mesh axes
    than it does.

    Args:
      x: a pytree of arrays.
      *deps: pytrees of arrays whose completion ``x`` must wait for.

    Returns:
      ``x``, unchanged in value.

    Example:
      >>> reduced = lax.switch(level, branches, buffers)  # holds collectives
      >>> plain = jaxcomm.allreduce(after(plain, reduced), op="mean")
    """
    leaves = [d for d in jax.tree.leaves(deps) if jnp.size(d) > 0]
    if not leaves or not jax.tree.leaves(x):
        return x

    def tied(x, leaves):
        def one(a):
            # Only dependencies that vary over no more axes than ``a``: reading the others
            # would change ``a``'s replication type (module docstring of jaxcomm.state).
            a = jnp.asarray(a)
            mine = varying_axes(a)
            usable = [d for d in leaves if varying_axes(d) <= mine]
            return _plus(a, _zero(usable)) if usable else a

        return jax.tree.map(one, x)

    return lax.platform_dependent(x, leaves, cpu=tied, default=lambda x, leaves: x)
