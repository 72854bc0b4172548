"""``sync_gradients``: the optax transform that averages gradients across data-parallel devices."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm.collectives import allreduce
from jaxcomm.collectives.auto import check_topology
from jaxcomm.collectives.base import check_algorithm, check_axes
from jaxcomm.mesh import DATA_AXES

__all__ = ["SyncGradientsState", "sync_gradients", "sync_probe"]


class SyncGradientsState(NamedTuple):
    """State of :func:`sync_gradients`.

    Attributes:
      count: number of synchronised steps (int32); compressors key their randomness and
        warm-up on it.
    """

    count: jax.Array


# Trace-time record of sync_gradients calls, so the step builder can refuse an optimizer
# that never synchronises (its params would silently drift apart across devices).
_SYNC_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxcomm_sync_calls", default=None
)


@contextlib.contextmanager
def sync_probe():
    """Context manager yielding a list that gets one entry per traced ``sync_gradients``."""
    calls: list = []
    token = _SYNC_CALLS.set(calls)
    try:
        yield calls
    finally:
        _SYNC_CALLS.reset(token)


def _check_bound(axes: tuple[str, ...]) -> None:
    for a in axes:
        try:
            lax.axis_size(a)
        except NameError as e:
            raise ValueError(
                f"sync_gradients(axes={axes}) was called where mesh axis {a!r} is not bound. "
                "Call the optimizer's update inside jax.shard_map over a mesh with these "
                "axes, e.g. through jaxcomm.data_parallel(...)."
            ) from e


def sync_gradients(
    *,
    axes: tuple[str, ...] = DATA_AXES,
    algorithm: str = "hierarchical",
    topology: Any = None,
) -> optax.GradientTransformation:
    """Averages gradients over the data-parallel mesh axes.

    Put it first in an ``optax.chain``; its ``update`` must run inside ``jax.shard_map``
    (``jaxcomm.data_parallel`` does that).

    Args:
      axes: mesh axis names to average over, outermost first.
      algorithm: all-reduce algorithm, one of ``jaxcomm.collectives.ALGORITHMS``;
        'auto' picks one per packed buffer with ``jaxcomm.cost.choose``.
      topology: the ``jaxcomm.topology.Topology`` that 'auto' plans with; None:
        ``jaxcomm.topology.detect()`` at trace time.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`SyncGradientsState`.

    Raises:
      ValueError: unknown ``algorithm`` or malformed ``axes`` (at construction).
      TypeError: ``topology`` is not a Topology.

    Example:
      >>> tx = optax.chain(jaxcomm.sync_gradients(algorithm='hierarchical'),
      ...                  optax.adamw(1e-3))
    """
    axes = check_axes(axes)
    check_algorithm(algorithm)
    check_topology(topology)

    def init(params: Any) -> SyncGradientsState:
        del params
        return SyncGradientsState(count=jnp.zeros((), jnp.int32))

    def update(grads: Any, state: SyncGradientsState, params: Any = None):
        del params
        calls = _SYNC_CALLS.get()
        if calls is not None:
            calls.append(axes)
        _check_bound(axes)
        reduced = allreduce(grads, axes=axes, algorithm=algorithm, op="mean", topology=topology)
        return reduced, SyncGradientsState(count=state.count + 1)

    return optax.GradientTransformation(init, update)
