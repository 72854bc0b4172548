"""The warm-up decision taken on the host: one program per phase, no conditional in either.

``sync_gradients(warmup_steps=N)`` sends the first N steps uncompressed. Decided on the
devices, that is a ``lax.cond`` on the sync count in every step's program, which on a GPU
copies its predicate to the host each step. A step builder instead keeps a
:class:`WarmupClock`: the host's copy of the count, read from the state once (and again
only when the state passed in is not the one the step returned), advanced by one per
step. Every process holds the same state, so every process takes the same decision and
compiles and runs the same program; the step passes it to the syncs as
``SyncRequest(warming_up=...)``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxcomm.sync import GradientSync, SyncGradientsState

__all__ = ["WarmupClock"]


def _is_sync_state(x: Any) -> bool:
    return isinstance(x, SyncGradientsState)


class WarmupClock:
    """The host's copy of the count of the one sync that warms up.

    Args:
      syncs: the ``GradientSync`` of each ``sync_gradients`` the step runs.
      opt_state: an example optimizer state (its structure).

    Attributes:
      steps: the sync's ``warmup_steps``; None when the host does not decide (no sync
        warms up, or several syncs do: each keeps its ``lax.cond``).

    Example:
      >>> clock = WarmupClock(dp.syncs, state.opt_state)
      >>> warming_up = clock.decide(state.opt_state)    # True, False, or None
      >>> new_state = step[warming_up](state, batch)
      >>> clock.advanced(new_state.opt_state)
    """

    def __init__(self, syncs: list[GradientSync], opt_state: Any):
        warm = [s for s in syncs if s.compression is not None and s.warmup_steps > 0]
        flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_sync_state)[0]
        states = [path for path, x in flat if _is_sync_state(x)]
        self.steps = warm[0].warmup_steps if len(warm) == 1 and len(states) == 1 else None
        self._path = states[0] if self.steps is not None else None
        self._known: tuple[Any, int] | None = None  # (count array, its value)

    def _count(self, opt_state: Any) -> Any:
        node = opt_state
        for key in self._path:
            node = _child(node, key)
        return node.count

    def decide(self, opt_state: Any) -> bool | None:
        """Whether this step is within the warm-up (None: not the host's to decide). Reads
        the count from the devices only if ``opt_state`` is not the one last returned."""
        if self.steps is None:
            return None
        count = self._count(opt_state)
        if self._known is not None and self._known[0] is count:
            value = self._known[1]
        else:
            value = int(np.asarray(jax.device_get(count)).reshape(-1)[0])
        self._known = (count, value)
        return value < self.steps

    def advanced(self, opt_state: Any) -> None:
        """Records the count the step returned: one more than the one it was given."""
        if self.steps is not None and self._known is not None:
            self._known = (self._count(opt_state), self._known[1] + 1)


def _child(node: Any, key: Any) -> Any:
    """``node``'s child at one entry of a key path (an index, a dict key, an attribute)."""
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            k = getattr(key, attr)
            return getattr(node, k) if attr == "name" else node[k]
    raise TypeError(f"unknown key path entry {key!r}")
