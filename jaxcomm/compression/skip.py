"""Steps a compressor voids: the protocol a compressor state follows to skip a step.

Some compressors decide, from the reduced gradients every device shares, that a step must
not be taken (``fp16``: its float16 sum overflowed). Their state says so through
:class:`SkipsSteps`; a step builder asks :func:`step_skipped` whether any state of the
optimizer skipped this step, and keeps the old params and optimizer state with
:func:`unless_skipped`, knowing no compressor by name.

Example:
  >>> skipped = step_skipped(opt_state, new_opt_state)   # inside the step
  >>> if skipped is not None:
  ...     params = unless_skipped(skipped, new_params, params)
  ...     new_opt_state = unless_skipped(skipped, new_opt_state, opt_state)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

__all__ = ["SkipsSteps", "keep_skipped", "step_skipped", "unless_skipped"]


@runtime_checkable
class SkipsSteps(Protocol):
    """A compressor state that can void the step that produced it.

    Its values are shared by every device (decided from reduced values), so every device
    takes or skips a step alike. A skipped step keeps the old params and optimizer state,
    except states of this kind themselves, which keep their new values (their counters
    record the skip).
    """

    def skipped_since(self, before: Any) -> jax.Array:
        """A bool scalar: whether the step from ``before`` (this state's previous value)
        to this state was skipped."""
        ...


def _is_skipper(x: Any) -> bool:
    return isinstance(x, SkipsSteps)


def _skippers(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_skipper) if _is_skipper(x)]


def step_skipped(old: Any, new: Any) -> jax.Array | None:
    """Whether any :class:`SkipsSteps` state of ``new`` (an optimizer state after a step;
    ``old`` before it, of the same structure) skipped this step, or None if it holds none.

    Args:
      old: the optimizer state before the step.
      new: the optimizer state after it.

    Returns:
      A bool scalar shared by every device, or None.
    """
    pairs = list(zip(_skippers(old), _skippers(new), strict=True))
    if not pairs:
        return None
    return jnp.any(jnp.stack([b.skipped_since(a) for a, b in pairs]))


def unless_skipped(skipped: jax.Array, new: Any, old: Any) -> Any:
    """``old`` where ``skipped``, else ``new`` (trees of one structure); the
    :class:`SkipsSteps` states of ``new`` are kept as they are (they count the skip).

    Args:
      skipped: the bool scalar of :func:`step_skipped`.
      new: the tree after the step (params, or the optimizer state).
      old: the tree before it.
    """

    def keep(n, o):
        if _is_skipper(n):
            return n
        return jax.tree.map(lambda a, b: jnp.where(skipped, b, a), n, o)

    return jax.tree.map(keep, new, old, is_leaf=_is_skipper)


def keep_skipped(opt_state: Any, new_opt: Any, params: Any, new_params: Any) -> tuple[Any, Any]:
    """``(params, optimizer state)`` after a step: the new ones, or the old ones where a
    :class:`SkipsSteps` state of ``new_opt`` skipped the step (:func:`step_skipped`,
    :func:`unless_skipped`; decided from reduced values, so the same on every device).

    Args:
      opt_state: the optimizer state before the step; new_opt: after it.
      params: the params before the step; new_params: after it.
    """
    skipped = step_skipped(opt_state, new_opt)
    if skipped is None:
        return new_params, new_opt
    return unless_skipped(skipped, new_params, params), unless_skipped(skipped, new_opt, opt_state)
