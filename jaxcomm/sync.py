"""``sync_gradients``: the optax transform that averages gradients across data-parallel devices."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import cost
from jaxcomm.buckets import AutoBuckets, check_bucket_bytes, plan_buckets
from jaxcomm.collectives import allreduce
from jaxcomm.collectives.auto import check_topology, fit_to_mesh
from jaxcomm.collectives.base import check_algorithm, check_axes, check_float_tree
from jaxcomm.mesh import DATA_AXES, INTRA
from jaxcomm.topology import detect

__all__ = [
    "SyncGradientsState",
    "pre_reduced",
    "reducer_probe",
    "sync_gradients",
    "sync_probe",
]


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


# Set by the microbatch loop of ``data_parallel``: gradients that reach sync_gradients were
# already reduced (one microbatch at a time, overlapped with the next one's compute).
_PRE_REDUCED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxcomm_pre_reduced", default=False
)
# Trace-time record of the gradient reducers of sync_gradients (for the microbatch loop).
_REDUCERS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxcomm_reducers", default=None
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


@contextlib.contextmanager
def reducer_probe():
    """Yields a list that gets the ``grads -> reduced grads`` function of each traced
    ``sync_gradients`` (used by ``data_parallel(..., microbatches=N)``)."""
    found: list = []
    token = _REDUCERS.set(found)
    try:
        yield found
    finally:
        _REDUCERS.reset(token)


@contextlib.contextmanager
def pre_reduced():
    """Inside: ``sync_gradients`` passes gradients through (they were reduced already)."""
    token = _PRE_REDUCED.set(True)
    try:
        yield
    finally:
        _PRE_REDUCED.reset(token)


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


def _predicted_seconds(algorithm: str, axes: tuple[str, ...], topology: Any):
    """``nbytes -> seconds`` of one all-reduce over ``axes`` from ``jaxcomm.cost`` (inside
    shard_map): the topology (given, or detected) fitted to the mesh as 'auto' does."""
    topo = topology or detect()
    sizes = [int(lax.axis_size(a)) for a in axes]
    g = sizes[-1] if axes[-1] == INTRA else 1
    topo = fit_to_mesh(topo, int(np.prod(sizes)) // g, g)
    name = algorithm if algorithm in cost.ALGORITHMS else "auto"
    return lambda nbytes: cost.predict(name, nbytes, topo)


def sync_gradients(
    *,
    axes: tuple[str, ...] = DATA_AXES,
    algorithm: str = "hierarchical",
    topology: Any = None,
    bucket_bytes: tuple[int, int] | str | AutoBuckets | None = None,
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
      bucket_bytes: ``None``: leaves are packed as in :func:`jaxcomm.allreduce` (large
        leaves alone, small ones concatenated per dtype). ``(min_bytes, max_bytes)``: the
        leaves of each dtype, in reverse parameter order, are cut into 1-D buckets, the
        first of ``min_bytes``, the others of ``max_bytes`` (``jaxcomm.buckets``), one
        collective per bucket. ``'auto'`` or a ``jaxcomm.buckets.AutoBuckets``: bucket
        sizes chosen at trace time to minimise predicted exposed communication
        (``jaxcomm.cost.predict`` of ``algorithm`` on ``topology``).

    Returns:
      An ``optax.GradientTransformation`` with state :class:`SyncGradientsState`.

    Raises:
      ValueError: unknown ``algorithm``, malformed ``axes`` or ``bucket_bytes`` (at
        construction).
      TypeError: ``topology`` is not a Topology.

    Example:
      >>> tx = optax.chain(jaxcomm.sync_gradients(algorithm='hierarchical'),
      ...                  optax.adamw(1e-3))
      >>> bucketed = jaxcomm.sync_gradients(bucket_bytes=(1 << 20, 25 << 20))  # DDP-like
    """
    axes = check_axes(axes)
    check_algorithm(algorithm)
    check_topology(topology)
    bucket_bytes = check_bucket_bytes(bucket_bytes)

    def reduce(grads: Any) -> Any:
        if bucket_bytes is None:
            return allreduce(grads, axes=axes, algorithm=algorithm, op="mean", topology=topology)
        # leaves -> buckets -> one all-reduce per bucket -> leaves
        check_float_tree(grads)
        leaves, treedef = jax.tree.flatten(grads)
        if not leaves:
            return grads
        bounds = bucket_bytes
        if isinstance(bounds, AutoBuckets):
            bounds = bounds.choose(leaves, _predicted_seconds(algorithm, axes, topology))
        plan = plan_buckets(leaves, min_bytes=bounds[0], max_bytes=bounds[1])
        reduced = [
            allreduce(b, axes=axes, algorithm=algorithm, op="mean", topology=topology)
            for b in plan.pack(leaves)
        ]
        return jax.tree.unflatten(treedef, plan.unpack(reduced))

    def init(params: Any) -> SyncGradientsState:
        del params
        return SyncGradientsState(count=jnp.zeros((), jnp.int32))

    def update(grads: Any, state: SyncGradientsState, params: Any = None):
        del params
        calls = _SYNC_CALLS.get()
        if calls is not None:
            calls.append(axes)
        _check_bound(axes)
        reducers = _REDUCERS.get()
        if reducers is not None:
            reducers.append(reduce)
        reduced = grads if _PRE_REDUCED.get() else reduce(grads)
        return reduced, SyncGradientsState(count=state.count + 1)

    return optax.GradientTransformation(init, update)
