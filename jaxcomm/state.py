"""Per-device optimizer state: how a transform says "this part of my state is not replicated".

Data-parallel training replicates params and ordinary optimizer state on every device. Some
state is different on every device: error-feedback residuals of a compressor, per-device
random keys. A transform wraps such a subtree in :class:`PerDevice`; the step builder
(:func:`jaxcomm.data_parallel`) then stores it with a leading axis of one entry per device,
sharded along the data axes, and hands the transform the local (unstacked) value inside
``shard_map``. Because it is part of the optimizer state pytree, it is in every checkpoint.

``PerDevice`` is the explicit way. The step builders (``data_parallel`` and the Flax front
ends) also *infer* per-device leaves from shard_map's replication types (``check_vma=True``)
with one function, :func:`infer_per_device`: a state leaf whose value varies over the data
axes after ``init`` or a step (``optax.MultiSteps``' ``acc_grads`` hold each device's own
gradients) is stored per device too. :func:`varying_axes` reads that type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "PerDevice",
    "global_abstract",
    "infer_per_device",
    "is_per_device",
    "leaf_specs",
    "marked_per_device",
    "replace_at",
    "stack_leaves",
    "state_partition_specs",
    "stack_local",
    "unstack_leaves",
    "unstack_local",
    "unwrap_per_device",
    "varying_axes",
    "wrap_per_device",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerDevice:
    """Marks a subtree of optimizer state as per device (sharded, never replicated).

    Example:
      >>> class ErrorFeedbackState(NamedTuple):
      ...     residual: PerDevice   # PerDevice(tree of arrays shaped like the gradients)
      >>> ErrorFeedbackState(residual=PerDevice(jax.tree.map(jnp.zeros_like, params)))
    """

    value: Any


def is_per_device(x: Any) -> bool:
    return isinstance(x, PerDevice)


def _map_per_device(fn_local, fn_other, tree: Any) -> Any:
    def visit(node):
        if isinstance(node, PerDevice):
            return PerDevice(jax.tree.map(fn_local, node.value))
        return fn_other(node)

    return jax.tree.map(visit, tree, is_leaf=is_per_device)


def wrap_per_device(tree: Any, per: list[bool]) -> Any:
    """``tree`` with each flagged leaf in a :class:`PerDevice` (how the Flax front ends
    mark state stored per device, e.g. a sharded optimizer's chunks)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [PerDevice(x) if f else x for x, f in zip(leaves, per, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def unwrap_per_device(tree: Any) -> Any:
    """``tree`` with every :class:`PerDevice` replaced by its value (the inverse of
    :func:`wrap_per_device`)."""
    return jax.tree.map(lambda x: x.value if is_per_device(x) else x, tree, is_leaf=is_per_device)


def state_partition_specs(tree: Any, axes: tuple[str, ...]) -> Any:
    """PartitionSpecs for a (global) state tree: per-device leaves on ``axes``, others P()."""
    return _map_per_device(lambda _: P(axes), lambda _: P(), tree)


def stack_local(tree: Any) -> Any:
    """Inside shard_map: give per-device leaves a leading axis of 1 (for out_specs P(axes))."""
    return _map_per_device(lambda x: x[None], lambda x: x, tree)


def unstack_local(tree: Any) -> Any:
    """Inside shard_map: drop the leading axis of 1 of per-device leaves."""
    return _map_per_device(lambda x: x[0], lambda x: x, tree)


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which ``x`` may differ, as shard_map's replication check types it
    (inside ``jax.shard_map(..., check_vma=True)``; empty outside or with the check off)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: the manual axis type
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def typed_alike(branches: list[Callable], *operands: Any) -> list[Callable]:
    """The branches of a ``lax.switch`` (or ``lax.cond``) on ``operands``, each with its
    outputs typed varying over the union of the mesh axes that output varies over in any
    branch (leaf by leaf; inside ``jax.shard_map(..., check_vma=True)``, free at run
    time), so that their types agree as the conditional requires.

    For branches some of which may return state more varying than it came in (a sync
    step's compressor state of hybrid sharding's blocks, per device, beside a branch that
    keeps the state as it was). Each branch is traced once more to read its types
    (``jax.eval_shape``); nothing of that trace runs.

    Example:
      >>> out = lax.switch(i, typed_alike(branches, x, s), x, s)
    """
    outs = [jax.tree.leaves(jax.eval_shape(b, *operands)) for b in branches]
    union = [
        frozenset().union(*(varying_axes(x) for x in leaves)) for leaves in zip(*outs, strict=True)
    ]

    def alike(branch):
        def typed(*args):
            out = branch(*args)
            leaves, treedef = jax.tree.flatten(out)
            typed = [
                jax.lax.pcast(x, tuple(sorted(u - varying_axes(x))), to="varying")
                if u - varying_axes(x)
                else x
                for x, u in zip(leaves, union, strict=True)
            ]
            return jax.tree.unflatten(treedef, typed)

        return typed

    return [alike(b) for b in branches]


def marked_per_device(tree: Any) -> list[bool]:
    """One flag per leaf of ``tree`` (``jax.tree.leaves`` order): inside a ``PerDevice``."""
    flags = _map_per_device(lambda _: True, lambda _: False, tree)
    return jax.tree.leaves(flags)


def leaf_specs(
    tree: Any, per_device: list[bool], axes: tuple[str, ...], base: tuple | None = None
) -> Any:
    """PartitionSpecs of a global tree: ``P(axes)`` for flagged leaves, for the others
    ``P()`` or their entry of ``base`` (a layout's split leaves: hybrid-sharded params)."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(per_device):
        raise ValueError(
            f"the state has {len(leaves)} leaves but its layout {len(per_device)}; build the "
            "state with the same DataParallel's init (its optimizer changed?)."
        )
    specs = [P(axes) if f else (base[i] if base else P()) for i, f in enumerate(per_device)]
    return jax.tree.unflatten(treedef, specs)


def _map_flagged(fn, tree: Any, per_device: list[bool]) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [fn(x) if f else x for x, f in zip(leaves, per_device, strict=True)]
    )


def replace_at(leaves: list, idx: list[int], fn: Callable[[list], list]) -> list:
    """``leaves`` (a new list) with those at ``idx`` replaced by ``fn`` of them, in one
    call (one program where ``fn`` is one); ``fn`` is not called when ``idx`` is empty.

    Example:
      >>> replace_at([a, b, c], [0, 2], lambda xs: [x + 1 for x in xs])   # [a+1, b, c+1]
    """
    leaves = list(leaves)
    if idx:
        for i, x in zip(idx, fn([leaves[i] for i in idx]), strict=True):
            leaves[i] = x
    return leaves


def stack_leaves(tree: Any, per_device: list[bool]) -> Any:
    """Inside shard_map: a leading axis of 1 on the flagged leaves (for ``P(axes)``)."""
    return _map_flagged(lambda x: x[None], tree, per_device)


def unstack_leaves(tree: Any, per_device: list[bool]) -> Any:
    """Inside shard_map: drop the leading axis of 1 of the flagged leaves."""
    return _map_flagged(lambda x: x[0], tree, per_device)


def global_abstract(
    local: Any,
    per_device: list[bool],
    mesh: Mesh,
    axes: tuple[str, ...],
    base: tuple | None = None,
) -> list[jax.ShapeDtypeStruct]:
    """The global shapes and shardings of a state whose leaves have ``local`` shapes: a
    flagged leaf gets a leading axis of one entry per device, sharded along ``axes``; the
    others are replicated, or laid out by their entry of ``base`` (:func:`leaf_specs`)."""
    devices = int(np.prod([mesh.shape[a] for a in axes]))
    out = []
    specs = leaf_specs(list(per_device), per_device, axes, base)
    for x, f, spec in zip(jax.tree.leaves(local), per_device, specs, strict=True):
        shape = (devices, *np.shape(x)) if f else tuple(np.shape(x))
        sharding = NamedSharding(mesh, spec)
        out.append(jax.ShapeDtypeStruct(shape, jnp.result_type(x), sharding=sharding))
    return out


def infer_per_device(
    step: Callable[..., list[bool]],
    local: Any,
    marked: list[bool],
    mesh: Mesh,
    axes: tuple[str, ...],
    *,
    args: tuple = (),
    arg_specs: tuple = (),
    may_vary: list[bool] | None = None,
    base_specs: tuple | None = None,
) -> list[bool]:
    """Which leaves of a step's state are stored per device: the fewest that let every other
    leaf be proven replicated by shard_map's replication check.

    The one layout inference of the step builders (``data_parallel``, the Flax front ends).

    1. Start from the ``marked`` leaves (``PerDevice``, accumulators, varying after init).
    2. Trace ``step(state, *args)`` abstractly (no compute, no compile) inside
       ``jax.shard_map(..., check_vma=True)``, with the state laid out as the flags say and
       handed to ``step`` local (unstacked: per-device leaves without their device axis).
       ``step`` returns, per state leaf, whether its new value varies over ``axes``; it may
       raise to refuse what it sees (the error passes through).
    3. Each leaf that varies (and ``may_vary`` allows) joins the per-device set; repeat until
       the set is stable. It only grows, so this ends within one round per leaf.

    Args:
      step: ``step(local_state, *args) -> list[bool]``, traced inside the shard_map.
      local: the state's local shapes (a tree of arrays or ``jax.ShapeDtypeStruct``).
      marked: per leaf of ``local``: known to be per device.
      mesh: the mesh; axes: the data axes.
      args: further global abstract arguments of ``step`` (``jax.ShapeDtypeStruct``).
      arg_specs: their PartitionSpecs.
      may_vary: per leaf: may become per device (default: all); a leaf that varies but may
        not is left to ``step``'s refusals.
      base_specs: per leaf, how it is laid out when not per device (default ``P()``; a
        layout's split leaves, :func:`leaf_specs`).

    Returns:
      One flag per leaf of ``local``: stored per device.

    Example:
      >>> per = infer_per_device(lambda s, p: [bool(varying_axes(x)) for x in
      ...     jax.tree.leaves(opt.update(g(p), s, p)[1])], local_state, marks, mesh, axes,
      ...     args=(params,), arg_specs=(P(),))
    """
    treedef = jax.tree.structure(local)
    allowed = may_vary if may_vary is not None else [True] * treedef.num_leaves
    per = list(marked)
    for _ in range(treedef.num_leaves + 1):
        flags = per
        seen: dict[str, list[bool]] = {}

        def probe(state, *a, flags=flags, seen=seen):
            seen["vary"] = step(unstack_leaves(state, flags), *a)
            return jnp.zeros(())

        state = jax.tree.unflatten(treedef, global_abstract(local, flags, mesh, axes, base_specs))
        specs = (leaf_specs(local, flags, axes, base_specs), *arg_specs)
        mapped = jax.shard_map(probe, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=True)
        jax.eval_shape(mapped, state, *args)
        nxt = [f or (v and ok) for f, v, ok in zip(flags, seen["vary"], allowed, strict=True)]
        if nxt == flags:
            return flags
        per = nxt
    raise AssertionError("unreachable: the per-device set grows by one leaf at least per round")
