"""The order of collectives across control flow, fixed by data dependencies (XLA:CPU).

XLA:CPU chains its collectives only by scheduling edges, and runs the body of a
``lax.cond`` / ``lax.switch`` / ``lax.scan`` on a nested executor that can return before
the collectives inside it finish; gloo, its transport between processes, pairs the
operations of one communicator in the order they are issued. A collective that does not
depend on such a conditional's result may then run concurrently with the collectives
inside it, and devices that interleave them differently exchange the wrong buffers
(``jaxcomm.backend``, reason 6). In one process the devices meet at a rendezvous keyed by
the operation, so nothing shows there.

:func:`after` gives a value a data dependency on others that XLA cannot remove: a
collective computed from ``after(x, y)`` waits until ``y`` is complete. It is applied only
where the backend row says ``tie_collective_order`` (a CPU mesh); elsewhere it returns
``x`` untouched, and the compiled program is the plain one.
``jaxcomm.hlo.ordering_hazards`` finds what is left in a compiled module.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import backend
from jaxcomm.state import varying_axes

__all__ = ["after"]


def after(x: Any, *deps: Any) -> Any:
    """``x`` (a pytree), made to depend on every array of ``deps`` on a CPU mesh.

    Every array of ``x`` keeps its value, bit for bit; on a CPU mesh it is computed from
    an int32 zero read out of ``deps`` (``jaxcomm.backend.tie``), so whatever consumes it
    runs after ``deps`` are complete. Use it on the inputs of a collective that must not start
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
    if not leaves or not jax.tree.leaves(x) or not backend.current().tie_collective_order:
        return x

    # Arrays tie only to dependencies that vary over no more axes than they do (reading
    # the others would change their replication type, module docstring of jaxcomm.state);
    # the arrays of one replication type share one zero (one read of ``deps``).
    flat, treedef = jax.tree.flatten(x)
    flat = [jnp.asarray(a) for a in flat]
    groups: dict[frozenset, list[int]] = {}
    for i, a in enumerate(flat):
        groups.setdefault(frozenset(varying_axes(a)), []).append(i)
    for mine, members in groups.items():
        usable = [d for d in leaves if varying_axes(d) <= mine]
        if usable:
            tied = backend.tie_all([flat[i] for i in members], usable)
            for i, t in zip(members, tied, strict=True):
                flat[i] = t
    return jax.tree.unflatten(treedef, flat)
