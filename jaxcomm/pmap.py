"""A ``jax.pmap`` Linen train step, data-parallel over the mesh: ``pmap_data_parallel``.

Flax's data-parallel examples are written for ``jax.pmap``: the step names its data axis
(``axis_name='batch'``) in ``nn.BatchNorm``, in ``lax.pmean`` of metrics and batch
statistics; the state is ``jax_utils.replicate``-d (a leading axis of one row per device),
batches come as ``(devices, per_device, ...)`` (``common_utils.shard``) and metrics come back
one row per device (``common_utils.get_metrics`` reads row 0). ``pmap_data_parallel(mesh,
axis_name='batch')`` stands in for ``jax.pmap(train_step, axis_name='batch')`` and keeps all
of that:

- the step runs as under its sibling :func:`jaxcomm.linen_data_parallel`, on the same
  engine (:class:`jaxcomm.flax_step.FlaxStep`: ``jax.shard_map`` over the mesh's data axes,
  ``check_vma=True``), with ``axis_name`` bound to those axes
  (``jaxcomm.axis_names``): the model's SyncBatchNorm and the step's ``lax.pmean`` /
  ``lax.psum`` over ``'batch'`` are the same reductions over every device;
- arguments that are a ``TrainState`` come in pmap's layout and go back in it: each
  replicated leaf is read from the rows the devices hold (no copy between devices; the rows
  are the same, as ``jax_utils.replicate`` makes them and the step proves them) and
  returned as one row per device; per-device optimizer state (error feedback) is stored in
  that layout already;
- the other arguments are the batch in pmap's layout: each device gets its row;
- every other output comes back one row per device, as pmap returns it (a value the step
  ``lax.pmean``-ed, the same on every device, repeated; a per-device value gathered).

The gradient mean is ``jaxcomm.sync_gradients``'s, first in the ``TrainState``'s ``tx``: a
step that still averages the gradients itself (``lax.pmean(grads, 'batch')``) is refused
with that line to delete; Flax's ``DynamicScale`` becomes ``jaxcomm.dynamic_scale``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.training.train_state import TrainState
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import outputs
from jaxcomm.axis_names import check_axis_name
from jaxcomm.flax_step import FlaxFrontEnd, FlaxStep, check_decorator_args, key_data
from jaxcomm.linen import LinenAdapter
from jaxcomm.mesh import DATA_AXES
from jaxcomm.replicas import check_replicas as compare_replicas
from jaxcomm.state import varying_axes

__all__ = ["PmapDataParallel", "pmap_data_parallel"]


def _is_state(x: Any) -> bool:
    return isinstance(x, TrainState)


def _rows_hint() -> str:
    """On several processes: how pmap_data_parallel's rows differ from jax.pmap's."""
    if jax.process_count() == 1:
        return ""
    return (
        f" On {jax.process_count()} processes jax.pmap takes each process's rows of its "
        f"{jax.local_device_count()} local devices; pmap_data_parallel takes the rows of all "
        f"{jax.device_count()} devices, the same global arrays on every process (each device "
        "takes its row)."
    )


def _check_rows(data: Any, num_devices: int) -> None:
    """Refuses a batch argument whose leading axis is not the devices (pmap's layout)."""
    for path, x in jax.tree_util.tree_flatten_with_path(data)[0]:
        shape = np.shape(x)
        if not shape or shape[0] != num_devices:
            raise ValueError(
                f"pmap_data_parallel: batch argument {jax.tree_util.keystr(path)} has shape "
                f"{shape}; in pmap's layout its leading axis is the {num_devices} "
                f"devices: (devices, per_device, ...), as common_utils.shard(batch) or "
                f"x.reshape({num_devices}, -1, *x.shape[1:]) makes it.{_rows_hint()}"
            )


class PmapDataParallel(FlaxFrontEnd):
    """A ``jax.pmap``-style Linen step run data-parallel over a mesh; build it with
    :func:`pmap_data_parallel`.

    A sibling of :class:`jaxcomm.LinenDataParallel` over the same engine and the same
    Linen adapter: it adds pmap's layouts around the engine's call (the state's rows in
    and out, the outputs one row per device, the user's step on each device's row)."""

    _name = "pmap_data_parallel"

    def __init__(
        self,
        fn: Callable,
        mesh: Mesh,
        *,
        axes: tuple[str, ...],
        axis_name: str,
        check_replicas: int,
    ):
        self._user_fn = fn
        engine = FlaxStep(
            self._body,
            mesh,
            LinenAdapter(self._name, check_batch=_check_rows),
            axes=axes,
            check_replicas=check_replicas,
            axis_name=axis_name,
        )
        super().__init__(engine, fn)
        self.axis_name = axis_name
        stacked, rep = P(self.axes), P()
        # Row i of a stacked leaf <-> device i's replica. No data moves between devices:
        # each device reads (or writes) its own row. Unchecked on purpose (check_vma=False):
        # the rows of a replicated leaf are equal by construction (jax_utils.replicate, or
        # a step's output proven invariant).
        self._rows_to_replicas = self._per_device(lambda xs: [x[0] for x in xs], stacked, rep)
        self._replicas_to_rows = self._per_device(lambda xs: [x[None] for x in xs], rep, stacked)
        # Outputs, one row per device on every device: each device keeps its own row.
        self._own_rows = self._per_device(
            lambda xs: [x[lax.axis_index(self.axes)][None] for x in xs], rep, stacked
        )

    def _per_device(self, fn: Callable, in_spec: P, out_spec: P) -> Callable:
        """``fn`` on each device's own part of a list of arrays, jitted (no data moves)."""
        mapped = jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False
        )
        return jax.jit(mapped)

    # -- inside shard_map ---------------------------------------------------------------
    def _body(self, *args):
        """The user's step on this device's row of each batch argument; its outputs one row
        per device (pmap's layout)."""
        local = [a if _is_state(a) else jax.tree.map(lambda x: x[0], a) for a in args]
        out = self._user_fn(*local)

        def row(x):
            if _is_state(x):
                return x
            x = jnp.asarray(x)
            if varying_axes(x) & set(self.axes):
                return outputs.gather(x[None])  # each device's own value, in device order
            # The same on every device (a pmean-ed metric): pmap returns it once per device.
            return jnp.broadcast_to(x[None], (self.num_devices, *x.shape))

        return jax.tree.map(row, out, is_leaf=_is_state)

    # -- the pmap layout of TrainState arguments ------------------------------------------
    def _per_device_flags(self, states: tuple) -> list[bool] | None:
        """Which leaves of ``states`` the compiled step stores per device (None before the
        step for this structure is built)."""
        return self.engine.per_device_flags(jax.tree.structure(states))

    def _from_rows(self, states: tuple) -> tuple:
        leaves, treedef = jax.tree.flatten(states)
        paths = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(states)[0]
        ]
        for path, x in zip(paths, leaves, strict=True):
            shape = np.shape(x)
            if not shape or shape[0] != self.num_devices:
                raise ValueError(
                    f"{self._name}: TrainState leaf {path} has shape {shape}; in pmap's "
                    f"layout every leaf has a leading axis of the {self.num_devices} devices. "
                    f"Pass jax_utils.replicate(state), as for jax.pmap.{_rows_hint()}"
                )
        per = self._per_device_flags(states) or [False] * len(leaves)
        sharding = NamedSharding(self.mesh, P(self.axes))

        def put(x):
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            return jax.device_put(x, sharding)

        idx = [i for i, f in enumerate(per) if not f]
        reps = self._rows_to_replicas([put(leaves[i]) for i in idx])
        for i, r in zip(idx, reps, strict=True):
            leaves[i] = r
        return jax.tree.unflatten(treedef, leaves)

    def _to_rows(self, states: tuple) -> tuple:
        leaves, treedef = jax.tree.flatten(states)
        per = self._per_device_flags(states)
        idx = [i for i, f in enumerate(per) if not f]
        rows = self._replicas_to_rows([leaves[i] for i in idx])
        for i, r in zip(idx, rows, strict=True):
            leaves[i] = r
        return jax.tree.unflatten(treedef, leaves)

    def drive_inputs(self, *args):
        """Refuses ``jaxcomm.CommProfiler.drive``: it reads and times the step's state in
        the global layout, not in pmap's per-device rows."""
        raise TypeError(
            "CommProfiler.drive does not drive a pmap_data_parallel step (its state comes "
            "and goes in pmap's per-device rows); decorate the step with "
            "jaxcomm.linen_data_parallel(mesh, axis_name=...) and pass the state unreplicated "
            "(flax.jax_utils.unreplicate) and the global batch to drive it."
        )

    def __call__(self, *args):
        """Runs the step on pmap-layout arguments; returns pmap-layout outputs."""
        states = tuple(a for a in args if _is_state(a))
        first = self._per_device_flags(states) is None
        states = self._from_rows(states)
        if first:
            # The rows were taken as replicas unchecked; once, compare them by their bits
            # (a state whose rows differ would otherwise train apart silently).
            compare_replicas(
                key_data(states), mesh=self.mesh, what=f"{self._name}: the TrainState rows "
            )
        it = iter(states)
        out = self.engine(*[next(it) if _is_state(a) else a for a in args])
        flat, treedef = jax.tree.flatten(out, is_leaf=_is_state)
        states = iter(self._to_rows(tuple(x for x in flat if _is_state(x))))
        rows = iter(self._own_rows([x for x in flat if not _is_state(x)]))
        return jax.tree.unflatten(
            treedef, [next(states) if _is_state(x) else next(rows) for x in flat]
        )


def pmap_data_parallel(
    mesh: Mesh,
    *,
    axis_name: str,
    axes: tuple[str, ...] = DATA_AXES,
    check_replicas: int | None = None,
) -> Callable[[Callable], PmapDataParallel]:
    """Runs a ``jax.pmap`` Linen train step data-parallel over ``mesh`` (in place of
    ``jax.pmap(train_step, axis_name=...)``).

    The step keeps its body, its ``lax.pmean(..., axis_name)`` of metrics and batch
    statistics, its model's ``nn.BatchNorm(axis_name=...)``, and its callers'
    ``jax_utils.replicate`` / ``common_utils.shard`` / ``common_utils.get_metrics`` (see the
    module docstring). Two lines of the script change besides this one: the
    ``TrainState``'s ``tx`` starts with ``jaxcomm.sync_gradients()``, and the step's own
    ``lax.pmean(grads, axis_name)`` goes (the sync does the mean; a step that keeps it is
    refused with that fix). With Flax's ``DynamicScale``, import
    ``jaxcomm.dynamic_scale`` in its place.

    Args:
      mesh: from :func:`jaxcomm.make_mesh`.
      axis_name: the name the script gave ``jax.pmap`` (``'batch'``), bound to ``axes``.
      axes: data-parallel axes of ``mesh``; device ``i`` of ``axis_name`` (row ``i`` of
        every pmap-layout argument and output) is device ``i`` of ``axes`` flattened.
      check_replicas: every this many steps, compare every replicated leaf across devices
        by its bits; 0/None: off.

    Returns:
      A decorator; the decorated step is a :class:`PmapDataParallel`.

    Example:
      >>> mesh = jaxcomm.make_mesh(intra=4)
      >>> p_train_step = jaxcomm.pmap_data_parallel(mesh, axis_name='batch')(
      ...     functools.partial(train_step, learning_rate_fn=learning_rate_fn))
      >>> state, metrics = p_train_step(jax_utils.replicate(state), common_utils.shard(batch))
    """
    n, axes = check_decorator_args("pmap_data_parallel", mesh, axes, check_replicas)
    name = check_axis_name(axis_name, axes, "pmap_data_parallel")
    if name is None:
        raise TypeError(
            "pmap_data_parallel(axis_name=None): pass the name the script gave jax.pmap, "
            "e.g. axis_name='batch'."
        )
    return lambda fn: PmapDataParallel(fn, mesh, axes=axes, axis_name=name, check_replicas=n)
