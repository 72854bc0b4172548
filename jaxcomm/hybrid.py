"""Hybrid sharding: params, gradients and optimizer state sharded inside a node, the
data-parallel sync across nodes (``data_parallel(..., shard_params=True)``).

The layout strategy of the step core (``jaxcomm.layout.OptimizerLayout``) for models that
outgrow a device, as PyTorch FSDP2's HSDP (a 2-D mesh, replicate x shard), DeepSpeed
ZeRO++'s hpZ and MaxText's FSDP over ICI with data parallelism over DCN do it, with
jaxcomm's compressed sync on the slow link. On the ``('inter', 'intra')`` mesh:

* each param leaf is a global array split along one dimension over ``'intra'`` (the
  largest dimension that ``intra`` divides; :func:`param_dims`) and replicated over
  ``'inter'``: a device holds ``1/intra`` of it, its *block*. So are the optimizer
  state's leaves shaped like the params (Adam's moments); the user sees ordinary arrays
  (``state.params`` is the params tree, evaluated, checkpointed and restored onto another
  device count as it is).

One step, inside the step core's ``jax.shard_map`` over the data axes (every axis manual,
``check_vma=True``: what is stored replicated over ``'inter'`` is proven so):

1. **gather**: the loss sees each leaf all-gathered over ``'intra'``
   (``jaxcomm.gathering.gather_blocks``: a large block alone, the small ones packed into
   one all-gather per dtype; XLA schedules them). The gathered
   params are what the backward pass keeps for the matmuls' gradients, so a device holds
   one gathered copy of the params during the step (besides its ``1/intra`` of params,
   gradients and optimizer state). With ``gather='layer'`` the loss gets the blocks and
   the model gathers them one layer at a time (``jaxcomm.gathering``: a scan over the
   layers whose rematerialised body gathers a layer's params, again in the backward
   pass), so a device holds one layer's gathered params at a time, as FSDP's re-gather
   after the forward pass. (A remat policy around the whole loss does not do it: the
   values computed from the gathered params, a transposed weight, are saved in their
   place.)
2. **reduce-scatter**: the gradient of an all-gather is a reduce-scatter (JAX transposes
   one into the other), so each device gets the sum over its node of its block's gradient,
   inside the node; divided by ``intra`` it is the node's mean. Leaves kept whole (no
   dimension divides) are averaged over ``'intra'`` with one ``pmean``, and after the
   sync taken from the node's first device (one small ``psum`` inside the node), so
   every device of the node holds the same bits of them.
3. **sync across nodes**: the chain's ``jaxcomm.sync_gradients`` (its ``GradientSync``,
   found through ``SyncRequest.on_sync``) reduces the blocks over the outer axes only
   (``'inter'``): every algorithm, each elementwise compressor with or without error
   feedback (its residuals are this device's, for its block), warm-up. A compressor's
   shared decisions (fp16's overflow skip, adaptive's error sketch and rung) are reduced
   over every data axis (``GradientSync.decision_axes``), so every device of every node
   decides alike; a step fp16 voids keeps every block's params and optimizer state. Only
   this crosses a node's link, with ``1/intra`` of the model's bytes, compressed.
4. **optimizer on the block**: the transforms after the sync run on the blocks, in the
   params' tree (masks by path work); a transform that takes a statistic of all of the
   updates (``jaxcomm.sharded.clip_by_global_norm``) reduces it over ``'intra'``
   (``SyncRequest.sharded_over``). The new blocks are the new params.

Why this design (fully manual, params gathered by hand) rather than a partial-manual
``shard_map`` that leaves ``'intra'`` to the compiler: the step core, its replication
proof, the outputs' combination, model state and the sync's collectives keep running over
the same manual axes as data parallelism and ``shard_optimizer`` do, so the hybrid layout
is one more :class:`~jaxcomm.layout.OptimizerLayout` and not a second step core; and the
collectives the sync issues over ``'inter'`` act on this device's block (in
partial-manual mode every collective but ``psum`` over ``'inter'`` first gathers its
operand inside the node: 4x the bytes across the link, ``shared/REFERENCE.md``). The
price is that the gathers are issued by hand: by the layout where XLA schedules them,
or per layer where the model asks (step 1); a model axis (tensor parallelism) is not this
layout's.

A matrix compressor (``powersgd``) compresses each device's block as a matrix of its own:
its ``P`` and ``Q`` are averaged over the outer axes only (``decision_axes`` left at
them), its factors and residuals are this device's (stored per device). A block of a
matrix is a matrix, so this is PowerSGD of the blocks: a valid compressor, not the same
as PowerSGD of the whole matrix (rank ``r`` per block, up to ``intra * r`` for the
matrix; ``P`` and ``Q`` of the block's shape on the wire). Its state is typed per device
over every data axis from the outset (:meth:`jaxcomm.GradientSync.of_blocks`), so it
keeps one type through the warm-up's ``lax.cond`` and ``local_sgd``'s ``lax.switch``.

``jaxcomm.local_sgd`` (the whole optimizer, as with the replicated layout) keeps a
*node's* local params: each device's local params are its blocks (``LocalSGDState.local``,
per device, as is the inner optimizer's state: they differ between nodes between syncs),
the gradient is taken at them (gathered inside the node, step 1) and reduce-scattered
inside the node (step 2), and the inner optimizer steps the blocks with the node's mean:
synchronous data parallelism inside the node, no collective across nodes. Every
``sync_every`` steps the outer gradient's blocks (anchor minus local) are averaged across
nodes only, through local SGD's syncs (the request's ``sharded_over``:
:meth:`jaxcomm.GradientSync.of_blocks`, compressed as configured, fragments included),
and the outer optimizer updates the anchor's blocks, the params, which are replicated
over ``'inter'`` (proven by ``check_vma``). It equals the replicated layout's local SGD on
a mesh of one device per node fed the same batch. The outer sync averages the leaves
kept whole with the blocks, so a compressor can leave the devices of a node with
different bits of them: every device takes its node's first device's updates, outer
optimizer state and local params of them (one small ``psum`` inside the node per step).

Not implemented (refused at build time, with the reason): ``microbatches > 1``,
``shard_optimizer=True`` (the optimizer is sharded already), the profiler's feedback and
compute-only twin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.compression.skip import keep_skipped
from jaxcomm.diloco import LocalSGDState, gradient_params
from jaxcomm.gathering import GATHER_MODES, blocks_of_step, gather_blocks
from jaxcomm.microbatch import update_with_value
from jaxcomm.sharded import _agree, _probe_gradients, split_state
from jaxcomm.state import (
    PerDevice,
    marked_per_device,
    replace_at,
    stack_leaves,
    unstack_leaves,
    varying_axes,
)
from jaxcomm.sync import (
    NO_HOST_PHASE,
    GradientSync,
    HostPhase,
    SyncGradientsState,
    SyncRequest,
    accepting_requests,
)
from jaxcomm.validate import check_choice

__all__ = ["MIN_SHARD_ELEMENTS", "HybridOptimizer", "param_dims", "param_specs"]

#: A param leaf with no dimension that ``intra`` divides is kept whole on every device of
#: a node if it has fewer elements than this (a bias of 10 classes), else refused: kept
#: whole, a large leaf would break the 1/intra memory the layout promises.
MIN_SHARD_ELEMENTS = 1 << 16

_CHAIN_FIX = (
    "{where}(shard_params=True) needs the optimizer as "
    "optax.chain(jaxcomm.sync_gradients(...), *transforms), the sync first: the gradients "
    "are reduce-scattered inside the node, the sync reduces each device's block across "
    "nodes and the transforms after it run on the block, e.g. optax.chain("
    "jaxcomm.sync_gradients(), optax.adamw(1e-3)). A wrapper around the chain "
    "(optax.MultiSteps, optax.masked) goes inside it, after the sync: optax.chain("
    "jaxcomm.sync_gradients(), optax.MultiSteps(optax.adamw(1e-3), k))."
)


def param_dims(params: Any, intra: int, where: str = "data_parallel") -> list[int | None]:
    """Per param leaf, the dimension split over ``'intra'``: the largest that ``intra``
    divides (the first of equal ones), or None for a leaf kept whole.

    Args:
      params: the params (arrays or ``jax.ShapeDtypeStruct`` s).
      intra: the size of the ``'intra'`` axis.
      where: the step builder, in the errors.

    Raises:
      ValueError: a leaf of :data:`MIN_SHARD_ELEMENTS` elements or more has no dimension
        that ``intra`` divides (its shape, ``intra``, the fix).
    """
    out: list[int | None] = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(np.shape(x))
        fits = [d for d, n in enumerate(shape) if n % intra == 0 and n >= intra]
        if fits:
            out.append(max(fits, key=lambda d: (shape[d], -d)))
            continue
        size = int(np.prod(shape, dtype=np.int64))
        if size >= MIN_SHARD_ELEMENTS and intra > 1:
            raise ValueError(
                f"{where}(shard_params=True): params{jax.tree_util.keystr(path)} of shape "
                f"{shape} has no dimension that intra={intra} divides, so it cannot be split "
                f"over the {intra} devices of a node (leaves under {MIN_SHARD_ELEMENTS} "
                "elements are kept whole; this one would cost every device its full size). "
                f"Make one of its dimensions a multiple of {intra} (e.g. pad a vocabulary "
                f"of {shape[0] if shape else 1} to "
                f"{-(-(shape[0] if shape else 1) // intra) * intra}), or build the mesh with "
                "an intra size that divides one of them."
            )
        out.append(None)
    return out


def _sync_leaves(state: Any) -> tuple[list[bool], list[bool]]:
    """Per leaf of ``state``: whether it is in a ``SyncGradientsState``, and whether it is
    in one's compressor state."""

    def is_sync(x):
        return isinstance(x, SyncGradientsState)

    in_sync, in_codec = [], []
    for node in jax.tree.leaves(state, is_leaf=is_sync):
        if is_sync(node):
            n = len(jax.tree.leaves(node.compression))
            in_sync += [True] * (1 + n)  # the count, then the compressor's state
            in_codec += [False] + [True] * n
        else:
            in_sync.append(False)
            in_codec.append(False)
    return in_sync, in_codec


def _spec(dim: int | None, axis: str) -> P:
    return P() if dim is None else P(*([None] * dim), axis)


def param_specs(params: Any, mesh: Mesh, axes: tuple[str, ...], where: str = "data_parallel"):
    """The PartitionSpec of each param leaf (a tree like ``params``): split over the
    innermost data axis along :func:`param_dims`, replicated over the others."""
    inner = axes[-1]
    dims = param_dims(params, int(mesh.shape[inner]), where)
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [_spec(d, inner) for d in dims])


def _check_sync(sync: GradientSync, axes: tuple[str, ...], where: str) -> None:
    """Refuses sync settings the hybrid step does not implement."""
    if tuple(sync.axes) != tuple(axes):
        raise ValueError(
            f"{where}(shard_params=True): sync_gradients(axes={sync.axes}) differs from the "
            f"step's axes={axes}; give both the same data axes (the step reduces inside the "
            f"node over {axes[-1]!r} and the sync across nodes over {axes[:-1]})."
        )


# Parameter trees over this many elements are probed with each dimension capped (the split
# one at 4 blocks of 4 per device, the others at 16): a build-time cost, not a step's.
_PROBE_ELEMENTS = 1 << 22
_PROBE_DIM = 16


def _probe_shapes(params: Any, dims: list[int | None], intra: int) -> list[tuple]:
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    if sum(int(np.prod(s)) for s in shapes) <= _PROBE_ELEMENTS:
        return shapes
    return [
        tuple((4 * intra if i == d else min(n, _PROBE_DIM)) for i, n in enumerate(s))
        for s, d in zip(shapes, dims, strict=True)
    ]


def refuse_unsplittable(
    optimizer: Any, params: Any, dims: list[int | None], mesh: Mesh, axes: tuple[str, ...],
    where: str = "data_parallel", *, local_sgd: bool = False,
) -> None:  # fmt: skip
    """Refuses an optimizer whose update on the blocks differs from the update on the
    whole params (``local_sgd``: the optimizer is ``jaxcomm.local_sgd``).

    The probe: three updates from ``init`` on random gradients (a large one, a small one,
    then one with an ``inf``; ``jaxcomm.sharded``'s), the sync passing them through, in a
    ``jax.shard_map`` over the mesh: once on the whole params on every device (what data
    parallelism runs), once on each device's blocks (``SyncRequest.sharded_over`` naming
    the node's axis); the blocks put together must give the same updates to 1e-4
    relative, non-finite values in the same places. A transform that reads a statistic of
    a leaf or of all the updates on the block alone (optax's ``clip_by_global_norm``,
    per-leaf clipping, a Shampoo-style preconditioner) shows; under ``jaxcomm.local_sgd``
    the local params' distance from the anchor after each update is compared too (its
    inner optimizer's steps).
    Parameter trees over ``2**22`` elements are probed with each dimension capped.

    Raises:
      ValueError: saying why the transforms do not split.
    """
    leaves, treedef = jax.tree.flatten(params)
    inner = axes[-1]
    intra = int(mesh.shape[inner])
    rng = np.random.default_rng(0)
    shapes = _probe_shapes(params, dims, intra)
    p = [
        np.asarray(rng.standard_normal(s), dtype=jnp.result_type(x))
        for s, x in zip(shapes, leaves, strict=True)
    ]
    inputs = [jax.tree.unflatten(treedef, xs) for xs in (p, *_probe_gradients(p, rng))]

    def updates(over, p, *gs):
        s, out = optimizer.init(p), []
        for g in gs:
            request = SyncRequest(communicate=False, grads=g, sharded_over=over)
            update = functools.partial(optimizer.update, sync_request=request)
            u, s = update_with_value(update, g, s, p, lambda: jnp.zeros((), jnp.float32))
            p = optax.apply_updates(p, u)
            out.append(u)
            if local_sgd:  # its inner steps move only the local params until a sync
                out.append(jax.tree.map(jnp.subtract, gradient_params(s), p))
        return out

    def run(over, specs, out_leaf_specs):
        specs = jax.tree.unflatten(treedef, specs)
        rows = [d is None and bool(over) for d in dims]  # kept whole: each device's copy

        def stacked(p, *gs):
            out = []
            for u in updates(over, p, *gs):
                leaves_u = jax.tree.leaves(u)
                out.append([x[None] if r else x for x, r in zip(leaves_u, rows, strict=True)])
            return out

        mapped = jax.shard_map(
            stacked,
            mesh=mesh,
            in_specs=(specs,) * len(inputs),
            out_specs=[list(out_leaf_specs)] * ((len(inputs) - 1) * (2 if local_sgd else 1)),
            # Typed where the transforms allow (a statistic summed over the node counts
            # a leaf typed the same on every device once: jaxcomm.sharded's clip);
            # local SGD's inner state is typed per device, which its probe does not lay out.
            check_vma=bool(over) and not local_sgd,
        )
        shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )
        with np.errstate(invalid="ignore", over="ignore"):
            out = jax.jit(mapped)(*(jax.device_put(x, shardings) for x in inputs))
        result = []
        for u in out:
            leaves_u = []
            for x, r in zip(u, rows, strict=True):
                x = np.asarray(x)
                if r:  # every device's copy of a leaf kept whole must be the same
                    if not all(np.array_equal(x[0], c, equal_nan=True) for c in x[1:]):
                        return None
                    x = x[0]
                leaves_u.append(np.ravel(x))
            result.append(leaves_u)
        return result

    whole = run((), [P()] * len(leaves), [P()] * len(leaves))
    try:
        split = run(
            (inner,),
            [_spec(d, inner) for d in dims],
            [P(inner) if d is None else _spec(d, inner) for d in dims],
        )
    except Exception as e:  # noqa: BLE001 (the reason is reported)
        raise ValueError(
            f"{where}(shard_params=True): the transforms after jaxcomm.sync_gradients fail "
            f"on each device's block of the params ({type(e).__name__}: {e})."
        ) from e
    if split is None:
        raise ValueError(
            f"{where}(shard_params=True): the transforms after jaxcomm.sync_gradients give "
            "the devices of a node different updates of a leaf kept whole on each of them "
            "(a statistic of each device's blocks, e.g. optax.clip_by_global_norm's norm: "
            "use jaxcomm.sharded.clip_by_global_norm, which sums it over the node), so "
            "the node's copies would drift apart. Use transforms that act elementwise, or "
            "shard_params=False."
        )
    if not _agree(whole, split):
        raise ValueError(
            f"{where}(shard_params=True): the transforms after jaxcomm.sync_gradients give "
            "another update on each device's block of the params than on the whole params: "
            "a transform reads a statistic of a leaf or of all the updates (optax."
            "clip_by_global_norm's norm of one device's blocks: use jaxcomm.sharded."
            "clip_by_global_norm, which sums it over the node; "
            "per-leaf clipping or normalisation, a Shampoo-style preconditioner), or decides "
            "from one block (optax.apply_if_finite). Use transforms that act elementwise "
            "(adam, adamw, sgd, lion, weight decay, masks by path, schedules), or "
            "shard_params=False."
        )


class HybridOptimizer:
    """The hybrid-sharded layout (:class:`~jaxcomm.layout.OptimizerLayout`): params,
    gradients and optimizer state split over the innermost data axis, the chain's sync
    across the outer ones; steps 1-4 of the module docstring.

    Args:
      optimizer: ``optax.chain(jaxcomm.sync_gradients(...), *transforms)``.
      mesh: the mesh; axes: its data axes, outermost first (at least two: the last is
        the node's).
      where: the step builder, named in errors.

    Raises:
      ValueError: fewer than two data axes (at construction); at :meth:`infer_layout`,
        an optimizer that is not such a chain, a param leaf that does not split
        (:func:`param_dims`), state the layout cannot place.
      NotImplementedError: sync settings the layout does not run (module docstring).

    Example:
      >>> dp = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_params=True)
      >>> state = dp.init(params)          # params split over 'intra'
      >>> state, metrics = dp(state, batch)
    """

    def __init__(
        self, optimizer: Any, mesh: Mesh, axes: tuple[str, ...], *, where: str,
        gather: str = "whole",
    ):  # fmt: skip
        self.where = where
        self.gather_mode = check_choice("gather", gather, GATHER_MODES)
        if len(axes) < 2:
            raise ValueError(
                f"{where}(shard_params=True) splits params over the innermost data axis and "
                f"syncs over the outer ones, but axes={tuple(axes)}; use "
                "axes=('inter', 'intra') (jaxcomm.make_mesh)."
            )
        self.optimizer = accepting_requests(optimizer)
        self.mesh, self.axes = mesh, tuple(axes)
        self.inner, self.outer = self.axes[-1], self.axes[:-1]
        self.intra = int(mesh.shape[self.inner])
        # the chain's sync of the blocks (None under local_sgd: its syncs run of_blocks)
        self.sync: GradientSync | None = None
        self.paths: list[str] = []
        self.local: Any = None  # one device's optimizer state, abstract
        self.per: list[bool] = []  # per state leaf: stored per device (stacked)
        self.kinds: list[Any] = []  # per state leaf: 'dev', 'rep' or a param leaf's index
        self.dims: list[int | None] = []  # per param leaf (param_dims)
        self.local_sgd = False

    @property
    def syncs(self) -> list[GradientSync]:
        """The chain's one sync, or ``jaxcomm.local_sgd``'s one per fragment, as the user
        built them (after :meth:`infer_layout`)."""
        return list(self._user_syncs)

    _user_syncs: tuple[GradientSync, ...] = ()

    # -- the params' layout ------------------------------------------------------------
    def param_specs(self, params: Any) -> Any:
        """The params' PartitionSpecs (:func:`param_specs`)."""
        return param_specs(params, self.mesh, self.axes, self.where)

    def differentiable(self, params: Any) -> Any:
        """This device's blocks typed varying over every data axis (free at run time), so
        that ``jax.grad`` returns this device's own gradient (the sync averages it)."""

        def vary(x):
            missing = tuple(a for a in self.axes if a not in varying_axes(x))
            return lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(vary, params)

    def gather(self, params: Any) -> Any:
        """Step 1: the blocks all-gathered over the node (inside ``jax.shard_map``), one
        all-gather per dtype (:func:`jaxcomm.gathering.gather_blocks`)."""
        leaves, treedef = jax.tree.flatten(params)
        dims = self.dims or param_dims(params, self.intra, self.where)
        return jax.tree.unflatten(treedef, gather_blocks(leaves, dims, self.inner))

    def loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` of the stored blocks: the params gathered (step 1); its gradient
        with respect to the blocks is the reduce-scatter of step 2.

        With ``gather='layer'`` the loss gets the blocks themselves and the model gathers
        them (``jaxcomm.gathering``: :func:`~jaxcomm.gathering.gather_params`,
        :func:`~jaxcomm.gathering.gathered_layers`); a split leaf it never gathers is
        refused when the step is traced."""
        if self.gather_mode == "whole":

            @functools.wraps(loss_fn)
            def of_blocks(params, *args):
                return loss_fn(self.gather(params), *args)

            return of_blocks

        @functools.wraps(loss_fn)
        def of_blocks_per_layer(params, *args):
            flat = jax.tree_util.tree_flatten_with_path(params)[0]
            dims = self.dims or param_dims(params, self.intra, self.where)
            leaves = [x for _, x in flat]
            with blocks_of_step(leaves, dims, self.inner) as record:
                out = loss_fn(params, *args)
            missed = [
                jax.tree_util.keystr(path)
                for (path, x), d in zip(flat, dims, strict=True)
                if d is not None and id(x) not in record.gathered
            ]
            if missed:
                raise ValueError(
                    f"{self.where}(shard_params=True, gather='layer'): the loss never "
                    f"gathered params{missed[0]} ({len(missed)} split leaves in all), so it "
                    f"computed with this device's 1/{self.intra} block of it. Gather each "
                    "leaf where the model uses it: jaxcomm.gathered_layers(fn)(layers, x) "
                    "over the layers, jaxcomm.gather_params(tree) for the rest "
                    "(embeddings), on the leaves the loss gets (not on values computed "
                    "from them); or gather='whole'."
                )
            return out

        return of_blocks_per_layer

    # -- the optimizer state's layout --------------------------------------------------
    def opt_specs(self, opt_state: Any, per: list[bool]) -> Any:
        """PartitionSpecs of the (global) optimizer state: per-device leaves stacked over
        the data axes, leaves shaped like a param leaf split like it, the rest
        replicated."""
        del per
        leaves, treedef = jax.tree.flatten(opt_state)
        self._check_leaves(leaves, "state_specs")
        specs = [
            P(self.axes) if k == "dev" else P() if k == "rep" else _spec(self.dims[k], self.inner)
            for k in self.kinds
        ]
        return jax.tree.unflatten(treedef, specs)

    def _check_leaves(self, leaves: list, where: str) -> None:
        if len(leaves) != len(self.kinds):
            raise ValueError(
                f"{where}: the optimizer state has {len(leaves)} leaves, this step's layout "
                f"{len(self.kinds)}; use a state built or written by a step with the same "
                "optimizer and params (its init, or a checkpoint of it)."
            )

    def _request(self, grads: Any, on_sync: Callable | None = None) -> SyncRequest:
        """What the chain's sync is told: the step reduced ``grads`` (this device's
        blocks) already; the updates are split over the node (``sharded_over``)."""

        def other_input(sync, _):
            del sync
            raise ValueError(_CHAIN_FIX.format(where=self.where))

        return SyncRequest(False, on_sync, grads, other_input, (self.inner,))

    def _init_local(self, blocks: Any) -> Any:
        """This device's optimizer state for its ``blocks``: the chain's, the sync's part
        built by the sync over the outer axes (its residuals sized for the blocks);
        ``jaxcomm.local_sgd``'s as it builds it (its syncs compress the whole reduction,
        so their state of the blocks is the same)."""
        state = self.optimizer.init(blocks)
        if self.local_sgd:
            return state
        sync_state, rest = split_state(state, f"{self.where}(shard_params=True)")
        del sync_state
        return (self.sync.init(blocks), *rest)

    def _find_sync(self, blocks: Any) -> None:
        found: list[GradientSync] = []
        state = self.optimizer.init(blocks)
        self.local_sgd = gradient_params(state) is not None
        if self.local_sgd:
            self._find_local_sgd_syncs(blocks, state)
            return
        try:
            split_state(state, self.where)
        except ValueError:  # its message names shard_optimizer's layout
            raise ValueError(_CHAIN_FIX.format(where=self.where)) from None
        update = functools.partial(
            self.optimizer.update, sync_request=self._request(blocks, found.append)
        )
        update_with_value(update, blocks, state, blocks, lambda: jnp.zeros((), jnp.float32))
        syncs = list({id(x): x for x in found}.values())
        if len(syncs) != 1:
            raise ValueError(_CHAIN_FIX.format(where=self.where))
        _check_sync(syncs[0], self.axes, self.where)
        self._user_syncs = (syncs[0],)
        # The sync of the blocks (GradientSync.of_blocks): over the outer axes, the whole
        # reduction compressed (compress_stage='inter' keeps the node's reduction in full
        # precision: here it is step 2's reduce-scatter already), an elementwise
        # compressor's decisions over every data axis (each device of a node holds a
        # different block, and all must decide alike), a matrix compressor's factors
        # averaged over the outer axes only and stored per device.
        self.sync = syncs[0].of_blocks((self.inner,))

    def _find_local_sgd_syncs(self, blocks: Any, state: Any) -> None:
        """``jaxcomm.local_sgd``'s outer syncs (one per fragment), found as its update
        traces: each must run over the step's axes; in the step each reduces this
        device's block of the outer gradient across nodes (the request's
        ``sharded_over``: :meth:`jaxcomm.GradientSync.of_blocks`)."""
        found: list[GradientSync] = []

        def on_sync(sync):  # checked before it runs over the blocks
            _check_sync(sync, self.axes, self.where)
            found.append(sync)

        request = SyncRequest(True, on_sync, None, None, (self.inner,))
        update = functools.partial(self.optimizer.update, sync_request=request)
        update_with_value(update, blocks, state, blocks, lambda: jnp.zeros((), jnp.float32))
        self._user_syncs = tuple({id(x): x for x in found}.values())

    def _global_params(self, params: Any) -> list[jax.ShapeDtypeStruct]:
        specs = jax.tree.leaves(self.param_specs(params), is_leaf=lambda x: isinstance(x, P))
        return [
            jax.ShapeDtypeStruct(
                jnp.shape(p), jnp.result_type(p), sharding=NamedSharding(self.mesh, s)
            )
            for p, s in zip(jax.tree.leaves(params), specs, strict=True)
        ]

    def infer_layout(self, params: Any) -> list[bool]:
        """Places each optimizer-state leaf: per device (typed varying over an outer axis
        after ``init`` or an update: error-feedback residuals), like a param leaf (its
        path ends with that leaf's path and its local shape is that leaf's block: Adam's
        moments), or replicated; refuses what fits none (state split over the node that
        is not shaped like a param).

        Args:
          params: the params (arrays or ``ShapeDtypeStruct`` s), as the loss takes them.

        Returns:
          Per state leaf, whether it is stored per device.
        """
        self.dims = param_dims(params, self.intra, self.where)
        treedef = jax.tree.structure(params)
        pspecs = self.param_specs(params)
        abstract = jax.tree.unflatten(treedef, self._global_params(params))
        param_paths = [
            jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        ]
        outer = frozenset(self.outer)
        rec: dict[str, Any] = {}

        def init_probe(p):
            self._find_sync(p)
            s = self._init_local(p)
            flat, rec["treedef"] = jax.tree_util.tree_flatten_with_path(s)
            rec["paths"] = [jax.tree_util.keystr(k) for k, _ in flat]
            rec["local"] = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in flat]
            # a sync's state is this device's where it differs inside the node; a matrix
            # compressor's state is from the outset (PowerSGD's factors of this device's
            # blocks: GradientSync.of_blocks)
            rec["in_sync"], in_codec = _sync_leaves(s)
            rec["dev"] = [
                m or bool(varying_axes(x) & outer) or (c and self._blockwise)
                for m, c, (_, x) in zip(marked_per_device(s), in_codec, flat, strict=True)
            ]
            rec["blocks"] = [tuple(jnp.shape(x)) for x in jax.tree.leaves(p)]
            return jnp.zeros(())

        probe = functools.partial(jax.shard_map, mesh=self.mesh, out_specs=P(), check_vma=True)
        jax.eval_shape(probe(init_probe, in_specs=(pspecs,)), abstract)
        self.paths, local = rec["paths"], jax.tree.unflatten(rec["treedef"], rec["local"])
        like = [
            self._param_like(path, x.shape, param_paths, rec["blocks"])
            for path, x in zip(rec["paths"], rec["local"], strict=True)
        ]
        dev = list(rec["dev"])
        for _ in range(len(dev) + 1):  # the per-device set grows until stable
            self.kinds = [
                "dev" if d else ("rep" if k is None else k) for d, k in zip(dev, like, strict=True)
            ]
            seen: dict[str, Any] = {}

            def update_probe(s, p, seen=seen, dev=dev):
                s = unstack_leaves(s, dev)
                g = jax.tree.map(jnp.zeros_like, self.differentiable(p))
                _, s2, _ = self.step(g, s, p, jnp.zeros((), jnp.int32), lambda: jnp.zeros(()))
                seen["vary"] = [varying_axes(x) for x in jax.tree.leaves(s2)]
                return jnp.zeros(())

            state = jax.tree.unflatten(rec["treedef"], self._global_state(rec["local"]))
            specs = self.opt_specs(state, dev)
            jax.eval_shape(probe(update_probe, in_specs=(specs, pspecs)), state, abstract)
            nxt = [
                d or bool(v & outer) or (y and self.inner in v)
                for d, y, v in zip(dev, rec["in_sync"], seen["vary"], strict=True)
            ]
            if nxt == dev:
                break
            dev = nxt
        for path, k, v in zip(self.paths, self.kinds, seen["vary"], strict=True):
            if k == "rep" and self.inner in v:
                raise ValueError(
                    f"{self.where}(shard_params=True): optimizer state {path} differs across "
                    f"the devices of a node (it is computed from each device's block) but is "
                    "not shaped like a param leaf's block, so the layout cannot place it "
                    "(e.g. optax.apply_if_finite's counts: it decides from each device's "
                    "block, and the devices of a node would decide apart). Use transforms "
                    "whose state mirrors the params (adam, adamw, sgd with momentum, lion), "
                    "or shard_params=False."
                )
        self.local, self.per = local, dev
        refuse_unsplittable(
            self.optimizer, params, self.dims, self.mesh, self.axes, self.where,
            local_sgd=self.local_sgd,
        )  # fmt: skip
        return dev

    @property
    def _blockwise(self) -> bool:
        """Whether the syncs compress with a matrix compressor (each block a matrix)."""
        return any(x.compression is not None and not x.compression.elementwise for x in self.syncs)

    def _param_like(self, path: str, shape: tuple, param_paths: list[str], blocks: list):
        """The index of the param leaf whose block a state leaf mirrors (its path ends with
        the param's path, the same local shape), or None."""
        best = None
        for i, (pp, b) in enumerate(zip(param_paths, blocks, strict=True)):
            if (
                path.endswith(pp)
                and tuple(shape) == b
                and (best is None or len(pp) > len(param_paths[best]))
            ):
                best = i
        return best

    def _global_state(self, local: list) -> list[jax.ShapeDtypeStruct]:
        """The global abstract optimizer state of ``local`` shapes, placed as
        :attr:`kinds` say."""
        n = int(np.prod([self.mesh.shape[a] for a in self.axes]))
        out = []
        for x, k in zip(local, self.kinds, strict=True):
            shape = tuple(x.shape)
            if k == "dev":
                shape, spec = (n, *shape), P(self.axes)
            elif k == "rep":
                spec = P()
            else:
                spec = _spec(self.dims[k], self.inner)
                if self.dims[k] is not None:
                    d = self.dims[k]
                    shape = (*shape[:d], shape[d] * self.intra, *shape[d + 1 :])
            out.append(
                jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(self.mesh, spec))
            )
        return out

    def init_fn(self, per: list[bool]) -> Callable[[Any], Any]:
        """The jitted init: the params (split over the node) -> the optimizer state."""

        def init(p):
            s = self._init_local(p)
            leaves, treedef = jax.tree.flatten(s)
            missing = lambda x: tuple(a for a in self.axes if a not in varying_axes(x))  # noqa: E731
            leaves = [
                lax.pcast(x, missing(x), to="varying") if f and missing(x) else x
                for x, f in zip(leaves, per, strict=True)
            ]
            return stack_leaves(jax.tree.unflatten(treedef, leaves), per)

        def build(params):
            specs = self.opt_specs(self.local, per)
            return jax.jit(
                jax.shard_map(
                    init,
                    mesh=self.mesh,
                    in_specs=(self.param_specs(params),),
                    out_specs=specs,
                    check_vma=False,
                )
            )(params)

        return build

    def check_step(self, *, feedback: bool, communicate: bool) -> None:
        """Refuses the profiler's feedback input and the compute-only twin."""
        if feedback or not communicate:
            raise NotImplementedError(
                f"{self.where}(shard_params=True): the profiler's feedback and its "
                "compute-only twin are not implemented for hybrid-sharded params."
            )

    def step(
        self,
        grads: Any,
        opt_state: Any,
        params: Any,
        step: jax.Array,
        value: Callable[[], jax.Array],
        *,
        update: Callable | None = None,
        communicate: bool = True,
        phase: HostPhase = NO_HOST_PHASE,
    ) -> tuple[Any, Any, Any]:
        """Steps 2-4 of the module docstring on this device's blocks: ``(new blocks, new
        optimizer state, done)``, ``done`` the updates. ``grads``: the gradient of
        :meth:`loss` with respect to :meth:`differentiable` blocks (reduce-scattered
        over the node already, summed)."""
        del step, update, communicate
        leaves, treedef = jax.tree.flatten(grads)
        node_mean = [
            lax.pmean(g, self.inner) if d is None else g / self.intra
            for g, d in zip(leaves, self.dims, strict=True)
        ]
        node_mean = jax.tree.unflatten(treedef, node_mean)
        if self.local_sgd:
            return self._local_sgd_step(node_mean, opt_state, params, value, phase)
        if not isinstance(opt_state[0], SyncGradientsState):
            raise ValueError(_CHAIN_FIX.format(where=self.where))
        mean, sync_state = self.sync.reduce(node_mean, opt_state[0], phase=phase)
        mean = self._whole_from_first(mean)
        update = functools.partial(self.optimizer.update, sync_request=self._request(mean))
        updates, new = update_with_value(update, mean, opt_state, params, value)
        new = (sync_state, *new[1:])
        new_params = optax.apply_updates(params, updates)
        # A step the compressor voids (fp16's overflow in any device's block: decided
        # over every data axis, so the same on all) keeps params and optimizer state.
        new_params, new = keep_skipped(opt_state, new, params, new_params)
        return new_params, new, updates

    def _local_sgd_step(
        self, node_mean: Any, opt_state: Any, params: Any, value: Callable, phase: HostPhase
    ) -> tuple[Any, Any, Any]:
        """``jaxcomm.local_sgd`` on this device's blocks: its local step on the node's mean
        gradient of the blocks (no collective across nodes), and on its sync steps the
        outer gradient's blocks averaged across nodes by its syncs (the request's
        ``sharded_over``), the outer optimizer on the anchor's blocks."""
        request = SyncRequest(True, None, None, None, (self.inner,), phase=phase)
        update = functools.partial(self.optimizer.update, sync_request=request)
        updates, new = update_with_value(update, node_mean, opt_state, params, value)
        # Leaves kept whole: the outer sync averages them with the blocks, so a compressor
        # can leave the devices of a node apart; every device takes its node's first
        # device's updates, outer optimizer state and local params of them.
        updates = self._whole_from_first(updates)
        new = self._whole_state_from_first(new)
        new_params = optax.apply_updates(params, updates)
        new_params, new = keep_skipped(opt_state, new, params, new_params)
        return new_params, new, updates

    def _whole_state_from_first(self, state: Any) -> Any:
        """``state`` with local SGD's local params and the leaves shaped like a param leaf
        kept whole (the outer optimizer's state of it) as the node's first device has
        them (:meth:`_whole_from_first`)."""
        if all(d is not None for d in self.dims):
            return state

        def local_from_first(node):
            if not isinstance(node, LocalSGDState):
                return node
            return node._replace(local=PerDevice(self._whole_from_first(node.local.value)))

        state = jax.tree.map(
            local_from_first, state, is_leaf=lambda x: isinstance(x, LocalSGDState)
        )
        leaves, treedef = jax.tree.flatten(state)
        whole = [
            i for i, k in enumerate(self.kinds) if k not in ("dev", "rep") and self.dims[k] is None
        ]
        return jax.tree.unflatten(treedef, replace_at(leaves, whole, self._from_first))

    def _from_first(self, leaves: list) -> list:
        """``leaves`` as the node's first device has them, typed invariant over the node."""
        if not leaves:
            return leaves
        first = lax.axis_index(self.inner) == 0
        return lax.psum([jnp.where(first, x, jnp.zeros_like(x)) for x in leaves], self.inner)

    def _whole_from_first(self, mean: Any) -> Any:
        """The leaves kept whole, as the node's first device has them (one ``psum`` over
        the node of them on that device, zeros elsewhere: adding zeros keeps the bits).

        The sync packs them with the blocks, so they come back typed as varying over the
        node, and a compressor's dither (seeded by the device) makes them differ; taken
        from one device they are the same on all, and typed so.
        """
        leaves, treedef = jax.tree.flatten(mean)
        whole = [i for i, d in enumerate(self.dims) if d is None]
        return jax.tree.unflatten(treedef, replace_at(leaves, whole, self._from_first))

    def reshard(self, opt_state: Any, stacked: NamedSharding) -> Any:
        """``opt_state`` (written on any device count: its leaves are global arrays) placed
        on this step's mesh; refused if it holds per-device leaves (error-feedback
        residuals are this device's block's, and the blocks change with the device
        count)."""
        del stacked
        leaves, treedef = jax.tree.flatten(opt_state)
        self._check_leaves(leaves, "reshard")
        dev = [p for p, k in zip(self.paths, self.kinds, strict=True) if k == "dev"]
        if dev:
            raise ValueError(
                f"reshard: optimizer state {dev[0]} is per device (an error-feedback "
                "residual or PowerSGD factor of this device's block, local_sgd's local "
                "params and inner state); blocks change with the "
                "device count, so it cannot move. Restore onto the device count it was "
                "written on, or restart the compressor's state (a sync without error "
                "feedback or PowerSGD reshards)."
            )
        specs = jax.tree.leaves(
            self.opt_specs(opt_state, self.per), is_leaf=lambda x: isinstance(x, P)
        )
        out = [
            jax.device_put(x, NamedSharding(self.mesh, s))
            for x, s in zip(leaves, specs, strict=True)
        ]
        return jax.tree.unflatten(treedef, out)
