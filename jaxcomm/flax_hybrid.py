"""Hybrid sharding under the Flax front ends: ``nnx_data_parallel(mesh, shard_params=True)``
and ``linen_data_parallel(mesh, shard_params=True)``.

The layout is ``data_parallel(shard_params=True)``'s, :class:`jaxcomm.hybrid.HybridOptimizer`
(behind the :class:`jaxcomm.layout.OptimizerLayout` protocol); this module only says how
the Flax engine (:class:`jaxcomm.flax_step.FlaxStep`) stores and shows the params it lays
out:

1. **stored split** (:meth:`HybridParams.lay_out`, each call; work at the first only): the
   model's params are global arrays split over ``'intra'`` along the layout's dimensions
   (``layout.param_specs``), replicated over ``'inter'``; the optimizer's fresh state is
   replaced by the layout's (Adam's moments split like the params, error-feedback
   residuals per device). NNX's ``nnx.Param`` variables and a ``TrainState``'s ``params``
   hold those global arrays after the step, and ordinary code (an eval step, orbax) uses
   them as they are.
2. **seen whole** (:meth:`HybridParams.enter`, inside the step's ``jax.shard_map``): the
   user's step sees each param gathered inside the node (``layout.loss`` of the identity:
   the view the layout's loss takes), so the model runs as written.
3. **gradients of the blocks**: the user differentiates the gathered params; the
   optimizer's update takes the transpose of the view (its ``vjp``: a reduce-scatter
   inside the node, as ``data_parallel``'s gradient of its gathered loss) and runs the
   layout's step on the blocks (:meth:`_Trace.update`: the sync across nodes, the
   transforms on the block).
4. **stored again**: the params the update writes into the model are the new blocks
   gathered (what code after the update sees); the step stores the blocks themselves (the
   gathered copies are unused after the step, and XLA drops them), or, for a param the
   step changed after the update, this device's slice of it.

A param the step changes after the update (a mask, a max-norm) is stored as this
device's slice of the changed param (:meth:`_Trace.store`), if it is the same on every
node (computed from the updated params and shared values); one computed from each
device's own values is refused.

Not implemented (refused by name): several optimizers or models in one step, an optimizer
over a subset of the params (``wrt``), the profiler's feedback and compute-only twin,
``shard_optimizer=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.hybrid import HybridOptimizer
from jaxcomm.state import varying_axes

__all__ = ["HybridParams", "check_shard_params", "spec_axes"]


def check_shard_params(where: str, shard_params: Any, shard_optimizer: bool, axes: tuple) -> bool:
    """A Flax decorator's ``shard_params`` argument, checked at construction.

    Raises:
      TypeError: ``shard_params`` is not a bool.
      ValueError: with ``shard_optimizer=True``, or fewer than two data axes.
    """
    if not isinstance(shard_params, bool):
        raise TypeError(f"{where}(shard_params={shard_params!r}) must be True or False.")
    if shard_params and shard_optimizer:
        raise ValueError(
            f"{where}(shard_params=True, shard_optimizer=True): shard_params splits the "
            "optimizer state with the params already; pass only shard_params=True."
        )
    if shard_params and len(axes) < 2:
        raise ValueError(
            f"{where}(shard_params=True) splits params over the innermost data axis and "
            f"syncs over the outer ones, but axes={tuple(axes)}; use axes=('inter', "
            "'intra') (jaxcomm.make_mesh(intra=...))."
        )
    return shard_params


def spec_axes(spec: P) -> frozenset:
    """The mesh axes a PartitionSpec names."""
    out: set = set()
    for entry in spec:
        if entry is not None:
            out.update(entry if isinstance(entry, tuple) else (entry,))
    return frozenset(out)


class HybridParams:
    """The params and optimizer state of a Flax step laid out by
    :class:`~jaxcomm.hybrid.HybridOptimizer` (module docstring).

    Args:
      where: the decorator's name, in messages.
      mesh: the engine's mesh; axes: its data axes (the last is the node's).
    """

    def __init__(self, where: str, mesh: Mesh, axes: tuple[str, ...]):
        self.where, self.mesh, self.axes = where, mesh, tuple(axes)
        self.layout: HybridOptimizer | None = None
        self._param_shardings: list[NamedSharding] = []
        self._state_specs: list[P] = []
        self._placements: dict = {}

    @property
    def split_axes(self) -> frozenset:
        """The axes the stored params and updates may differ over (the node's)."""
        return frozenset(self.axes[-1:])

    def lay_out(self, adapter: Any, objs: tuple) -> tuple:
        """``objs`` with the optimizer's state laid out by the layout (at the first call:
        the layout is built, its checks and probes run); the params are placed split by
        the engine (:meth:`placement`).

        Raises:
          NotImplementedError: not one optimizer.
          ValueError: a trained optimizer state that cannot be laid out (per-device
            leaves), and the layout's refusals.
        """
        opts = adapter.optimizers(objs)
        if len(opts) != 1:
            raise NotImplementedError(
                f"{self.where}(shard_params=True): the step takes {len(opts)} optimizers; "
                "the hybrid layout splits the params of one model with one optimizer: pass "
                "one (an nnx.Optimizer with its model, or one TrainState)."
            )
        i, tx, params, opt_state = opts[0]
        if self.layout is None:
            layout = HybridOptimizer(tx, self.mesh, self.axes, where=self.where)
            layout.infer_layout(params)
            specs = jax.tree.leaves(layout.param_specs(params), is_leaf=lambda x: isinstance(x, P))
            self._param_shardings = [NamedSharding(self.mesh, s) for s in specs]
            self._state_specs = jax.tree.leaves(
                layout.opt_specs(layout.local, layout.per), is_leaf=lambda x: isinstance(x, P)
            )
            self.layout = layout
        given = jax.tree.leaves(opt_state)
        targets = [NamedSharding(self.mesh, s) for s in self._state_specs]
        if len(given) == len(targets) and all(
            isinstance(x, jax.Array) and x.sharding == t
            for x, t in zip(given, targets, strict=True)
        ):
            return objs  # laid out (a later call, or a state restored in this layout)
        return adapter.with_opt_state(objs, i, self._new_state(tx, params, opt_state, targets))

    def _new_state(self, tx: Any, params: Any, opt_state: Any, targets: list) -> Any:
        layout = self.layout
        leaves, treedef = jax.tree.flatten(params)
        split = jax.tree.unflatten(treedef, jax.device_put(leaves, self._param_shardings))
        fresh = jax.tree.leaves(jax.jit(tx.init)(params))
        given = jax.tree.leaves(opt_state)
        # compared on the host: one small program per leaf shape otherwise
        if len(fresh) == len(given) and all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(fresh, given, strict=True)
        ):
            return layout.init_fn(layout.per)(split)
        shapes = jax.eval_shape(layout.init_fn(layout.per), split)
        same = len(given) == len(jax.tree.leaves(shapes)) and all(
            np.shape(a) == b.shape for a, b in zip(given, jax.tree.leaves(shapes), strict=True)
        )
        if not same or any(layout.per):
            raise ValueError(
                f"{self.where}(shard_params=True): the optimizer's state is not the one its "
                "init gives (it was trained, or restored from a checkpoint of another "
                "layout) and holds per-device leaves (error-feedback residuals, PowerSGD "
                "factors) whose blocks the hybrid layout cannot derive. Build the optimizer "
                "anew before the first step, or restore a state saved from this step into "
                "the layout: train_step.shard_optimizer_state(model, optimizer) first, then "
                "restore with nnx.state(optimizer) (its shardings) as the target."
            )
        # A trained state without per-device leaves (Adam's moments of the whole params):
        # the same values, split like the params.
        return jax.tree.unflatten(jax.tree.structure(opt_state), jax.device_put(given, targets))

    def placement(self, kinds: tuple, opts: list, marked: list[bool], param: str) -> tuple:
        """``(specs, marked)`` of the engine's state leaves: each param leaf's split spec
        and each optimizer-state leaf's (``P()`` for the rest), and the per-device flags
        with the layout's per-device optimizer leaves added. Checked once per structure.

        Raises:
          NotImplementedError: the optimizer does not train exactly the step's params.
        """
        key = (kinds, tuple(tuple(idx) for _, idx in opts))
        if key not in self._placements:
            specs = [P()] * len(kinds)
            params = [i for i, k in enumerate(kinds) if k == param]
            if len(params) != len(self._param_shardings):
                raise NotImplementedError(
                    f"{self.where}(shard_params=True): the step holds {len(params)} params "
                    f"and its optimizer trains {len(self._param_shardings)}; the hybrid "
                    "layout splits exactly the params the optimizer trains: train them all "
                    "(nnx.Optimizer(..., wrt=nnx.Param)) with one model."
                )
            for i, s in zip(params, self._param_shardings, strict=True):
                specs[i] = s.spec
            flags = list(marked)
            ((_, idx),) = opts
            for j, s, per in zip(idx, self._state_specs, self.layout.per, strict=True):
                if per:
                    flags[j] = True
                else:
                    specs[j] = s
            self._placements[key] = (tuple(specs), flags)
        return self._placements[key]

    def enter(self, kinds: tuple, leaves: list, param: str) -> _Trace:
        """Inside the step's ``jax.shard_map``: the params as the user's step sees them
        (gathered inside the node), for the trace of one step."""
        idx = [i for i, k in enumerate(kinds) if k == param]
        blocks = [leaves[i] for i in idx]
        view = self.layout.loss(lambda p: p)  # the params as the layout's loss sees them
        full, vjp = jax.vjp(view, self.layout.differentiable(blocks))
        return _Trace(self, dict(zip(idx, full, strict=True)), blocks, full, vjp)


class _Trace:
    """One trace of a step under :class:`HybridParams`: what the step saw and stored."""

    def __init__(self, owner: HybridParams, seen: dict, blocks: list, full: list, vjp: Callable):
        self.owner, self.layout = owner, owner.layout
        self.seen = seen  # engine leaf index -> the gathered param the model holds
        self.blocks = blocks
        self._position = {id(x): j for j, x in enumerate(full)}
        self._vjp = vjp
        self._stored: dict[int, jax.Array] = {}  # id(new gathered param) -> its new block

    def update(self, grads: Any, state: Any, params: Any, kwargs: dict, hooks: Any) -> tuple:
        """The optimizer's update under the layout: the gradients of the gathered params
        taken back to the blocks (the view's transpose: a reduce-scatter inside the
        node), the layout's step on the blocks; the new params, gathered, recorded for
        ``apply_updates`` (``hooks.exact``) and their blocks for :meth:`store`."""
        where = self.owner.where
        self.layout.check_step(feedback=False, communicate=hooks.communicate)
        flat, treedef = jax.tree.flatten(params)
        order = [self._position.get(id(p)) for p in flat]
        if order != list(range(len(self.blocks))):
            raise NotImplementedError(
                f"{where}(shard_params=True): the optimizer's update is not over the step's "
                "params as the step holds them (a subset, other arrays, or a second "
                "update); update once per step with the model's params, e.g. "
                "optimizer.update(model, grads)."
            )
        (grad_blocks,) = self._vjp(treedef.flatten_up_to(grads))
        value = self._value(kwargs, where)
        new_blocks, new_state, updates = self.layout.step(
            jax.tree.unflatten(treedef, grad_blocks),
            state,
            jax.tree.unflatten(treedef, self.blocks),
            jnp.zeros((), jnp.int32),
            value,
            phase=hooks.phase,
        )
        new_full = jax.tree.leaves(self.layout.gather(new_blocks))
        for u, full, block in zip(
            jax.tree.leaves(updates), new_full, jax.tree.leaves(new_blocks), strict=True
        ):
            hooks.exact[id(u)] = full
            self._stored[id(full)] = block
        hooks.log.syncs.extend(self.layout.syncs)
        return updates, new_state

    def _value(self, kwargs: dict, where: str) -> Callable[[], jax.Array]:
        axes = self.owner.axes

        def value():
            if "value" not in kwargs:
                raise TypeError(f"{where}: the optimizer takes optax's extra argument 'value'")
            return lax.pmean(kwargs["value"], axes)

        return value

    def store(self, result: list, kinds: tuple, stored: list, paths: Callable, param: str) -> list:
        """The step's new leaves with each param leaf as the engine stores it: its new
        block (the param the update wrote), the stored block (not trained), or this
        device's block of a param the step changed after the update (a mask, a max-norm),
        which must be the same on every node.

        Raises:
          ValueError: a param changed after the update from values that differ across
            nodes (its part of the batch, its own gradients).
        """
        out = list(result)
        outer = frozenset(self.owner.axes[:-1])
        j = -1
        for i, k in enumerate(kinds):
            if k != param:
                continue
            j += 1
            x = out[i]
            if id(x) in self._stored:
                out[i] = self._stored[id(x)]
            elif x is not stored[i]:
                if varying_axes(x) & outer:
                    raise ValueError(
                        f"{self.owner.where}(shard_params=True): param {paths(i)} was "
                        "changed after the optimizer's update from values that differ "
                        f"across {sorted(outer)} (each device's part of the batch, its own "
                        "gradients), so the nodes' copies would drift apart. Compute the "
                        "change from the updated params and values every device shares "
                        "(a lax.pmean-ed value)."
                    )
                out[i] = self._block(x, self.layout.dims[j])
        return out

    def _block(self, x: jax.Array, dim: int | None) -> jax.Array:
        """This device's block of a whole (gathered) param: its slice along ``dim`` at
        its position in the node (the leaf itself if kept whole)."""
        if dim is None:
            return x
        size = x.shape[dim] // self.owner.layout.intra
        start = lax.axis_index(self.owner.axes[-1]) * size
        return lax.dynamic_slice_in_dim(x, start, size, axis=dim)
