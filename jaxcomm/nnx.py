"""Flax data parallelism: ``@jaxcomm.nnx_data_parallel(mesh)`` on an NNX train step.

The user keeps the model, ``nnx.Optimizer(model, optax.chain(jaxcomm.sync_gradients(),
...))``, ``nnx.MultiMetric`` and the body of ``train_step(model, optimizer, metrics,
batch)``; the decorator (in place of ``nnx.jit``) runs the body on every device's shard of
the batch inside ``jax.shard_map(..., check_vma=True)`` (the engine,
:class:`jaxcomm.flax_step.FlaxStep`) and treats each kind of NNX state by its ``Variable``
type:

- ``nnx.Param`` (and whatever the optimizer updates): replicated. Inside, each device
  differentiates a varying copy (its own gradient; ``sync_gradients`` reduces it). The
  ``nnx.Optimizer`` the step receives updates the model from the invariant old params
  (``Optimizer.update`` as Flax writes it, with the update added to the old params every
  device shares), so the new params, and whatever the step computes from them afterwards
  (a pruning mask, a max-norm), are kept as computed and proven the same on every device
  by shard_map's replication check. A param that comes out different per device (changed
  from the batch) is refused. (An ``nnx.Optimizer`` subclass that overrides ``update``
  keeps its own, and its params come out per device: refused.)
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

With ``axis_name='batch'`` the decorator binds that name to the data axes while the step
traces (:mod:`jaxcomm.axis_names`): ``BatchNorm(axis_name='batch')`` normalises with the
global batch's statistics, and an axis name bound nowhere raises an error that lists the
names in scope. Gradients that reach the optimizer averaged already (the step's own
``lax.pmean(grads, ...)``) are refused. Its siblings: :func:`jaxcomm.linen_data_parallel`
(``jaxcomm/linen.py``, a Linen ``TrainState``) and :func:`jaxcomm.pmap_data_parallel`
(``jaxcomm/pmap.py``, a ``jax.pmap`` script's layouts).

With ``shard_optimizer=True`` the optimizer's state is sharded (ZeRO-1/2,
:mod:`jaxcomm.sharded`): at the first call its fresh state is replaced by each device's
chunk, stored per device, and the optimizer's update runs a
:class:`~jaxcomm.sharded.ShardedOptimizer` (reduce-scatter, the chunk's update,
all-gather); the new params are then the gathered params themselves.

Everything it writes back lives on the mesh's devices with a plain (non-explicit)
``NamedSharding``, so ordinary Flax code (an ``nnx.jit`` eval step, ``metrics.reset()``,
orbax) uses it without a mesh context.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state
from jax.sharding import Mesh

from jaxcomm.axis_names import check_axis_name
from jaxcomm.flax_hybrid import check_shard_params
from jaxcomm.flax_step import (
    KEY,
    METRIC,
    OPT,
    OTHER,
    PARAM,
    FlaxFrontEnd,
    FlaxStep,
    Recording,
    Split,
    TraceHooks,
    check_decorator_args,
    key_data,
    replicated_params,
)
from jaxcomm.linen import LinenDataParallel, linen_data_parallel
from jaxcomm.mesh import DATA_AXES
from jaxcomm.sharded import shard_options

__all__ = [
    "LinenDataParallel",
    "NnxAdapter",
    "NnxDataParallel",
    "key_data",
    "linen_data_parallel",
    "nnx_data_parallel",
    "replicated_params",
]


def _kind(var_type: type) -> str:
    if issubclass(var_type, nnx.training.optimizer.OptState):
        return OPT
    if issubclass(var_type, nnx.metrics.MetricState):
        return METRIC
    if issubclass(var_type, nnx.RngKey):
        return KEY
    if issubclass(var_type, nnx.Param):
        return PARAM
    return OTHER


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


class _Structure:
    """One graph structure of a step's objects (Flax's ``GraphDef``), interned: equal
    structures are one object, hashed by identity. The engine keys its plans by the
    structure on every call; a ``GraphDef`` hashes and compares its whole node list each
    time, the interned one once per call (here). Holds what depends on the structure
    alone: each state leaf's kind (the Variable types are in the graphdef), checked
    metrics."""

    __slots__ = ("graphdef", "kinds")

    def __init__(self, graphdef: Any, kinds: tuple[str, ...]):
        self.graphdef = graphdef
        self.kinds = kinds


# Every structure seen, by its GraphDef (a few per program; reset if a program makes many).
_STRUCTURES: dict[Any, _Structure] = {}
_MAX_STRUCTURES = 256


def _structure(objs: tuple, graphdef: Any, state: Any) -> _Structure:
    """The interned structure of ``objs`` (split into ``graphdef`` and ``state``); its
    metrics checked and its kinds read at the first sight of the structure."""
    found = _STRUCTURES.get(graphdef)
    if found is None:
        _check_metrics(objs)
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        kinds = jax.tree.leaves(jax.tree.map(lambda v: _kind(type(v)), state, is_leaf=is_var))
        if len(_STRUCTURES) >= _MAX_STRUCTURES:
            _STRUCTURES.clear()
        found = _STRUCTURES[graphdef] = _Structure(graphdef, tuple(kinds))
    return found


def _optimizers_in(objs: Any) -> list[nnx.Optimizer]:
    return [o for _, o in nnx.iter_graph(objs) if isinstance(o, nnx.Optimizer)]


def _update(optimizer: nnx.Optimizer, model: Any, grads: Any, /, **kwargs: Any) -> Any:
    """``nnx.Optimizer.update`` as Flax documents it (``tx.update``, then the updates
    applied to the params), with the updates applied by the step's
    :class:`~jaxcomm.flax_step.Recording` (its ``tx`` while the step traces): to the
    invariant old params, so the new params are typed the same on every device."""
    graph = optimizer.graph
    params = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph))
    updates, new_opt_state = optimizer.tx.update(
        grad_arrays, nnx.as_pure(optimizer.opt_state), params, **nnx.as_pure(kwargs)
    )
    nnx.update(model, optimizer.tx.apply_updates(params, updates))
    nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=graph))
    optimizer.step[...] += 1
    return updates


# The updates Flax writes (``tx.update``, then the updates applied to the params), which
# the step's optimizers take in the step's own form.
_FLAX_UPDATES = (nnx.Optimizer.update, nnx.ModelAndOptimizer.update)


def _is_variable(x: Any) -> bool:
    # By its type: isinstance goes through Variable's metaclass (for tracers), twice as
    # slow in the flatten of every call.
    return issubclass(type(x), nnx.Variable)


class _Warm(NamedTuple):
    """How to read one structure's state without Flax's graph traversal.

    The objects flattened as a JAX pytree (``nnx.Pytree`` s are pytrees) with their
    ``Variable`` s as leaves, and those ``Variable`` s flattened in turn, give two
    treedefs that hold every node's type and static attributes, each ``Variable``'s type
    and metadata; which leaves are the same ``Variable`` (shared) is read from their
    identities. Equal treedefs and the same sharing: the objects have the structure
    ``nnx.split`` read (its ``GraphDef``), and its state's leaves are the ``Variable`` s'
    values at ``order``, written back into those ``Variable`` s."""

    variables_def: Any  # the objects' treedef, Variables as leaves
    values_def: Any  # the Variables' treedef (types, metadata), their values as leaves
    order: tuple[int, ...]  # state leaf i is the value of Variable order[i] of the flatten
    shared: tuple[tuple[int, ...], ...]  # Variables that occur more than once: positions
    distinct: int  # how many distinct Variables
    structure: _Structure
    treedef: Any  # the state's treedef (nnx.split's State)

    def matches(self, variables: list) -> bool:
        """Whether ``variables`` (this call's, in flatten order) are shared as at the
        structure's first sight (with equal treedefs: the same graph)."""
        return len({id(v) for v in variables}) == self.distinct and all(
            variables[j] is variables[g[0]] for g in self.shared for j in g[1:]
        )


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for treedefs; False where their metadata do not compare (an array)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _warm(
    variables: list, variables_def: Any, structure: _Structure, state: Any, treedef: Any
) -> _Warm | None:
    """The :class:`_Warm` reading of a structure (``nnx.split`` gave ``state``, of
    structure ``treedef``); None where the objects hold state outside ``Variable`` s, a
    ``Variable`` whose value is not one leaf, or array references (``ref``, ``hijax``
    metadata), which only Flax's ``nnx.split`` / ``nnx.update`` read and write."""
    if not all(_is_variable(v) for v in variables):
        return None  # a plain array attribute, a graph node that is not a pytree
    values, values_def = jax.tree.flatten(variables)
    in_state = jax.tree.leaves(state, is_leaf=_is_variable)
    leaves = jax.tree.leaves(state)
    if len(values) != len(variables) or len(leaves) != len(in_state):
        return None  # a Variable whose value is not one array
    first: dict[int, int] = {}
    for j, v in enumerate(variables):
        first.setdefault(id(v), j)
    order = tuple(first.get(id(v), -1) for v in in_state)
    if -1 in order or len(order) != len(first):
        return None
    if any(values[j] is not x for j, x in zip(order, leaves, strict=True)):
        return None
    for v in in_state:
        meta = v.get_metadata()
        if meta.get("ref") or meta.get("hijax"):
            return None  # an array reference: written through Flax (nnx.update)
    positions: dict[int, list[int]] = {}
    for j, v in enumerate(variables):
        positions.setdefault(id(v), []).append(j)
    shared = tuple(tuple(p) for p in positions.values() if len(p) > 1)
    return _Warm(variables_def, values_def, order, shared, len(first), structure, treedef)


class NnxAdapter:
    """NNX state for the engine (:class:`jaxcomm.flax_step.Adapter`): graph nodes split by
    ``Variable`` type, updated in place.

    Per call, the objects' structure is recognised from their pytree flatten (a few
    microseconds per node; :class:`_Warm`) and their state read from and written into
    their ``Variable`` s; Flax's ``nnx.split`` (its graph traversal, about ten times
    slower) runs at a structure's first sight and where the warm reading does not apply.
    """

    name = "nnx_data_parallel"
    global_batch = True
    rows_out = False
    fix = (
        "nnx.Optimizer(model, optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-3)), "
        "wrt=nnx.Param)"
    )

    def __init__(self):
        # By the objects' treedef (Variables as leaves): the warm reading, or None.
        self._warm: dict[Any, _Warm | None] = {}

    @staticmethod
    def is_node(a: Any) -> bool:
        return isinstance(a, nnx.Pytree)

    def split(self, objs: tuple) -> Split:
        """The objects' interned structure (the engine's "graphdef"), their state's leaves
        and treedef, and each leaf's kind; ``targets``: the ``Variable`` s the new leaves
        are written into (None: through ``nnx.update``). The checks and kinds are the
        structure's, read once."""
        variables, variables_def = jax.tree.flatten(objs, is_leaf=_is_variable)
        try:
            warm = self._warm.get(variables_def, False)
        except Exception:  # a static attribute that does not hash or compare: no warm path
            warm = None
        if warm:
            values, values_def = jax.tree.flatten(variables)
            if _equal(values_def, warm.values_def) and warm.matches(variables):
                structure = warm.structure
                leaves = [values[j] for j in warm.order]
                targets = [variables[j] for j in warm.order]
                return Split(structure, leaves, warm.treedef, structure.kinds, targets)
        graphdef, state = nnx.split(objs)
        structure = _structure(objs, graphdef, state)
        leaves, treedef = jax.tree.flatten(state)
        if warm is not None:  # first sight, or the Variables' metadata or sharing changed
            if len(self._warm) >= _MAX_STRUCTURES:
                self._warm.clear()
            self._warm[variables_def] = _warm(variables, variables_def, structure, state, treedef)
        return Split(structure, leaves, treedef, structure.kinds)

    @staticmethod
    def enter(graphdef: _Structure, state: Any, hooks: TraceHooks) -> tuple:
        """The objects merged from ``state``; each ``nnx.Optimizer`` records through
        ``hooks`` (its ``tx``) and updates the model from the invariant old params (its
        ``update``, unless its class overrides it)."""
        objs = nnx.merge(graphdef.graphdef, state)
        opts = _optimizers_in(objs)
        txs = [o.tx for o in opts]
        own = [o for o in opts if type(o).update in _FLAX_UPDATES]
        for i, o in enumerate(opts):
            o.tx = Recording(o.tx, hooks, i, lambda o=o: o.step[...])
        for o in own:
            if type(o).update is nnx.Optimizer.update:
                o.update = functools.partial(_update, o)
            else:  # the deprecated nnx.ModelAndOptimizer: update(grads) of its model
                o.update = lambda grads, /, o=o, **kw: _update(o, o.model, grads, **kw)

        def restore():
            for o, tx in zip(opts, txs, strict=True):
                o.tx = tx
            for o in own:
                del o.update

        return objs, restore, bool(opts)

    @staticmethod
    def exit(objs: tuple, out: Any) -> tuple[list, Any]:
        return jax.tree.leaves(nnx.split(objs)[1]), out

    @staticmethod
    def write_back(objs: tuple, split: Split, new: list, out: Any) -> Any:
        if split.targets is None:
            nnx.update(objs, jax.tree.unflatten(split.treedef, new))
        else:  # the Variables the leaves were read from (as nnx.update writes them)
            for v, x in zip(split.targets, new, strict=True):
                v.set_raw_value(x)
        return out

    def optimizers(self, objs: tuple) -> list[tuple]:
        """``(index, tx, params, opt_state)`` of each ``nnx.Optimizer`` among ``objs``, its
        params those of the step's one model argument (``wrt``-filtered), all as arrays."""
        opts = _optimizers_in(objs)
        models = [a for a in objs if isinstance(a, nnx.Module)]
        if opts and len(models) != 1:
            raise ValueError(
                f"{self.name}(shard_optimizer=True or shard_params=True): the step takes "
                f"{len(models)} nnx.Module arguments; the sharded optimizer state is laid "
                "out over the params of the one model the optimizer trains: pass one model, "
                "or shard neither."
            )
        return [
            (i, o.tx, nnx.as_pure(nnx.state(models[0], o.wrt)), nnx.as_pure(o.opt_state))
            for i, o in enumerate(opts)
        ]

    @staticmethod
    def with_opt_state(objs: tuple, i: int, opt_state: Any) -> tuple:
        _optimizers_in(objs)[i].opt_state = nnx.data(to_opt_state(opt_state))
        return objs

    @staticmethod
    def opt_states(objs: tuple) -> list[tuple[tuple, Any]]:
        return [
            ((i, "opt_state"), nnx.as_pure(o.opt_state))
            for i, o in enumerate(objs)
            if isinstance(o, nnx.Optimizer)
        ]

    @staticmethod
    def leaf_key(path: tuple) -> tuple:
        return path[:-1]  # every NNX state leaf is a Variable's value

    @staticmethod
    def laid_out(objs: tuple) -> None:
        return None  # NNX objects are updated in place

    @staticmethod
    def check_batch(data: Any, num_devices: int) -> None:
        del data, num_devices  # any leading axis that splits over the devices


class NnxDataParallel(FlaxFrontEnd):
    """A data-parallel NNX step; build it with :func:`nnx_data_parallel`.

    Attributes:
      mesh: the mesh the step runs on (its axes typed ``Auto``, see the module docstring).
      axes: data-parallel axis names.
      per_device_paths: optimizer-state leaves stored per device (after the first call).
      syncs: the ``GradientSync`` of each ``sync_gradients`` the step runs (after the
        first call).
    """


def nnx_data_parallel(
    mesh: Mesh,
    *,
    axes: tuple[str, ...] = DATA_AXES,
    check_replicas: int | None = None,
    axis_name: str | None = None,
    shard_optimizer: bool = False,
    param_gather: Any = None,
    shard_bucket_bytes: int | None = None,
    shard_params: bool = False,
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
        step's ``optimizer.update`` writes into the model are the gathered ones.
      param_gather: with ``shard_optimizer``: None (f32 gathers) or
        ``jaxcomm.compression.bf16()`` / ``int8()`` (ZeRO++ qwZ).
      shard_bucket_bytes: with ``shard_optimizer``: the bucket bound of the packed
        gradients and params (64 MiB by default).
      shard_params: hybrid sharding (as ``jaxcomm.data_parallel(shard_params=True)``,
        :mod:`jaxcomm.flax_hybrid`): the model's ``nnx.Param`` s are stored split over the
        innermost data axis (``'intra'``), replicated over the others, and so is the
        optimizer's state (laid out at the first call); the step sees each param gathered
        inside the node, and its ``optimizer.update`` reduce-scatters the gradients
        inside the node and syncs each device's block across nodes. The optimizer is
        ``optax.chain(jaxcomm.sync_gradients(...), *transforms)``.

    Returns:
      A decorator; the decorated step is a :class:`NnxDataParallel`.

    Example:
      >>> @jaxcomm.nnx_data_parallel(mesh)
      ... def train_step(model, optimizer, metrics, batch):
      ...     grads = nnx.grad(loss_fn)(model, batch)
      ...     optimizer.update(model, grads)
    """
    n, axes = check_decorator_args("nnx_data_parallel", mesh, axes, check_replicas)
    name = check_axis_name(axis_name, axes, "nnx_data_parallel")
    shard = shard_options("nnx_data_parallel", shard_optimizer, param_gather, shard_bucket_bytes)
    hybrid = check_shard_params("nnx_data_parallel", shard_params, shard_optimizer, axes)
    options = dict(axes=axes, check_replicas=n, axis_name=name, shard=shard, shard_params=hybrid)
    return lambda fn: NnxDataParallel(FlaxStep(fn, mesh, NnxAdapter(), **options))
