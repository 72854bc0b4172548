"""Decisions that change rarely, taken on the host: one program per phase, no conditional.

Three of a step's decisions depend on values that every device shares and that change at
known steps: whether the sync is still within ``warmup_steps`` (the sync count), which
branch ``jaxcomm.local_sgd`` takes (its count: fragment f's outer sync or none), and an
adaptive compressor's rung (its state, which changes only at a window's first step).
Decided on the devices, each is a ``lax.cond`` / ``lax.switch`` in every step's program,
and on a GPU every executed ``conditional`` copies its predicate to the host, so the host
cannot run ahead of the device. A step builder instead keeps a :class:`PhaseClock`:

1. It reads the counts (and the rung) from the state once, and again only when the state
   passed in is not the one the step returned (a restored checkpoint, a state the
   profiler's drive produced).
2. Each step it computes the :class:`jaxcomm.HostPhase` from its copy: the warm-up phase
   from the sync count, local SGD's branch from ``sync_schedule(H, F)[(count + 1) % H]``,
   the rung from the compressor's ``host_choice``, asked again only when the choice it
   gave runs out (adaptive: once per window; that read waits for the previous step, one
   host round trip per window instead of up to three per step).
3. The step builder runs the program of that phase (compiled at its first use; a phase
   is a hashable tuple) and hands the phase to the syncs as ``SyncRequest(phase=...)``.
4. It advances its copy by one step; at the next read of the rung it checks that the
   step's own decision took the rung it was given (``check_choice``).

Every process holds the same state, so every process takes the same decisions and runs
the same program (the "processes agree" rule).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxcomm.diloco import LocalSGDState, sync_schedule
from jaxcomm.sync import GradientSync, HostPhase, SyncGradientsState

__all__ = ["PhaseClock"]


def _is_node(x: Any) -> bool:
    # A LocalSGDState is a node of its own: its outer syncs count sync steps, not steps.
    return isinstance(x, (SyncGradientsState, LocalSGDState))


def _value(x: Any) -> int:
    """A replicated int scalar leaf (or its first row) on the host."""
    return int(np.asarray(jax.device_get(x)).reshape(-1)[0])


class PhaseClock:
    """The host's copy of the values a step's rare decisions are taken from.

    Args:
      syncs: the ``GradientSync`` of each ``sync_gradients`` whose count advances by one
        per step (a step builder leaves out syncs reduced per microbatch and a sharded
        optimizer's); the warm-up and the compressor's choice are decided on the host
        when exactly one sync state is found and it is one of these.
      opt_state: an example optimizer state (its structure).
      axis_sizes: the mesh's axis sizes (``dict(mesh.shape)``), for the compressor's
        device count.

    Example:
      >>> clock = PhaseClock(dp.syncs, state.opt_state, dict(mesh.shape))
      >>> phase = clock.decide(state.opt_state)        # a jaxcomm.HostPhase
      >>> new_state = program[phase](state, batch)
      >>> clock.advanced(new_state.opt_state)
    """

    def __init__(self, syncs: Sequence[GradientSync], opt_state: Any, axis_sizes: Mapping):
        flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_node)[0]
        sync_paths = [p for p, x in flat if isinstance(x, SyncGradientsState)]
        local_paths = [p for p, x in flat if isinstance(x, LocalSGDState)]
        compressed = [s for s in syncs if s.compression is not None]
        one = compressed[0] if len(compressed) == 1 and len(sync_paths) == 1 else None
        self._warmup = one.warmup_steps if one is not None and one.warmup_steps else None
        self._choose = one.compression if one is not None and one.compression.host_choice else None
        self._devices = math.prod(axis_sizes[a] for a in one.codec_axes) if one else 0
        self._sync_path = sync_paths[0] if self._warmup or self._choose else None
        self._local_path = local_paths[0] if len(local_paths) == 1 else None
        self._marker: Any = None  # the array the copy below was read from or advanced to
        self._count = 0  # the sync's count
        self._local = (0, 0, 0)  # local SGD's (count, sync_every, fragments)
        self._schedule: list[int] = []  # sync_schedule(sync_every, fragments), read with them
        self._choice: tuple[int, int] | None = None  # (choice, steps it still holds for)
        self._phase = HostPhase()

    @property
    def active(self) -> bool:
        """Whether the host decides anything (else every step is ``HostPhase()``)."""
        return self._sync_path is not None or self._local_path is not None

    def _mark(self, opt_state: Any) -> Any:
        path = self._sync_path if self._sync_path is not None else self._local_path
        return _at(opt_state, path).count

    def _read(self, opt_state: Any) -> None:
        if self._sync_path is not None:
            self._count = _value(_at(opt_state, self._sync_path).count)
        if self._local_path is not None:
            s = _at(opt_state, self._local_path)
            self._local = (_value(s.count), _value(s.sync_every), _value(s.fragments))
            self._schedule = sync_schedule(*self._local[1:]).tolist()
        self._choice = None

    def decide(self, opt_state: Any) -> HostPhase:
        """The phase of the step from ``opt_state``: ``HostPhase()`` where the host decides
        nothing. Reads the devices only where its copy is not of ``opt_state``, or the
        compressor's choice ran out."""
        if not self.active:
            return HostPhase()
        if self._marker is None or self._mark(opt_state) is not self._marker:
            self._read(opt_state)
        warming_up = None if self._warmup is None else self._count < self._warmup
        choice = None
        if self._choose is not None and warming_up is not True:
            cstate = _at(opt_state, self._sync_path).compression
            if self._choice is None or self._choice[1] == 0:
                if self._choice is not None:  # the window that ends ran the rung it was given
                    self._choose.check_choice(cstate, self._choice[0])
                self._choice = self._choose.host_choice(cstate, self._devices)
            choice = self._choice[0]
        local = None
        if self._local_path is not None:
            count, every, fragments = self._local
            local = (self._schedule[(count + 1) % every], every, fragments)
        self._marker = self._mark(opt_state)
        self._phase = HostPhase(warming_up, local, choice)
        return self._phase

    def advanced(self, opt_state: Any) -> None:
        """Records the state the step returned: one step after the one it was given."""
        if not self.active:
            return
        self._count += 1
        count, every, fragments = self._local
        self._local = (count + 1, every, fragments)
        if self._phase.codec_choice is not None:
            self._choice = (self._choice[0], self._choice[1] - 1)
        self._marker = self._mark(opt_state)


def _at(node: Any, path: tuple) -> Any:
    """The node at a key path of ``jax.tree_util.tree_flatten_with_path``."""
    for key in path:
        node = _child(node, key)
    return node


def _child(node: Any, key: Any) -> Any:
    """``node``'s child at one entry of a key path (an index, a dict key, an attribute)."""
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            k = getattr(key, attr)
            return getattr(node, k) if attr == "name" else node[k]
    raise TypeError(f"unknown key path entry {key!r}")
