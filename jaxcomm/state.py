"""Per-device optimizer state: how a transform says "this part of my state is not replicated".

Data-parallel training replicates params and ordinary optimizer state on every device. Some
state is different on every device: error-feedback residuals of a compressor, per-device
random keys. A transform wraps such a subtree in :class:`PerDevice`; the step builder
(:func:`jaxcomm.data_parallel`) then stores it with a leading axis of one entry per device,
sharded along the data axes, and hands the transform the local (unstacked) value inside
``shard_map``. Because it is part of the optimizer state pytree, it is in every checkpoint.

``PerDevice`` is the explicit way. ``data_parallel`` also *infers* per-device leaves from
shard_map's replication types (``check_vma=True``): a state leaf whose value varies over the
data axes after ``init`` or ``update`` (``optax.MultiSteps``' ``acc_grads`` hold each
device's own gradients) is stored per device too. :func:`varying_axes` reads that type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

__all__ = [
    "PerDevice",
    "is_per_device",
    "leaf_specs",
    "marked_per_device",
    "stack_leaves",
    "state_partition_specs",
    "stack_local",
    "unstack_leaves",
    "unstack_local",
    "varying_axes",
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


def marked_per_device(tree: Any) -> list[bool]:
    """One flag per leaf of ``tree`` (``jax.tree.leaves`` order): inside a ``PerDevice``."""
    flags = _map_per_device(lambda _: True, lambda _: False, tree)
    return jax.tree.leaves(flags)


def leaf_specs(tree: Any, per_device: list[bool], axes: tuple[str, ...]) -> Any:
    """PartitionSpecs of a global tree: ``P(axes)`` for flagged leaves, ``P()`` for others."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(per_device):
        raise ValueError(
            f"the state has {len(leaves)} leaves but its layout {len(per_device)}; build the "
            "state with the same DataParallel's init (its optimizer changed?)."
        )
    return jax.tree.unflatten(treedef, [P(axes) if f else P() for f in per_device])


def _map_flagged(fn, tree: Any, per_device: list[bool]) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [fn(x) if f else x for x, f in zip(leaves, per_device, strict=True)]
    )


def stack_leaves(tree: Any, per_device: list[bool]) -> Any:
    """Inside shard_map: a leading axis of 1 on the flagged leaves (for ``P(axes)``)."""
    return _map_flagged(lambda x: x[None], tree, per_device)


def unstack_leaves(tree: Any, per_device: list[bool]) -> Any:
    """Inside shard_map: drop the leading axis of 1 of the flagged leaves."""
    return _map_flagged(lambda x: x[0], tree, per_device)
