"""Flax data parallelism: ``@jaxcomm.nnx_data_parallel(mesh)`` on an NNX train step.

The user keeps the model, ``nnx.Optimizer(model, optax.chain(jaxcomm.sync_gradients(),
...))``, ``nnx.MultiMetric`` and the body of ``train_step(model, optimizer, metrics,
batch)``; the decorator (in place of ``nnx.jit``) runs the body on every device's shard of
the batch inside ``jax.shard_map(..., check_vma=True)`` and treats each kind of NNX state
by its ``Variable`` type:

- ``nnx.Param`` (and whatever the optimizer updates): replicated. Inside, each device
  differentiates a varying copy (its own gradient; ``sync_gradients`` reduces it). While
  the step is traced, ``optax.apply_updates`` (which ``nnx.Optimizer.update`` and
  ``TrainState.apply_gradients`` call) adds the optimizer's invariant update to the
  invariant old params, so the new params, and whatever the step computes from them
  afterwards (a pruning mask, a max-norm), are kept as computed and proven the same on
  every device by shard_map's replication check. A param that comes out different per
  device (changed from the batch) is refused.
- ``nnx.OptState``: replicated, except state a compressor wraps in ``jaxcomm.PerDevice``
  (error feedback), stored with a leading axis of one entry per device
  (``per_device_paths``). Any other optimizer state that comes out different per device
  (adam's moments when a stateful transform runs before the sync) is refused.
- ``nnx.metrics.MetricState`` (``Average``, ``Accuracy``, ...): each device starts from
  zero, and the sums and counts it adds are summed across devices (``psum``), so the
  metric equals the one computed on the global batch.
- ``nnx.RngKey``: each device draws from ``fold_in(key, device index)``, so dropout masks
  differ across devices and are reproducible; the stored key and counts stay replicated.
- Any other state that a step changes per device (``nnx.BatchStat``): float leaves are
  averaged across devices (``pmean``).

What the step returns is combined by :func:`jaxcomm.outputs.combine`: a float scalar is
averaged, a per-example array (leading axis) is gathered along the batch in global order,
values marked ``jaxcomm.outputs.sum/max/min/mean/gather`` are combined so, an unmarked
integer scalar is refused, and an unmarked value that is the same on every device (typed
invariant: a param, the step count) is returned as it is.

At the first call of each compiled step, the replicated state is compared across
processes (:func:`jaxcomm.distributed.check_same_on_processes`): processes that start from
different params (a per-process seed) are refused. Each process passes the same global
batch (not its own part, as ``jaxcomm.data_parallel`` takes it; a part is refused at the
first call, naming the shapes, or a global array built from the parts with
``jax.make_array_from_process_local_data(step.batch_sharding, part)`` is taken as it is).
With several processes each step is compiled ahead, as ``data_parallel``'s is
(:func:`jaxcomm.train.compile_on_every_process`: every process agrees it compiled, a CPU
module whose collectives' order gloo could pair differently is refused), and the outputs'
reductions (batch statistics, metrics, the step's return values) run after the
optimizer's update, so after the sync's conditionals (:mod:`jaxcomm.ordering`).

Each ``sync_gradients`` must receive the gradients the step computed, or a function of
them that commutes with the mean over devices (checked at the first call by a probe,
whatever wraps the sync): a clip before the sync is refused.

``@jaxcomm.linen_data_parallel(mesh)`` does the same for a Linen step on
``flax.training.train_state.TrainState``, by field: ``params``, ``opt_state``, key fields
(typed keys, and legacy raw ``uint32`` keys in a field whose name says ``key`` or ``rng``;
a raw-key-shaped ``uint32`` field with another name is refused), and the rest
(``batch_stats``).

With ``axis_name='batch'`` a decorator binds that name to the data axes while the step
traces (:mod:`jaxcomm.axis_names`): ``BatchNorm(axis_name='batch')`` normalises with the
global batch's statistics, and an axis name bound nowhere raises an error that lists the
names in scope. A step written for ``jax.pmap`` runs under
:func:`jaxcomm.pmap_data_parallel` (``jaxcomm/pmap.py``, pmap's layouts). Gradients that
reach the optimizer averaged already (the step's own ``lax.pmean(grads, ...)``) are refused.

With ``shard_optimizer=True`` the optimizer's state is sharded (ZeRO-1/2,
:mod:`jaxcomm.sharded`): at the first call its fresh state is replaced by each device's
chunk, stored per device, and the optimizer's update runs a
:class:`~jaxcomm.sharded.ShardedOptimizer` (reduce-scatter, the chunk's update,
all-gather); ``optax.apply_updates`` then returns the gathered params themselves.

Everything it writes back lives on the mesh's devices with a plain (non-explicit)
``NamedSharding``, so ordinary Flax code (an ``nnx.jit`` eval step, ``metrics.reset()``,
orbax) uses it without a mesh context.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state
from flax.training.train_state import TrainState
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import ordering, outputs, xla_cpu
from jaxcomm.axis_names import bind, bound_names, check_axis_name
from jaxcomm.collectives import check_axes
from jaxcomm.compression.adaptive import AdaptiveState
from jaxcomm.diloco import gradient_params
from jaxcomm.distributed import check_same_on_processes, exchange, fingerprint
from jaxcomm.mesh import DATA_AXES, check_mesh_axes
from jaxcomm.replicas import check_replicas as _check_replicas
from jaxcomm.sharded import ShardedOptimizer, ShardedState, shard_options
from jaxcomm.state import (
    PerDevice,
    infer_per_device,
    leaf_specs,
    stack_leaves,
    unstack_leaves,
    unwrap_per_device,
    varying_axes,
    wrap_per_device,
)
from jaxcomm.sync import SyncRequest, accepting_requests, other_input_message
from jaxcomm.train import check_sync_inputs, compile_on_every_process, refuse_nnx_object
from jaxcomm.validate import check_int

__all__ = [
    "LinenDataParallel",
    "NnxDataParallel",
    "key_data",
    "linen_data_parallel",
    "nnx_data_parallel",
    "replicated_params",
]

# Kinds of state leaves.
_PARAM, _OPT, _METRIC, _KEY, _OTHER = "param", "opt", "metric", "key", "other"


def _kind(var_type: type) -> str:
    if issubclass(var_type, nnx.training.optimizer.OptState):
        return _OPT
    if issubclass(var_type, nnx.metrics.MetricState):
        return _METRIC
    if issubclass(var_type, nnx.RngKey):
        return _KEY
    if issubclass(var_type, nnx.Param):
        return _PARAM
    return _OTHER


class _Log(NamedTuple):
    """What :class:`_Recording` saw while a step was traced."""

    updates: list  # (params, updates) of each optimizer update
    syncs: list  # the GradientSync of each sync_gradients the updates ran
    # other_input(sync, tx, params): a sync received arrays other than the step's
    # gradients (a transform before it, a wrapper): recorded for the build-time probe,
    # or, in the step itself, accepted if the probe checked it (SyncRequest.other_input).
    other_input: Callable


class _Sharded(NamedTuple):
    """A sharded optimizer inside a traced step: its engine, the step count (a thunk read
    inside the trace: the dither seeds), and the new params by the identity of their
    update (``exact``: what the patched ``optax.apply_updates`` returns for them)."""

    engine: ShardedOptimizer
    step: Callable[[], jax.Array]
    exact: dict


class _Recording:
    """Stands in for ``nnx.Optimizer.tx`` while the step is traced: records each update and
    the syncs it ran (optax's extra argument ``sync_request``); with ``communicate=False``
    (the compute-only twin) every sync passes the gradients through."""

    def __init__(
        self,
        tx: optax.GradientTransformation,
        log: _Log,
        old: dict,
        communicate: bool = True,
        sharded: _Sharded | None = None,
    ):
        self._tx, self._log, self._old = accepting_requests(tx), log, old
        self._communicate = communicate
        self._sharded = sharded
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
        # The transform sees the invariant params (weight decay must not make the update
        # vary); the model holds varying copies only so that gradients are per device.
        invariant = jax.tree.map(lambda p: self._old.get(id(p), p), params)
        if self._communicate:  # the twin runs unchecked: every value is typed invariant
            _refuse_averaged_gradients(grads)
        if self._sharded is not None:
            updates, state = self._sharded_update(grads, state, invariant, kwargs)
        else:
            request = SyncRequest(
                self._communicate,
                self._log.syncs,
                grads,  # what the step computed: the sync must receive these
                lambda sync, _: self._log.other_input(sync, self._tx, invariant),
            )
            updates, state = self._tx.update(
                grads, state, invariant, sync_request=request, **kwargs
            )
        self._log.updates.append((params, updates))
        return updates, state

    def _sharded_update(self, grads, state, params, kwargs):
        """The update of a sharded optimizer (``shard_optimizer=True``): its
        :class:`~jaxcomm.sharded.ShardedOptimizer` on this device's chunks; the new params
        go to ``optax.apply_updates`` as they are (``exact``), not as old + (new - old)."""
        engine, step, exact = self._sharded
        if not self._communicate:
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
            jax.tree.leaves(grads), unwrap_per_device(state), leaves, step(), value
        )
        self._log.syncs.append(engine.sync)
        updates = [n - p for n, p in zip(new, leaves, strict=True)]
        exact.update({id(u): n for u, n in zip(updates, new, strict=True)})
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


# A patch of another library's function (jaxcomm.axis_names has the other): while a step
# is traced, ``optax.apply_updates`` (what ``nnx.Optimizer.update`` and
# ``TrainState.apply_gradients`` call) adds the update to the invariant old params in place
# of each device's varying copy: the same bits, typed as the same on every device. So
# whatever the step computes from the new params afterwards (a mask, a max-norm, zeroing) is
# kept as computed, and shard_map's replication check still proves it replicated. Traces
# that patch are serialised by a lock; a nested one chains to the outer patch.
_PATCH_LOCK = threading.RLock()
_OLD: list[dict] = []  # the ``old`` map of each step being traced, innermost last


@contextlib.contextmanager
def _invariant_apply_updates(old: dict, exact: dict):
    """Within: ``optax.apply_updates`` takes each param in ``old`` (by the identity of its
    varying copy) at its invariant value; every other param is unchanged. An update in
    ``exact`` (by its identity: a sharded optimizer's) gives the new param recorded
    there, the gathered value itself (old + (new - old) may round differently)."""
    with _PATCH_LOCK:
        original = optax.apply_updates

        def apply_updates(params, updates):
            new = original(jax.tree.map(lambda p: old.get(id(p), p), params), updates)
            if not exact:
                return new
            none = lambda x: x is None  # noqa: E731 (optax allows None updates)
            return jax.tree.map(lambda n, u: exact.get(id(u), n), new, updates, is_leaf=none)

        optax.apply_updates = apply_updates
        _OLD.append(old)
        try:
            yield
        finally:
            _OLD.pop()
            optax.apply_updates = original


def replicated_params(tree: Any) -> Any:
    """``tree`` with each param of the step being traced at its replicated value.

    Inside a Flax front end's step, ``state.params`` (or the model's ``nnx.Param``) are
    each device's own copies, typed varying so that each device differentiates its own.
    A value computed from them after the update, such as a pmap script's restore of a
    skipped step (``jnp.where(is_fin, new_state.params, state.params)``), would differ per
    device in type and be refused; this gives the same bits typed as the same on every
    device. Outside a jaxcomm step (under ``jax.pmap``) it returns ``tree`` unchanged.

    Example:
      >>> params = jax.tree.map(functools.partial(jnp.where, is_fin), new_state.params,
      ...                       jaxcomm.replicated_params(state.params))
    """
    if not _OLD:
        return tree
    old = _OLD[-1]
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


def _plain(path: tuple) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def _opt_state_nodes(objs: tuple, kind: type) -> list[tuple]:
    """The path prefix of every ``kind`` node in the opt_state of an ``nnx.Optimizer`` /
    ``TrainState`` argument, as paths among the leaves of ``nnx.split(objs)`` read."""
    is_kind = lambda x: isinstance(x, kind)  # noqa: E731
    prefixes = []
    for i, o in enumerate(objs):
        if isinstance(o, nnx.Optimizer | TrainState):
            flat = jax.tree_util.tree_flatten_with_path(o.opt_state, is_leaf=is_kind)[0]
            prefixes += [(i, "opt_state", *_plain(p)) for p, x in flat if is_kind(x)]
    return prefixes


def _leaf_paths(state: Any) -> list[tuple]:
    return [_plain(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _marked(objs: tuple, state: Any) -> list[bool]:
    """Per leaf of ``state`` (``nnx.split(objs)``): inside a ``jaxcomm.PerDevice`` of the
    opt_state of an ``nnx.Optimizer`` argument (a compressor's error feedback)."""
    prefixes = _opt_state_nodes(objs, PerDevice)
    return [any(p[: len(q)] == q for q in prefixes) for p in _leaf_paths(state)]


def _adaptive_fields(objs: tuple, state: Any) -> list[dict[str, int]]:
    """Per adaptive compressor in the opt_state of an ``nnx.Optimizer`` / ``TrainState``
    argument: the index, among the leaves of ``state`` (``nnx.split(objs)``), of each of
    its :class:`AdaptiveState` fields but the residual."""
    paths = _leaf_paths(state)
    out = []
    for q in _opt_state_nodes(objs, AdaptiveState):
        fields = {p[len(q)]: j for j, p in enumerate(paths) if p[: len(q)] == q}
        fields.pop("residual", None)
        out.append(fields)
    return out


def _adaptive_views(leaves: list, fields: list[dict[str, int]]) -> list[AdaptiveState]:
    """The :class:`AdaptiveState` of each adaptive compressor, read from flat ``leaves``
    (its residual left out)."""
    return [AdaptiveState(residual=(), **{f: leaves[j] for f, j in fs.items()}) for fs in fields]


def _with_adaptive(leaves: list, fields: list[dict[str, int]], states: list) -> list:
    """``leaves`` with the fields (but the residual) of each of ``states`` written back."""
    leaves = list(leaves)
    for fs, a in zip(fields, states, strict=True):
        for f, j in fs.items():
            leaves[j] = getattr(a, f)
    return leaves


def _check_metrics(objs: Any) -> None:
    for _, node in nnx.iter_graph(objs):
        if isinstance(node, nnx.metrics.Metric) and not isinstance(
            node, nnx.metrics.Average | nnx.MultiMetric
        ):
            raise NotImplementedError(
                f"nnx_data_parallel: metric {type(node).__name__} is not a sum and a count "
                "(nnx.metrics.Average or a subclass such as Accuracy), so its state cannot "
                "be combined exactly across devices. Use Average/Accuracy in the step, or "
                "compute this metric outside the data-parallel step."
            )


class NnxDataParallel:
    """A data-parallel NNX step; build it with :func:`nnx_data_parallel`.

    Attributes:
      mesh: the mesh the step runs on (its axes typed ``Auto``, see the module docstring).
      axes: data-parallel axis names.
      per_device_paths: optimizer-state leaves stored per device (after the first call).
      syncs: the ``GradientSync`` of each ``sync_gradients`` the step runs (after the
        first call).
    """

    def __init__(
        self,
        fn: Callable,
        mesh: Mesh,
        *,
        axes: tuple[str, ...],
        check_replicas: int,
        axis_name: str | None = None,
        shard: dict | None = None,
    ):
        check_mesh_axes(self._name, axes, mesh)
        self._fn = fn
        self.axes = axes
        # A pmap script's axis name, bound to the data axes while the step is traced.
        self._aliases = {} if axis_name is None else {axis_name: axes}
        # Plain (Auto) axis types: arrays on it mix with ordinary single-device code.
        self.mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
        self.num_devices = int(np.prod([mesh.shape[a] for a in axes]))
        self.batch_sharding = NamedSharding(self.mesh, P(self.axes))
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
        self._feedback: Any = None  # set_feedback: the measured share goes into each step
        self._feedback_step: Any = None
        self._fields: list[dict[str, int]] = []  # where each AdaptiveState's fields are
        # shard_optimizer=True: the ShardedOptimizer's arguments, and one per optimizer
        # (by its position among the step's optimizers), built at the first call.
        self._shard_args = shard
        self._engines: dict[int, ShardedOptimizer] = {}
        functools.update_wrapper(self, fn)

    # -- inside shard_map -------------------------------------------------------------
    def _stacked_step(self, plan, leaves, args, share=None, *, write=None, communicate=True):
        """The step inside shard_map: per-device leaves come and go with their device axis.

        With ``share`` (the measured communication share, one value per device), its mean
        over the devices is written into every adaptive compressor's state by
        ``write(states, share)`` before the step; with ``communicate=False`` every sync
        passes the gradients through (the compute-only twin)."""
        per = plan[3]
        leaves = unstack_leaves(leaves, per)
        if share is not None:
            views = write(_adaptive_views(leaves, self._fields), lax.pmean(share[0], self.axes))
            leaves = _with_adaptive(leaves, self._fields, views)
        result, out = self._local(plan, leaves, args, communicate=communicate)
        return stack_leaves(result, per), out

    def _local(self, plan, leaves, args, rec=None, *, communicate=True):
        """One device's step on its local leaves; returns the new leaves and outputs."""
        graphdef, treedef, kinds, _, nodes = plan
        dev = lax.axis_index(self.axes)
        inside = []
        for x, k in zip(leaves, kinds, strict=True):
            if k == _PARAM:
                x = lax.pcast(x, self.axes, to="varying")  # each device's own gradient
            elif k == _METRIC:
                x = jnp.zeros_like(x)  # this device's sums and counts only
            elif k == _KEY:
                x = _fold(x, dev)
            inside.append(x)
        # Old invariant value of every param, by the identity of its varying copy.
        old = {id(v): x for v, x, k in zip(inside, leaves, kinds, strict=True) if k == _PARAM}
        index = {id(v): i for i, (v, k) in enumerate(zip(inside, kinds, strict=True))}
        log = _Log([], [], self._checked_input if rec is None else rec["other_input"])
        exact: dict = {}  # a sharded optimizer's new params, by the identity of the update
        objs, restore, has_opt = self._enter(
            graphdef,
            jax.tree.unflatten(treedef, inside),
            log,
            old,
            communicate,
            {i: (e, exact) for i, e in self._engines.items()},
        )
        try:
            names = bind(self._aliases, axes=self.axes, where=self._name)
            with _invariant_apply_updates(old, exact), names:
                out = self._fn(*self._fill(nodes, objs, args))
        finally:
            restore()
        if rec is not None:
            rec["syncs"] = log.syncs
        if has_opt and not log.syncs:
            raise ValueError(
                f"{self._name}: the optimizer's transform never synchronises gradients, so "
                "params would drift apart across devices. Put jaxcomm.sync_gradients() first: "
                f"{self._fix}."
            )
        for params, updates in log.updates:
            for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates), strict=True):
                if id(p) not in old:
                    # A gradient at params every device holds alike is summed over the
                    # devices by JAX itself: a second update would be silently wrong.
                    raise NotImplementedError(
                        f"{self._name}: the optimizer's update ran twice in one step, or on "
                        "params changed before it; call it once per step, and change params "
                        "after it (a mask or a max-norm on the updated params is kept)."
                    )
                if rec is not None and varying_axes(u) & set(self.axes):
                    rec["varying_update"].append(index[id(p)])
        out_leaves, out = self._exit(objs, out)
        result: list = []
        summed: list[int] = []  # metric leaves: each device's additions, summed
        averaged: list[int] = []  # other float state a step changed per device
        for i, (x, x0, v0, k) in enumerate(zip(out_leaves, leaves, inside, kinds, strict=True)):
            if k == _PARAM:
                if x is v0:  # not trained this step
                    x = x0
                # Else what the step computed: the optimizer's new params (invariant, see
                # _invariant_apply_updates) and any change made to them afterwards. A
                # value still varying is refused when the step is built (_plan).
            elif k == _METRIC:
                summed.append(i)  # x0 + psum(x), below
            elif k == _KEY:
                if x is not v0:
                    raise ValueError(
                        f"{self._name}: the step replaced the random key at leaf {i}; keep the "
                        "key fixed and draw per step from it (nnx.Rngs does; in Linen, "
                        "jax.random.fold_in(state.key, state.step))."
                    )
                x = x0  # draws advance the counts, never the key
            elif k == _OTHER and varying_axes(x) & set(self.axes):
                if jnp.issubdtype(x.dtype, jnp.floating):
                    averaged.append(i)  # e.g. batch statistics: pmean, below
            result.append(x)
        # Batch statistics, metric sums and the step's outputs in one combine: one packed
        # all-reduce per op and dtype, not one per leaf (jaxcomm.outputs.combine). After
        # the optimizer's updates, as data_parallel's: the sync's conditionals may hold
        # collectives still running when an independent all-reduce starts, which gloo
        # would pair differently on different processes (jaxcomm.ordering).
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
        for i, m in zip(averaged, means, strict=True):
            result[i] = m
        for i, total in zip(summed, sums, strict=True):
            result[i] = leaves[i] + total
        if rec is not None:
            rec["vary"] = [bool(varying_axes(x) & set(self.axes)) for x in result]
        return result, out

    def _checked_input(self, sync: Any, tx: Any, params: Any) -> None:
        """Accepts, in the step's trace, a sync whose input the build-time probe checked
        (:func:`jaxcomm.train.check_sync_inputs`, at the first call); refuses it
        otherwise."""
        del sync, tx, params
        if not self._inputs_checked:
            raise ValueError(
                other_input_message(self._name, "which the first call's probe did not check")
            )

    def _per_device_outputs(self, out: Any) -> tuple[list, Any, list[bool]]:
        """The step's outputs as leaves (markers kept whole), their structure, and which
        are unmarked and the same on every device (typed invariant): those are returned as
        they are, not combined (a gather would repeat them once per device)."""
        marked = lambda x: isinstance(x, outputs.Reduced)  # noqa: E731
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out, is_leaf=marked)[0]]
        flat, treedef = jax.tree.flatten(out, is_leaf=marked)
        keep = []
        for path, x in zip(paths, flat, strict=True):
            keep.append(not marked(x) and not varying_axes(x) & set(self.axes))
            if not marked(x) and not keep[-1]:
                outputs.op_of(x, f"{jax.tree_util.keystr(path)} of {self._name}")  # refusals
        return flat, treedef, keep

    @staticmethod
    def _fill(nodes, objs, args):
        it = iter(objs)
        return [next(it) if is_node else a for a, is_node in zip(args, nodes, strict=True)]

    # -- plan -------------------------------------------------------------------------
    def _plan(self, graphdef, treedef, kinds, leaves, nodes, args, marked):
        key = (graphdef, treedef, jax.tree.structure(args))
        if key in self._plans:
            return self._plans[key]
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, leaves))[0]
        ]
        glob_args = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=NamedSharding(self.mesh, P(self.axes))
            ),
            args,
        )

        indirect: list[tuple] = []  # (sync, tx, abstract params): probed below

        def other_input(sync, tx, params):
            if not any(s is sync for s, _, _ in indirect):
                shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
                indirect.append((sync, tx, shapes))

        def probe(lv, a):
            rec: dict = {"varying_update": [], "other_input": other_input}
            self._local((graphdef, treedef, kinds, None, nodes), lv, a, rec)
            self._refuse_varying(rec, kinds, marked, paths)
            self.syncs = list({id(x): x for x in rec["syncs"]}.values())
            return rec["vary"]

        per = infer_per_device(
            probe,
            leaves,
            list(marked),
            self.mesh,
            self.axes,
            args=(glob_args,),
            arg_specs=(P(self.axes),),
            may_vary=[k == _OPT for k in kinds],
        )
        self.per_device_paths = [p for p, f in zip(paths, per, strict=True) if f]
        for _, tx, params in {id(t): (s, t, p) for s, t, p in indirect}.values():
            check_sync_inputs(tx, params, self.mesh, self._name)
        self._inputs_checked = self._inputs_checked or bool(indirect)
        # Replicas start alike only if every process starts from the same values.
        check_same_on_processes(
            f"{self._name}: the initial values of the replicated state (params, optimizer "
            "state, batch statistics, rng keys)",
            key_data([x for x, f in zip(leaves, per, strict=True) if not f]),
            fix=(
                "Build the model, optimizer and state from the same seed on every process "
                "(nnx.Rngs(0) or jax.random.key(0), not a seed from jax.process_index()), "
                "or restore the same checkpoint on every process; per-process randomness "
                "belongs in the data or in keys the step folds per device."
            ),
        )
        plan = (graphdef, treedef, kinds, per, nodes)
        step = self._jit(plan, leaf_specs(leaves, per, self.axes))
        self._plans[key] = (plan, step)
        return plan, step

    def _jit(self, plan, specs, *, write=None, communicate=True):
        """The jitted shard_map of the step; with ``write`` (a feedback's) it takes the
        measured share as a third input; ``communicate=False``: the compute-only twin, its
        params drifting apart, so unchecked by shard_map's replication check."""
        body = functools.partial(self._stacked_step, plan, write=write, communicate=communicate)
        return jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(specs, P(self.axes), *((P(self.axes),) if write else ())),
                out_specs=(specs, P()),
                check_vma=communicate,
            )
        )

    def _refuse_varying(self, rec: dict, kinds, marked, paths: list[str]) -> None:
        """Refuses what a traced step left varying across devices that must agree: an
        optimizer update, unmarked optimizer state, a param, other non-statistics state."""
        if rec["varying_update"]:
            i = rec["varying_update"][0]
            raise ValueError(
                f"{self._name}: the optimizer's update of {paths[i]} varies across "
                f"devices (mesh axes {self.axes}): a stateful transform (e.g. adam) runs "
                "before jaxcomm.sync_gradients() in the chain, on each device's own "
                f"gradients. Put the sync first: {self._fix}."
            )
        for i, (v, k, m) in enumerate(zip(rec["vary"], kinds, marked, strict=True)):
            if v and k == _OPT and not m:
                raise ValueError(
                    f"{self._name}: optimizer state {paths[i]} comes out different on "
                    "each device: a stateful transform (e.g. adam's moments) runs on "
                    "each device's own gradients before jaxcomm.sync_gradients() in the "
                    "chain, so each device would keep its own moments. Put the sync "
                    f"first: {self._fix}. (State meant to be per device is wrapped in "
                    "jaxcomm.PerDevice.)"
                )
            if v and k == _PARAM:
                raise ValueError(
                    f"{self._name}: param {paths[i]} comes out of the step different on "
                    "each device: it was computed from values each device holds for "
                    "itself (its part of the batch, or the params as read before the "
                    "optimizer's update: each device differentiates its own copy). "
                    "Change params only through the optimizer's update "
                    "(optimizer.update / state.apply_gradients, which call "
                    "optax.apply_updates), and compute any change after it (a mask, a "
                    "max-norm) from the updated params and values every device shares."
                )
            if v and k != _OPT:
                raise ValueError(
                    f"{self._name}: state {paths[i]} ({k}) comes out different on "
                    "each device and is not optimizer state, batch statistics, a metric "
                    "or an rng key; change it only from values every device shares."
                )

    # -- call -------------------------------------------------------------------------
    def _prepare(self, args: tuple) -> tuple:
        """The step's graph objects, its plan and jitted step, and its inputs on the mesh:
        ``(objs, state, plan, step, leaves, data)``."""
        nodes = [self._is_node(a) for a in args]
        objs = tuple(a for a, n in zip(args, nodes, strict=True) if n)
        data = [None if n else a for a, n in zip(args, nodes, strict=True)]
        for a in data:
            jax.tree.map(lambda x: refuse_nnx_object(x, self._name), a)
        if self._shard_args is not None:
            objs = self._shard_optimizers(objs)
        graphdef, state, kinds = self._split(objs)
        leaves, treedef = jax.tree.flatten(state)
        data = self._shard(data)
        stacked = NamedSharding(self.mesh, P(self.axes))
        rep = NamedSharding(self.mesh, P())
        marked = _marked(objs, state)
        # A per-device leaf stored by an earlier step (or a sharded optimizer's chunks)
        # has its device axis already: its plan sees one device's shape.
        local = [
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
            if m and isinstance(x, jax.Array) and x.sharding == stacked
            else x
            for x, m in zip(leaves, marked, strict=True)
        ]
        plan, step = self._plan(graphdef, treedef, kinds, local, tuple(nodes), data, marked)

        def put(x, f):
            if not f:
                return jax.device_put(x, rep)
            if isinstance(x, jax.Array) and x.sharding == stacked:
                return x  # stacked by an earlier call
            return jax.device_put(jnp.broadcast_to(x, (self.num_devices, *np.shape(x))), stacked)

        leaves = [put(x, f) for x, f in zip(leaves, plan[3], strict=True)]
        return objs, state, plan, step, leaves, data

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
                step, (leaves, data), self.mesh, f"{self._name} step"
            )
        return self._compiled_steps[key]

    def __call__(self, *args):
        objs, _, plan, step, leaves, data = self._prepare(args)
        if self._feedback is None:
            new, out = self._compiled(step, leaves, data)(leaves, data)
        else:
            new, out = self._feedback_step(leaves, data, self._feedback.before_step())
        if xla_cpu.one_step_in_flight(self.mesh):
            jax.block_until_ready(new)
        self._calls += 1
        if self.check_replicas and self._calls % self.check_replicas == 0:
            _check_replicas(key_data(new), mesh=self.mesh, what=f"state (step {self._calls})")
        if self._feedback is not None:
            self._feedback.after_step(new)
        return self._write_back(objs, jax.tree.unflatten(plan[1], new), out)

    # -- shard_optimizer=True ----------------------------------------------------------
    def _shard_optimizers(self, objs: tuple) -> tuple:
        """``objs`` with each optimizer's state laid out sharded (:class:`ShardedState`,
        its chunks stacked along the data axes in ``jaxcomm.PerDevice``), from the state
        its ``init`` gives; a state sharded already (a later call, a restored checkpoint)
        is kept. Builds each optimizer's :class:`~jaxcomm.sharded.ShardedOptimizer` once
        (its checks and the probe of its transforms run here, at the first call)."""
        for i, tx, params, opt_state in self._optimizers(objs):
            engine = self._engines.get(i)
            if engine is None:
                engine = ShardedOptimizer(
                    tx, self.mesh, self.axes, where=self._name, **self._shard_args
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
                    f"{self._name}(shard_optimizer=True): the optimizer's state is not the "
                    "one its init gives (it was updated, or restored from an unsharded "
                    "checkpoint), and only a fresh state is laid out sharded (its moments "
                    "would be lost). Build the optimizer anew before the first step, or "
                    "restore a state saved from this sharded step."
                )
            replicated = jax.device_put(jax.tree.leaves(params), NamedSharding(self.mesh, P()))
            sharded = wrap_per_device(engine.init_fn(engine.per)(replicated), engine.per)
            objs = self._with_opt_state(objs, i, sharded)
        return objs

    def shard_optimizer_state(self, *args) -> Any:
        """Lays each optimizer's state out sharded now, as the first call does
        (``shard_optimizer=True``): e.g. before restoring a checkpoint of the sharded
        state, whose structure (``ShardedState`` chunks, stacked) it then has.

        Args:
          *args: the step's arguments (its ``nnx.Optimizer`` and model, or its
            ``TrainState`` s; the batch may be left out).

        Returns:
          NNX: None (the optimizers are updated in place). Linen: the ``TrainState`` with
          its sharded ``opt_state`` (a tuple of them for several).

        Raises:
          ValueError: the step was built without ``shard_optimizer=True``; or as at the
            first call (a transform that does not shard, a trained state).

        Example:
          >>> train_step.shard_optimizer_state(model, optimizer)
          >>> target = nnx.state(optimizer)                   # the sharded layout
          >>> nnx.update(optimizer, checkpointer.restore(path, target))
        """
        if self._shard_args is None:
            raise ValueError(
                f"{self._name}: shard_optimizer_state needs the step built with "
                "shard_optimizer=True."
            )
        objs = self._shard_optimizers(tuple(a for a in args if self._is_node(a)))
        return self._laid_out(objs)

    @staticmethod
    def _laid_out(objs: tuple) -> Any:
        return None  # NNX objects are updated in place

    # -- what jaxcomm.CommProfiler.drive reads -----------------------------------------
    def drive_inputs(self, *args) -> tuple[list, Any]:
        """The inputs of the compiled step for these arguments (as the step is called):
        ``(leaves, batch)``, the state's flat leaves and the batch on the mesh, for
        ``jaxcomm.CommProfiler.drive``, which times the step on them several times.

        Returns:
          ``(leaves, batch)``; the first is the state :meth:`adaptive_states` reads.
        """
        objs, state, _, _, leaves, data = self._prepare(args)
        self._fields = _adaptive_fields(objs, state)
        return leaves, data

    def set_feedback(self, feedback: Any, *args) -> Any:
        """Feeds a measurement into every later step, and compiles that step now.

        From now on each call passes ``feedback.before_step()`` (an f32 array of one
        value per device, laid out like the batch: the measured communication share) into
        the step as an explicit input; inside, its mean over the devices is written into
        every adaptive compressor's state with ``feedback.write(states, share)`` before the
        user's step runs, and the new state's leaves go to ``feedback.after_step(leaves)``.
        ``jaxcomm.CommProfiler.drive`` is the feedback that measures the share; users call
        that.

        Args:
          feedback: an object with ``before_step() -> jax.Array``,
            ``write(states, share) -> states`` (traced) and ``after_step(leaves)``.
          *args: the step's arguments, as it is called (it is compiled for them).

        Returns:
          The ``jax.stages.Compiled`` step: ``compiled(leaves, batch, share)``.
        """
        objs, state, plan, _, leaves, data = self._prepare(args)
        self._fields = _adaptive_fields(objs, state)
        step = self._jit(plan, leaf_specs(leaves, plan[3], self.axes), write=feedback.write)
        share = jax.ShapeDtypeStruct((self.num_devices,), jnp.float32, sharding=self.batch_sharding)
        self._feedback_step = compile_on_every_process(
            step, (leaves, data, share), self.mesh, f"{self._name} step"
        )
        self._feedback = feedback
        return self._feedback_step

    def compile(self, *args, communicate: bool = True) -> Any:
        """The step compiled for these arguments (as the step is called).

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
        _, _, plan, _, leaves, data = self._prepare(args)
        step = self._jit(plan, leaf_specs(leaves, plan[3], self.axes), communicate=communicate)
        return compile_on_every_process(step, (leaves, data), self.mesh, f"{self._name} step")

    def adaptive_states(self, leaves: list) -> list[AdaptiveState]:
        """The state of each adaptive compressor, read from the step's state ``leaves``
        (as :meth:`drive_inputs` returns them and the step updates them); the residual is
        left out."""
        return _adaptive_views(leaves, self._fields)

    def replace_adaptive(self, leaves: list, fn: Callable) -> list:
        """``leaves`` with ``fn`` applied to each adaptive compressor's state (its fields
        but the residual)."""
        return _with_adaptive(leaves, self._fields, [fn(a) for a in self.adaptive_states(leaves)])

    # -- NNX: graph nodes, Variable types, in-place updates ----------------------------
    _name = "nnx_data_parallel"
    _fix = (
        "nnx.Optimizer(model, optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-3)), "
        "wrt=nnx.Param)"
    )

    @staticmethod
    def _is_node(a: Any) -> bool:
        return isinstance(a, nnx.Pytree)

    @staticmethod
    def _split(objs: tuple) -> tuple[Any, Any, tuple[str, ...]]:
        _check_metrics(objs)
        graphdef, state = nnx.split(objs)
        kinds = jax.tree.leaves(
            jax.tree.map(
                lambda v: _kind(type(v)), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
            )
        )
        return graphdef, state, tuple(kinds)

    @staticmethod
    def _enter(graphdef, state, log: _Log, old: dict, communicate: bool, engines: dict):
        objs = nnx.merge(graphdef, state)
        opts = [o for _, o in nnx.iter_graph(objs) if isinstance(o, nnx.Optimizer)]
        txs = [o.tx for o in opts]
        for i, o in enumerate(opts):
            sharded = None
            if i in engines:
                engine, exact = engines[i]
                sharded = _Sharded(engine, lambda o=o: o.step[...], exact)
            o.tx = _Recording(o.tx, log, old, communicate, sharded)

        def restore():
            for o, tx in zip(opts, txs, strict=True):
                o.tx = tx

        return objs, restore, bool(opts)

    @staticmethod
    def _exit(objs, out):
        return jax.tree.leaves(nnx.split(objs)[1]), out

    @staticmethod
    def _write_back(objs, state, out):
        nnx.update(objs, state)
        return out

    def _optimizers(self, objs: tuple) -> list[tuple]:
        """``(index, tx, params, opt_state)`` of each ``nnx.Optimizer`` among ``objs``, its
        params those of the step's one model argument (``wrt``-filtered), all as arrays."""
        opts = [o for _, o in nnx.iter_graph(objs) if isinstance(o, nnx.Optimizer)]
        models = [a for a in objs if isinstance(a, nnx.Module)]
        if opts and len(models) != 1:
            raise ValueError(
                f"{self._name}(shard_optimizer=True): the step takes {len(models)} "
                "nnx.Module arguments; the sharded optimizer state is laid out over the "
                "params of the one model the optimizer trains: pass one model."
            )
        return [
            (i, o.tx, nnx.as_pure(nnx.state(models[0], o.wrt)), nnx.as_pure(o.opt_state))
            for i, o in enumerate(opts)
        ]

    @staticmethod
    def _with_opt_state(objs: tuple, i: int, opt_state: Any) -> tuple:
        opts = [o for _, o in nnx.iter_graph(objs) if isinstance(o, nnx.Optimizer)]
        opts[i].opt_state = nnx.data(to_opt_state(opt_state))
        return objs

    def _shard(self, data):
        sharding = NamedSharding(self.mesh, P(self.axes))
        many = jax.process_count() > 1
        if many and not self._batch_checked:
            self._check_global_batch(data)

        def put(x):
            if many and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
                x = np.asarray(x)  # this process's copy of the global batch
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            if x.ndim == 0 or x.shape[0] % self.num_devices:
                where = f" of {jax.process_count()} processes" if many else ""
                raise ValueError(
                    f"{self._name}: a batch argument of shape {x.shape} does not split "
                    f"over the {self.num_devices} devices{where} along its leading axis; use "
                    f"a multiple of {self.num_devices} (non-module arguments are the global "
                    "batch)."
                )
            return jax.device_put(x, sharding)

        return jax.tree.map(put, data)

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
            f"{self._name}/global batch", f"{shapes}|{fingerprint([x for _, x in host])}"
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
            f"{self._name}: the batch differs between processes: {what}. {self._name} takes "
            "the global batch, the same on every process (each device takes its slice of "
            "the leading axis), not each process's part as jaxcomm.data_parallel does. Pass "
            "every process the same global batch, or build the global array from each "
            f"process's part: jax.make_array_from_process_local_data(step.batch_sharding, "
            f"part) (a part of {rows} rows on each of {jax.process_count()} processes makes "
            f"a global batch of {rows * jax.process_count()} rows)."
        )


def _decorator_args(name: str, mesh: Any, axes: Any, check_replicas: Any) -> tuple[int, tuple]:
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


class _Slot:
    """Where a returned ``TrainState`` goes back in the step's output."""


jax.tree_util.register_pytree_node(_Slot, lambda _: ((), None), lambda *_: _Slot())


def _linen_kind(path: tuple, x: Any) -> str:
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        return _KEY
    field = _plain(path[1:2])[0]
    kind = {"params": _PARAM, "opt_state": _OPT}.get(field, _OTHER)
    if kind == _OTHER and _raw_key_like(x):
        # A legacy raw key (jax.random.PRNGKey): folded per device like a typed one, or
        # every device would draw the same dropout mask. Only a name says it is a key.
        name = ".".join(str(k) for k in _plain(path[1:]))
        if "key" in name.lower() or "rng" in name.lower():
            return _KEY
        raise ValueError(
            f"linen_data_parallel: state field {name} is a uint32 array of shape "
            f"{np.shape(x)}, the form of a legacy raw key (jax.random.PRNGKey), but its "
            "name does not say 'key' or 'rng', so jaxcomm cannot tell whether to give each "
            "device its own stream (unfolded, every device would draw the same dropout "
            "mask). Store a typed key, jax.random.key(seed), or name the field ...key / "
            "...rng; a value that is not a key can be stored as int32."
        )
    return kind


def _raw_key_like(x: Any) -> bool:
    """A ``uint32`` array whose trailing shape is the default PRNG's raw key data."""
    if jnp.result_type(x) != jnp.uint32:
        return False
    raw = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    return tuple(np.shape(x)[-len(raw) :]) == raw


class LinenDataParallel(NnxDataParallel):
    """A data-parallel Linen step on ``flax.training.train_state.TrainState``; build it with
    :func:`linen_data_parallel`."""

    _name = "linen_data_parallel"
    _fix = "TrainState.create(..., tx=optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-3)))"

    @staticmethod
    def _is_node(a: Any) -> bool:
        return isinstance(a, TrainState)

    @staticmethod
    def _split(objs: tuple) -> tuple[Any, Any, tuple[str, ...]]:
        flat = jax.tree_util.tree_flatten_with_path(objs)[0]
        return None, objs, tuple(_linen_kind(p, x) for p, x in flat)

    @staticmethod
    def _enter(graphdef, states, log: _Log, old: dict, communicate: bool, engines: dict):
        def recording(i, s):
            sharded = None
            if i in engines:
                engine, exact = engines[i]
                sharded = _Sharded(engine, lambda s=s: s.step, exact)
            return s.replace(tx=_Recording(s.tx, log, old, communicate, sharded))

        states = tuple(recording(i, s) for i, s in enumerate(states))
        return states, lambda: None, bool(states)

    @staticmethod
    def _exit(objs, out):
        is_state = lambda x: isinstance(x, TrainState)  # noqa: E731
        new = [x for x in jax.tree.leaves(out, is_leaf=is_state) if is_state(x)]
        if len(new) != len(objs):
            raise ValueError(
                f"linen_data_parallel: the step takes {len(objs)} TrainState(s) and returns "
                f"{len(new)}; return each new state, e.g. (state, metrics)."
            )
        rest = jax.tree.map(lambda x: _Slot() if is_state(x) else x, out, is_leaf=is_state)
        return jax.tree.leaves(tuple(new)), rest

    @staticmethod
    def _optimizers(objs: tuple) -> list[tuple]:
        return [(i, s.tx, s.params, s.opt_state) for i, s in enumerate(objs)]

    @staticmethod
    def _with_opt_state(objs: tuple, i: int, opt_state: Any) -> tuple:
        return (*objs[:i], objs[i].replace(opt_state=opt_state), *objs[i + 1 :])

    @staticmethod
    def _laid_out(objs: tuple) -> Any:
        return objs[0] if len(objs) == 1 else objs

    @staticmethod
    def _write_back(objs, states, out):
        it = iter(states)
        return jax.tree.map(
            lambda x: next(it) if isinstance(x, _Slot) else x,
            out,
            is_leaf=lambda x: isinstance(x, _Slot),
        )


def linen_data_parallel(
    mesh: Mesh,
    *,
    axes: tuple[str, ...] = DATA_AXES,
    check_replicas: int | None = None,
    axis_name: str | None = None,
    shard_optimizer: bool = False,
    param_gather: Any = None,
    shard_bucket_bytes: int | None = None,
) -> Callable[[Callable], LinenDataParallel]:
    """Makes a Flax Linen train step on ``TrainState`` data-parallel (in place of ``jax.jit``).

    The step is ``train_step(state, batch, ...) -> (state, metrics)`` as written for one
    device, with ``state`` a ``flax.training.train_state.TrainState`` (or a subclass with
    fields such as ``batch_stats`` and ``key``) whose ``tx`` starts with
    ``jaxcomm.sync_gradients()``. Its other arguments are the global batch, split over
    ``axes``. Inside ``shard_map(..., check_vma=True)``: ``state.params`` are replicated
    (each device differentiates its own copy; the new params are the old plus the
    optimizer's synchronised update, proven invariant), ``state.opt_state`` is replicated
    except ``jaxcomm.PerDevice`` state, float fields that the step makes differ per device
    (``batch_stats``) are averaged across devices, and a key field (a typed
    ``jax.random.key``, or a legacy ``jax.random.PRNGKey`` in a field named ...key or
    ...rng) is folded with the device index, so dropout keys drawn from it
    (``jax.random.fold_in(state.key, state.step)``) differ per device. Params the step
    changes after ``apply_gradients`` (``state.replace(params=...)``) are kept. The
    returned state lives on the mesh with a plain sharding; the other outputs are combined
    by :func:`jaxcomm.outputs.combine` (float scalars averaged, per-example arrays gathered
    in batch order, marked values as marked, values the same on every device as they are).

    Args:
      mesh: from :func:`jaxcomm.make_mesh`.
      axes: data-parallel axes of ``mesh``.
      check_replicas: every this many steps, compare every replicated leaf across devices
        by its bits; 0/None: off.
      axis_name: a name the step uses for the data axis (``'batch'`` of
        ``nn.BatchNorm(axis_name='batch')`` or ``lax.pmean(x, 'batch')``), bound to
        ``axes`` while the step is traced (``jaxcomm.axis_names``): BatchNorm then
        normalises with the statistics of the global batch (SyncBatchNorm).
      shard_optimizer, param_gather, shard_bucket_bytes: sharded optimizer state, as
        :func:`nnx_data_parallel`'s (``state.opt_state`` becomes a ``ShardedState``).

    Returns:
      A decorator; the decorated step is a :class:`LinenDataParallel`.

    Example:
      >>> @jaxcomm.linen_data_parallel(mesh)
      ... def train_step(state, batch):
      ...     grads = jax.grad(loss_fn)(state.params, batch)
      ...     return state.apply_gradients(grads=grads), {}
    """
    n, axes = _decorator_args("linen_data_parallel", mesh, axes, check_replicas)
    name = check_axis_name(axis_name, axes, "linen_data_parallel")
    shard = shard_options("linen_data_parallel", shard_optimizer, param_gather, shard_bucket_bytes)
    return lambda fn: LinenDataParallel(
        fn, mesh, axes=axes, check_replicas=n, axis_name=name, shard=shard
    )


def nnx_data_parallel(
    mesh: Mesh,
    *,
    axes: tuple[str, ...] = DATA_AXES,
    check_replicas: int | None = None,
    axis_name: str | None = None,
    shard_optimizer: bool = False,
    param_gather: Any = None,
    shard_bucket_bytes: int | None = None,
) -> Callable[[Callable], NnxDataParallel]:
    """Makes an NNX train step data-parallel over ``mesh`` (use in place of ``nnx.jit``).

    The step's NNX arguments (model, ``nnx.Optimizer``, ``nnx.MultiMetric``) are updated in
    place, as with ``nnx.jit``; its other arguments are the global batch, split along their
    leading axis over ``axes``. The optimizer's transform must contain
    ``jaxcomm.sync_gradients()`` before any stateful transform. What the step returns is
    combined over devices by :func:`jaxcomm.outputs.combine`: float scalars averaged,
    per-example arrays (logits) gathered in global batch order, values marked
    ``jaxcomm.outputs.sum/max/min/gather`` combined so, integer scalars refused unless
    marked, values the same on every device returned as they are. Params changed after
    ``optimizer.update`` (a mask, a max-norm) are kept. See the module docstring for how
    each kind of state is kept; BatchNorm normalises with each device's own batch
    statistics and averages the running statistics, or, with ``axis_name=`` given to
    both the decorator and ``nnx.BatchNorm``, with the global batch's (SyncBatchNorm).

    Args:
      mesh: from :func:`jaxcomm.make_mesh`.
      axes: data-parallel axes of ``mesh``.
      check_replicas: every this many steps, compare every replicated leaf across devices
        by its bits (``jaxcomm.ReplicaDivergenceError``); 0/None: off.
      axis_name: a name the model or step uses for the data axis
        (``nnx.BatchNorm(..., axis_name='batch')``), bound to ``axes`` while the step is
        traced (``jaxcomm.axis_names``): BatchNorm then normalises with the statistics of
        the global batch (SyncBatchNorm), as on one device.
      shard_optimizer: shard the optimizer's state and update over ``axes`` (ZeRO-1/2, as
        ``jaxcomm.data_parallel(shard_optimizer=True)``, ``jaxcomm.sharded``): the
        optimizer's transform is ``optax.chain(jaxcomm.sync_gradients(...), *elementwise
        transforms)``; at the first call its fresh state is replaced by each device's
        ``1/N`` chunk (a ``ShardedState``), the gradients are reduce-scattered, each
        device updates its chunk and the params are all-gathered, so the new params the
        step's ``optax.apply_updates`` returns are the gathered ones.
      param_gather: with ``shard_optimizer``: None (f32 gathers) or
        ``jaxcomm.compression.bf16()`` / ``int8()`` (ZeRO++ qwZ).
      shard_bucket_bytes: with ``shard_optimizer``: the bucket bound of the packed
        gradients and params (64 MiB by default).

    Returns:
      A decorator; the decorated step is a :class:`NnxDataParallel`.

    Example:
      >>> @jaxcomm.nnx_data_parallel(mesh)
      ... def train_step(model, optimizer, metrics, batch):
      ...     grads = nnx.grad(loss_fn)(model, batch)
      ...     optimizer.update(model, grads)
    """
    n, axes = _decorator_args("nnx_data_parallel", mesh, axes, check_replicas)
    name = check_axis_name(axis_name, axes, "nnx_data_parallel")
    shard = shard_options("nnx_data_parallel", shard_optimizer, param_gather, shard_bucket_bytes)
    return lambda fn: NnxDataParallel(
        fn, mesh, axes=axes, check_replicas=n, axis_name=name, shard=shard
    )
