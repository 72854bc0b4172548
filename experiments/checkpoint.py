"""Orbax checkpoints of the whole run: train state and data position.

A checkpoint holds the full :class:`jaxcomm.TrainState` (step, params, optimizer state with
its per-device subtrees such as error-feedback residuals, batch statistics) and a small JSON
item with the data position (global batches consumed) and the run's identity (preset, model,
seed, config), so a resumed run reads the batch the interrupted one would have read next.
Per-device optimizer state is stored as what it is, one entry per device sharded along the
data axes; restoring onto the same mesh shape gives every device its own entry back.
Stopping and resuming is bit-identical to an uninterrupted run
(``tests/test_experiment_checkpoint.py``).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Saves and restores ``(TrainState, data position)`` in ``directory/<step>/``.

    Args:
      directory: checkpoint root (created if missing; shared by all processes).
      max_to_keep: newest checkpoints kept.

    Example:
      >>> ckpt = Checkpointer('/tmp/run1')
      >>> ckpt.save(state, position=120, meta={'preset': 'cpu-smoke'})
      >>> state, data = ckpt.restore(fresh_state)     # fresh_state gives shapes+shardings
      >>> data['position']
      120
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        """The newest saved step, or ``None``."""
        return self._manager.latest_step()

    def save(self, state: Any, *, position: int, meta: dict | None = None) -> None:
        """Saves ``state`` under its step, with the data position; waits until written.

        Args:
          state: a ``jaxcomm.TrainState``.
          position: global batches consumed so far (the next batch to read).
          meta: JSON-serialisable identity of the run, checked on restore by the caller.
        """
        step = int(jax.device_get(state.step))
        data = {"position": int(position), "step": step, **(meta or {})}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores a state shaped and sharded like ``like``.

        Args:
          like: a state of the same structure (e.g. ``dp.init(...)`` of a fresh run); only
            its shapes, dtypes and shardings are used.
          step: which checkpoint; default the newest.

        Returns:
          ``(state, data)`` with ``data['position']`` the data position.

        Raises:
          FileNotFoundError: no checkpoint in the directory.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        mismatch = (
            f"checkpoint {self.directory}/{step} holds a state of another structure than "
            "this run's (different model, optimizer or ablation config); resume with the "
            "settings it was saved with, or use another --checkpoint-dir"
        )
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(like)), data=ocp.args.JsonRestore()
                ),
            )
        except ValueError as e:
            raise ValueError(f"{mismatch}. Orbax: {e}") from e
        state = out["state"]
        if jax.tree.structure(state) != jax.tree.structure(like):
            raise ValueError(mismatch + ".")
        return state, dict(out["data"])

    def close(self) -> None:
        self._manager.close()
