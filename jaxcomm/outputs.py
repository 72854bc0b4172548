"""What a data-parallel step returns: per-example values whole, reductions reduced.

A step runs once per device on that device's part of the batch, so each value it returns
exists once per device. How the per-device values become the one value of the global
batch depends on what the value is, and only the user knows that: a mean loss is averaged,
a count is summed, a largest error is a maximum, and logits or predictions are per example
and must be gathered along the batch (averaging them mixes different examples).

Mark a value with its reduction; an unmarked value follows the default rule:

1. a floating scalar (shape ``()``) is a mean over the batch: averaged over devices;
2. an array with a leading axis is per example: gathered along axis 0 in the order of the
   global batch (devices in mesh order, ``('inter', 'intra')`` flattened);
3. an integer or boolean scalar has no safe default and is refused: mark it.

Example:
  >>> def loss_fn(params, batch):
  ...     logits = model(params, batch["x"])
  ...     loss = xent(logits, batch["y"]).mean()
  ...     correct = (logits.argmax(-1) == batch["y"]).sum()
  ...     return loss, {"logits": logits,                     # gathered: (global batch, C)
  ...                   "correct": jaxcomm.outputs.sum(correct),
  ...                   "worst": jaxcomm.outputs.max(loss)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm.collectives import all_gather_invariant, allreduce_floats
from jaxcomm.validate import check_choice

__all__ = [
    "OPS",
    "Reduced",
    "combine",
    "combine_microbatches",
    "gather",
    "max",
    "mean",
    "min",
    "op_of",
    "sum",
]

OPS = ("mean", "sum", "max", "min", "gather")
_GATHER_SCALAR = (
    "jaxcomm.outputs.gather of a scalar: per-example values have a leading batch axis. "
    "Return one value per example, or mark the scalar with jaxcomm.outputs.mean, sum, max "
    "or min."
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Reduced:
    """A step output marked with how its per-device values combine.

    Attributes:
      value: the per-device value.
      op: one of :data:`OPS`.
    """

    value: Any
    op: str = dataclasses.field(metadata={"static": True})

    def __post_init__(self):
        check_choice("jaxcomm.outputs op", self.op, OPS)


def mean(x: Any) -> Reduced:
    """Marks ``x`` as a per-device mean over equal parts of the batch: averaged."""
    return Reduced(x, "mean")


def sum(x: Any) -> Reduced:  # noqa: A001 (the reduction's name)
    """Marks ``x`` as a per-device sum (a count, a total): summed over devices."""
    return Reduced(x, "sum")


def max(x: Any) -> Reduced:  # noqa: A001
    """Marks ``x`` as a per-device maximum: the maximum over devices."""
    return Reduced(x, "max")


def min(x: Any) -> Reduced:  # noqa: A001
    """Marks ``x`` as a per-device minimum: the minimum over devices."""
    return Reduced(x, "min")


def gather(x: Any) -> Reduced:
    """Marks ``x`` as per example along axis 0: concatenated in global batch order."""
    return Reduced(x, "gather")


def _is_marked(x: Any) -> bool:
    return isinstance(x, Reduced)


def op_of(x: Any, where: str = "output") -> str:
    """The reduction of one unmarked leaf by the default rule (module docstring).

    Args:
      x: an array (or array-like) a step returns.
      where: the leaf's path, for the error message.

    Returns:
      ``'mean'`` for a floating scalar, ``'gather'`` for an array with a leading axis.

    Raises:
      TypeError: an integer or boolean scalar (no safe default).
    """
    shape = jnp.shape(x)
    if len(shape) >= 1:
        return "gather"
    if jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return "mean"
    raise TypeError(
        f"jaxcomm: the step output {where} is a {jnp.result_type(x)} scalar, which has no "
        f"safe default across devices (a mean would change its type, a sum or a maximum "
        f"may be meant). Mark it: jaxcomm.outputs.sum(x), .max(x), .min(x) or .mean(x)."
    )


def _leaves_with_ops(tree: Any, *, stacked: bool = False) -> tuple[list[tuple[Any, str]], Any]:
    """Flattens ``tree`` to (value, op) per array leaf, markers resolved, and a spec that
    :func:`_rebuild` turns back into the tree (a marker's value as one subtree).
    ``stacked``: leaves carry a leading microbatch axis, not part of the default rule."""
    pairs: list[tuple[Any, str]] = []
    marked_flat, outer = jax.tree.flatten_with_path(tree, is_leaf=_is_marked)
    structure = []
    for path, leaf in marked_flat:
        if isinstance(leaf, Reduced):
            inner, inner_def = jax.tree.flatten(leaf.value)
            pairs.extend((v, leaf.op) for v in inner)
            structure.append((inner_def, len(inner)))
        else:
            probe = jnp.asarray(leaf)[0] if stacked else leaf
            pairs.append((leaf, op_of(probe, jax.tree_util.keystr(path))))
            structure.append((None, 1))
    return pairs, (outer, structure)


def _rebuild(values: Sequence[Any], spec: Any) -> Any:
    outer, structure = spec
    out, k = [], 0
    for inner_def, n in structure:
        chunk = list(values[k : k + n])
        k += n
        out.append(chunk[0] if inner_def is None else jax.tree.unflatten(inner_def, chunk))
    return jax.tree.unflatten(outer, out)


def combine(tree: Any, axes: tuple[str, ...]) -> Any:
    """Combines a step's per-device outputs across devices (inside ``jax.shard_map``).

    1. Resolve each leaf's reduction (its marker, else the default rule).
    2. Means and sums of floats: one packed all-reduce each (``allreduce_floats``); integer
       sums: ``lax.psum``; maxima and minima: ``lax.pmax`` / ``lax.pmin``.
    3. Per-example leaves: gathered along axis 0 over ``axes`` (typed replicated).

    Args:
      tree: the outputs, leaves optionally wrapped by :func:`mean`, :func:`sum`, ... .
      axes: the data mesh axes, outermost first.

    Returns:
      ``tree`` with markers removed and every leaf the same on every device.
    """
    pairs, spec = _leaves_with_ops(tree)
    values = [jnp.asarray(v) for v, _ in pairs]
    for op in ("mean", "sum"):
        idx = [
            i
            for i, (v, o) in enumerate(pairs)
            if o == op and jnp.issubdtype(values[i].dtype, jnp.floating)
        ]
        for i, r in zip(idx, allreduce_floats([values[i] for i in idx], axes, op), strict=True):
            values[i] = r
    for i, (_, op) in enumerate(pairs):
        x = values[i]
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        if op == "mean" and not floating:
            raise TypeError(
                f"jaxcomm.outputs.mean of a {x.dtype} value: a mean of integers is not an "
                f"integer. Cast it to a float first, or use jaxcomm.outputs.sum."
            )
        if op == "sum" and not floating:
            values[i] = lax.psum(x, axes)
        elif op == "max":
            values[i] = lax.pmax(x, axes)
        elif op == "min":
            values[i] = lax.pmin(x, axes)
        elif op == "gather":
            if x.ndim == 0:
                raise ValueError(_GATHER_SCALAR)
            values[i] = all_gather_invariant(x, axes, axis=0)
    return _rebuild(values, spec)


def combine_microbatches(stacked: Any) -> Any:
    """Combines outputs stacked over microbatches (leading axis ``n``, ``lax.scan``'s ys)
    into the outputs of the whole per-device batch, each marked with its op for
    :func:`combine`.

    Means are averaged over the microbatches (equal parts), sums summed, maxima and minima
    taken, and per-example values concatenated in batch order (``(n, b, ...) -> (n*b, ...)``).

    Args:
      stacked: the outputs of each microbatch, stacked.

    Returns:
      The per-device outputs, every leaf wrapped in :class:`Reduced` with its op.

    Raises:
      TypeError: a mean of integers; ValueError: a gathered scalar.
    """
    pairs, spec = _leaves_with_ops(stacked, stacked=True)
    out = []
    for x, op in pairs:
        x = jnp.asarray(x)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        if op == "mean" and not floating:
            raise TypeError(
                f"jaxcomm.outputs.mean of a {x.dtype} value: a mean of integers is not an "
                f"integer. Cast it to a float first, or use jaxcomm.outputs.sum."
            )
        if op == "gather" and x.ndim < 2:
            raise ValueError(_GATHER_SCALAR)
        if op == "mean":
            y = x.mean(0).astype(x.dtype)
        elif op == "sum":
            y = x.sum(0).astype(x.dtype)
        elif op == "max":
            y = x.max(0)
        elif op == "min":
            y = x.min(0)
        else:
            y = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
        out.append(Reduced(y, op))
    return _rebuild(out, spec)
