"""How a data-parallel step keeps its optimizer state: the layout strategies of the core.

``jaxcomm.DataParallel`` (the step core of ``jaxcomm.data_parallel``) runs one step over
an :class:`OptimizerLayout`, which owns the optimizer state's layout and the optimizer's
part of the step; the core computes the gradients and combines the outputs around it:

* :class:`ReplicatedOptimizer` (here): the optimizer runs whole on every device, its state
  replicated except its per-device leaves; each ``sync_gradients`` in it reduces the
  gradients.
* ``jaxcomm.sharded.ShardedOptimizer`` (``shard_optimizer=True``): the gradients are
  reduce-scattered with the sync's configuration, the optimizer runs on this device's
  ``1/N`` pieces, the params are all-gathered.
* ``jaxcomm.hybrid.HybridOptimizer`` (``shard_params=True``): the params themselves are
  split over the node's devices (``'intra'``) and gathered where the loss uses them; the
  gradients are reduce-scattered inside the node, the sync runs across nodes on each
  device's block, the optimizer on the block.

The params' own layout is the layout's say too (:meth:`OptimizerLayout.param_specs`,
:meth:`~OptimizerLayout.differentiable`, :meth:`~OptimizerLayout.loss`): replicated for the
first two (:class:`ReplicatedParams`), split for the third.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.compression.skip import keep_skipped
from jaxcomm.diloco import gradient_params
from jaxcomm.microbatch import update_with_value
from jaxcomm.state import (
    infer_per_device,
    leaf_specs,
    marked_per_device,
    stack_leaves,
    varying_axes,
)
from jaxcomm.sync import (
    NO_HOST_PHASE,
    GradientSync,
    HostPhase,
    SyncGradientsState,
    SyncRequest,
    other_input_message,
)
from jaxcomm.sync_inputs import check_sync_inputs

__all__ = ["OptimizerLayout", "ReplicatedOptimizer", "ReplicatedParams"]


class OptimizerLayout(Protocol):
    """The optimizer's part of a data-parallel step, and the layout of its state.

    Attributes:
      paths: ``jax.tree_util.keystr`` of each optimizer-state leaf (after
        :meth:`infer_layout`).
      local: one device's optimizer state, as ``jax.ShapeDtypeStruct`` s.
      per: per optimizer-state leaf, whether it is stored per device (stacked along the
        data axes) rather than replicated.
      syncs: the ``GradientSync`` of each ``sync_gradients`` the step runs.
      local_sgd: whether the gradient is taken at ``jaxcomm.local_sgd``'s local params.
    """

    paths: list[str]
    local: Any
    per: list[bool]
    syncs: list[GradientSync]
    local_sgd: bool

    def infer_layout(self, params: Any) -> list[bool]:
        """Decides the layout for ``params`` (arrays or ``ShapeDtypeStruct`` s), refusing
        an optimizer the layout cannot run; returns :attr:`per`."""
        ...

    def init_fn(self, per: list[bool]) -> Callable[[Any], Any]:
        """The jitted init: replicated params -> the optimizer state, per-device leaves
        stacked along the data axes."""
        ...

    def check_step(self, *, feedback: bool, communicate: bool) -> None:
        """Refuses a step variant the layout does not run (the profiler's feedback input,
        the compute-only twin)."""
        ...

    def step(
        self,
        grads: Any,
        opt_state: Any,
        params: Any,
        step: jax.Array,
        value: Callable[[], jax.Array],
        *,
        update: Callable,
        communicate: bool,
        phase: HostPhase = NO_HOST_PHASE,
    ) -> tuple[Any, Any, Any]:
        """One device's optimizer step inside ``jax.shard_map``: ``(new params, new
        optimizer state, done)``, ``done`` what the outputs' collectives wait for.

        Args:
          grads: this device's gradients; opt_state: its optimizer state (unstacked);
          params: the replicated params; step: the step count; value: the mean loss (for
            optax's extra argument ``value=``); update: the optimizer's ``update`` as the
            gradients' computation hands it (microbatches may thread a sync's state);
          communicate: False for the compute-only twin.
          phase: the host's decisions for the syncs (:class:`jaxcomm.HostPhase`, passed
            in :class:`jaxcomm.SyncRequest`; its None fields decided on the devices).
        """
        ...

    def reshard(self, opt_state: Any, sharding: Any) -> Any:
        """``opt_state`` written on another device count, laid out for this one."""
        ...

    def param_specs(self, params: Any) -> Any:
        """The PartitionSpec of each stored param leaf (a tree like ``params``)."""
        ...

    def opt_specs(self, opt_state: Any, per: list[bool]) -> Any:
        """The PartitionSpec of each leaf of the (global) optimizer state, ``per`` the
        flags of :meth:`infer_layout`."""
        ...

    def differentiable(self, params: Any) -> Any:
        """Inside ``jax.shard_map``: the stored (local) params typed so that ``jax.grad``
        of :meth:`loss` gives this device's own gradient (varying over the data axes: the
        gradient of an invariant input would be summed by JAX itself)."""
        ...

    def loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` as a function of the stored (local) params: the step
        differentiates it with respect to :meth:`differentiable` params."""
        ...


class ReplicatedParams:
    """The params' part of a layout whose params are replicated on every device
    (:class:`ReplicatedOptimizer`, ``jaxcomm.sharded.ShardedOptimizer``): the loss takes
    them as they are, and optimizer state is replicated or stacked per device."""

    mesh: Mesh
    axes: tuple[str, ...]

    def param_specs(self, params: Any) -> Any:
        """``P()`` for every leaf."""
        return jax.tree.map(lambda _: P(), params)

    def opt_specs(self, opt_state: Any, per: list[bool]) -> Any:
        """Per-device leaves stacked along the data axes, the others replicated."""
        return leaf_specs(opt_state, per, self.axes)

    def differentiable(self, params: Any) -> Any:
        """``params`` typed varying over the data axes (a no-op at run time)."""
        return lax.pcast(params, self.axes, to="varying")

    def loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` itself."""
        return loss_fn


def _accumulators(opt_state: Any) -> list[bool]:
    """Flags the leaves of ``optax.MultiSteps``' ``acc_grads`` that sum each device's own
    gradients (one flag per leaf).

    A MultiSteps that wraps the sync, or comes before it in the chain, accumulates the
    gradients before they are synchronised: each device holds its own sums. MultiSteps
    passes them through a ``lax.cond`` whose branches must agree in type, so the fixed
    point of the layout inference cannot discover them from an invariant start: they are
    per device from the outset. A MultiSteps after the sync (``optax.chain(
    jaxcomm.sync_gradients(), optax.MultiSteps(...))``) sums the synchronised gradients:
    its accumulators are replicated like the rest of the state.
    """

    def is_node(x):
        return isinstance(x, (optax.MultiStepsState, SyncGradientsState))

    nodes, treedef = jax.tree.flatten(opt_state, is_leaf=is_node)
    seen_sync = False
    flags = []
    for node in nodes:
        if isinstance(node, SyncGradientsState):
            seen_sync = True
        if isinstance(node, optax.MultiStepsState):
            before_sync = _has_sync(node.inner_opt_state) or not seen_sync
            flags.append(
                node._replace(
                    **{
                        f: jax.tree.map(lambda _, f=f, b=before_sync: b and f == "acc_grads", v)
                        for f, v in zip(node._fields, node, strict=True)
                    }
                )
            )
            seen_sync = seen_sync or _has_sync(node.inner_opt_state)
        else:
            flags.append(jax.tree.map(lambda _: False, node))
    return jax.tree.leaves(jax.tree.unflatten(treedef, flags))


def _has_sync(state: Any) -> bool:
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, SyncGradientsState))
    return any(isinstance(x, SyncGradientsState) for x in found)


def _refuse_drift(paths: list[str], per: list[bool], marked: list[bool]) -> None:
    """Refuses optimizer state computed from each device's own gradients without a mark."""
    drifting = [p for p, f, m in zip(paths, per, marked, strict=True) if f and not m]
    if drifting:
        more = f" (and {len(drifting) - 1} more leaves)" if len(drifting) > 1 else ""
        raise ValueError(
            f"data_parallel: optimizer state {drifting[0]}{more} is computed from each "
            "device's own gradients: a stateful transform runs before "
            "jaxcomm.sync_gradients in the chain, so every device would keep a different "
            "copy (e.g. Adam's moments of its local gradients). Put "
            "jaxcomm.sync_gradients() first, e.g. optax.chain(jaxcomm.sync_gradients(), "
            "optax.adamw(1e-3)); if per-device state is what you mean, wrap it in "
            "jaxcomm.PerDevice in the transform's init."
        )


def _refuse_varying_updates(updates: list[tuple[str, list]]) -> None:
    """Refuses an update that varies over the data axes (no sync before it)."""
    varying = [(k, v) for k, v in updates if v]
    if varying:
        path, vma = varying[0]
        more = f" (and {len(varying) - 1} more leaves)" if len(varying) > 1 else ""
        raise ValueError(
            f"data_parallel: the optimizer's update of params{path}{more} varies over "
            f"mesh axes {tuple(vma)}: it is "
            "computed from each device's own gradients with no synchronising collective "
            "after them, so params would differ across devices. Put "
            "jaxcomm.sync_gradients() in the optax.chain before the transforms whose "
            "output must agree, e.g. optax.chain(jaxcomm.sync_gradients(), "
            "optax.adamw(1e-3)). If you reduce the gradients yourself, pass "
            "require_sync=False (replication is then not proven; use check_replicas=N)."
        )


class ReplicatedOptimizer(ReplicatedParams):
    """The optimizer run whole on every device (:class:`OptimizerLayout`): its state
    replicated except the leaves that are per device, and its ``sync_gradients`` reducing
    the gradients.

    Args:
      optimizer: the optax transform (accepting optax's extra arguments).
      mesh: the mesh; axes: its data axes.
      require_sync: refuse an optimizer that runs no ``sync_gradients`` and prove the
        replicated state invariant (False: only ``PerDevice`` marks decide).
      overlapped: the gradients reach the optimizer reduced already
        (``accumulate='overlap'``).
    """

    def __init__(
        self,
        optimizer: Any,
        mesh: Mesh,
        axes: tuple[str, ...],
        *,
        require_sync: bool,
        overlapped: bool,
    ):
        self.optimizer = optimizer
        self.mesh, self.axes = mesh, tuple(axes)
        self.require_sync, self.overlapped = require_sync, overlapped
        self.paths: list[str] = []
        self.local: Any = None  # this device's optimizer state shapes, from the probe
        self.per: list[bool] = []
        self.syncs: list[GradientSync] = []  # each sync_gradients' GradientSync (probe)
        self.local_sgd = False  # the optimizer holds jaxcomm.local_sgd (from the probe)
        # The build-time probe found that what reaches each sync commutes with the mean
        # (a linear transform before it, MultiSteps' accumulator): the step accepts it.
        self.inputs_checked = False

    def infer_layout(self, params: Any) -> list[bool]:
        """Which optimizer-state leaves are per device, from shard_map's replication types.

        1. ``init`` is traced: a leaf is per device if it is marked ``PerDevice`` (or is an
           ``optax.MultiSteps`` accumulator), or typed varying over the data axes.
        2. ``update`` with per-device gradients is traced abstractly (no compute, no
           compile) until the set is stable, because a per-device input can make further
           leaves vary; each sync reports its :class:`~jaxcomm.GradientSync` to the
           request (``SyncRequest.on_sync``).
        3. State that varies without a mark (a stateful transform before the sync) and an
           update that varies (no sync) are refused, naming the leaf; so is a transform
           before the sync that does not commute with the mean.

        Args:
          params: the params (arrays or ``ShapeDtypeStruct`` s, replicated).
        """
        concrete = params
        replicated = NamedSharding(self.mesh, P())
        params = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(jnp.shape(p), p.dtype, sharding=replicated), params
        )
        rec = self._trace_init(params)
        self.paths = rec["paths"]
        self.local = jax.tree.unflatten(rec["treedef"], rec["local"])
        self.local_sgd = rec["local_sgd"]
        if rec["local_sgd"] and self.overlapped:
            raise ValueError(
                "data_parallel(accumulate='overlap') reduces every microbatch's gradient, but "
                "jaxcomm.local_sgd synchronises only every sync_every steps: use "
                "accumulate='local' (the default) with local_sgd."
            )
        if not self.require_sync:
            # The user reduces (or, for a compute-only twin, skips) the gradients: nothing
            # is proven, so only explicit marks decide (and check_replicas=N checks values).
            self.per = rec["marked"]
            return self.per
        marked = [m or v for m, v in zip(rec["marked"], rec["vary"], strict=True)]
        per, updates, indirect = self._trace_update(params, rec, marked)
        _refuse_drift(rec["paths"], per, rec["marked"])
        _refuse_varying_updates(updates)
        if indirect:  # a sync receives something computed from the gradients: probe it
            check_sync_inputs(self.optimizer, concrete, self.mesh, "data_parallel")
            self.inputs_checked = True
        self.per = per
        return per

    def _trace_init(self, params: Any) -> dict[str, Any]:
        """Step 1 of :meth:`infer_layout`: the optimizer state's paths, local shapes,
        marks and replication types after ``init``."""
        axes = frozenset(self.axes)
        rec: dict[str, Any] = {}

        def init_probe(p):
            s = self.optimizer.init(p)
            flat, treedef = jax.tree_util.tree_flatten_with_path(s)
            rec["treedef"] = treedef
            rec["paths"] = [jax.tree_util.keystr(k) for k, _ in flat]
            rec["local"] = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in flat]
            rec["vary"] = [bool(varying_axes(x) & axes) for _, x in flat]
            rec["marked"] = [
                a or b for a, b in zip(marked_per_device(s), _accumulators(s), strict=True)
            ]
            rec["local_sgd"] = gradient_params(s) is not None
            return jnp.zeros(())

        jax.eval_shape(self._probe_map(init_probe, (P(),)), params)
        return rec

    def _trace_update(self, params: Any, rec: dict, marked: list[bool]):
        """Step 2 of :meth:`infer_layout`: ``update`` traced with per-device gradients
        until the per-device set is stable (:func:`jaxcomm.state.infer_per_device`).
        Returns the set and, per update leaf, its path and the data axes it varies over;
        sets :attr:`syncs`."""
        axes = frozenset(self.axes)
        out: dict[str, Any] = {}
        indirect: list[GradientSync] = []  # syncs that receive other arrays than g

        def other_input(sync, _):
            if not any(x is sync for x in indirect):
                indirect.append(sync)

        def update_probe(s, p):
            g = jax.tree.map(jnp.zeros_like, p)
            if not self.overlapped:  # gradients of the local batch(es): per device
                g = lax.pcast(g, self.axes, to="varying")
            found: list[GradientSync] = []
            request = self.request(not self.overlapped, g, other_input, found.append)
            update = functools.partial(self.optimizer.update, sync_request=request)
            u, s2 = update_with_value(update, g, s, p, lambda: jnp.zeros((), jnp.float32))
            self._check_synced(found, s)
            self.syncs = list({id(x): x for x in found}.values())
            out["updates"] = [
                (jax.tree_util.keystr(k), sorted(varying_axes(x) & axes))
                for k, x in jax.tree_util.tree_flatten_with_path(u)[0]
            ]
            return [bool(varying_axes(x) & axes) for x in jax.tree.leaves(s2)]

        local = jax.tree.unflatten(rec["treedef"], rec["local"])
        try:
            per = infer_per_device(
                update_probe, local, marked, self.mesh, self.axes, args=(params,), arg_specs=(P(),)
            )
        except (TypeError, ValueError) as e:
            refused = untyped_update("data_parallel", e)
            if refused is None:
                raise
            raise refused from e
        return per, out["updates"], indirect

    def request(
        self,
        communicate: bool,
        grads: Any,
        other_input: Callable | None = None,
        on_sync: Callable | None = None,
        phase: HostPhase = NO_HOST_PHASE,
    ) -> SyncRequest:
        """The request the step passes every sync: the gradients it computed (which the
        sync must receive, or ``other_input`` decides; default: accepted if the build-time
        probe checked the syncs). With ``accumulate='overlap'`` the sync reduced each
        microbatch already and passes its input through, so whatever runs before it sees
        the global mean, as on one device: nothing to check."""
        stated = None if self.overlapped else grads
        checked = other_input or self._checked_input
        return SyncRequest(communicate, on_sync, stated, checked, phase=phase)

    def _checked_input(self, sync: GradientSync, _: Any) -> None:
        """Accepts, in the step's trace, a sync that receives arrays other than the step's
        gradients if the build-time probe checked the optimizer's syncs
        (:func:`~jaxcomm.sync_inputs.check_sync_inputs`: the same update, so the same
        places); refuses it otherwise."""
        del sync
        if not self.inputs_checked:
            raise ValueError(
                other_input_message(
                    "data_parallel",
                    "which was not checked when the step was built (require_sync=False "
                    "skips the build-time probes)",
                )
            )

    def _check_synced(self, found: list, opt_state: Any) -> None:
        """Refuses an optimizer whose update ran no ``sync_gradients`` (``found``: the
        syncs that reported themselves to the request)."""
        if not self.require_sync or found:
            return
        if _has_sync(opt_state):
            raise ValueError(
                "data_parallel: the optimizer state holds a SyncGradientsState, but no "
                "sync_gradients reported itself through optax's extra argument "
                "sync_request=: a wrapper in the optimizer does not forward extra "
                "arguments to the transforms it wraps. Forward **extra_args in its update "
                "(optax's own wrappers do), or wrap it with optax.with_extra_args_support."
            )
        raise ValueError(
            "the optimizer passed to data_parallel never synchronises gradients, so "
            "params would drift apart across devices. Put jaxcomm.sync_gradients() first "
            "in the optax.chain, or pass require_sync=False if you reduce them yourself."
        )

    def _probe_map(self, fn: Callable, in_specs: tuple) -> Callable:
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=P(), check_vma=True)

    def init_fn(self, per: list[bool]) -> Callable[[Any], Any]:
        """The jitted optimizer init: replicated params -> the state, per-device leaves
        stacked along the data axes."""
        return jax.jit(
            jax.shard_map(
                lambda p: stack_leaves(self.optimizer.init(p), per),
                mesh=self.mesh,
                in_specs=(P(),),
                out_specs=leaf_specs(self.local, per, self.axes),
            )
        )

    def check_step(self, *, feedback: bool, communicate: bool) -> None:
        """Every step variant runs (nothing refused)."""
        del feedback, communicate

    def step(
        self,
        grads: Any,
        opt_state: Any,
        params: Any,
        step: jax.Array,
        value: Callable[[], jax.Array],
        *,
        update: Callable,
        communicate: bool,
        phase: HostPhase = NO_HOST_PHASE,
    ) -> tuple[Any, Any, Any]:
        """The optimizer's ``update`` (its syncs reduce the gradients), the params updated;
        a step a compressor voids (``jaxcomm.compression.skip``: fp16's overflow) is
        skipped whole, as ``optax.apply_if_finite`` does: params and optimizer state stay
        as they were, only the skipping state moves. ``done``: the updates."""
        del step
        found: list[GradientSync] = []
        request = self.request(communicate, grads, on_sync=found.append, phase=phase)
        # Optimizers that read the loss (optax's extra argument value=, e.g.
        # reduce_on_plateau) get the loss of the global batch, as on one device.
        updates, new_opt = update_with_value(
            functools.partial(update, sync_request=request), grads, opt_state, params, value
        )
        self._check_synced(found, opt_state)
        new_params = optax.apply_updates(params, updates)
        # Decided from the reduced values: the same on every device.
        new_params, new_opt = keep_skipped(opt_state, new_opt, params, new_params)
        return new_params, new_opt, updates

    def reshard(self, opt_state: Any, sharding: Any) -> Any:
        """Refused: replicated optimizer state needs no new layout."""
        del opt_state, sharding
        raise ValueError(
            "reshard lays out sharded optimizer state (data_parallel(shard_optimizer=True)) "
            "for another device count; this step's optimizer state is replicated: restore "
            "it with this step's state shardings (dp.state_shardings(state))."
        )


def untyped_update(where: str, error: Exception) -> ValueError | None:
    """The refusal for ``error``, raised while a step builder traced its optimizer update
    to infer the layout, if it is a branch that does not type-check under shard_map's
    replication check (the cause and the fix); None for any other error.

    Args:
      where: the step builder, in the message (``'data_parallel'``, a Flax decorator).
      error: what the trace raised.
    """
    if "manual axis types" not in str(error) and "vma" not in str(error):
        return None
    return ValueError(
        f"{where}: the optimizer's update does not type-check under shard_map's "
        "replication check: a branch or decision depends on each device's own gradients, "
        "so devices could take different branches (and some would skip the sync's "
        "collectives). A common cause is a wrapper around jaxcomm.sync_gradients that "
        "decides from the raw gradients, e.g. optax.apply_if_finite(optax.chain("
        "jaxcomm.sync_gradients(), ...)): put it after the sync instead, optax.chain("
        f"jaxcomm.sync_gradients(), optax.apply_if_finite(...)). JAX says: {error}"
    )
