"""Gradient all-reduce algorithms, selected by name in :func:`allreduce`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import ordering
from jaxcomm.collectives import auto as _auto  # noqa: F401  (registers 'auto')
from jaxcomm.collectives import flat as _flat  # noqa: F401  (registers 'flat')
from jaxcomm.collectives import halving_doubling as _hd  # noqa: F401  (registers 'halving_doubling')
from jaxcomm.collectives import hierarchical as _hier  # noqa: F401  (registers 'hierarchical')
from jaxcomm.collectives import ring as _ring  # noqa: F401  (registers 'ring')
from jaxcomm.collectives import tree as _tree  # noqa: F401  (registers 'tree')
from jaxcomm.collectives.auto import check_topology, fit_to_mesh
from jaxcomm.collectives.base import (
    ALGORITHMS,
    OPS,
    SMALL_LEAF_ELEMENTS,
    allreduce_plan,
    axes_size,
    check_algorithm,
    check_axes,
    check_bound,
    check_float_tree,
    check_op,
    pad_to_multiple,
    reduce_scatter,
    register_algorithm,
)
from jaxcomm.collectives.flat import flat_allreduce
from jaxcomm.collectives.halving_doubling import halving_doubling_allreduce
from jaxcomm.collectives.hierarchical import all_gather_invariant, hierarchical_allreduce
from jaxcomm.collectives.ring import ring_allreduce
from jaxcomm.collectives.tree import tree_allreduce

# The algorithms, and the building blocks other jaxcomm packages (sync, compression,
# bench) use: import them from here, not from the submodules.
__all__ = [
    "ALGORITHMS",
    "OPS",
    "SMALL_LEAF_ELEMENTS",
    "all_gather_invariant",
    "allreduce",
    "allreduce_floats",
    "check_algorithm",
    "check_axes",
    "check_bound",
    "check_float_tree",
    "check_topology",
    "fit_to_mesh",
    "flat_allreduce",
    "halving_doubling_allreduce",
    "hierarchical_allreduce",
    "pad_to_multiple",
    "reduce_scatter",
    "register_algorithm",
    "ring_allreduce",
    "tree_allreduce",
]


def allreduce(
    tree: Any,
    *,
    axes: tuple[str, ...] = ("inter", "intra"),
    algorithm: str = "hierarchical",
    op: str = "mean",
    topology: Any = None,
    after: Any = (),
) -> Any:
    """All-reduces every leaf of ``tree`` over the data-parallel mesh axes.

    Call it inside ``jax.shard_map`` on the per-device values.

    Args:
      tree: a pytree of floating-point arrays (f32, bf16, f16, f64; scalars allowed).
      axes: mesh axis names, outermost first.
      algorithm: one of ``jaxcomm.collectives.ALGORITHMS`` ('flat', 'hierarchical', and
        the ones other modules register). 'ring', 'tree' and 'halving_doubling' run once
        per dtype on all its leaves packed into one buffer (they are built from ppermutes,
        which XLA compiles per call); the others once per large leaf.
      op: 'sum' or 'mean'.
      topology: a ``jaxcomm.topology.Topology`` that ``algorithm='auto'`` plans with
        (``jaxcomm.cost.choose`` per buffer: a large leaf alone, the small leaves per
        dtype); None: ``jaxcomm.topology.detect()``.
        Other algorithms ignore it. Every algorithm's result is typed invariant over
        ``axes`` by shard_map's replication check (``check_vma=True``), so it may leave a
        ``shard_map`` with ``out_specs=P()``.
      after: a pytree of arrays the collectives must wait for (``jaxcomm.ordering.after``
        on each packed buffer: on a CPU mesh, where a conditional holding collectives may
        still be running them; the values are unchanged).

    Returns:
      A pytree of the same structure, shapes and dtypes holding the reduced values.

    Raises:
      ValueError: unknown ``algorithm`` or ``op`` (the message lists the choices), or
        called outside ``jax.shard_map`` / over an axis the mesh lacks.
      TypeError: a leaf is not floating point (the message names its path), or
        ``topology`` is not a Topology.

    Example:
      >>> def step(g):
      ...     return jaxcomm.allreduce(g, algorithm='hierarchical', op='mean')
      >>> jax.shard_map(step, mesh=mesh, in_specs=P(('inter','intra')), out_specs=P())
    """
    check_algorithm(algorithm)
    check_op(op)
    axes = check_axes(axes)
    check_float_tree(tree)
    check_topology(topology)
    check_bound(
        axes,
        "jaxcomm.allreduce",
        "Call it inside jax.shard_map over a mesh with these axes (jaxcomm.make_mesh gives "
        "('inter', 'intra')), e.g. in a step built by jaxcomm.data_parallel(...).",
    )
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    leaves = [jnp.asarray(x) for x in leaves]
    # 'auto' picks per buffer of the leaf plan, before the buffers of each packed
    # algorithm are merged (allreduce_plan).
    if algorithm == "auto":
        plan, names = allreduce_plan(leaves, algorithm=lambda b: _auto.resolve(b, axes, topology))
    else:
        plan, names = allreduce_plan(leaves, algorithm=lambda _: algorithm)
    buffers = ordering.after(plan.pack(leaves), after)
    reduced = [ALGORITHMS[a](buf, axes) for a, buf in zip(names, buffers, strict=True)]
    if op == "mean":
        n = axes_size(axes)
        reduced = [(r / n).astype(r.dtype) for r in reduced]
    return jax.tree.unflatten(treedef, plan.unpack(reduced))


def allreduce_floats(tree: Any, axes: tuple[str, ...], op: str) -> Any:
    """:func:`allreduce` (``algorithm='flat'``) of the floating-point leaves of ``tree``;
    every other leaf is returned as it is.

    For the few floats a step reduces besides its gradient (batch statistics, metrics):
    they are packed into one buffer per dtype, so the step runs one all-reduce for them,
    not one per leaf. XLA combines per-leaf all-reduces into a tuple, and gloo (XLA:CPU's
    multi-process collectives) runs a tuple one operand after the other, each paying a
    ring's latency; one packed buffer pays it once.

    Args:
      tree: a pytree (inside ``jax.shard_map``).
      axes: mesh axis names, outermost first.
      op: 'sum' or 'mean'.

    Returns:
      ``tree`` with its floating leaves reduced over ``axes``.

    Example:
      >>> stats, metrics = allreduce_floats((stats, metrics), ('inter', 'intra'), 'mean')
    """
    flat, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(flat) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    reduced = allreduce([flat[i] for i in idx], axes=axes, algorithm="flat", op=op)
    for i, r in zip(idx, reduced, strict=True):
        flat[i] = r
    return jax.tree.unflatten(treedef, flat)
