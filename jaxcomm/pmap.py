"""``jax.pmap`` for a Linen train step, data-parallel over the mesh: ``pmap_data_parallel``.

Flax's data-parallel examples are written for ``jax.pmap``: the step names its data axis
(``axis_name='batch'``) in ``nn.BatchNorm``, in ``lax.pmean`` of metrics and batch
statistics; batches come as ``(devices, per_device, ...)`` and metrics go back one row per
device (``common_utils.get_metrics`` reads row 0). The state comes either replicated (one
row per device, ``jax_utils.replicate``, the older form) or unreplicated with
``in_axes=(None, 0), out_axes=(None, 0)`` (Flax's current ImageNet example).
``pmap_data_parallel(mesh)`` returns a function with ``jax.pmap``'s signature that stands in
for it and means the same by its arguments:

- the step runs as under its sibling :func:`jaxcomm.linen_data_parallel`, on the same
  engine (:class:`jaxcomm.flax_step.FlaxStep`: ``jax.shard_map`` over the mesh's data axes,
  ``check_vma=True``), with ``axis_name`` bound to those axes (``jaxcomm.axis_names``): the
  model's SyncBatchNorm and the step's ``lax.pmean`` / ``lax.psum`` over ``'batch'`` are
  the same reductions over every device;
- ``in_axes``: ``0`` for an argument in pmap's layout, ``None`` for one every device takes
  whole. A ``TrainState`` with ``0`` is read from the rows the devices hold (no copy between
  devices; the rows are the same, as ``jax_utils.replicate`` makes them, compared by their
  bits at the first call); with ``None`` it is the state itself. Any other argument with
  ``0`` is split by rows (each device its row), with ``None`` given whole to every device;
- ``out_axes``: ``0`` returns an output one row per device (a ``TrainState`` as rows, a
  value the step ``lax.pmean``-ed repeated, a per-device value gathered), ``None`` returns
  it once (a ``TrainState`` unreplicated; another output must be the same on every device);
- ``donate_argnums`` donates the state's or the batch's buffers, ``static_broadcasted_argnums``
  makes arguments static (one program per value), as for ``jax.pmap``.

What the sync keeps per device (error-feedback residuals, a sharded optimizer's chunks) is
not in the ``TrainState`` the script sees, so that its eval step (``jax.pmap(eval_step,
in_axes=(None, 0))``) and its checkpoint code (a row taken with ``unreplicate``, or orbax's
``fully_replicated_host_local_array_to_global_array``) see only replicated values and lose
nothing. Each such leaf is a small token in the state (``uint32[2]``: a mark and the version
of the values the step object holds); the step object keeps the values
(:meth:`PmapDataParallel.per_device_state`, :meth:`PmapDataParallel.load_per_device_state`),
and a state whose tokens the step object cannot match (a checkpoint restored in a new
process without them, an older state) is refused with that fix, never trained on with the
per-device state reset.

**The optax form.** A script without a ``TrainState`` (``update_fn(params, opt_state, batch,
rng)``, its optimizer ``tx`` closed over) gets the same guarantees. Its state arguments are
named with ``state_argnums=`` or found: the argument holding a ``sync_gradients`` state (the
optimizer state) and every other argument of floating leaves whose rows are the same (as
``jax_utils.replicate`` makes them); each must come back in its own output place. A pmap
step in which no state is seen is refused with that fix. The params are the first of them
(the others, e.g. batch statistics, are model state); they travel through the engine as one
:class:`OptaxState` in the place of a ``TrainState``. The step calls its own ``tx``, so
what the ``TrainState`` form sees through its recording ``tx`` is read here from the state
and the step's jaxpr: an optimizer state with no sync, or with the sync not first in its
chain (after ``clip_by_global_norm``, or last), is refused, and so is a step that keeps its
own ``lax.pmean`` of the gradients. A checkpoint of the unported script resumes through
:func:`jaxcomm.lift_opt_state`. ``donate_argnums`` frees the donated arguments' buffers,
these only, as ``jax.pmap`` does.

The gradient mean is ``jaxcomm.sync_gradients``'s, first in the ``TrainState``'s ``tx``: a
step that still averages the gradients itself (``lax.pmean(grads, 'batch')``) is refused
with that line to delete. Flax's ``DynamicScale`` is kept: inside the step it runs as
:class:`jaxcomm.dynamic_scale.DynamicScale` (the mean left to the sync, one finiteness
decision on every device), and a skipped step's ``jnp.where(is_fin, new_state.params,
state.params)`` is proven the same on every device (:mod:`jaxcomm.same_value`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.training.train_state import TrainState
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.axis_names import check_axis_name
from jaxcomm.flax_step import FlaxFrontEnd, FlaxStep, Rows, check_decorator_args, key_data
from jaxcomm.linen import LinenAdapter
from jaxcomm.mesh import DATA_AXES
from jaxcomm.replicas import check_replicas as compare_replicas
from jaxcomm.sharded import shard_options
from jaxcomm.state import replace_at, varying_axes
from jaxcomm.sync import SyncGradientsState
from jaxcomm.validate import check_int

__all__ = ["OptaxState", "PmapDataParallel", "first_row", "pmap_data_parallel"]

# The first word of a token that stands for per-device state the step object holds.
TOKEN_MARK = 0x6A78434D  # "jxCM"


@struct.dataclass
class OptaxState:
    """The optax form's state arguments (``update_fn(params, opt_state, batch, rng)``, the
    optimizer ``tx`` closed over), held together as one node of the engine, in the place of
    a ``TrainState``: ``params`` are differentiated per device and proven the same on every
    device after the update, ``opt_state`` is replicated but for per-device state (held by
    the step object), ``model_state`` (other state arguments, e.g. batch statistics) is
    averaged where a step makes it differ per device."""

    params: Any
    opt_state: Any
    model_state: tuple = ()


class _Form(NamedTuple):
    """Where the optax form's state arguments are among the step's arguments and outputs."""

    params: int
    opt: int
    model: tuple[int, ...]

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(sorted((self.params, self.opt, *self.model)))


# What the engine takes as state: a TrainState, or the optax form's node.
def _is_state(x: Any) -> bool:
    return isinstance(x, (TrainState, OptaxState))


def _is_sync(x: Any) -> bool:
    return isinstance(x, SyncGradientsState)


def _holds_sync(tree: Any) -> bool:
    return any(_is_sync(x) for x in jax.tree.leaves(tree, is_leaf=_is_sync))


OPTAX_FIX = "tx = optax.chain(jaxcomm.sync_gradients(), tx) (the tx the step closes over)"


class PmapAdapter(LinenAdapter):
    """The pmap entry's state for the engine: ``TrainState`` s (through the Linen
    adapter's recording ``tx``), or the optax form's :class:`OptaxState` (the step calls
    the ``tx`` it closes over: no recording; its sync is seen in its state, and what the
    step makes of the gradients in its jaxpr, :meth:`PmapDataParallel._check_optax_step`)."""

    @staticmethod
    def is_node(a: Any) -> bool:
        return _is_state(a)

    @staticmethod
    def enter(graphdef: Any, states: Any, hooks: Any) -> tuple:
        if any(isinstance(s, OptaxState) for s in states):
            return states, lambda: None, False
        return LinenAdapter.enter(graphdef, states, hooks)


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
                f"{shape}; in pmap's layout (in_axes=0) its leading axis is the "
                f"{num_devices} devices: (devices, per_device, ...), as "
                f"common_utils.shard(batch) or x.reshape({num_devices}, -1, *x.shape[1:]) "
                f"makes it; an argument every device takes whole has in_axes=None."
                f"{_rows_hint()}"
            )


def _check_axes(value: Any, what: str) -> None:
    """Refuses an ``in_axes`` / ``out_axes`` entry other than 0 and None."""
    entries = value if isinstance(value, (tuple, list)) else (value,)
    for a in entries:
        if a is not None and (isinstance(a, bool) or not isinstance(a, int)):
            raise NotImplementedError(
                f"pmap_data_parallel: {what}={value!r}: each entry is 0 (pmap's rows) or "
                "None (whole on every device), one per argument (a tuple) or one for all; "
                "axes per leaf (a dict) and other mapped axes are not implemented."
            )
        if a not in (0, None):
            raise NotImplementedError(
                f"pmap_data_parallel: {what} entry {a!r}: only axis 0 (pmap's rows) and "
                "None are implemented; move the mapped axis first (jnp.moveaxis)."
            )


def _argnums(value: Any, what: str) -> tuple[int, ...]:
    """``value`` (one argument position or several) as a tuple of positions, checked."""
    nums = value if isinstance(value, (tuple, list)) else (value,)
    name = f"pmap_data_parallel({what})"
    return tuple(check_int(name, i, minimum=0, fix="pass argument positions") for i in nums)


def first_row(x: Any) -> Any:
    """Row 0 of ``x`` in pmap's rows, read on one device: the row this process's first
    device holds (every row of a replicated leaf holds the same bits).

    ``x[0]`` of rows sharded over the devices is a program over all of them that sends
    device 0's row to the others, a collective that XLA:CPU's in-process rendezvous can
    abort or deadlock on when several are queued (:mod:`jaxcomm.backend`, 7); this one
    runs on that device alone.

    Example:
      >>> once = jax.tree.map(first_row, state)   # jax_utils.unreplicate, collective-free
    """
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        return x.addressable_shards[0].data[0]
    return x[0]


def _rows_equal(x: jax.Array) -> jax.Array:
    """Whether every row of ``x`` holds row 0's bits (NaNs included)."""
    if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    return jnp.all(x == x[:1])


def _floating(tree: Any) -> bool:
    """Whether ``tree`` has leaves and every one is a floating-point array."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves)


_MEANS = frozenset({"psum", "psum_invariant", "pmean"})


def _reduced_operands(jaxpr: Any, axes: set, seen: set) -> None:
    """Adds to ``seen`` the ``(shape, dtype)`` of every operand of a sum over all of
    ``axes`` in ``jaxpr`` and the jaxprs nested in it (loops, conditionals, calls)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MEANS:
            reduced = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            reduced = set(reduced if isinstance(reduced, (tuple, list)) else (reduced,))
            if axes <= reduced:
                seen.update((tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _reduced_operands(inner, axes, seen)


def _refuse_sync_not_first(name: str, opt_state: Any) -> None:
    """Refuses an optimizer state whose ``sync_gradients`` state is not first in its
    chain (``optax.chain``'s state is a tuple, ``named_chain``'s a dict; a wrapper's
    NamedTuple, e.g. ``inject_hyperparams``', is looked into): what runs before the sync
    runs on each device's own gradients. The step calls the ``tx`` it closes over, so the
    entry cannot probe whether a transform before the sync commutes with the mean, as the
    ``TrainState`` form does; the sync goes first."""

    def walk(node: Any, path: str) -> None:
        if _is_sync(node):
            return
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            for f in node._fields:
                walk(getattr(node, f), f"{path}.{f}")
            return
        if isinstance(node, (tuple, list, dict)):
            items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            for j, (k, x) in enumerate(items):
                if j > 0 and _holds_sync(x):
                    where = "last" if j == len(items) - 1 else f"entry {j}"
                    raise ValueError(
                        f"{name}: jaxcomm.sync_gradients is {where} of the chain at "
                        f"opt_state{path}, not first: the transforms before it (e.g. "
                        "optax.clip_by_global_norm, a momentum) run on each device's own "
                        "gradients, so each device would clip (or accumulate) its own share "
                        "and the result would differ from jax.pmap's. Put the sync first: "
                        f"{OPTAX_FIX}, e.g. optax.chain(jaxcomm.sync_gradients(), "
                        "optax.clip_by_global_norm(1.0), optax.sgd(...))."
                    )
                walk(x, f"{path}[{k!r}]")

    walk(opt_state, "")


class _Held(NamedTuple):
    """The per-device leaves of one ``TrainState`` argument, held by the step object."""

    version: int
    leaves: list  # the stacked leaves (one entry per device), in the state's leaf order
    token: jax.Array  # uint32[2] (mark, version), replicated
    rows: jax.Array | None  # the token in pmap's rows (devices, 2), once returned so


class PmapDataParallel(FlaxFrontEnd):
    """A ``jax.pmap``-style Linen step run data-parallel over a mesh; build it with
    :func:`pmap_data_parallel`.

    A sibling of :class:`jaxcomm.LinenDataParallel` over the same engine and the same
    Linen adapter: it adds pmap's layouts around the engine's call (``in_axes`` and
    ``out_axes``, the user's step on each device's row) and keeps the per-device state out
    of the ``TrainState`` the script sees (see the module docstring)."""

    _name = "pmap_data_parallel"

    def __init__(
        self,
        fn: Callable,
        mesh: Mesh,
        *,
        axes: tuple[str, ...],
        axis_name: str,
        check_replicas: int,
        in_axes: Any = 0,
        out_axes: Any = 0,
        donate_argnums: tuple[int, ...] = (),
        shard: dict | None = None,
        state_argnums: tuple[int, ...] | None = None,
    ):
        _check_axes(in_axes, "in_axes")
        _check_axes(out_axes, "out_axes")
        self._user_fn = fn
        self._in_axes, self._out_axes = in_axes, out_axes
        self._donate = donate_argnums
        self._state_argnums = state_argnums
        self._sharded = shard is not None
        self._form: _Form | None = None  # the optax form's places, found at the first call
        self._optax_checked = False  # the optax form's step was read for a kept mean
        engine = FlaxStep(
            self._body,
            mesh,
            PmapAdapter(self._name, check_batch=_check_rows),
            axes=axes,
            check_replicas=check_replicas,
            axis_name=axis_name,
            shard=shard,
        )
        super().__init__(engine, fn)
        self.axis_name = axis_name
        self._held: dict[int, _Held] = {}  # per TrainState argument (by its position)
        # Per TrainState output (by its place among them): whether the last call returned
        # it in rows; the next call asks the step's program for the same.
        self._rows_out: dict[int, bool] = {}
        self._out_axes_of: dict = {}  # by the outputs' structure: out_axes per output leaf
        self._returned: dict[int, Any] = {}  # per TrainState output: the last one returned
        self._per_of: dict = {}  # by the states' structure: per leaf, stored per device
        self._version = 0
        self._restore_checked = False
        self._same_rows = jax.jit(lambda xs: jnp.all(jnp.stack([_rows_equal(x) for x in xs])))

    def _arg_axes(self, n: int) -> list:
        if not isinstance(self._in_axes, (tuple, list)):
            return [self._in_axes] * n
        if len(self._in_axes) != n:
            raise ValueError(
                f"pmap_data_parallel: in_axes={self._in_axes!r} names {len(self._in_axes)} "
                f"arguments but the step was called with {n}; give one entry per argument, "
                "as for jax.pmap."
            )
        return list(self._in_axes)

    def _flat_out_axes(self, out: Any) -> list:
        """One ``out_axes`` entry per output leaf (a ``TrainState`` counts as one)."""
        axes_def = jax.tree.structure(self._out_axes, is_leaf=lambda x: x is None)
        try:
            subtrees = axes_def.flatten_up_to(out)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"pmap_data_parallel: out_axes={self._out_axes!r} does not match the step's "
                f"outputs ({e}); give one entry per output, e.g. out_axes=(None, 0) for "
                "(state, metrics)."
            ) from None
        flat_axes = jax.tree.leaves(self._out_axes, is_leaf=lambda x: x is None)
        return [
            a
            for a, sub in zip(flat_axes, subtrees, strict=True)
            for _ in jax.tree.leaves(sub, is_leaf=_is_state)
        ]

    # -- inside shard_map ---------------------------------------------------------------
    def _body(self, *args):
        """The user's step on this device's row of each batch argument; its outputs as
        ``out_axes`` says (one row per device, or once)."""
        local = [a if _is_state(a) else jax.tree.map(lambda x: x[0], a) for a in args]
        if self._form is None:
            out = self._user_fn(*local)
        else:  # the optax form: the state arguments in their places, back in one node
            user = self._user_args(local)
            if not self._optax_checked:
                self._check_optax_step(user)
            out = self._pack_outputs(self._user_fn(*user), user)
        flat, treedef = jax.tree.flatten(out, is_leaf=_is_state)

        def row(x, axis):
            if _is_state(x):
                return x
            x = jnp.asarray(x)
            if axis is None and varying_axes(x) & set(self.axes):
                raise ValueError(
                    "pmap_data_parallel: an output with out_axes=None differs across "
                    "devices; jax.pmap would return device 0's value only. Reduce it in the "
                    "step (lax.pmean(x, axis_name)) or give it out_axes=0."
                )
            # Each device's row of a (devices, ...) output (the engine's rows_out): a value
            # the step pmean-ed is the same in every row, as pmap returns it.
            return x[None]

        axes = self._flat_out_axes(out)
        return jax.tree.unflatten(treedef, [row(x, a) for x, a in zip(flat, axes, strict=True)])

    # -- the optax form ------------------------------------------------------------------
    def _user_args(self, args: list) -> list:
        """The step's arguments from the engine's (the node first, then the others)."""
        f = self._form
        node, rest = args[0], iter(args[1:])
        places = {f.params: node.params, f.opt: node.opt_state}
        places.update(zip(f.model, node.model_state, strict=True))
        n = len(args) - 1 + len(f.positions)
        return [places[i] if i in places else next(rest) for i in range(n)]

    def _pack_outputs(self, out: Any, user: list) -> tuple:
        """The step's outputs with its new state in one node at the first state place
        (None at the others); refuses a state argument not returned in its own place."""
        f = self._form
        if not isinstance(out, (tuple, list)) or len(out) <= max(f.positions):
            raise ValueError(
                f"{self._name}: the step takes its state as arguments {list(f.positions)} "
                f"and must return the new state in the same places (as "
                "update_fn(params, opt_state, batch, rng) -> (params, opt_state, ...)); it "
                f"returns {type(out).__name__}. Name the state arguments with "
                "state_argnums=, or return them in their places."
            )
        for i in f.positions:
            got = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), out[i])
            want = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), user[i])
            if got != want:
                raise ValueError(
                    f"{self._name}: argument {i} was taken as state (params, optimizer "
                    "state or model state: its rows are the same and its optimizer holds "
                    f"jaxcomm.sync_gradients), but output {i} is not its new value (another "
                    f"structure, shape or dtype). Name the state arguments: "
                    f"pmap_data_parallel(mesh)(step, state_argnums=...), e.g. (0, 1) for "
                    "update_fn(params, opt_state, batch, rng)."
                )
        node = OptaxState(out[f.params], out[f.opt], tuple(out[i] for i in f.model))
        first = f.positions[0]
        packed = [
            node if i == first else None if i in f.positions else x for i, x in enumerate(out)
        ]
        return type(out)(packed) if isinstance(out, list) else tuple(packed)

    def _unpack_outputs(self, out: Any) -> Any:
        """The call's outputs with the node's state back in the step's places."""
        f = self._form
        node = out[f.positions[0]]
        out = list(out)
        out[f.params], out[f.opt] = node.params, node.opt_state
        for i, x in zip(f.model, node.model_state, strict=True):
            out[i] = x
        return tuple(out)

    def _check_optax_step(self, user: list) -> None:
        """Refuses, from the step's jaxpr, a step that still averages the gradients
        itself: a ``psum`` over every data axis of arrays shaped as each of the params'
        matrices (as ``lax.pmean(grads, 'batch')`` leaves it; ``sync_gradients`` reduces
        flat buffers, never a param's own shape)."""
        params = jax.tree.leaves(user[self._form.params])
        want = [(np.shape(p), jnp.result_type(p)) for p in params if np.ndim(p) >= 2]
        want = want or [(np.shape(p), jnp.result_type(p)) for p in params if np.ndim(p) >= 1]
        seen = set()
        if want:
            _reduced_operands(jax.make_jaxpr(self._user_fn)(*user).jaxpr, set(self.axes), seen)
        if want and all(w in seen for w in want):
            raise ValueError(
                f"{self._name}: the step averages the gradients itself: delete "
                f"lax.pmean(grads, {self.axis_name!r}) (or its jax.tree.map) from the step: "
                "jaxcomm.sync_gradients in the optimizer does the mean (hierarchical, "
                "compressed); with both, a flat all-reduce of the gradients runs on top of "
                "the sync's."
            )
        self._optax_checked = True  # (a refused step is read again at the next call)

    def _classify(self, args: tuple, arg_axes: list) -> _Form:
        """The optax form's state arguments: those ``state_argnums`` names, or those
        found (the one holding a ``sync_gradients`` state, and every other argument of
        floating leaves whose rows are the same, as ``jax_utils.replicate`` makes them);
        the optimizer state is the one holding the sync, the params the first other one.
        """
        n = len(args)
        named = self._state_argnums
        if named is not None:
            bad = [i for i in named if i >= n]
            if bad:
                raise ValueError(
                    f"{self._name}: state_argnums={named} names arguments {bad} but the step "
                    f"was called with {n}."
                )
            positions = sorted(set(named))
            opt = [i for i in positions if _holds_sync(args[i])]
            if not opt:
                raise ValueError(
                    f"{self._name}: none of the state arguments {positions} holds a "
                    "jaxcomm.sync_gradients state: the optimizer never synchronises the "
                    "gradients, so every device would train on its own share. Put the sync "
                    f"first in the optimizer the step closes over: {OPTAX_FIX}, and pass "
                    "its opt_state (tx.init(params))."
                )
        else:
            opt = [i for i, a in enumerate(args) if _holds_sync(a)]
            if not opt:
                raise ValueError(
                    f"{self._name}: the step takes no TrainState and no argument holding a "
                    "jaxcomm.sync_gradients state, so jaxcomm cannot see its state (params, "
                    "optimizer state): it would treat every argument as batch rows and "
                    "check nothing. Put the sync first in the optimizer the step closes "
                    f"over ({OPTAX_FIX}) and pass its opt_state, or name the state "
                    "arguments: pmap_data_parallel(mesh)(update_fn, state_argnums=(0, 1), "
                    "...) for update_fn(params, opt_state, batch, rng)."
                )
            positions = sorted(
                {*opt}
                | {
                    i
                    for i, a in enumerate(args)
                    if i not in opt
                    and _floating(a)
                    and (arg_axes[i] is None or self._rows_identical(a))
                }
            )
        if len(opt) > 1:
            raise NotImplementedError(
                f"{self._name}: arguments {opt} each hold a jaxcomm.sync_gradients state; "
                "the optax form takes one optimizer state."
            )
        others = [i for i in positions if i != opt[0]]
        if not others:
            raise ValueError(
                f"{self._name}: found the optimizer state (argument {opt[0]}) but no params "
                "argument (floating leaves, the same rows on every device); name them: "
                "state_argnums=(0, 1) for update_fn(params, opt_state, batch, rng)."
            )
        for i in others:
            if not _floating(args[i]):
                raise ValueError(
                    f"{self._name}: state argument {i} holds leaves that are not floating "
                    "point (a random key, a count): state other than the optimizer's is "
                    "params or model state; pass keys and other values as ordinary "
                    "arguments (leave them out of state_argnums)."
                )
        if len({arg_axes[i] for i in positions}) > 1:
            raise NotImplementedError(
                f"{self._name}: the state arguments {positions} have in_axes "
                f"{[arg_axes[i] for i in positions]}; give them all 0 (rows) or all None."
            )
        if isinstance(self._out_axes, (tuple, list)):
            outs = {self._out_axes[i] for i in positions if i < len(self._out_axes)}
            if len(outs) > 1:
                raise NotImplementedError(
                    f"{self._name}: the state arguments {positions} have out_axes "
                    f"{[self._out_axes[i] for i in positions]}; give their outputs all 0 "
                    "(rows) or all None."
                )
        if self._sharded:
            raise NotImplementedError(
                f"{self._name}(shard_optimizer=True): the optax form (tx closed over) is not "
                "implemented sharded: the sharded step runs the optimizer's chain itself. "
                "Use a TrainState, or shard_optimizer=False."
            )
        _refuse_sync_not_first(self._name, args[opt[0]])
        self.engine.adapter.fix = OPTAX_FIX
        return _Form(others[0], opt[0], tuple(others[1:]))

    def _rows_identical(self, a: Any) -> bool:
        """Whether every leaf of ``a`` is in pmap's rows and its rows hold the same bits."""
        leaves = jax.tree.leaves(a)
        if not leaves or any(not np.shape(x) or np.shape(x)[0] != self.num_devices for x in leaves):
            return False
        return bool(self._same_rows(leaves))

    def _group(self, args: tuple, arg_axes: list) -> tuple[list, list]:
        """The engine's arguments (the state's node first) and their ``in_axes``."""
        f = self._form
        if len(args) <= max(f.positions):
            raise ValueError(
                f"{self._name}: the step's state is arguments {list(f.positions)} but it "
                f"was called with {len(args)} arguments."
            )
        node = OptaxState(args[f.params], args[f.opt], tuple(args[i] for i in f.model))
        rest = [i for i in range(len(args)) if i not in f.positions]
        return [node, *[args[i] for i in rest]], [
            arg_axes[f.positions[0]],
            *[arg_axes[i] for i in rest],
        ]

    # -- the TrainState arguments ---------------------------------------------------------
    def _check_rows(self, state: TrainState, per: list[bool]) -> None:
        """Refuses a state in pmap's rows (``in_axes=0``) with a leaf, not per device,
        whose leading axis is not the devices. The step's program reads the rows as
        replicas (no program of their own, :class:`jaxcomm.flax_step.Rows`)."""
        n = self.num_devices
        for j, (x, f) in enumerate(zip(jax.tree.leaves(state), per, strict=True)):
            shape = np.shape(x)
            if not f and (not shape or shape[0] != n):
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(state)[0][j][0])
                raise ValueError(
                    f"{self._name}: TrainState leaf {path} has shape {shape}; in pmap's "
                    f"layout (in_axes=0) every leaf has a leading axis of the "
                    f"{n} devices. Pass jax_utils.replicate(state), as for "
                    f"jax.pmap, or the state itself with in_axes=None.{_rows_hint()}"
                )

    def _read_state(self, state: TrainState, per: list[bool]) -> TrainState:
        """A state in pmap's rows as the state itself (per-device leaves kept), by a
        program of its own in which each device reads its own row."""
        leaves, treedef = jax.tree.flatten(state)
        idx = [i for i, f in enumerate(per) if not f]
        return jax.tree.unflatten(treedef, replace_at(leaves, idx, self.engine.read_rows))

    def _token_version(self, x: Any) -> int | None:
        """The version a token stands for; None if ``x`` is not a token. A restore may have
        cast the token to the dtype of the leaf it replaced (Flax's ``restore_checkpoint``
        casts to its target's): the mark is matched to within bfloat16's precision."""
        if np.shape(x) not in ((2,), (self.num_devices, 2)):
            return None
        value = np.asarray(x).astype(np.float64).reshape(-1, 2)[0]
        if not abs(value[0] - TOKEN_MARK) <= TOKEN_MARK * 2.0**-7:
            return None
        return int(round(value[1]))

    def _with_held(self, k: int, state: TrainState, per: list[bool] | None) -> tuple:
        """``(state, per)``: the state with its tokens replaced by the held per-device
        leaves, and which leaves are per device (the step's layout once it is built, else
        the tokens' places)."""
        if per is not None and not any(per):
            return state, per  # no leaf is per device: no token to find
        leaves, treedef = jax.tree.flatten(state)
        held = self._held.get(k)

        def version(x: Any, may: bool) -> int | None:
            if not may:
                return None
            if held is not None and (x is held.token or x is held.rows):
                return held.version  # the state this object returned: no read
            return self._token_version(x)

        may = per if per is not None else [True] * len(leaves)
        versions = [version(x, m) for x, m in zip(leaves, may, strict=True)]
        marked = [v is not None for v in versions]
        per = per if per is not None else marked
        if not any(marked):
            return state, per
        found = sorted({v for v in versions if v is not None})
        if held is None or found != [held.version] or sum(marked) != len(held.leaves):
            have = "nothing" if held is None else f"version {held.version}"
            raise ValueError(
                f"{self._name}: this TrainState's per-device state (error-feedback residuals, "
                "a sharded optimizer's chunks) is kept by the step object, not in the state; "
                f"the state stands for version {found} and the step object holds {have}. "
                "A checkpoint of the state needs the step's own: save "
                "p_train_step.per_device_state() beside it and, after restoring the state, "
                "call p_train_step.load_per_device_state(saved) before the first step; or "
                "pass the state the step returned last. Training on with the per-device "
                "state reset would lose it silently."
            )
        it = iter(held.leaves)
        leaves = [next(it) if m else x for x, m in zip(leaves, marked, strict=True)]
        return jax.tree.unflatten(treedef, leaves), per

    def _keep_held(
        self, k: int, state: TrainState, per: list[bool], rows: bool, given: bool
    ) -> TrainState:
        """The returned state with its per-device leaves held here and a token in their
        place (in pmap's rows with ``rows``); the other leaves as ``out_axes`` says
        (``given``: whether the step's program returned them as rows)."""
        if rows == given and not any(per):
            return state
        leaves, treedef = jax.tree.flatten(state)
        if rows != given:  # (a call whose out_axes changed) by a program of their own
            idx = [i for i, f in enumerate(per) if not f]
            leaves = replace_at(
                leaves, idx, self.engine.write_rows if rows else self.engine.read_rows
            )
        if any(per):
            self._version += 1
            held = self._token(self._version, [x for x, f in zip(leaves, per, strict=True) if f])
            if rows:
                token_rows = np.tile(
                    np.array([TOKEN_MARK, self._version], np.uint32), (self.num_devices, 1)
                )
                held = held._replace(
                    rows=jax.device_put(token_rows, NamedSharding(self.mesh, P(self.axes)))
                )
            self._held[k] = held
            place = held.rows if rows else held.token
            leaves = [place if f else x for x, f in zip(leaves, per, strict=True)]
        return jax.tree.unflatten(treedef, leaves)

    def _token(self, version: int, leaves: list) -> _Held:
        """Held leaves and their token (``uint32[2]``: the mark and ``version``)."""
        token = jax.device_put(
            np.array([TOKEN_MARK, version], np.uint32), NamedSharding(self.mesh, P())
        )
        return _Held(version, leaves, token, None)

    def per_device_state(self) -> dict:
        """What the step object holds per device, to save beside the script's checkpoint.

        Returns:
          ``{'state_<k>': {'version': uint32[], 'leaves': [...]}}`` for the ``k``-th
          ``TrainState`` argument: global arrays (one entry per device along the first
          axis), for ``orbax.checkpoint`` or ``flax.training.checkpoints``. Empty when the
          sync keeps nothing per device.

        Example:
          >>> checkpoints.save_checkpoint(workdir, state, step)
          >>> with ocp.StandardCheckpointer() as checkpointer:
          ...     checkpointer.save(f'{workdir}/per_device_{step}',
          ...                       p_train_step.per_device_state())
        """
        return {
            f"state_{k}": {"version": np.uint32(h.version), "leaves": list(h.leaves)}
            for k, h in sorted(self._held.items())
        }

    def load_per_device_state(self, saved: dict) -> None:
        """Loads what :meth:`per_device_state` returned (from a checkpoint), so that a
        restored ``TrainState`` whose tokens stand for that version trains on.

        Args:
          saved: the dict :meth:`per_device_state` returned, its arrays restored (numpy or
            jax arrays, one entry per device along the first axis).

        Raises:
          ValueError: an entry's leaves do not have one entry per device.
        """
        sharding = NamedSharding(self.mesh, P(self.axes))
        for key, entry in saved.items():
            k = int(str(key).removeprefix("state_"))
            leaves = list(entry["leaves"])
            for x in leaves:
                if not np.shape(x) or np.shape(x)[0] != self.num_devices:
                    raise ValueError(
                        f"{self._name}.load_per_device_state: a leaf of {key} has shape "
                        f"{np.shape(x)}; each has one entry per device ({self.num_devices}) "
                        "first: load what per_device_state() saved on this many devices."
                    )
            version = int(np.asarray(entry["version"]))
            self._held[k] = self._token(version, [jax.device_put(x, sharding) for x in leaves])
            self._version = max(self._version, version)

    def _refuse_dropped_optimizer_state(self, state: TrainState) -> None:
        """Refuses, at the first call, a state trained for steps whose optimizer state is
        the one ``tx.init`` gives: a restore that kept the params and step but not the
        optimizer state (Flax's ``restore_checkpoint`` logs that at INFO level only)."""
        if int(np.asarray(jax.device_get(state.step)).reshape(-1)[0]) == 0:
            return
        fresh = jax.tree.leaves(jax.jit(state.tx.init)(state.params))
        given = jax.tree.leaves(state.opt_state)
        floats = [x for x in fresh if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
        if not floats or len(fresh) != len(given):
            return
        same = all(
            np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))
            for a, b in zip(fresh, given, strict=True)
        )
        if same:
            raise ValueError(
                f"{self._name}: the TrainState is at step {int(np.asarray(state.step))} but its "
                "optimizer state is the one tx.init gives (zero momentum, counts at 0): a "
                "checkpoint restore kept the params and the step but not the optimizer state "
                "(flax.training.checkpoints logs that at INFO level). Restore into a target "
                "state whose opt_state has the saved structure (the same tx, "
                "jaxcomm.sync_gradients() first), or start from step 0. A checkpoint of the "
                "unported script (its tx without the sync) has another structure: restore "
                "it without a target and lift its optimizer state into tx's, "
                "jaxcomm.lift_opt_state(old_opt_state, tx, params)."
            )

    def drive_inputs(self, *args):
        """Refuses ``jaxcomm.CommProfiler.drive``: it reads and times the step's state in
        the global layout, not in pmap's per-device rows."""
        raise TypeError(
            "CommProfiler.drive does not drive a pmap_data_parallel step (its state comes "
            "and goes in pmap's layouts); decorate the step with "
            "jaxcomm.linen_data_parallel(mesh, axis_name=...) and pass the state unreplicated "
            "and the global batch to drive it."
        )

    def __call__(self, *args):
        """Runs the step on arguments laid out as ``in_axes`` says; returns the outputs laid
        out as ``out_axes`` says."""
        arg_axes = self._arg_axes(len(args))
        user_args = args
        if self._form is None and not any(_is_state(a) for a in args):
            self._form = self._classify(args, arg_axes)
        if self._form is not None:
            args, arg_axes = self._group(args, arg_axes)
        layouts = iter(self._layouts([a for a in args if _is_state(a)]))
        inputs = []
        rows_in: list[bool] = []  # per state leaf: the step's program reads its rows
        rows_out: list[bool] = []  # per new state leaf: the step's program writes rows
        out_rows: list[bool] = []  # the same per state
        guess = None if isinstance(self._out_axes, (tuple, list)) else self._out_axes
        k = 0
        for a, axis in zip(args, arg_axes, strict=True):
            if not _is_state(a):
                if axis is None:  # every device takes it whole: one row each
                    a = jax.tree.map(self._one_row_each, a)
                inputs.append(a)
                continue
            per = next(layouts)
            first = per is None
            a, per = self._with_held(k, a, per)
            seen = a  # the state itself (its replicas, where it comes in rows)
            if axis == 0:
                if a is not self._returned.get(k):  # (the rows this entry returned passed)
                    self._check_rows(a, per)
                if first:
                    # The rows are taken as replicas unchecked; once, compare them by their
                    # bits (a state whose rows differ would otherwise train apart silently).
                    seen = self._read_state(a, per)
                    compare_replicas(
                        key_data(seen), mesh=self.mesh, what=f"{self._name}: the TrainState rows "
                    )
                    if self._sharded:  # its optimizer state is laid out from the replicas
                        a = seen
            if not self._restore_checked and isinstance(seen, TrainState):
                self._refuse_dropped_optimizer_state(seen)
            inputs.append(a)
            rows_in += [axis == 0 and not (first and self._sharded)] * len(per)
            out_rows.append(self._rows_out.get(k, guess == 0))
            rows_out += [out_rows[-1]] * len(per)
            k += 1
        self._restore_checked = True
        deleted = self._set_donation(user_args, args)
        asked = Rows(tuple(rows_in), tuple(rows_out)) if any(rows_in) or any(rows_out) else None
        out = self.engine(*inputs, rows=asked)
        flat, treedef = jax.tree.flatten(out, is_leaf=_is_state)
        # Outputs come one row per device as the step made them; out_axes=None: each
        # device's own row (the same on every device: the step refuses another).
        if treedef not in self._out_axes_of:  # read once per structure of the outputs
            self._out_axes_of[treedef] = self._flat_out_axes(out)
        flat_axes = self._out_axes_of[treedef]
        idx = [i for i, a in enumerate(flat_axes) if a is None and not _is_state(flat[i])]
        flat = replace_at(flat, idx, self.engine.read_rows)
        layouts = iter(self._layouts([x for x in flat if _is_state(x)]))
        k, given = 0, iter(out_rows)
        for i, (x, a) in enumerate(zip(flat, flat_axes, strict=True)):
            if _is_state(x):
                flat[i] = self._keep_held(k, x, next(layouts), rows=a == 0, given=next(given))
                self._rows_out[k] = a == 0
                self._returned[k] = flat[i]
                k += 1
        out = jax.tree.unflatten(treedef, flat)
        if self._form is not None:
            out = self._unpack_outputs(out)
        # Donated state arguments the engine did not take over (the optax form donating
        # some of its state arguments): invalid after the call, as under jax.pmap.
        returned = {id(x) for x in jax.tree.leaves(out)} if deleted else set()
        for x in deleted:
            if id(x) not in returned and not x.is_deleted():
                x.delete()
        return out

    def _layouts(self, states: list) -> list:
        """Per ``TrainState``: which of its leaves the compiled step stores per device
        (None each before the step is built)."""
        treedef = jax.tree.structure(tuple(states))
        per = self._per_of.get(treedef)
        if per is None:
            per = self.engine.per_device_flags(treedef)
        if per is None:
            return [None] * len(states)
        self._per_of[treedef] = per  # a built step's layout does not change
        out, it = [], iter(per)
        for st in states:
            out.append([next(it) for _ in jax.tree.leaves(st)])
        return out

    def _one_row_each(self, x: Any) -> np.ndarray:
        """An ``in_axes=None`` value as pmap's rows: each device takes it whole."""
        return np.broadcast_to(np.asarray(x), (self.num_devices, *np.shape(x)))

    def _set_donation(self, user_args: tuple, args: tuple) -> list:
        """Tells the engine which of its inputs (the state's leaves, the batch) are
        donated, from ``donate_argnums``; returns the arrays of donated state arguments
        the engine does not take (some of the optax form's state arguments), to delete
        after the call."""
        if not self._donate:
            return []
        donated = set(self._donate)
        if donated - set(range(len(user_args))):
            raise ValueError(
                f"pmap_data_parallel: donate_argnums={self._donate} names arguments the step "
                f"was not called with ({len(user_args)} arguments)."
            )
        later: list = []
        if self._form is not None:  # the engine's arguments: the node, then the others
            places = self._form.positions
            rest = [i for i in range(len(user_args)) if i not in places]
            mine = donated & set(places)
            # jax.pmap frees the donated arguments' buffers, these and no others: so do
            # we after the call (the engine runs on replicas read from rows); the engine
            # donates the node's leaves only when every state argument is donated.
            later = [
                x
                for i in sorted(mine)
                for x in jax.tree.leaves(user_args[i])
                if isinstance(x, jax.Array)
            ]
            donated = {0} if mine == set(places) else set()
            donated |= {1 + rest.index(i) for i in set(self._donate) & set(rest)}
        states = {i for i, a in enumerate(args) if _is_state(a)}
        batch = set(range(len(args))) - states
        parts = []
        for group, what in ((states, "TrainState"), (batch, "batch")):
            if donated & group and not group <= donated:
                raise NotImplementedError(
                    f"pmap_data_parallel: donate_argnums={self._donate} donates some of the "
                    f"{what} arguments {sorted(group)} but not all; donate all or none."
                )
            parts.append(bool(group) and group <= donated)
        self.engine.donate = tuple(parts)
        return later


class _StaticArgs:
    """``static_broadcasted_argnums``: one :class:`PmapDataParallel` per value of the static
    arguments (as ``jax.pmap`` compiles one program per value)."""

    def __init__(
        self,
        fn: Callable,
        static: tuple[int, ...],
        make: Callable,
        in_axes: Any,
        donate: tuple[int, ...],
        state: tuple[int, ...] | None = None,
    ):
        self._fn, self._static, self._make = fn, tuple(sorted(static)), make
        self._in_axes, self._donate, self._state = in_axes, donate, state
        self._steps: dict = {}

    def __call__(self, *args):
        missing = [i for i in self._static if i >= len(args)]
        if missing:
            raise ValueError(
                f"pmap_data_parallel: static_broadcasted_argnums={self._static} but the step "
                f"was called with {len(args)} arguments."
            )
        key = tuple(args[i] for i in self._static)
        try:
            hash(key)
        except TypeError:
            raise ValueError(
                f"pmap_data_parallel: static arguments {self._static} must be hashable, as "
                f"for jax.pmap; got {[type(v).__name__ for v in key]}."
            ) from None
        if key not in self._steps:
            static = dict(zip(self._static, key, strict=True))

            def fn(*dynamic):
                it = iter(dynamic)
                full = [static[i] if i in static else next(it) for i in range(len(args))]
                return self._fn(*full)

            keep = [i for i in range(len(args)) if i not in static]
            in_axes = self._in_axes
            if isinstance(in_axes, (tuple, list)):
                in_axes = tuple(in_axes[i] for i in keep)
            donate = tuple(keep.index(i) for i in self._donate if i in keep)
            state = None if self._state is None else tuple(keep.index(i) for i in self._state)
            self._steps[key] = self._make(fn, in_axes, donate, state)
        return self._steps[key](*[a for i, a in enumerate(args) if i not in self._static])


def pmap_data_parallel(
    mesh: Mesh,
    *,
    axis_name: str | None = None,
    axes: tuple[str, ...] = DATA_AXES,
    check_replicas: int | None = None,
    shard_optimizer: bool = False,
    param_gather: Any = None,
    shard_bucket_bytes: int | None = None,
) -> Callable[..., Any]:
    """``jax.pmap`` for a Linen train step, data-parallel over ``mesh``.

    ``jaxcomm.pmap_data_parallel(mesh)`` takes what ``jax.pmap`` takes and means the same
    by it (see the module docstring), so a script's ``jax.pmap(`` becomes
    ``jaxcomm.pmap_data_parallel(mesh)(``. Two more lines change: the ``TrainState``'s
    ``tx`` starts with ``jaxcomm.sync_gradients()``, and the step's own
    ``lax.pmean(grads, axis_name)`` goes (the sync does the mean; a step that keeps it is
    refused with that fix). Flax's ``DynamicScale``, the eval step (``jax.pmap`` as it
    was) and the checkpoint code stay.

    Args:
      mesh: from :func:`jaxcomm.make_mesh`.
      axis_name: the pmap axis name, here or (as for ``jax.pmap``) in the call.
      axes: data-parallel axes of ``mesh``; device ``i`` of ``axis_name`` (row ``i`` of
        every pmap-layout argument and output) is device ``i`` of ``axes`` flattened.
      check_replicas: every this many steps, compare every replicated leaf across devices
        by its bits; 0/None: off.
      shard_optimizer, param_gather, shard_bucket_bytes: sharded optimizer state, as
        :func:`jaxcomm.linen_data_parallel`'s; the chunks are held by the step object
        (:meth:`PmapDataParallel.per_device_state`). Not with the optax form.

    Returns:
      ``pmap(fun, axis_name=None, *, in_axes=0, out_axes=0, static_broadcasted_argnums=(),
      donate_argnums=(), state_argnums=None)``, returning a :class:`PmapDataParallel` (one
      per value of the static arguments, if any). ``state_argnums``: the optax form's state
      arguments (params, the optimizer state, other model state), each returned in its own
      place; None: a ``TrainState`` argument, or the state found (module docstring).
      ``devices``, ``backend`` and ``axis_size`` are refused: the mesh says them.

    Example:
      >>> p_train_step = jaxcomm.pmap_data_parallel(jaxcomm.make_mesh())(
      ...     functools.partial(train_step, learning_rate_fn=learning_rate_fn),
      ...     in_axes=(None, 0), out_axes=(None, 0), axis_name='batch')
      >>> state, metrics = p_train_step(state, batch)    # batch: (devices, per_device, ...)

      The optax form (``tx = optax.chain(jaxcomm.sync_gradients(), tx)`` closed over):

      >>> p_update = jaxcomm.pmap_data_parallel(mesh)(update_fn, axis_name='batch',
      ...                                             donate_argnums=(0,))
      >>> params, opt_state, loss, rng = p_update(params, opt_state, batch, rng)
    """
    n, axes = check_decorator_args("pmap_data_parallel", mesh, axes, check_replicas)
    default_name = check_axis_name(axis_name, axes, "pmap_data_parallel")
    shard = shard_options("pmap_data_parallel", shard_optimizer, param_gather, shard_bucket_bytes)

    def pmap(
        fun: Callable,
        axis_name: str | None = None,
        *,
        in_axes: Any = 0,
        out_axes: Any = 0,
        static_broadcasted_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
        state_argnums: int | Sequence[int] | None = None,
        devices: Any = None,
        backend: Any = None,
        axis_size: Any = None,
    ) -> Any:
        for arg, value in (("devices", devices), ("backend", backend), ("axis_size", axis_size)):
            if value is not None:
                raise TypeError(
                    f"pmap_data_parallel(mesh)(..., {arg}={value!r}): the mesh gives the "
                    "devices; leave it out (build the mesh from those devices: "
                    "jaxcomm.make_mesh(devices=...))."
                )
        name = check_axis_name(axis_name, axes, "pmap_data_parallel") or default_name
        if name is None:
            raise TypeError(
                "pmap_data_parallel: pass the name the script gave jax.pmap, "
                "pmap_data_parallel(mesh)(train_step, axis_name='batch')."
            )
        if default_name is not None and axis_name is not None and axis_name != default_name:
            raise ValueError(
                f"pmap_data_parallel(axis_name={default_name!r})(..., axis_name={axis_name!r}): "
                "two names for one axis; give it once."
            )
        _check_axes(in_axes, "in_axes")
        _check_axes(out_axes, "out_axes")
        static = _argnums(static_broadcasted_argnums, "static_broadcasted_argnums")
        donate = _argnums(donate_argnums, "donate_argnums")
        state = None if state_argnums is None else _argnums(state_argnums, "state_argnums")
        if state is not None and set(state) & set(static):
            raise ValueError(
                f"pmap_data_parallel: arguments {sorted(set(state) & set(static))} are both "
                "static and state; state is arrays."
            )
        if set(static) & set(donate):
            raise ValueError(
                f"pmap_data_parallel: arguments {sorted(set(static) & set(donate))} are both "
                "static and donated; a static argument has no buffer to donate."
            )

        def make(fn, fn_in_axes, fn_donate, fn_state=state):
            return PmapDataParallel(
                fn,
                mesh,
                axes=axes,
                axis_name=name,
                check_replicas=n,
                in_axes=fn_in_axes,
                out_axes=out_axes,
                donate_argnums=fn_donate,
                shard=shard,
                state_argnums=fn_state,
            )

        if static:
            return _StaticArgs(fun, static, make, in_axes, donate, state)
        return make(fun, in_axes, donate)

    return pmap
