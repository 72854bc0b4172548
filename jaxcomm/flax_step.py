"""The one step engine of the Flax front ends (NNX, Linen, pmap), by composition.

:func:`jaxcomm.nnx_data_parallel`, :func:`jaxcomm.linen_data_parallel` and
:func:`jaxcomm.pmap_data_parallel` are siblings: each builds a :class:`FlaxStep` with a
small :class:`Adapter` for what its kind of state differs in (which arguments are state,
how they are split into leaves and merged back, where their optimizers are), and exposes it
through :class:`FlaxFrontEnd`, the :class:`jaxcomm.front_end.FrontEnd` the profiler drives.
The engine holds what they share: the plan (the kinds of leaves, the per-device layout
inferred by :func:`jaxcomm.state.infer_per_device`), the ``jax.shard_map(...,
check_vma=True)`` of the user's step, its compilation on every process, the replica checks
and the combination of outputs (:func:`jaxcomm.outputs.combine`).

How each kind of leaf is kept, inside the step:

- params: each device differentiates a varying copy (its own gradient; ``sync_gradients``
  reduces it). The optimizer the step calls is the one the front end handed in: its
  ``tx`` is a :class:`Recording` of the user's transform and its update
  (``nnx.Optimizer.update`` / ``TrainState.apply_gradients``) adds the synchronised update
  to the invariant old params (:meth:`Recording.apply_updates`), so the new params, and
  whatever the step computes from them afterwards (a mask, a max-norm), are proven the
  same on every device by shard_map's replication check. A param that comes out different
  per device (changed from the batch) is refused. With ``shard_optimizer=True`` the new
  params are the all-gathered ones, bit for bit.
- optimizer state: replicated, except state wrapped in ``jaxcomm.PerDevice`` (error
  feedback, a sharded optimizer's chunks), stored with a leading axis of one entry per
  device. Other optimizer state that comes out different per device is refused.
- metrics (sums and counts): each device starts from zero; the additions are summed.
- rng keys: each device draws from ``fold_in(key, device index)``.
- any other state a step changes per device (batch statistics): float leaves averaged.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import backend, ordering, outputs
from jaxcomm.axis_names import bound_names, call_step
from jaxcomm.collectives import check_axes
from jaxcomm.diloco import gradient_params
from jaxcomm.distributed import check_same_on_processes, exchange, fingerprint
from jaxcomm.flax_hybrid import HybridParams, spec_axes
from jaxcomm.layout import untyped_update
from jaxcomm.mesh import check_mesh_axes
from jaxcomm.phase_clock import PhaseClock
from jaxcomm.replicas import check_replicas as compare_replicas
from jaxcomm.same_value import same_on_every_device
from jaxcomm.sharded import ShardedOptimizer, ShardedState
from jaxcomm.state import (
    PerDevice,
    global_abstract,
    infer_per_device,
    leaf_specs,
    replace_at,
    stack_leaves,
    unstack_leaves,
    unwrap_per_device,
    varying_axes,
    wrap_per_device,
)
from jaxcomm.sync import (
    NO_HOST_PHASE,
    HostPhase,
    SyncRequest,
    accepting_requests,
    other_input_message,
)
from jaxcomm.train import check_sync_inputs, compile_on_every_process, refuse_nnx_object
from jaxcomm.validate import check_int, refuse_pmap_layout

__all__ = [
    "KEY",
    "METRIC",
    "OPT",
    "OTHER",
    "PARAM",
    "Adapter",
    "FlaxFrontEnd",
    "FlaxStep",
    "Recording",
    "Rows",
    "TraceHooks",
    "check_decorator_args",
    "key_data",
    "plain_path",
    "replicated_params",
]

# Kinds of state leaves.
PARAM, OPT, METRIC, KEY, OTHER = "param", "opt", "metric", "key", "other"

# The invariant old value of each param of the step being traced, by the identity of its
# varying copy (for replicated_params). A context variable: each thread's trace sees its own.
_PARAMS_AT_START: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "jaxcomm_params_at_start", default=None
)


class Log(NamedTuple):
    """What the step's :class:`Recording` s saw while a step was traced."""

    updates: list  # (params, updates) of each optimizer update
    syncs: list  # the GradientSync of each sync_gradients the updates ran
    # other_input(sync, tx, params): a sync received arrays other than the step's
    # gradients (a transform before it, a wrapper): recorded for the build-time probe,
    # or, in the step itself, accepted if the probe checked it (SyncRequest.other_input).
    other_input: Callable


class TraceHooks(NamedTuple):
    """What an adapter hands each optimizer's :class:`Recording` while the step traces."""

    log: Log
    old: dict  # invariant old params by the identity of their varying copies
    communicate: bool  # False: the compute-only twin (every sync passes through)
    engines: dict  # shard_optimizer=True: the ShardedOptimizer of each optimizer index
    exact: dict  # a sharded optimizer's new params, by the identity of their update
    phase: HostPhase = NO_HOST_PHASE  # the host's decisions (None fields: on the devices)
    view: Any = None  # shard_params=True: the trace of the params' layout (flax_hybrid)


class Recording:
    """Stands in for an optimizer's transform while the step is traced: records each
    update and the syncs it ran (optax's extra argument ``sync_request``); with
    ``communicate=False`` (the compute-only twin) every sync passes the gradients through.
    Its :meth:`apply_updates` is what the front end's optimizer update calls in place of
    ``optax.apply_updates``.

    Args:
      tx: the user's transform.
      hooks: the trace's :class:`TraceHooks`.
      index: the optimizer's position among the step's optimizers (its sharded engine).
      step: a thunk of the optimizer's step count, read inside the trace (sharded only:
        the dither seeds).
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        hooks: TraceHooks,
        index: int = 0,
        step: Callable[[], jax.Array] | None = None,
    ):
        self._tx, self._hooks = accepting_requests(tx), hooks
        self._engine = hooks.engines.get(index)
        self._step = step
        self.init = tx.init

    def update(self, grads, state, params=None, **kwargs):
        if gradient_params(state) is not None:
            # The model's gradient is taken at its (replicated) params, not at local_sgd's
            # per-device ones: the local steps would be silently wrong.
            raise NotImplementedError(
                "jaxcomm.local_sgd runs under jaxcomm.data_parallel only (it takes the "
                "gradient at each device's local params); the Flax front ends take it at the "
                "model's params. Use jaxcomm.data_parallel with a params pytree."
            )
        hooks = self._hooks
        # The transform sees the invariant params (weight decay must not make the update
        # vary); the model holds varying copies only so that gradients are per device.
        invariant = jax.tree.map(lambda p: hooks.old.get(id(p), p), params)
        if hooks.communicate:  # the twin runs unchecked: every value is typed invariant
            _refuse_averaged_gradients(grads)
        if hooks.view is not None:  # params stored by a layout (shard_params=True)
            updates, state = hooks.view.update(grads, state, params, kwargs, hooks)
        elif self._engine is not None:
            updates, state = self._sharded_update(grads, state, invariant, kwargs)
        else:
            request = SyncRequest(
                communicate=hooks.communicate,
                on_sync=hooks.log.syncs.append,
                grads=grads,  # what the step computed: the sync must receive these
                other_input=lambda sync, _: hooks.log.other_input(sync, self._tx, invariant),
                phase=hooks.phase,
            )
            updates, state = self._tx.update(
                grads, state, invariant, sync_request=request, **kwargs
            )
        hooks.log.updates.append((params, updates))
        return updates, state

    def apply_updates(self, params: Any, updates: Any) -> Any:
        """``optax.apply_updates`` on each param's invariant old value (the same bits as
        the device's varying copy, typed as the same on every device); a sharded
        optimizer's update gives the gathered param itself (old + (new - old) may round
        differently)."""
        old, exact = self._hooks.old, self._hooks.exact
        new = optax.apply_updates(jax.tree.map(lambda p: old.get(id(p), p), params), updates)
        if not exact:
            return new
        none = lambda x: x is None  # noqa: E731 (optax allows None updates)
        return jax.tree.map(lambda n, u: exact.get(id(u), n), new, updates, is_leaf=none)

    def _sharded_update(self, grads, state, params, kwargs):
        """The update of a sharded optimizer (``shard_optimizer=True``): its
        :class:`~jaxcomm.sharded.ShardedOptimizer` on this device's chunks; the new params
        are recorded by their update's identity for :meth:`apply_updates`."""
        engine = self._engine
        if not self._hooks.communicate:
            raise NotImplementedError(
                f"{engine.where}(shard_optimizer=True): the compute-only twin "
                "(communicate=False, the profiler's) is not implemented for sharded "
                "optimizer state."
            )
        if not isinstance(unwrap_per_device(state), ShardedState):
            raise ValueError(
                f"{engine.where}(shard_optimizer=True): the optimizer's state is not the "
                "sharded state the step laid out; pass the optimizer the decorated step "
                "was first called with, or one restored from its checkpoint."
            )
        axes = engine.axes

        def value():
            if "value" not in kwargs:
                raise TypeError("the optimizer takes optax's extra argument 'value'; pass it")
            return lax.pmean(kwargs["value"], axes)

        leaves, treedef = jax.tree.flatten(params)
        new, opt = engine.update(
            jax.tree.leaves(grads), unwrap_per_device(state), leaves, self._step(), value
        )
        self._hooks.log.syncs.append(engine.sync)
        updates = [n - p for n, p in zip(new, leaves, strict=True)]
        self._hooks.exact.update({id(u): n for u, n in zip(updates, new, strict=True)})
        return jax.tree.unflatten(treedef, updates), wrap_per_device(opt, engine.per)


def _refuse_averaged_gradients(grads: Any) -> None:
    """Refuses gradients that reach the optimizer the same on every device already.

    Each device differentiates its own copy of the params, so its gradients are typed
    varying; gradients typed invariant were averaged by the step itself (a pmap script's
    ``lax.pmean(grads, 'batch')``, or Flax's ``DynamicScale.value_and_grad(...,
    axis_name='batch')``). ``sync_gradients`` would then average the mean again: a second
    all-reduce, flat and uncompressed where the step's was, for nothing.
    """
    floats = [g for g in jax.tree.leaves(grads) if jnp.issubdtype(jnp.result_type(g), jnp.floating)]
    if floats and not any(varying_axes(g) for g in floats):
        name = next(iter(bound_names()), None)  # the step's axis_name=, if any
        mean = f"lax.pmean(grads, {name!r})" if name else "lax.pmean(grads, ...)"
        raise ValueError(
            "the gradients reach the optimizer averaged already (the same on every device): "
            f"delete {mean} from the step: jaxcomm.sync_gradients in the optimizer does the "
            "mean (hierarchical, compressed). For Flax's DynamicScale.value_and_grad(..., "
            "axis_name=...), use jaxcomm.dynamic_scale.DynamicScale() in its place: it "
            "leaves the mean to the sync and takes its finiteness decision on all devices."
        )


def replicated_params(tree: Any) -> Any:
    """``tree`` with each param of the step being traced at its replicated value.

    Inside a Flax front end's step, ``state.params`` (or the model's ``nnx.Param``) are
    each device's own copies, typed varying so that each device differentiates its own.
    A param computed from them after the update, such as a pmap script's restore of a
    skipped step (``jnp.where(is_fin, new_state.params, state.params)``), is typed varying;
    the step proves it the same on every device from its dataflow
    (:mod:`jaxcomm.same_value`) and returns it replicated, so this is not needed there. It
    gives the same bits typed as the same on every device, for values the step uses
    inside itself (a reduction that must see one value). Outside a jaxcomm step (under
    ``jax.pmap``) it returns ``tree`` unchanged.

    Example:
      >>> params = jax.tree.map(functools.partial(jnp.where, is_fin), new_state.params,
      ...                       jaxcomm.replicated_params(state.params))
    """
    old = _PARAMS_AT_START.get()
    if old is None:
        return tree
    return jax.tree.map(lambda p: old.get(id(p), p), tree)


def _fold(key: Any, dev: Any) -> Any:
    """``fold_in(key, dev)`` for a typed key or a legacy raw ``uint32`` key, of any batch
    shape; a raw key comes back raw."""
    raw = not jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key)
    k = jax.random.wrap_key_data(key) if raw else key
    if k.shape:
        flat = jax.vmap(lambda one: jax.random.fold_in(one, dev))(k.reshape(-1))
        k = flat.reshape(k.shape)
    else:
        k = jax.random.fold_in(k, dev)
    return jax.random.key_data(k) if raw else k


def key_data(tree: Any) -> Any:
    """``tree`` with typed PRNG keys (``nnx.RngKey``) as their raw ``uint32`` words, so that
    replicas can be compared by their bits."""

    def raw(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    return jax.tree.map(raw, tree)


def plain_path(path: tuple) -> tuple:
    """A key path (jax's or NNX's) as plain dict keys, indices and attribute names."""
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def check_decorator_args(name: str, mesh: Any, axes: Any, check_replicas: Any) -> tuple:
    """The checked ``(check_replicas, axes)`` of a Flax decorator's arguments.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh`` (an NNX object passed as one).
      ValueError: ``check_replicas`` is negative or not an integer; bad ``axes``.
    """
    refuse_nnx_object(mesh, f"{name}(mesh)")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{name}(mesh): got {type(mesh).__name__}; pass a mesh from "
            f"jaxcomm.make_mesh() and decorate the step: @jaxcomm.{name}(mesh)."
        )
    n = check_int(
        "check_replicas",
        0 if check_replicas is None else check_replicas,
        minimum=0,
        fix="N compares the replicas every N steps; 0 or None turns it off",
    )
    return n, check_axes(axes)


class Split(NamedTuple):
    """An adapter's split of the step's state objects (:meth:`Adapter.split`)."""

    graphdef: Any  # the static part: keys the engine's plans (compared by identity first)
    leaves: list  # the state's leaves, in the order of ``treedef``
    treedef: Any  # ``jax.tree.unflatten(treedef, leaves)`` is what ``Adapter.enter`` takes
    kinds: tuple[str, ...]  # each leaf's kind (PARAM, OPT, METRIC, KEY, OTHER)
    targets: Any = None  # the adapter's own: where ``write_back`` writes the new leaves


class Adapter(Protocol):
    """What one kind of Flax state (NNX objects, Linen ``TrainState`` s) tells the engine.

    Attributes:
      name: the decorator's name, in every message.
      fix: the optimizer the messages suggest (with the sync first).
      global_batch: whether the batch arguments are the global batch (a pmap-shaped one
        is refused) or pmap's rows.
      rows_out: whether the step's outputs come back as each device's row of a
        ``(devices, ...)`` array, as the step made them (pmap's layout), rather than
        combined over the devices (:func:`jaxcomm.outputs.combine`).
    """

    name: str
    fix: str
    global_batch: bool  # the batch is the global batch (else pmap's rows)
    rows_out: bool  # the step's outputs are each device's row (else combined)

    def is_node(self, a: Any) -> bool:
        """Whether a step argument is state (else it is the batch)."""
        ...

    def split(self, objs: tuple) -> Split:
        """The objects' static part, their state's leaves and structure, each leaf's kind.
        Called on every step: what depends on the structure alone is read once per
        structure."""
        ...

    def enter(self, graphdef: Any, state: Any, hooks: TraceHooks) -> tuple:
        """Inside the trace: ``(objs, restore, has_optimizer)``, the step's objects rebuilt
        from ``state`` with each optimizer recording through ``hooks``; ``restore()``
        undoes what ``enter`` set on them."""
        ...

    def exit(self, objs: tuple, out: Any) -> tuple[list, Any]:
        """The new state leaves after the step, and its outputs without the state."""
        ...

    def write_back(self, objs: tuple, split: Split, new: list, out: Any) -> Any:
        """What the call returns, the new state's leaves ``new`` (in the order of
        ``split.treedef``) written back into ``objs``."""
        ...

    def optimizers(self, objs: tuple) -> list[tuple]:
        """``(index, tx, params, opt_state)`` of each optimizer, as arrays."""
        ...

    def with_opt_state(self, objs: tuple, i: int, opt_state: Any) -> tuple:
        """``objs`` with optimizer ``i``'s state replaced."""
        ...

    def opt_states(self, objs: tuple) -> list[tuple[tuple, Any]]:
        """``(path prefix, opt_state)`` of each optimizer argument: its optax state pytree
        (arrays), found among the state's leaves under the prefix."""
        ...

    def leaf_key(self, path: tuple) -> tuple:
        """A state leaf's plain path as the optax state's own paths spell it (NNX: the
        ``Variable``'s ``value`` left out)."""
        ...

    def laid_out(self, objs: tuple) -> Any:
        """What ``shard_optimizer_state`` returns."""
        ...

    def check_batch(self, data: Any, num_devices: int) -> None:
        """Refuses a batch the front end's layout cannot take."""
        ...


class Rows(NamedTuple):
    """pmap's layout of the state's replicated leaves for one call
    (:meth:`FlaxStep.__call__`): each device's replica as its row of a ``(devices, ...)``
    array sharded over the data axes (``jax_utils.replicate``'s rows).

    The step's own program reads the rows as replicas and writes the new leaves as rows:
    no program of its own on either side, no data between devices. A leaf stored per
    device is stacked either way (its rows, flagged, are taken as its stacked layout).

    Attributes:
      inputs: per state leaf, whether it comes in as rows.
      outputs: per state leaf (in the order of the new state's leaves), whether it goes
        out as rows.
    """

    inputs: tuple[bool, ...]
    outputs: tuple[bool, ...]


class Plan(NamedTuple):
    """A step built for one structure of state and batch."""

    graphdef: Any
    treedef: Any
    kinds: tuple
    per: Any  # per leaf: stored per device (None while the layout is inferred)
    nodes: tuple  # per argument: state (True) or batch
    opts: list  # per optimizer: (treedef of its opt_state, indices among the leaves)
    # Params typed varying that the step's dataflow proves the same on every device
    # (jaxcomm.same_value): returned replicated by an unchecked per-device read.
    lifted: tuple = ()
    # Per leaf, its PartitionSpec when not per device (empty: all replicated); a layout's
    # split leaves (shard_params=True: params and optimizer state over 'intra').
    specs: tuple = ()


def _opt_layout(adapter: Adapter, objs: tuple, state: Any) -> tuple[list, list[bool]]:
    """Each optimizer's ``(treedef, leaf indices)`` among the leaves of ``state``, and per
    leaf whether it lies inside a ``jaxcomm.PerDevice`` of an optimizer state."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    at = {adapter.leaf_key(plain_path(p)): j for j, (p, _) in enumerate(flat)}
    marked = [False] * len(at)
    is_pd = lambda x: isinstance(x, PerDevice)  # noqa: E731
    layout = []
    for prefix, opt_state in adapter.opt_states(objs):
        flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
        idx = [at[(*prefix, *plain_path(p))] for p, _ in flat]
        inside = jax.tree.map(
            lambda n: jax.tree.map(lambda _: True, n) if is_pd(n) else False,
            opt_state,
            is_leaf=is_pd,
        )
        for j, m in zip(idx, jax.tree.leaves(inside), strict=True):
            marked[j] = m
        layout.append((treedef, idx))
    return layout, marked


def _gather(leaves: list, layout: list) -> list:
    return [jax.tree.unflatten(td, [leaves[j] for j in idx]) for td, idx in layout]


def _scatter(leaves: list, layout: list, opt_states: list) -> list:
    leaves = list(leaves)
    for (td, idx), o in zip(layout, opt_states, strict=True):
        for j, x in zip(idx, td.flatten_up_to(o), strict=True):
            leaves[j] = x
    return leaves


class FlaxStep:
    """The engine of a Flax front end: the user's step data-parallel over the mesh.

    Args:
      fn: the step as the user wrote it (or a front end's wrapper of it).
      mesh: the mesh; its axes are used typed ``Auto``.
      adapter: the kind of state (:class:`Adapter`).
      axes: data-parallel axis names.
      check_replicas: every this many calls, compare the replicated state by its bits.
      axis_name: a name the step uses for the data axes, bound to them while it traces.
      shard: ``shard_optimizer=True``: the ``ShardedOptimizer`` arguments; else None.
      shard_params: hybrid sharding (:mod:`jaxcomm.flax_hybrid`).
    """

    def __init__(
        self,
        fn: Callable,
        mesh: Mesh,
        adapter: Adapter,
        *,
        axes: tuple[str, ...],
        check_replicas: int,
        axis_name: str | None = None,
        shard: dict | None = None,
        shard_params: bool = False,
    ):
        self.adapter = adapter
        self.name = adapter.name
        check_mesh_axes(self.name, axes, mesh)
        self.fn = fn
        self.axes = axes
        # A pmap script's axis name, bound to the data axes while the step is traced.
        self._aliases = {} if axis_name is None else {axis_name: axes}
        # Plain (Auto) axis types: arrays on it mix with ordinary single-device code.
        self.mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
        self.num_devices = int(np.prod([mesh.shape[a] for a in axes]))
        self.batch_sharding = NamedSharding(self.mesh, P(self.axes))
        self.replicated = NamedSharding(self.mesh, P())
        self._one_step_in_flight = backend.for_mesh(self.mesh).one_step_in_flight
        self.check_replicas = check_replicas
        self._plans: dict = {}
        # The first call's probe found that what reaches each sync commutes with the mean
        # (a linear transform before it): the step accepts it.
        self._inputs_checked = False
        self._compiled_steps: dict = {}  # several processes: each step compiled ahead
        self._batch_checked = False  # several processes: the first batch was compared
        self.per_device_paths: list[str] = []
        self.syncs: list = []  # the GradientSync of each sync_gradients the step runs
        self._calls = 0
        # set_feedback's feedback (None before): the measured share goes into each step.
        self.feedback: Any = None
        self._feedback_step: Any = None
        self._opts: list = []  # the optimizer layout of the last prepared state
        self._layouts: dict = {}  # by the state's structure: (optimizer layout, marked)
        # The last call's (graphdef, treedef, batch structure, nodes, (plan, step)): a call
        # with the same structures takes its plan without a lookup.
        self._last: tuple | None = None
        # (batch structure, shapes) of batches laid out already that passed the checks.
        self._batches_checked: set = set()
        # shard_optimizer=True: the ShardedOptimizer's arguments, and one per optimizer
        # (by its position among the step's optimizers), built at the first call.
        self._shard_args = shard
        self._engines: dict[int, ShardedOptimizer] = {}
        # (state leaves, batch): donated to the step, as jax.jit's donate_argnums (set by
        # pmap_data_parallel's donate_argnums before the first call).
        self.donate = (False, False)
        self._clock: PhaseClock | None = None  # the host's copy of the counts
        # (plan, HostPhase, Rows) -> the jitted step of that phase taking those rows
        self._phase_steps: dict = {}
        self._rows_seen: dict = {}  # (plan, Rows asked) -> the Rows of replicated leaves
        self._row_shardings: dict = {}  # (sharding, ndim) -> whether it lays out rows
        # shard_params=True: the params and optimizer state laid out by the hybrid layout.
        self._params = HybridParams(self.name, self.mesh, axes) if shard_params else None
        # The axes over which an optimizer's update must agree (not those it is split over).
        self._agree = set(axes) - (self._params.split_axes if shard_params else set())

    # -- inside shard_map -------------------------------------------------------------
    def _stacked_step(
        self,
        plan,
        leaves,
        args,
        share=None,
        *,
        write=None,
        communicate=True,
        phase=NO_HOST_PHASE,
        rows_out=(),
    ):
        """The step inside shard_map: per-device leaves come and go with their device axis.

        With ``share`` (the measured communication share, one value per device), its mean
        over the devices is written into each optimizer's state by ``write(opt_state,
        share)`` before the step; with ``communicate=False`` every sync passes the
        gradients through (the compute-only twin). The leaves at ``rows_out`` go out as
        this device's row (:class:`Rows`)."""
        leaves = unstack_leaves(leaves, plan.per)
        if share is not None:
            mean = lax.pmean(share[0], self.axes)
            opt_states = [write(o, mean) for o in _gather(leaves, plan.opts)]
            leaves = _scatter(leaves, plan.opts, opt_states)
        result, out = self._local(plan, leaves, args, communicate=communicate, phase=phase)
        new = stack_leaves(result, plan.per)
        lifted = plan.lifted if communicate else ()
        for i in {*lifted, *rows_out}:
            new[i] = new[i][None]  # each device's copy; read back as replicated in _jit
        return new, out

    def _local(self, plan, leaves, args, rec=None, *, communicate=True, phase=NO_HOST_PHASE):
        """One device's step on its local leaves; returns the new leaves and outputs."""
        dev = lax.axis_index(self.axes)
        view = None if self._params is None else self._params.enter(plan.kinds, leaves, PARAM)
        inside = []
        for i, (x, k) in enumerate(zip(leaves, plan.kinds, strict=True)):
            if k == PARAM:
                # each device's own gradient (shard_params: of the params gathered)
                x = lax.pcast(x, self.axes, to="varying") if view is None else view.seen[i]
            elif k == METRIC:
                x = jnp.zeros_like(x)  # this device's sums and counts only
            elif k == KEY:
                x = _fold(x, dev)
            inside.append(x)
        # Old invariant value of every param, by the identity of its varying copy.
        old = {id(v): x for v, x, k in zip(inside, leaves, plan.kinds, strict=True) if k == PARAM}
        log = Log([], [], self._checked_input if rec is None else rec["other_input"])
        hooks = TraceHooks(log, old, communicate, self._engines, {}, phase, view)
        objs, out = self._run_user(plan, inside, args, hooks)
        if rec is not None:
            rec["syncs"] = log.syncs
        self._check_updates(log, old, inside, rec)
        out_leaves, out = self.adapter.exit(objs, out)
        result, summed, averaged = self._new_leaves(plan.kinds, out_leaves, leaves, inside)
        if view is not None:
            result = view.store(result, plan.kinds, leaves, self._leaf_path(plan), PARAM)
        result, out = self._combine(result, leaves, summed, averaged, out, log)
        if rec is not None:  # varying beyond the leaf's layout (a split leaf over 'intra')
            split = [spec_axes(s) for s in plan.specs] or [frozenset()] * len(result)
            rec["vary"] = [
                bool(varying_axes(x) & (set(self.axes) - a))
                for x, a in zip(result, split, strict=True)
            ]
        return result, out

    def _run_user(self, plan, inside, args, hooks):
        """The user's step on the objects rebuilt from ``inside``, with the axis name bound
        and each optimizer recording; refuses a step whose optimizer never syncs."""
        objs, restore, has_opt = self.adapter.enter(
            plan.graphdef, jax.tree.unflatten(plan.treedef, inside), hooks
        )
        token = _PARAMS_AT_START.set(hooks.old)
        try:
            user_args = self._fill(plan.nodes, objs, args)
            out = call_step(
                self.fn, user_args, aliases=self._aliases, axes=self.axes, where=self.name
            )
        finally:
            _PARAMS_AT_START.reset(token)
            restore()
        if has_opt and not hooks.log.syncs:
            raise ValueError(
                f"{self.name}: the optimizer's transform never synchronises gradients, so "
                "params would drift apart across devices. Put jaxcomm.sync_gradients() first: "
                f"{self.adapter.fix}."
            )
        return objs, out

    def _check_updates(self, log: Log, old: dict, inside: list, rec: dict | None) -> None:
        """Refuses an update of params other than the step's own (a second update), and
        records, in the probe, the leaves whose update varies across devices."""
        index = {id(v): i for i, v in enumerate(inside)}
        for params, updates in log.updates:
            for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates), strict=True):
                if id(p) not in old:
                    # A gradient at params every device holds alike is summed over the
                    # devices by JAX itself: a second update would be silently wrong.
                    raise NotImplementedError(
                        f"{self.name}: the optimizer's update ran twice in one step, or on "
                        "params changed before it; call it once per step, and change params "
                        "after it (a mask or a max-norm on the updated params is kept)."
                    )
                if rec is not None and varying_axes(u) & self._agree:
                    rec["varying_update"].append(index[id(p)])

    def _new_leaves(self, kinds, out_leaves, leaves, inside) -> tuple[list, list, list]:
        """Each leaf's new value by its kind; the metric leaves to sum, the other float
        leaves the step changed per device to average."""
        result: list = []
        summed: list[int] = []  # metric leaves: each device's additions, summed
        averaged: list[int] = []  # other float state a step changed per device
        for i, (x, x0, v0, k) in enumerate(zip(out_leaves, leaves, inside, kinds, strict=True)):
            if k == PARAM:
                if x is v0:  # not trained this step
                    x = x0
                # Else what the step computed: the optimizer's new params (invariant, see
                # Recording.apply_updates) and any change made to them afterwards. A
                # value still varying is refused when the step is built (_plan).
            elif k == METRIC:
                summed.append(i)  # x0 + psum(x), below
            elif k == KEY:
                if x is not v0:
                    raise ValueError(
                        f"{self.name}: the step replaced the random key at leaf {i}; keep the "
                        "key fixed and draw per step from it (nnx.Rngs does; in Linen, "
                        "jax.random.fold_in(state.key, state.step))."
                    )
                x = x0  # draws advance the counts, never the key
            elif k == OTHER and varying_axes(x) & set(self.axes):
                if jnp.issubdtype(x.dtype, jnp.floating):
                    averaged.append(i)  # e.g. batch statistics: pmean, below
            result.append(x)
        return result, summed, averaged

    def _combine(self, result, leaves, summed, averaged, out, log) -> tuple[list, Any]:
        """Batch statistics, metric sums and the step's outputs in one combine: one packed
        all-reduce per op and dtype, not one per leaf (:func:`jaxcomm.outputs.combine`).
        After the optimizer's updates, as data_parallel's: the sync's conditionals may hold
        collectives still running when an independent all-reduce starts, which gloo would
        pair differently on different processes (:mod:`jaxcomm.ordering`)."""
        flat, treedef, keep = self._per_device_outputs(out)
        means, sums, combined = outputs.combine(
            ordering.after(
                (
                    outputs.mean([result[i] for i in averaged]),
                    outputs.sum([result[i] for i in summed]),
                    [x for x, k in zip(flat, keep, strict=True) if not k],
                ),
                [u for _, u in log.updates],
            ),
            self.axes,
        )
        it = iter(combined)
        out = jax.tree.unflatten(
            treedef, [x if k else next(it) for x, k in zip(flat, keep, strict=True)]
        )
        result = list(result)
        for i, m in zip(averaged, means, strict=True):
            result[i] = m
        for i, total in zip(summed, sums, strict=True):
            result[i] = leaves[i] + total
        return result, out

    def _checked_input(self, sync: Any, tx: Any, params: Any) -> None:
        """Accepts, in the step's trace, a sync whose input the build-time probe checked
        (:func:`jaxcomm.train.check_sync_inputs`, at the first call); refuses it
        otherwise."""
        del sync, tx, params
        if not self._inputs_checked:
            raise ValueError(
                other_input_message(self.name, "which the first call's probe did not check")
            )

    def _per_device_outputs(self, out: Any) -> tuple[list, Any, list[bool]]:
        """The step's outputs as leaves (markers kept whole), their structure, and which
        are unmarked and the same on every device (typed invariant): those are returned as
        they are, not combined (a gather would repeat them once per device)."""
        marked = lambda x: isinstance(x, outputs.Reduced)  # noqa: E731
        flat, treedef = jax.tree.flatten(out, is_leaf=marked)
        if self.adapter.rows_out:
            return flat, treedef, [True] * len(flat)  # each device's own row, as they are
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out, is_leaf=marked)[0]]
        keep = []
        for path, x in zip(paths, flat, strict=True):
            keep.append(not marked(x) and not varying_axes(x) & set(self.axes))
            if not marked(x) and not keep[-1]:
                outputs.op_of(x, f"{jax.tree_util.keystr(path)} of {self.name}")  # refusals
        return flat, treedef, keep

    @staticmethod
    def _fill(nodes, objs, args):
        it = iter(objs)
        return [next(it) if is_node else a for a, is_node in zip(args, nodes, strict=True)]

    # -- plan -------------------------------------------------------------------------
    def _plan(self, base: Plan, leaves, args, marked) -> tuple[Plan, Callable]:
        """The plan (the per-device layout inferred, the build-time checks run) and the
        jitted step for ``base``'s structure, built once per structure."""
        key = (base.graphdef, base.treedef, jax.tree.structure(args))
        if key in self._plans:
            return self._plans[key]
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(
                jax.tree.unflatten(base.treedef, leaves)
            )[0]
        ]
        glob_args = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.batch_sharding), args
        )
        indirect: list[tuple] = []  # (sync, tx, abstract params): probed below

        def other_input(sync, tx, params):
            if not any(s is sync for s, _, _ in indirect):
                shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
                indirect.append((sync, tx, shapes))

        last: dict = {}

        def probe(lv, a):
            rec: dict = {"varying_update": [], "other_input": other_input}
            self._local(base, lv, a, rec)
            self._refuse_varying(rec, base.kinds, marked, paths)
            self.syncs = list({id(x): x for x in rec["syncs"]}.values())
            last.update(rec)
            return rec["vary"]

        try:
            per = infer_per_device(
                probe,
                leaves,
                list(marked),
                self.mesh,
                self.axes,
                args=(glob_args,),
                arg_specs=(P(self.axes),),
                may_vary=[k == OPT for k in base.kinds],
                base_specs=base.specs or None,
            )
        except (TypeError, ValueError) as e:
            refused = untyped_update(self.name, e)
            if refused is None:
                raise
            raise refused from e
        self.per_device_paths = [p for p, f in zip(paths, per, strict=True) if f]
        for _, tx, params in {id(t): (s, t, p) for s, t, p in indirect}.values():
            check_sync_inputs(tx, params, self.mesh, self.name)
        self._inputs_checked = self._inputs_checked or bool(indirect)
        # (a layout's split leaves, placed from the replicated params, are not compared)
        split = [s != P() for s in base.specs] or [False] * len(leaves)
        self._check_processes(
            [x for x, f, s in zip(leaves, per, split, strict=True) if not (f or s)]
        )
        plan = base._replace(per=tuple(per))
        varying = [
            i
            for i, (v, k) in enumerate(zip(last["vary"], base.kinds, strict=True))
            if v and k == PARAM
        ]
        if varying:
            plan = plan._replace(lifted=self._prove_params(plan, leaves, glob_args, varying, paths))
        step = self._jit(plan, self._specs(leaves, plan))
        self._plans[key] = (plan, step)
        return plan, step

    def _check_processes(self, replicated: list) -> None:
        """Replicas start alike only if every process starts from the same values."""
        check_same_on_processes(
            f"{self.name}: the initial values of the replicated state (params, optimizer "
            "state, batch statistics, rng keys)",
            key_data(replicated),
            fix=(
                "Build the model, optimizer and state from the same seed on every process "
                "(nnx.Rngs(0) or jax.random.key(0), not a seed from jax.process_index()), "
                "or restore the same checkpoint on every process; per-process randomness "
                "belongs in the data or in keys the step folds per device."
            ),
        )

    def _jit(self, plan, specs, *, write=None, communicate=True, phase=NO_HOST_PHASE, rows=None):
        """The jitted shard_map of the step; with ``write`` (a feedback's) it takes the
        measured share as a third input; ``communicate=False``: the compute-only twin, its
        params drifting apart, so unchecked by shard_map's replication check; ``rows``
        (:class:`Rows`, flags of replicated leaves only): those leaves come in and go out
        as rows."""
        rows_in = [i for i, r in enumerate(rows.inputs) if r] if rows else []
        rows_out = tuple(i for i, r in enumerate(rows.outputs) if r) if rows else ()
        body = functools.partial(
            self._stacked_step,
            plan,
            write=write,
            communicate=communicate,
            phase=phase,
            rows_out=rows_out,
        )
        lifted = plan.lifted if communicate else ()
        out_specs = list(specs)
        for i in {*lifted, *rows_out}:
            out_specs[i] = P(self.axes)
        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(specs, P(self.axes), *((P(self.axes),) if write else ())),
            out_specs=(out_specs, P(self.axes) if self.adapter.rows_out else P()),
            check_vma=communicate,
        )
        donate = tuple(i for i, d in enumerate(self.donate) if d)
        # Params proven the same on every device (Plan.lifted) come out as each device's
        # copy: read back as the replicated value, unless they go out as rows.
        back = [i for i in lifted if i not in rows_out]
        if not back and not rows_in:
            return jax.jit(mapped, donate_argnums=donate)
        own = self._own_rows

        def step(leaves, *rest):
            # each device's row read as its replica, in the same program
            new, out = mapped(replace_at(leaves, rows_in, own), *rest)
            # (back) no data moves; unchecked, as the proof covers it
            return replace_at(new, back, own), out

        return jax.jit(step, donate_argnums=donate)

    @functools.cached_property
    def _own_rows(self) -> Callable:
        """Each device's row of ``(devices, ...)`` arrays as its replica of the value:
        no data moves between devices. Unchecked (``check_vma=False``): the rows hold the
        same bits by construction (a replicated leaf, a value proven the same)."""
        return jax.shard_map(
            lambda xs: [x[0] for x in xs],
            mesh=self.mesh,
            in_specs=P(self.axes),
            out_specs=P(),
            check_vma=False,
        )

    @functools.cached_property
    def _rows_of(self) -> Callable:
        """Replicated arrays as rows, each device's replica its row (jitted; no data
        moves between devices)."""
        return jax.jit(
            jax.shard_map(
                lambda xs: [x[None] for x in xs],
                mesh=self.mesh,
                in_specs=P(),
                out_specs=P(self.axes),
                check_vma=False,
            )
        )

    def read_rows(self, xs: list) -> list:
        """Rows (``(devices, ...)`` arrays, each device's row its replica) as the
        replicated values, by a program of their own in which each device reads its own
        row (no collective)."""
        if not xs:
            return []
        sharded = [
            x
            if isinstance(x, jax.Array) and x.sharding == self.batch_sharding
            else jax.device_put(x, self.batch_sharding)
            for x in xs
        ]
        return self._read_rows(sharded)

    @functools.cached_property
    def _read_rows(self) -> Callable:
        return jax.jit(self._own_rows)

    def write_rows(self, xs: list) -> list:
        """Replicated values as rows, by a program of their own (no collective)."""
        return self._rows_of(xs) if xs else []

    def _refuse_varying(self, rec: dict, kinds, marked, paths: list[str]) -> None:
        """Refuses what a traced step left varying across devices that must agree: an
        optimizer update, unmarked optimizer state, a param, other non-statistics state."""
        if rec["varying_update"]:
            i = rec["varying_update"][0]
            raise ValueError(
                f"{self.name}: the optimizer's update of {paths[i]} varies across "
                f"devices (mesh axes {self.axes}): a stateful transform (e.g. adam) runs "
                "before jaxcomm.sync_gradients() in the chain, on each device's own "
                f"gradients. Put the sync first: {self.adapter.fix}."
            )
        for i, (v, k, m) in enumerate(zip(rec["vary"], kinds, marked, strict=True)):
            if v and k == OPT and not m:
                raise ValueError(
                    f"{self.name}: optimizer state {paths[i]} comes out different on "
                    "each device: a stateful transform (e.g. adam's moments) runs on "
                    "each device's own gradients before jaxcomm.sync_gradients() in the "
                    "chain, so each device would keep its own moments. Put the sync "
                    f"first: {self.adapter.fix}. (State meant to be per device is wrapped in "
                    "jaxcomm.PerDevice.)"
                )
            if v and k == PARAM:
                continue  # proven the same on every device, or refused: _prove_params
            if v and k != OPT:
                raise ValueError(
                    f"{self.name}: state {paths[i]} ({k}) comes out different on "
                    "each device and is not optimizer state, batch statistics, a metric "
                    "or an rng key; change it only from values every device shares."
                )

    def _prove_params(self, plan, local, args, varying: list[int], paths: list[str]) -> tuple:
        """The params typed varying that the step's dataflow proves the same on every
        device (:func:`jaxcomm.same_value.same_on_every_device`); refuses the first that
        it does not."""
        per = list(plan.per)

        def body(lv, a):
            new, _ = self._stacked_step(plan, lv, a)
            return [x if f else x[None] for x, f in zip(new, per, strict=True)]

        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(leaf_specs(local, per, self.axes), P(self.axes)),
            out_specs=P(self.axes),
            check_vma=True,
        )
        closed = jax.make_jaxpr(mapped)(global_abstract(local, per, self.mesh, self.axes), args)
        inner = next(e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map")
        # The body's inputs: the step's leaves (replicated ones the same everywhere), the
        # batch, and constants hoisted from the trace (typed by their in_spec).
        flags = [not f for f in per] + [False] * len(jax.tree.leaves(args))
        given = dict(zip(closed.jaxpr.invars, flags, strict=True))
        same = same_on_every_device(
            inner.params["jaxpr"], [given.get(v, False) for v in inner.invars], self.axes
        )
        for i in varying:
            if not same[i]:
                self._refuse_param(paths[i])
        return tuple(varying)

    def _refuse_param(self, path: str) -> None:
        """Refuses a param that comes out of the step different on each device."""
        raise ValueError(
            f"{self.name}: param {path} comes out of the step different on each device: it "
            "was computed from values each device holds for itself (its part of the batch, "
            "its device index, its own gradients). Change params only through the "
            "optimizer's update (optimizer.update / state.apply_gradients, which call "
            "optax.apply_updates), and compute any change after it (a mask, a max-norm, a "
            "skipped step's jnp.where) from the updated params, the old params and values "
            "every device shares (a lax.pmean-ed value, a flag reduced with lax.pmin)."
        )

    def _specs(self, leaves: list, plan: Plan) -> Any:
        """The PartitionSpecs of the step's state leaves (:attr:`Plan.specs`)."""
        return leaf_specs(leaves, plan.per, self.axes, plan.specs or None)

    @staticmethod
    def _leaf_path(plan: Plan) -> Callable[[int], str]:
        """A state leaf's path by its index, for messages."""

        def path(i: int) -> str:
            tree = jax.tree.unflatten(plan.treedef, list(range(plan.treedef.num_leaves)))
            return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])

        return path

    def per_device_flags(self, treedef: Any) -> list[bool] | None:
        """Which leaves of state with structure ``treedef`` the compiled step stores per
        device (None before the step for that structure is built)."""
        for key, (plan, _) in self._plans.items():
            if key[1] == treedef:
                return list(plan.per)
        return None

    # -- call -------------------------------------------------------------------------
    def prepare(self, args: tuple) -> tuple:
        """The step's objects, its plan and jitted step, and its inputs on the mesh:
        ``(objs, plan, step, leaves, data)``; ``objs`` is ``(objects, split)``.

        Once warm (the structures of the state and the batch those of the call before), the
        plan is the last call's: nothing is looked up, checked or built again."""
        return self._prepare(args, None)[:5]

    def _prepare(self, args: tuple, rows: Rows | None) -> tuple:
        """:meth:`prepare`'s tuple and the call's :class:`Rows` (those of replicated
        leaves; None where none): leaves that come in as rows stay rows (a plan built
        now is built from their replicas, read here)."""
        adapter = self.adapter
        nodes = tuple(adapter.is_node(a) for a in args)
        objs = tuple(a for a, n in zip(args, nodes, strict=True) if n)
        if self._shard_args is not None:
            objs = self._shard_optimizers(objs)
        if self._params is not None:
            objs = self._params.lay_out(adapter, objs)
        split = adapter.split(objs)
        data, data_def = self._shard([None if n else a for a, n in zip(args, nodes, strict=True)])
        last = self._last
        if (
            last is not None
            and split.graphdef is last[0]
            and (split.treedef is last[1] or split.treedef == last[1])
            and data_def == last[2]
            and nodes == last[3]
        ):
            plan, step = last[4]
        else:
            built = split
            key = (split.graphdef, split.treedef, data_def)
            if rows is not None and any(rows.inputs) and key not in self._plans:
                # A plan is built from the replicated values: the rows read for it once.
                built = split._replace(leaves=self._read(split.leaves, rows.inputs))
            plan, step = self._plan_for(objs, built, data, data_def, nodes)
        if plan.specs:  # the params and optimizer state split (flax_hybrid)
            leaves = [
                self._put(x, f, s)
                for x, f, s in zip(split.leaves, plan.per, plan.specs, strict=True)
            ]
        elif rows is None:
            leaves = [self._put(x, f) for x, f in zip(split.leaves, plan.per, strict=True)]
        else:
            # (the rows of a leaf stored per device are its stacked layout: each device's)
            leaves = [
                self._put_rows(x) if r else self._put(x, f)
                for x, f, r in zip(split.leaves, plan.per, rows.inputs, strict=True)
            ]
            rows = self._rows_for(plan, rows)
        return (objs, split), plan, step, leaves, data, rows

    def _rows_for(self, plan: Plan, rows: Rows) -> Rows | None:
        """``rows`` for the replicated leaves of ``plan`` (None where it names none)."""
        key = (id(plan), rows)
        if key not in self._rows_seen:
            n = len(plan.per)
            if len(rows.inputs) != n or len(rows.outputs) != n:
                raise ValueError(
                    f"{self.name}: Rows of {len(rows.inputs)} and {len(rows.outputs)} "
                    f"leaves for a state of {n} leaves."
                )
            specs = plan.specs or (P(),) * n
            mine = [not f and s == P() for f, s in zip(plan.per, specs, strict=True)]
            ins = tuple(r and m for r, m in zip(rows.inputs, mine, strict=True))
            outs = tuple(r and m for r, m in zip(rows.outputs, mine, strict=True))
            self._rows_seen[key] = Rows(ins, outs) if any(ins) or any(outs) else None
        return self._rows_seen[key]

    def _read(self, leaves: list, flags: tuple) -> list:
        """``leaves`` with those flagged (rows) read as their replicas."""
        return replace_at(leaves, [i for i, r in enumerate(flags) if r], self.read_rows)

    def _put_rows(self, x: Any) -> jax.Array:
        """A leaf that comes as rows, on the mesh as rows."""
        if isinstance(x, jax.Array) and self._as_rows(x):
            return x  # rows the step returned: no call into the runtime
        return jax.device_put(x, self.batch_sharding)

    def _as_rows(self, x: jax.Array) -> bool:
        """Whether ``x`` is laid out as rows over the data axes. The step's program
        names its rows' sharding in its own terms (``P('intra')`` where ``'inter'`` has
        one device): an equivalent sharding counts, compared once per sharding."""
        s = x.sharding
        if s == self.batch_sharding:
            return True
        key = (s, x.ndim)
        if key not in self._row_shardings:
            self._row_shardings[key] = s.is_equivalent_to(self.batch_sharding, x.ndim)
        return self._row_shardings[key]

    def _plan_for(self, objs: tuple, split: Split, data: list, data_def: Any, nodes: tuple):
        """The plan and jitted step for the structures of ``split`` and ``data``
        (:meth:`_plan`, built once per structure); remembered as the last call's."""
        graphdef, treedef, leaves = split.graphdef, split.treedef, split.leaves
        if (graphdef, treedef) not in self._layouts:  # paths depend on the structure only
            state = jax.tree.unflatten(treedef, leaves)
            self._layouts[graphdef, treedef] = _opt_layout(self.adapter, objs, state)
        opts, marked = self._layouts[graphdef, treedef]
        specs: tuple = ()
        if self._params is not None:  # the params and optimizer state split (flax_hybrid)
            specs, marked = self._params.placement(split.kinds, opts, marked, PARAM)
        # A per-device leaf stored by an earlier step (or a sharded optimizer's chunks)
        # has its device axis already: its plan sees one device's shape.
        local = [
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
            if m and isinstance(x, jax.Array) and x.sharding == self.batch_sharding
            else x
            for x, m in zip(leaves, marked, strict=True)
        ]
        base = Plan(graphdef, treedef, split.kinds, None, nodes, opts, specs=specs)
        plan, step = self._plan(base, local, data, marked)
        self._opts = plan.opts
        self._last = (graphdef, treedef, data_def, nodes, (plan, step))
        return plan, step

    def _put(self, x: Any, per_device: bool, spec: P | None = None) -> jax.Array:
        """A state leaf on the mesh: replicated (or laid out by ``spec``), or one entry
        per device."""
        if not per_device:
            to = self.replicated if spec is None else NamedSharding(self.mesh, spec)
            if isinstance(x, jax.Array) and x.sharding == to:
                return x  # a leaf the step returned: no call into the runtime
            return jax.device_put(x, to)
        if isinstance(x, jax.Array) and x.sharding == self.batch_sharding:
            return x  # stacked by an earlier call
        stacked = jnp.broadcast_to(x, (self.num_devices, *np.shape(x)))
        return jax.device_put(stacked, self.batch_sharding)

    def _host_decides(self, plan: Plan, leaves: list) -> bool:
        """Whether the host takes decisions for the steps (:mod:`jaxcomm.phase_clock`,
        its clock built at the first call from the optimizer states' structure): never
        where the syncs decide everything on the devices (no sync warms up or chooses on
        the host, several syncs do, or a sharded optimizer, which has neither)."""
        if self._clock is None:
            if not self.syncs:
                return False
            laid_out = self._shard_args is not None or self._params is not None
            syncs = [] if laid_out else self.syncs
            self._clock = PhaseClock(syncs, _gather(list(leaves), plan.opts), dict(self.mesh.shape))
        return self._clock.active

    def _phase(self, plan: Plan, leaves: list) -> HostPhase | None:
        """The host's decisions for this step (:mod:`jaxcomm.phase_clock`); None where
        the host decides nothing (:meth:`_host_decides`)."""
        if not self._host_decides(plan, leaves):
            return None
        return self._clock.decide(_gather(list(leaves), plan.opts))

    def _phase_step(
        self, plan: Plan, leaves: list, phase: HostPhase, rows: Rows | None
    ) -> Callable:
        """The jitted step of one phase (taking and returning ``rows``' leaves as rows),
        built at its first use."""
        key = (id(plan), phase, rows)
        if key not in self._phase_steps:
            specs = self._specs(leaves, plan)
            self._phase_steps[key] = self._jit(plan, specs, phase=phase, rows=rows)
        return self._phase_steps[key]

    def _compiled(self, step: Callable, leaves: list, data: Any) -> Callable:
        """``step`` itself in one process; with several, compiled for these inputs' shapes
        and shardings, once, by :func:`jaxcomm.train.compile_on_every_process` (every
        process agrees it compiled; a CPU module's ordering hazards are refused)."""
        if jax.process_count() == 1:
            return step
        flat, treedef = jax.tree.flatten((leaves, data))
        key = (id(step), treedef, tuple((x.shape, x.dtype, x.sharding) for x in flat))
        if key not in self._compiled_steps:
            self._compiled_steps[key] = compile_on_every_process(
                step, (leaves, data), self.mesh, f"{self.name} step"
            )
        return self._compiled_steps[key]

    def __call__(self, *args, rows: Rows | None = None):
        """One step on the front end's arguments; returns what the adapter writes back.

        Args:
          *args: the step's arguments (state objects and the batch).
          rows: pmap's layout (:class:`Rows`): the replicated leaves it flags come in
            (and the new ones go out) as rows, read and written by the step's own
            program (the phase clock reads a row of each value it decides from); with a
            feedback, whose step takes the state itself, by programs of their own."""
        (objs, split), plan, step, leaves, data, rows = self._prepare(args, rows)
        written = None  # new leaves to write as rows after the step (its program does not)
        if rows is not None and self.feedback is not None:
            leaves, written, rows = self._read(leaves, rows.inputs), rows.outputs, None
        phase = None
        if self.feedback is None:
            phase = self._phase(plan, leaves)
            if phase is not None or rows is not None:
                step = self._phase_step(plan, leaves, phase or NO_HOST_PHASE, rows)
            new, out = self._compiled(step, leaves, data)(leaves, data)
        else:
            new, out = self._feedback_step(leaves, data, self.feedback.before_step())
        if self._one_step_in_flight:
            jax.block_until_ready(new)
        if phase is not None:
            self._clock.advanced(_gather(list(new), plan.opts))
        self._calls += 1
        if self.check_replicas and self._calls % self.check_replicas == 0:
            # (leaves that went out as rows: each device's row read as its copy)
            held = new if rows is None else self._read(new, rows.outputs)
            compare_replicas(key_data(held), mesh=self.mesh, what=f"state (step {self._calls})")
        if self.feedback is not None:
            self.feedback.after_step(new)
        if written is not None:
            new = replace_at(new, [i for i, r in enumerate(written) if r], self.write_rows)
        return self.adapter.write_back(objs, split, new, out)

    # -- shard_optimizer=True ----------------------------------------------------------
    def _shard_optimizers(self, objs: tuple) -> tuple:
        """``objs`` with each optimizer's state laid out sharded (:class:`ShardedState`,
        its chunks stacked along the data axes in ``jaxcomm.PerDevice``), from the state
        its ``init`` gives; a state sharded already (a later call, a restored checkpoint)
        is kept. Builds each optimizer's :class:`~jaxcomm.sharded.ShardedOptimizer` once
        (its checks and the probe of its transforms run here, at the first call)."""
        for i, tx, params, opt_state in self.adapter.optimizers(objs):
            engine = self._engines.get(i)
            if engine is None:
                engine = ShardedOptimizer(
                    tx, self.mesh, self.axes, where=self.name, **self._shard_args
                )
                engine.infer_layout(params)
                self._engines[i] = engine
            if isinstance(unwrap_per_device(opt_state), ShardedState):
                continue
            fresh = jax.tree.leaves(jax.jit(tx.init)(params))
            given = jax.tree.leaves(opt_state)
            if len(fresh) != len(given) or not all(
                bool(jnp.array_equal(a, b)) for a, b in zip(fresh, given, strict=False)
            ):
                raise ValueError(
                    f"{self.name}(shard_optimizer=True): the optimizer's state is not the "
                    "one its init gives (it was updated, or restored from an unsharded "
                    "checkpoint), and only a fresh state is laid out sharded (its moments "
                    "would be lost). Build the optimizer anew before the first step, or "
                    "restore a state saved from this sharded step."
                )
            replicated = jax.device_put(jax.tree.leaves(params), NamedSharding(self.mesh, P()))
            sharded = wrap_per_device(engine.init_fn(engine.per)(replicated), engine.per)
            objs = self.adapter.with_opt_state(objs, i, sharded)
        return objs

    def shard_optimizer_state(self, *args) -> Any:
        """Lays each optimizer's state out sharded now, as the first call does; see
        :meth:`FlaxFrontEnd.shard_optimizer_state`."""
        objs = tuple(a for a in args if self.adapter.is_node(a))
        if self._params is not None:  # shard_params=True: the hybrid layout's state
            return self.adapter.laid_out(self._params.lay_out(self.adapter, objs))
        if self._shard_args is None:
            raise ValueError(
                f"{self.name}: shard_optimizer_state needs the step built with "
                "shard_optimizer=True or shard_params=True."
            )
        objs = self._shard_optimizers(objs)
        return self.adapter.laid_out(objs)

    # -- the FrontEnd protocol ---------------------------------------------------------
    def drive_inputs(self, *args) -> tuple[list, Any]:
        """``(leaves, batch)``: the state's flat leaves and the batch on the mesh."""
        _, _, _, leaves, data = self.prepare(args)
        return leaves, data

    def set_feedback(self, feedback: Any, *args) -> Any:
        """Compiles the step with the measured share as its third input; every later call
        passes ``feedback.before_step()`` and hands the new leaves to
        ``feedback.after_step``."""
        _, plan, _, leaves, data = self.prepare(args)
        if self._params is not None:
            self._params.layout.check_step(feedback=True, communicate=True)
        step = self._jit(plan, self._specs(leaves, plan), write=feedback.write)
        share = jax.ShapeDtypeStruct((self.num_devices,), jnp.float32, sharding=self.batch_sharding)
        self._feedback_step = compile_on_every_process(
            step, (leaves, data, share), self.mesh, f"{self.name} step"
        )
        self.feedback = feedback
        return self._feedback_step

    def compile(self, *args, communicate: bool = True) -> Any:
        """The program the step runs from these arguments (its :class:`jaxcomm.HostPhase`),
        compiled (``communicate=False``: the twin, which decides on the devices)."""
        _, plan, _, leaves, data = self.prepare(args)
        phase = (self._phase(plan, leaves) if communicate else None) or NO_HOST_PHASE
        specs = self._specs(leaves, plan)
        step = self._jit(plan, specs, communicate=communicate, phase=phase)
        return compile_on_every_process(step, (leaves, data), self.mesh, f"{self.name} step")

    def optimizer_states(self, state: list) -> list[Any]:
        """Each optimizer's optax state, read from the flat leaves ``state``."""
        return _gather(list(state), self._opts)

    def with_optimizer_states(self, state: list, opt_states: list) -> list:
        """The flat leaves ``state`` with each optimizer's state replaced."""
        return _scatter(state, self._opts, opt_states)

    # -- the batch ---------------------------------------------------------------------
    def _shard(self, data: list) -> tuple[list, Any]:
        """The batch arguments on the mesh (``None`` in the places of the state), and their
        structure. A batch laid out already whose structure and shapes passed the checks
        before passes without them (they read only those)."""
        flat, data_def = jax.tree.flatten(data)
        laid_out = all(isinstance(x, jax.Array) and x.sharding == self.batch_sharding for x in flat)
        if laid_out and (data_def, tuple(x.shape for x in flat)) in self._batches_checked:
            return data, data_def
        for a in data:
            jax.tree.map(lambda x: refuse_nnx_object(x, self.name), a)
        self.adapter.check_batch(data, self.num_devices)
        if self.adapter.global_batch:
            refuse_pmap_layout(data, self.num_devices, self.name, self.batch_sharding)
        many = jax.process_count() > 1
        if many and not self._batch_checked:
            self._check_global_batch(data)
        if laid_out:
            if len(self._batches_checked) >= 64:
                self._batches_checked.clear()
            self._batches_checked.add((data_def, tuple(x.shape for x in flat)))
            return data, data_def

        def put(x):
            if isinstance(x, jax.Array) and x.sharding == self.batch_sharding:
                return x  # laid out already (e.g. by the data loader): stays on the devices
            if many and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
                x = np.asarray(x)  # this process's copy of the global batch
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            if x.ndim == 0 or x.shape[0] % self.num_devices:
                where = f" of {jax.process_count()} processes" if many else ""
                raise ValueError(
                    f"{self.name}: a batch argument of shape {x.shape} does not split "
                    f"over the {self.num_devices} devices{where} along its leading axis; use "
                    f"a multiple of {self.num_devices} (non-module arguments are the global "
                    "batch)."
                )
            return jax.device_put(x, self.batch_sharding)

        return jax.tree.map(put, data), data_def

    def _check_global_batch(self, data: Any) -> None:
        """Refuses, at the first call on several processes, a batch that is not the same
        global batch on every process.

        The Flax front ends take the global batch on every process (each device takes its
        slice of the leading axis), where ``jaxcomm.data_parallel`` takes each process's
        part. A process's part cannot be told from a global batch by its shape (a part of
        ``n`` rows looks like a global batch of ``n``), only by comparing processes: each
        posts its batch leaves' paths, shapes and dtypes and a digest of their values
        (:func:`jaxcomm.distributed.fingerprint`) through the coordination service (no
        collective). Leaves that are global arrays already (not fully addressable, e.g.
        from ``jax.make_array_from_process_local_data``) are not compared.

        Raises:
          ValueError: on every process, naming the shapes each process passed (or, for
            equal shapes, the processes whose values differ) and the fix.
        """
        host = [
            (jax.tree_util.keystr(k), x)
            for k, x in jax.tree_util.tree_flatten_with_path(data)[0]
            if not (isinstance(x, jax.Array) and not x.is_fully_addressable)
        ]
        shapes = ", ".join(f"{k} {np.shape(x)} {np.asarray(x).dtype}" for k, x in host)
        posted = exchange(
            f"{self.name}/global batch", f"{shapes}|{fingerprint([x for _, x in host])}"
        )
        differ = [i for i, v in enumerate(posted) if v != posted[0]]
        if not differ:
            self._batch_checked = True  # (a refused first call is compared again)
            return
        i = differ[0]
        theirs = posted[i].rsplit("|", 1)[0]
        if theirs != posted[0].rsplit("|", 1)[0]:
            what = f"process {i} passed {theirs}; process 0 passed {posted[0].rsplit('|', 1)[0]}"
        else:
            what = f"processes {differ} passed other values than process 0 (shapes {shapes})"
        rows = next((np.shape(x)[0] for _, x in host if np.ndim(x)), 0)
        raise ValueError(
            f"{self.name}: the batch differs between processes: {what}. {self.name} takes "
            "the global batch, the same on every process (each device takes its slice of "
            "the leading axis), not each process's part as jaxcomm.data_parallel does. Pass "
            "every process the same global batch, or build the global array from each "
            f"process's part: jax.make_array_from_process_local_data(step.batch_sharding, "
            f"part) (a part of {rows} rows on each of {jax.process_count()} processes makes "
            f"a global batch of {rows * jax.process_count()} rows)."
        )


class FlaxFrontEnd:
    """What the Flax front ends share: their :class:`FlaxStep`, exposed as a
    :class:`jaxcomm.front_end.FrontEnd` (the interface ``jaxcomm.CommProfiler.drive``
    drives). The program's state is the flat list of the state's leaves.

    Attributes:
      engine: the :class:`FlaxStep` that runs the step.
      mesh: the mesh the step runs on (its axes typed ``Auto``).
      axes: data-parallel axis names.
      num_devices: devices along ``axes``.
      batch_sharding: how a batch (or one value per device) is laid out.
      check_replicas: compare the replicas every this many calls (0: off).
      per_device_paths: optimizer-state leaves stored per device (after the first call).
      syncs: the ``GradientSync`` of each ``sync_gradients`` the step runs (after the
        first call).
      feedback: the feedback :meth:`set_feedback` installed (None before).
      shard_optimizer: whether the step was built with ``shard_optimizer=True``.
    """

    def __init__(self, engine: FlaxStep, fn: Callable | None = None):
        self.engine = engine
        functools.update_wrapper(self, fn or engine.fn)

    mesh = property(lambda self: self.engine.mesh)
    axes = property(lambda self: self.engine.axes)
    num_devices = property(lambda self: self.engine.num_devices)
    batch_sharding = property(lambda self: self.engine.batch_sharding)
    check_replicas = property(lambda self: self.engine.check_replicas)
    per_device_paths = property(lambda self: self.engine.per_device_paths)
    syncs = property(lambda self: self.engine.syncs)
    feedback = property(lambda self: self.engine.feedback)
    # Whether the step was built with shard_optimizer=True (its optimizer state in chunks).
    shard_optimizer = property(lambda self: self.engine._shard_args is not None)

    def __call__(self, *args):
        return self.engine(*args)

    def shard_optimizer_state(self, *args) -> Any:
        """Lays each optimizer's state out sharded now, as the first call does
        (``shard_optimizer=True``): e.g. before restoring a checkpoint of the sharded
        state, whose structure (``ShardedState`` chunks, stacked) it then has. With
        ``shard_params=True``: the hybrid layout's state (Adam's moments split over
        ``'intra'``, error-feedback residuals per device), whose shardings a restore
        then takes.

        Args:
          *args: the step's arguments (its ``nnx.Optimizer`` and model, or its
            ``TrainState`` s; the batch may be left out).

        Returns:
          NNX: None (the optimizers are updated in place). Linen: the ``TrainState`` with
          its sharded ``opt_state`` (a tuple of them for several).

        Raises:
          ValueError: the step was built without ``shard_optimizer=True`` or
            ``shard_params=True``; or as at the first call (a transform that does not
            shard, a trained state).

        Example:
          >>> train_step.shard_optimizer_state(model, optimizer)
          >>> target = nnx.state(optimizer)                   # the sharded layout
          >>> nnx.update(optimizer, checkpointer.restore(path, target))
        """
        return self.engine.shard_optimizer_state(*args)

    def drive_inputs(self, *args) -> tuple[list, Any]:
        """The inputs of the compiled step for these arguments (as the step is called):
        ``(leaves, batch)``, the state's flat leaves and the batch on the mesh, for
        ``jaxcomm.CommProfiler.drive``, which times the step on them several times.

        Returns:
          ``(leaves, batch)``; the first is the state :meth:`optimizer_states` reads.
        """
        return self.engine.drive_inputs(*args)

    def set_feedback(self, feedback: Any, *args) -> Any:
        """Feeds a measurement into every later step, and compiles that step now.

        From now on each call passes ``feedback.before_step()`` (an f32 array of one
        value per device, laid out like the batch: the measured communication share) into
        the step as an explicit input; inside, its mean over the devices is written into
        each optimizer's state with ``feedback.write(opt_state, share)`` before the user's
        step runs, and the new state's leaves go to ``feedback.after_step(leaves)``.
        ``jaxcomm.CommProfiler.drive`` is the feedback that measures the share; users call
        that.

        Args:
          feedback: an object with ``before_step() -> jax.Array``,
            ``write(opt_state, share) -> opt_state`` (traced) and ``after_step(leaves)``.
          *args: the step's arguments, as it is called (it is compiled for them).

        Returns:
          The ``jax.stages.Compiled`` step: ``compiled(leaves, batch, share)``.
        """
        return self.engine.set_feedback(feedback, *args)

    def compile(self, *args, communicate: bool = True) -> Any:
        """The step compiled for these arguments (as the step is called): the program of
        the phase it runs from them (:class:`jaxcomm.HostPhase`).

        Args:
          *args: the step's arguments.
          communicate: False builds the compute-only twin: every ``sync_gradients`` passes
            the gradients through (no gradient collective; the params drift apart, so no
            replication check). It returns the new state without writing it back.

        Returns:
          A ``jax.stages.Compiled`` step ``compiled(*drive_inputs(*args))`` returning the
          new state's leaves and the outputs.

        Example:
          >>> twin = train_step.compile(model, optimizer, metrics, batch, communicate=False)
          >>> jaxcomm.wire_bytes(twin, mesh=mesh)["total"]   # the metrics' scalars only
        """
        return self.engine.compile(*args, communicate=communicate)

    def optimizer_states(self, state: list) -> list[Any]:
        """The optax state of each optimizer argument (an ``nnx.Optimizer``, a
        ``TrainState``), read from the step's state leaves (as :meth:`drive_inputs`
        returns them and the step updates them; per-device leaves keep their device axis).

        Example:
          >>> leaves, batch = train_step.drive_inputs(model, optimizer, batch)
          >>> jaxcomm.compression.adaptive_states(train_step.optimizer_states(leaves))
        """
        return self.engine.optimizer_states(state)

    def with_optimizer_states(self, state: list, opt_states: list) -> list:
        """The step's state leaves with each optimizer's state replaced by ``opt_states``
        (the structure :meth:`optimizer_states` returned)."""
        return self.engine.with_optimizer_states(state, opt_states)
