"""Per-device optimizer state: how a transform says "this part of my state is not replicated".

Data-parallel training replicates params and ordinary optimizer state on every device. Some
state is different on every device: error-feedback residuals of a compressor, per-device
random keys. A transform wraps such a subtree in :class:`PerDevice`; the step builder
(:func:`jaxcomm.data_parallel`) then stores it with a leading axis of one entry per device,
sharded along the data axes, and hands the transform the local (unstacked) value inside
``shard_map``. Because it is part of the optimizer state pytree, it is in every checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["PerDevice", "is_per_device", "state_partition_specs", "stack_local", "unstack_local"]


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
