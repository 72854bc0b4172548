"""Flax data parallelism for Linen: ``@jaxcomm.linen_data_parallel(mesh)`` on a step on
``flax.training.train_state.TrainState``.

A sibling of :func:`jaxcomm.nnx_data_parallel` over the same engine
(:class:`jaxcomm.flax_step.FlaxStep`); this module holds what differs for a ``TrainState``:
its leaves are kept by field: ``params`` (each device differentiates its own copy; the
new params are the old plus the optimizer's synchronised update, proven invariant),
``opt_state`` (replicated except ``jaxcomm.PerDevice`` state), key fields (typed keys,
and legacy raw ``uint32`` keys in a field whose name says ``key`` or ``rng``, folded with
the device index; a raw-key-shaped ``uint32`` field with another name is refused), and the
rest (``batch_stats``: float fields a step makes differ per device are averaged).

While the step traces, each ``TrainState`` it receives is of a subclass of its own class
whose ``apply_gradients`` is Flax's (``tx.update``, then the updates applied to the
params) with the updates added to the invariant old params
(:meth:`jaxcomm.flax_step.Recording.apply_updates`): params the step changes after
``apply_gradients`` (``state.replace(params=...)``) are kept and proven the same on every
device. (A ``TrainState`` subclass that overrides ``apply_gradients`` keeps its own, and
its params come out per device: refused.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training.train_state import TrainState
from jax.sharding import Mesh

from jaxcomm.axis_names import check_axis_name
from jaxcomm.dynamic_scale import DynamicScale
from jaxcomm.flax_hybrid import check_shard_params
from jaxcomm.flax_step import (
    KEY,
    OPT,
    OTHER,
    PARAM,
    FlaxFrontEnd,
    FlaxStep,
    Recording,
    Split,
    TraceHooks,
    check_decorator_args,
    plain_path,
)
from jaxcomm.mesh import DATA_AXES
from jaxcomm.sharded import shard_options

__all__ = ["LinenAdapter", "LinenDataParallel", "linen_data_parallel"]


class _Slot:
    """Where a returned ``TrainState`` goes back in the step's output."""


jax.tree_util.register_pytree_node(_Slot, lambda _: ((), None), lambda *_: _Slot())


def _linen_kind(path: tuple, x: Any) -> str:
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        return KEY
    field = plain_path(path[1:2])[0]
    kind = {"params": PARAM, "opt_state": OPT}.get(field, OTHER)
    if kind == OTHER and _raw_key_like(x):
        # A legacy raw key (jax.random.PRNGKey): folded per device like a typed one, or
        # every device would draw the same dropout mask. Only a name says it is a key.
        name = ".".join(str(k) for k in plain_path(path[1:]))
        if "key" in name.lower() or "rng" in name.lower():
            return KEY
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


def _apply_gradients(self: TrainState, *, grads: Any, **kwargs: Any) -> TrainState:
    """``TrainState.apply_gradients`` as Flax documents it (``tx.update``, then the updates
    applied to the params), with the updates applied by the step's
    :class:`~jaxcomm.flax_step.Recording` (its ``tx`` while the step traces): to the
    invariant old params, so the new params are typed the same on every device."""
    overwrite = OVERWRITE_WITH_GRADIENT in grads
    trained = grads["params"] if overwrite else grads
    params = self.params["params"] if overwrite else self.params
    updates, new_opt_state = self.tx.update(trained, self.opt_state, params)
    new_params = self.tx.apply_updates(params, updates)
    if overwrite:  # the gradients themselves are the new values of these
        new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)


_RECORDING_CLASSES: dict[type, type] = {}


def _recording_state(state: TrainState, hooks: TraceHooks, index: int) -> TrainState:
    """``state`` with its ``tx`` recording through ``hooks``, as an instance of a subclass
    of its class whose ``apply_gradients`` updates from the invariant old params (unless
    its class overrides ``apply_gradients``)."""
    state = state.replace(tx=Recording(state.tx, hooks, index, lambda s=state: s.step))
    cls = type(state)
    if cls.apply_gradients is not TrainState.apply_gradients:
        return state
    if cls not in _RECORDING_CLASSES:
        attrs = {"apply_gradients": _apply_gradients, "__module__": cls.__module__}
        _RECORDING_CLASSES[cls] = struct.dataclass(type(cls.__name__, (cls,), attrs))
    fields = {f.name: _in_step(getattr(state, f.name)) for f in dataclasses.fields(state) if f.init}
    return _RECORDING_CLASSES[cls](**fields)


def _in_step(value: Any) -> Any:
    """A field's value as the step sees it: Flax's ``DynamicScale`` as
    :class:`jaxcomm.dynamic_scale.DynamicScale` (the same fields; its ``value_and_grad``
    leaves the gradient mean to the sync and takes one finiteness decision on every
    device), anything else as it is."""
    if type(value) is flax_dynamic_scale.DynamicScale:
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        return DynamicScale(**fields)
    return value


class LinenAdapter:
    """Linen ``TrainState`` s for the engine (:class:`jaxcomm.flax_step.Adapter`): leaves by
    field, new states returned by the step.

    Args:
      name: the decorator's name in messages.
      check_batch: refuses a batch its front end's layout cannot take (the pmap
        layout's: the batch in rows, the outputs each device's row); default: the global
        batch (a pmap-shaped one is refused), the outputs combined.
    """

    fix = "TrainState.create(..., tx=optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-3)))"

    def __init__(self, name: str = "linen_data_parallel", check_batch: Callable | None = None):
        self.name = name
        self._check_batch = check_batch
        self.global_batch = check_batch is None
        self.rows_out = not self.global_batch  # pmap's layout: outputs one row per device
        self._kinds: dict = {}

    @staticmethod
    def is_node(a: Any) -> bool:
        return isinstance(a, TrainState)

    def split(self, objs: tuple) -> Split:
        leaves, treedef = jax.tree.flatten(objs)
        # A leaf's kind follows from its path, dtype and shape: found once per structure.
        key = (treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))
        if key not in self._kinds:
            flat = jax.tree_util.tree_flatten_with_path(objs)[0]
            self._kinds[key] = tuple(_linen_kind(p, x) for p, x in flat)
        return Split(None, leaves, treedef, self._kinds[key])

    @staticmethod
    def enter(graphdef: Any, states: Any, hooks: TraceHooks) -> tuple:
        del graphdef
        states = tuple(_recording_state(s, hooks, i) for i, s in enumerate(states))
        return states, lambda: None, bool(states)

    def exit(self, objs: tuple, out: Any) -> tuple[list, Any]:
        is_state = self.is_node
        new = [x for x in jax.tree.leaves(out, is_leaf=is_state) if is_state(x)]
        if len(new) != len(objs):
            raise ValueError(
                f"{self.name}: the step takes {len(objs)} TrainState(s) and returns "
                f"{len(new)}; return each new state, e.g. (state, metrics)."
            )
        rest = jax.tree.map(lambda x: _Slot() if is_state(x) else x, out, is_leaf=is_state)
        return jax.tree.leaves(tuple(new)), rest

    @staticmethod
    def write_back(objs: tuple, split: Split, new: list, out: Any) -> Any:
        it = iter(jax.tree.unflatten(split.treedef, new))
        return jax.tree.map(
            lambda x: next(it) if isinstance(x, _Slot) else x,
            out,
            is_leaf=lambda x: isinstance(x, _Slot),
        )

    @staticmethod
    def optimizers(objs: tuple) -> list[tuple]:
        return [(i, s.tx, s.params, s.opt_state) for i, s in enumerate(objs)]

    @staticmethod
    def with_opt_state(objs: tuple, i: int, opt_state: Any) -> tuple:
        return (*objs[:i], objs[i].replace(opt_state=opt_state), *objs[i + 1 :])

    @staticmethod
    def opt_states(objs: tuple) -> list[tuple[tuple, Any]]:
        return [((i, "opt_state"), s.opt_state) for i, s in enumerate(objs)]

    @staticmethod
    def leaf_key(path: tuple) -> tuple:
        return path

    @staticmethod
    def laid_out(objs: tuple) -> Any:
        return objs[0] if len(objs) == 1 else objs

    def check_batch(self, data: Any, num_devices: int) -> None:
        if self._check_batch is not None:
            self._check_batch(data, num_devices)


class LinenDataParallel(FlaxFrontEnd):
    """A data-parallel Linen step on ``flax.training.train_state.TrainState``; build it with
    :func:`linen_data_parallel`."""


def linen_data_parallel(
    mesh: Mesh,
    *,
    axes: tuple[str, ...] = DATA_AXES,
    check_replicas: int | None = None,
    axis_name: str | None = None,
    shard_optimizer: bool = False,
    param_gather: Any = None,
    shard_bucket_bytes: int | None = None,
    shard_params: bool = False,
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
      shard_params: hybrid sharding, as :func:`nnx_data_parallel`'s: ``state.params``
        and ``state.opt_state`` are stored split over ``'intra'``.

    Returns:
      A decorator; the decorated step is a :class:`LinenDataParallel`.

    Example:
      >>> @jaxcomm.linen_data_parallel(mesh)
      ... def train_step(state, batch):
      ...     grads = jax.grad(loss_fn)(state.params, batch)
      ...     return state.apply_gradients(grads=grads), {}
    """
    n, axes = check_decorator_args("linen_data_parallel", mesh, axes, check_replicas)
    name = check_axis_name(axis_name, axes, "linen_data_parallel")
    shard = shard_options("linen_data_parallel", shard_optimizer, param_gather, shard_bucket_bytes)
    hybrid = check_shard_params("linen_data_parallel", shard_params, shard_optimizer, axes)
    options = dict(axes=axes, check_replicas=n, axis_name=name, shard=shard, shard_params=hybrid)
    return lambda fn: LinenDataParallel(FlaxStep(fn, mesh, LinenAdapter(), **options))
