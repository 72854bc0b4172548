"""Params gathered per layer in a hybrid-sharded step (``data_parallel(...,
shard_params=True, gather='layer')``), as FSDP gathers each wrapped layer before its
forward pass and again before its backward pass.

Under ``gather='whole'`` (the default) the loss sees every param leaf all-gathered over the
node at its start, and the backward pass keeps those gathered values: a device holds one
gathered copy of the model during the step. Under ``gather='layer'`` the loss gets the
stored blocks (each device's ``1/intra`` of each leaf) and the model gathers them where it
uses them, with two helpers that do nothing outside such a step (the same program as
without them):

* :func:`gather_params` ``(tree)``: each leaf of ``tree`` that is one of the step's blocks,
  all-gathered over the node along its split dimension (``jaxcomm.hybrid.param_dims``),
  now. For params used across the whole model (embeddings, a tied output head).
* :func:`gathered_layers` ``(fn)(layers, carry)``: ``carry = fn(params, carry)`` for
  each layer, as a ``lax.scan`` over the layers' stacked blocks whose body (under
  ``jax.checkpoint``) gathers one layer's params, so the backward pass gathers them again
  (and recomputes the layer's activations) instead of keeping them: during the step a
  device holds one layer's gathered params at a time, besides its blocks and their
  stacked copy.

A block is known by its identity: the leaves the step passes the loss, or the same objects
read back from a module (``nnx.merge`` / ``nnx.split`` keep them). A leaf computed from a
block (a cast, a reshape) is not a block and passes through untouched; a block the loss
never gathers is refused when the step is traced, with its path.

Example:
  >>> class Model(nnx.Module):
  ...     def __call__(self, x):
  ...         graphdef = nnx.graphdef(self.layers[0])
  ...         params = [nnx.state(layer) for layer in self.layers]
  ...         apply = lambda p, x: nnx.merge(graphdef, p)(x)
  ...         return jaxcomm.gathered_layers(apply)(params, x)
  >>> dp = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_params=True, gather='layer')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import SMALL_LEAF_ELEMENTS
from jaxcomm.packing import plan_groups

__all__ = ["GATHER_MODES", "gather_blocks", "gather_params", "gathered_layers"]

#: ``data_parallel(gather=...)``: ``'whole'``, every leaf gathered at the loss's start;
#: ``'layer'``, the model gathers each layer's blocks itself (this module).
GATHER_MODES = ("whole", "layer")


@dataclasses.dataclass
class _Blocks:
    """The blocks of the step being traced: by ``id``, (the block, its split dimension or
    None for a leaf kept whole); the ids gathered so far."""

    axis: str
    by_id: dict[int, tuple[Any, int | None]]
    gathered: set[int] = dataclasses.field(default_factory=set)

    def dims(self, leaves: list) -> list[int | None]:
        """The split dimension of each leaf that is a block (marked gathered), None for
        any other leaf."""
        out = []
        for x in leaves:
            entry = self.by_id.get(id(x))
            if entry is not None and entry[0] is x:
                self.gathered.add(id(x))
                out.append(entry[1])
            else:
                out.append(None)
        return out

    def gather(self, leaves: list, dims: list[int | None]) -> list:
        return gather_blocks(leaves, dims, self.axis)


def gather_blocks(blocks: list, dims: list[int | None], axis: str) -> list:
    """Each block whose split dimension is given, all-gathered over ``axis`` along it
    (inside ``jax.shard_map``): a large block alone, the small ones packed, one
    all-gather per dtype for all of them.

    A collective's fixed cost is paid once per call (a gloo round trip on CPU, a kernel
    launch and a rendezvous on GPU), so a layer's small leaves (biases, norm scales)
    cost more in calls than in bytes when each has its own; FSDP gathers each wrapped
    module's params as one flat buffer for the same reason (Zhao et al., "PyTorch FSDP",
    VLDB 2023, section 3.2), and ``jaxcomm.allreduce`` packs small leaves alike (the same
    bound: ``jaxcomm.collectives.SMALL_LEAF_ELEMENTS`` elements per block). A large block
    is gathered alone, straight into its leaf: packing it would add a gathered copy of it
    to the step's memory (the rows below, then the leaf) for a call that its bytes, not
    its count, make long. The gradient of the gathered params, JAX's transpose of this
    program, is likewise one reduce-scatter per large block and one per dtype.

    1. The small blocks are raveled and concatenated, one buffer per dtype
       (``jaxcomm.packing.plan_groups``).
    2. Each buffer is all-gathered over ``axis`` as rows: ``(n, elements)``, row ``i``
       device ``i``'s buffer.
    3. Each small leaf is unpacked from the rows (``BufferPlan.unpack``),
       ``(n, *block)``, and the ``n`` blocks are laid end to end along its dimension:
       the leaf ``lax.all_gather(block, axis, axis=d, tiled=True)`` gives.

    Args:
      blocks: arrays, this device's blocks (and leaves kept whole).
      dims: per leaf, the dimension it is split along, or None for a leaf passed
        through as it is.
      axis: the mesh axis the blocks are split over.

    Returns:
      The leaves, gathered where ``dims`` says, in order.
    """
    out = list(blocks)
    small: list[int] = []  # the leaves packed, in order
    split: dict[int, int] = {}  # leaf -> its split dimension, counted from 0
    for i, (x, d) in enumerate(zip(blocks, dims, strict=True)):
        if d is None:
            continue
        ndim = jnp.ndim(x)
        if not -ndim <= d < ndim:
            raise ValueError(
                f"gather_blocks: leaf {i} of shape {jnp.shape(x)} has no dimension {d} to "
                "gather along; give a dimension of it, or None to pass it through."
            )
        split[i] = d % ndim
        if jnp.size(x) >= SMALL_LEAF_ELEMENTS:
            out[i] = lax.all_gather(x, axis, axis=split[i], tiled=True)
        else:
            small.append(i)
    if not small:
        return out
    parts = [blocks[i] for i in small]  # the plan sees the small ones only
    by_dtype: dict[Any, list[int]] = {}
    for k, x in enumerate(parts):
        by_dtype.setdefault(jnp.result_type(x), []).append(k)
    plan = plan_groups(parts, by_dtype.values())
    rows = [lax.all_gather(b, axis, axis=0) for b in plan.pack(parts)]
    for i, leaf in zip(small, plan.unpack(rows), strict=True):
        shape = list(jnp.shape(blocks[i]))
        shape[split[i]] *= leaf.shape[0]
        out[i] = jnp.moveaxis(leaf, 0, split[i]).reshape(shape)
    return out


_BLOCKS: contextvars.ContextVar[_Blocks | None] = contextvars.ContextVar(
    "jaxcomm_gathering_blocks", default=None
)


@contextlib.contextmanager
def blocks_of_step(blocks: list, dims: list[int | None], axis: str) -> Iterator[_Blocks]:
    """While the loss of a ``gather='layer'`` step is traced: ``blocks`` (the leaves the
    loss gets) are known to :func:`gather_params` and :func:`gathered_layers`, gathered
    over ``axis`` along ``dims``. Yields the record of what was gathered."""
    record = _Blocks(axis, {id(x): (x, d) for x, d in zip(blocks, dims, strict=True)})
    token = _BLOCKS.set(record)
    try:
        yield record
    finally:
        _BLOCKS.reset(token)


def gather_params(tree: Any) -> Any:
    """``tree`` with each leaf that is a block of the hybrid step being traced
    (``data_parallel(..., shard_params=True, gather='layer')``) all-gathered over the node
    along its split dimension; other leaves as they are. Outside such a step: ``tree``
    itself.

    The gathered values are kept for the backward pass like any other value; for a
    layers' params use :func:`gathered_layers`, which gathers them again there.

    Args:
      tree: a pytree (params, an ``nnx.State``).

    Returns:
      A tree like ``tree``.
    """
    record = _BLOCKS.get()
    if record is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, record.gather(leaves, record.dims(leaves)))


def gathered_layers(fn: Callable, *, policy: Callable | None = None) -> Callable:
    """``carry = fn(params, carry)`` for each layer's ``params`` in turn, the params
    gathered one layer at a time.

    In a hybrid step with ``gather='layer'``: the layers' blocks are stacked (one array
    per leaf, ``layers`` long: ``1/intra`` of the layers' bytes) and ``lax.scan`` runs
    ``jax.checkpoint`` of a body that gathers one layer's blocks over the node
    (:func:`gather_params`) and applies ``fn``; the backward scan gathers them again
    (and recomputes the layer's activations) instead of keeping them, and the gradient of
    each gather is a reduce-scatter inside the node, in that layer's backward step. So a
    device holds one layer's gathered params at a time. A scan rather than one
    ``jax.checkpoint`` per layer because XLA's common-subexpression pass merges a
    layer's re-gather with its forward gather when both are in one computation (the
    optimisation barriers that ``jax.checkpoint`` sets are gone by then on XLA:CPU),
    which keeps the gathered params again; the loop's two bodies cannot be merged.
    Outside such a step: ``fn`` applied to each layer in a Python loop, as it is.

    Args:
      fn: ``fn(params, carry) -> carry``, one layer (``carry`` a pytree, e.g. the
        activations; its shapes and types the same after each layer).
      policy: ``jax.checkpoint``'s policy for the body: which of a layer's values to keep
        rather than recompute (``jax.checkpoint_policies``); by default none. A policy
        that keeps values computed from the gathered params keeps them again.

    Returns:
      ``call(layers, carry) -> carry``: ``layers`` a sequence of param trees of one
      structure and shapes (the layers of a transformer), ``carry`` the input.

    Raises:
      ValueError: in such a step, layers whose trees, shapes or split dimensions differ.
    """

    @functools.wraps(fn)
    def call(layers, carry):
        layers = list(layers)
        record = _BLOCKS.get()
        if record is None or not layers:
            for params in layers:
                carry = fn(params, carry)
            return carry
        flat = [jax.tree.flatten(p) for p in layers]
        treedef = flat[0][1]
        dims = [record.dims(leaves) for leaves, _ in flat]
        shapes = [[(jnp.shape(x), jnp.result_type(x)) for x in leaves] for leaves, _ in flat]
        for i, ((_, t), d, s) in enumerate(zip(flat, dims, shapes, strict=True)):
            if t != treedef or d != dims[0] or s != shapes[0]:
                raise ValueError(
                    f"jaxcomm.gathered_layers: layer {i} differs from layer 0 in its tree, "
                    "its leaves' shapes or their split dimensions, so the layers cannot be "
                    "stacked for one scan; pass layers of one shape (a transformer's "
                    "blocks), or gather the others with jaxcomm.gather_params."
                )
        stacked = [jnp.stack([leaves[k] for leaves, _ in flat]) for k in range(len(flat[0][0]))]

        def body(carry, blocks):
            full = jax.tree.unflatten(treedef, record.gather(blocks, dims[0]))
            return fn(full, carry), None

        carry, _ = lax.scan(jax.checkpoint(body, policy=policy), carry, stacked)
        return carry

    return call
