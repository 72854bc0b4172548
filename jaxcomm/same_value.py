"""Proofs, from a step's jaxpr, that values typed varying hold the same bits on every device.

``jax.shard_map(..., check_vma=True)`` types a value *varying* when it may differ across
devices. The type is conservative: a copy of a replicated value made varying (``pcast``,
``pvary``) is typed varying although every device holds the same bits, and so is anything
computed from it. A Flax front end gives each device a varying copy of the params (so that
each differentiates its own); a step that then reads the old params after the update, as
Flax's mixed-precision examples do (``jnp.where(is_fin, new_state.params, state.params)``),
returns params typed varying that are the same on every device.

:func:`same_on_every_device` proves that from the dataflow of the shard_map's body:

1. An input (or constant) typed invariant is the same everywhere; a batch input is not.
2. An equation's outputs typed invariant are the same everywhere (the type guarantees it).
3. ``pcast`` / ``pvary`` keep the value: their output is the same iff their input is.
4. Any other equation is deterministic (XLA computes the same bits from the same inputs on
   the same kind of device), so its outputs are the same iff all its inputs are, unless it
   or a jaxpr nested in it depends on the device: ``axis_index``, an exchange that gives
   each device its own part (``all_to_all``, ``psum_scatter``), a host callback, a
   stateful RNG, or any other equation that makes a varying value from invariant inputs.

The proof is what lets :class:`jaxcomm.flax_step.FlaxStep` return such params as replicated
with an unchecked per-device read (no collective); ``check_replicas`` then compares them by
their bits at run time, as every replicated leaf.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal

__all__ = ["same_on_every_device"]

# Primitives whose result depends on which device computes it.
_DEVICE_DEPENDENT = frozenset(
    {
        "axis_index",
        "all_to_all",
        "ragged_all_to_all",
        "psum_scatter",
        "reduce_scatter",
        "rng_uniform",
        "pure_callback",
        "io_callback",
        "debug_callback",
        "infeed",
    }
)
# Primitives that change a value's type to varying and keep its bits.
_RETYPE = frozenset({"pvary", "pcast"})


def _varies(var: Any, axes: frozenset) -> bool:
    """Whether a jaxpr variable is typed varying over any of ``axes``."""
    aval = getattr(var, "aval", None)
    mat = getattr(aval, "mat", None)
    varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", ())
    return bool(frozenset(varying or ()) & axes)


def _nested(params: dict) -> list:
    """The jaxprs among an equation's parameters (a ``cond``'s branches, a ``jit``'s body)."""
    found = []
    for value in params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            jaxpr = getattr(v, "jaxpr", v)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(jaxpr, "eqns"):
                found.append(jaxpr)
    return found


def _depends_on_device(eqn: Any, axes: frozenset) -> bool:
    """Whether ``eqn``, or an equation nested in it, may compute different bits on
    different devices from the same inputs."""
    name = eqn.primitive.name
    if name in _DEVICE_DEPENDENT:
        return True
    if name not in _RETYPE:
        ins = [v for v in eqn.invars if hasattr(v, "aval")]
        if any(_varies(v, axes) for v in eqn.outvars) and not any(_varies(v, axes) for v in ins):
            return True  # a varying value made from invariant ones: the device's own
    return any(_depends_on_device(e, axes) for j in _nested(eqn.params) for e in j.eqns)


def same_on_every_device(jaxpr: Any, inputs_same: list[bool], axes: tuple[str, ...]) -> list[bool]:
    """Per output of ``jaxpr`` (a shard_map's body): proven the same bits on every device.

    Args:
      jaxpr: the body of a ``jax.shard_map(..., check_vma=True)`` (its equation's
        ``params['jaxpr']``), typed with the manual axes.
      inputs_same: per input of ``jaxpr``: the same on every device (replicated state);
        False for the batch and per-device state.
      axes: the mesh axes the devices are spread over.

    Returns:
      One flag per output: True where the algorithm in the module docstring proves it.

    Example:
      >>> closed = jax.make_jaxpr(jax.shard_map(step, mesh=mesh, in_specs=(P(), P('d')),
      ...                                      out_specs=P('d')))(params, batch)
      >>> body = next(e for e in closed.eqns if e.primitive.name == 'shard_map')
      >>> same_on_every_device(body.params['jaxpr'], [True, False], ('d',))
    """
    names = frozenset(axes)
    if len(inputs_same) != len(jaxpr.invars):
        raise ValueError(f"{len(inputs_same)} flags for {len(jaxpr.invars)} inputs")
    same: dict = {
        v: bool(s) or not _varies(v, names) for v, s in zip(jaxpr.invars, inputs_same, strict=True)
    }
    same.update({v: True for v in jaxpr.constvars})

    def is_same(v: Any) -> bool:
        if isinstance(v, Literal):
            return True  # a constant in the program
        return same[v] if v in same else not _varies(v, names)

    for eqn in jaxpr.eqns:
        inputs = all(is_same(v) for v in eqn.invars)
        if eqn.primitive.name in _RETYPE:
            result = inputs
        else:
            result = inputs and not _depends_on_device(eqn, names)
        for v in eqn.outvars:
            same[v] = result or not _varies(v, names)
    return [is_same(v) for v in jaxpr.outvars]
