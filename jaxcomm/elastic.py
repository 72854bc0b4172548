"""Elastic training: a run saved on ``N`` devices goes on on ``M``, for every front end.

A checkpoint written on ``N`` devices (:func:`save` into a
:class:`jaxcomm.checkpoint.Checkpointer`) is restored onto the ``M`` devices of a new step
(:func:`restore`); a live ``data_parallel`` state is moved with :func:`resize` (the same
rule without a checkpoint). Every front end: ``jaxcomm.data_parallel`` (replicated and
``shard_optimizer=True``), the NNX and Linen decorators (per-device state in the
``nnx.Optimizer`` / ``TrainState`` leaves, stacked one entry per device) and the pmap
entry (per-device state held by the step object, :meth:`PmapDataParallel.per_device_state`).
What is kept, and how:

* **params, batch statistics, step count, replicated optimizer state** (Adam's moments of
  a replicated optimizer, the adaptive compressor's level, window and hold, PowerSGD's
  warm start): as they are, bit for bit. The learning-rate schedule is a function of the
  step count, so it goes on where it was.
* **sharded optimizer state** (``shard_optimizer=True``): resharded exactly by the step's
  layout (``DataParallel.reshard``, or each chunk leaf of a Flax step read row after row
  as its param leaf and cut anew into ``M`` pieces, :meth:`ShardedOptimizer.reshard`'s
  rule).
* **other per-device state** (error-feedback residuals, the adaptive compressor's residual,
  ``local_sgd``'s per-device params, ``MultiSteps``' accumulators) by ``rule``:

  - ``'mean'`` (default): every new device gets the mean of the ``N`` old entries. For an
    error-feedback residual this keeps, exactly up to f32 rounding, the correction the
    averaged gradient still owes: the next mean of ``g + e`` over ``M`` devices carries
    ``mean_j e'_j = mean_i e_i``, as it would have over the ``N``. Refused for a leaf
    whose per-device shape changes with the device count, for integer leaves whose
    entries differ, and for a ``compress_stage='inter'`` sync (its residuals are chunks
    that belong to a device's place in its node).
  - ``'zero'``: reset to zeros (what an error-feedback buffer starts from); loses at most
    one step's compression error per device.

* **data position**: as saved. The global batch is kept (each device takes
  ``global_batch / M`` examples; :func:`per_device_batch` refuses a count that does not
  divide it), so position ``p`` names the same examples on any device count and no
  example is skipped or seen twice.

Checked against the checkpoint's manifest (paths, shapes, dtypes of every leaf) before
anything is read: a checkpoint of another model, optimizer or front end is refused naming
the first leaf that differs.

A layout plugs in its own re-lay through its step: ``data_parallel`` calls
``DataParallel.reshard`` (the ``OptimizerLayout.reshard`` of its layout) for any layout
other than the replicated one.

Example (any front end; ``like`` is the fresh state of the new run):
  >>> ckpt = jaxcomm.checkpoint.Checkpointer('/shared/ckpt', async_save=True, job=run_id)
  >>> jaxcomm.elastic.save(ckpt, dp, state, position=p)            # on 8 devices
  >>> state, data = jaxcomm.elastic.restore(ckpt, dp, like)        # on 4
  >>> (model, optimizer), data = jaxcomm.elastic.restore(ckpt, nnx_step, model, optimizer)
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import distributed
from jaxcomm.checkpoint import Checkpointer, manifest
from jaxcomm.layout import ReplicatedOptimizer
from jaxcomm.pmap import PmapDataParallel, first_row
from jaxcomm.sharded import relayout_pieces
from jaxcomm.train import DataParallel
from jaxcomm.validate import check_choice, check_int

__all__ = [
    "AGENT_VARS",
    "RULES",
    "agent_env",
    "check_minimum",
    "parse_nodes",
    "per_device_batch",
    "resize",
    "restore",
    "save",
]

RULES = ("mean", "zero")


def per_device_batch(global_batch: int, devices: int) -> int:
    """Examples per device when ``global_batch`` is split over ``devices``.

    Raises:
      ValueError: ``devices`` does not divide ``global_batch``; the message lists the
        device counts that do.
    """
    global_batch = check_int("global_batch", global_batch, minimum=1)
    devices = check_int("devices", devices, minimum=1)
    if global_batch % devices:
        fits = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise ValueError(
            f"global batch {global_batch} does not divide over {devices} devices; a restart "
            f"keeps the global batch (the schedule and the data position depend on it). "
            f"Device counts that divide it: {fits}. Choose a global batch every device count "
            "the job may shrink to divides (e.g. 24 for 8, 6, 4, 3 or 2 devices), or a "
            "minimum node count that leaves such a device count."
        )
    return global_batch // devices


def check_minimum(available: int, minimum: int, *, what: str = "nodes") -> int:
    """Refuses to go on with fewer than ``minimum`` ``what``; returns ``available``.

    Raises:
      ValueError: ``available < minimum`` (or either is not a positive integer).
    """
    available = check_int(f"{what} available", available, minimum=1)
    minimum = check_int(f"minimum {what}", minimum, minimum=1)
    if available < minimum:
        raise ValueError(
            f"{available} {what} left, the job's minimum is {minimum} (allowed: {minimum} or "
            f"more): it does not resume below its minimum. Lower the minimum (e.g. "
            f"--elastic {available}:...) or bring back {minimum - available} {what}."
        )
    return available


def _per_device_flags(dp: Any, like_opt: Any) -> list[bool]:
    paths = set(dp.per_device_paths)
    return [
        jax.tree_util.keystr(p) in paths for p, _ in jax.tree_util.tree_leaves_with_path(like_opt)
    ]


def _old_devices(opt_state: Any, flags: list[bool]) -> int | None:
    rows = {
        int(jnp.shape(x)[0]) for x, f in zip(jax.tree.leaves(opt_state), flags, strict=True) if f
    }
    if len(rows) > 1:
        raise ValueError(f"per-device leaves disagree on the device count: {sorted(rows)}")
    return rows.pop() if rows else None


def _placing(mesh: Any, axes: tuple[str, ...], rows: int, devices: int) -> NamedSharding:
    """Where ``rows`` per-device entries go on a mesh of ``devices`` before their re-lay:
    split over the devices when they divide evenly, else whole on every device."""
    return NamedSharding(mesh, P(axes) if rows % devices == 0 else P())


def _relay(x: jax.Array, target: jax.ShapeDtypeStruct, rule: str, path: str) -> jax.Array:
    """One per-device leaf of ``N`` rows as ``target``'s ``M`` rows, by ``rule``."""
    if rule == "zero":
        return jax.jit(
            lambda: jnp.zeros(target.shape, target.dtype), out_shardings=target.sharding
        )()
    if tuple(x.shape[1:]) != tuple(target.shape[1:]):
        raise ValueError(
            f"per-device leaf {path} holds {tuple(x.shape[1:])} per device on {x.shape[0]} "
            f"devices and {tuple(target.shape[1:])} on {target.shape[0]}: its layout depends "
            "on the device count, so a mean of its entries means nothing. Restore with "
            "rule='zero' (the entries start again from zero)."
        )
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        same = bool(jax.jit(lambda v: jnp.all(v == v[:1]))(x))
        if not same:
            raise ValueError(
                f"per-device leaf {path} ({x.dtype}) differs between devices: integer "
                "entries have no mean. Restore with rule='zero'."
            )
        mean = lambda v: jnp.broadcast_to(v[0], target.shape)  # noqa: E731
    else:
        mean = lambda v: jnp.broadcast_to(  # noqa: E731
            jnp.mean(v.astype(jnp.float32), axis=0).astype(v.dtype), target.shape
        )
    return jax.jit(mean, out_shardings=target.sharding)(x)


def resize(state: Any, dp: Any, *, rule: str = "mean") -> Any:
    """``state``, a :class:`jaxcomm.TrainState` of the same model and optimizer on another
    device count (a live state, or one restored as it was saved), laid out for ``dp``.

    Args:
      state: the train state; its arrays on ``dp``'s devices (replicated, or per-device
        leaves split over them) or on another mesh of this process.
      dp: the step on the new devices (``jaxcomm.data_parallel``), initialised
        (``dp.init`` run once, so its per-device leaves are known).
      rule: per-device state other than sharded chunks, ``'mean'`` or ``'zero'`` (module
        docstring).

    Returns:
      The state on ``dp``'s mesh; the same values where nothing changes.

    Raises:
      ValueError: unknown ``rule``; a per-device leaf the rule cannot re-lay; a sharded
        state of other params (``DataParallel.reshard``).
    """
    check_choice("rule", rule, RULES, fix="'mean' keeps the entries' mean, 'zero' resets them")
    target = dp.abstract_state(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    )
    flags = _per_device_flags(dp, target.opt_state)
    rows = _old_devices(state.opt_state, flags)
    devices, put = dp.num_devices, lambda t: jax.device_put(t, dp.replicated)  # noqa: E731
    leaves, treedef = jax.tree.flatten(state.opt_state)
    if len(leaves) != len(flags):
        raise ValueError(
            f"the optimizer state has {len(leaves)} leaves, this step's {len(flags)}: another "
            "optimizer. Resume with the optimizer the state was written by."
        )
    stacked = NamedSharding(dp.mesh, P(dp.axes))
    same = rows is None or rows == devices  # entries back to their own devices
    moved = [
        (jax.device_put(x, stacked if same else _placing(dp.mesh, dp.axes, rows, devices)))
        if f
        else put(x)
        for x, f in zip(leaves, flags, strict=True)
    ]
    model_state = None if state.model_state is None else put(state.model_state)
    base = type(state)(
        put(state.step), put(state.params), jax.tree.unflatten(treedef, moved), model_state
    )
    if same:
        return base
    if not isinstance(dp.layout, ReplicatedOptimizer):  # the layout's own exact re-lay
        return dp.reshard(base)
    if rule == "mean" and any(s.compress_stage == "inter" for s in dp.syncs):
        raise ValueError(
            "rule='mean' re-lays per-device state whose entries mean the same thing on every "
            "device; a sync_gradients(compress_stage='inter') keeps residuals of the chunk a "
            "device owns in its node. Restore with rule='zero'."
        )
    targets = jax.tree.leaves(target.opt_state)
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(target.opt_state)
    ]
    out = [
        _relay(x, t, rule, p) if f else x
        for x, t, f, p in zip(moved, targets, flags, paths, strict=True)
    ]
    return base._replace(opt_state=jax.tree.unflatten(treedef, out))


def _check_manifest(saved: list, here: list, per_device: set[str], where: str) -> None:
    """Refuses a checkpoint whose leaves are not this state's: another optimizer (paths)
    or another model (shapes or dtypes of leaves that do not depend on the device count)."""
    saved_paths, here_paths = [s[0] for s in saved], [h[0] for h in here]
    if saved_paths != here_paths:
        gone = [p for p in saved_paths if p not in here_paths][:3]
        new = [p for p in here_paths if p not in saved_paths][:3]
        raise ValueError(
            f"checkpoint {where} holds {len(saved_paths)} state leaves, this run "
            f"{len(here_paths)}; only in the checkpoint: {gone}, only in this run: {new}. It "
            "was written by another optimizer or model: resume with the settings it was "
            "saved with, or use another checkpoint folder."
        )
    for (path, shape, dtype), (_, shape2, dtype2) in zip(saved, here, strict=True):
        if dtype != dtype2 or (path not in per_device and shape != shape2):
            raise ValueError(
                f"checkpoint {where}: {path} is {dtype}{shape}, this run's {dtype2}{shape2}. "
                "It was written by another model (or optimizer): resume with the settings it "
                "was saved with, or use another checkpoint folder."
            )


def _restore_data_parallel(
    checkpointer: Checkpointer, dp: Any, like: Any, data: dict, rule: str
) -> tuple[Any, dict]:
    """:func:`restore` for ``jaxcomm.data_parallel``'s ``TrainState``."""
    where = f"{checkpointer.directory}/{data['step']}"
    if data.get("front_end", "data_parallel") != "data_parallel":
        raise ValueError(
            f"checkpoint {where} was written from a {data['front_end']} step "
            "(jaxcomm.elastic.save), this step is a data_parallel one: its leaves are another "
            "state's. Restore it with the front end it was saved from."
        )
    saved_devices = data.get("devices")
    if saved_devices == dp.num_devices:
        return checkpointer.restore(like, step=data["step"])
    if "leaves" not in data:
        raise ValueError(
            f"checkpoint {where} has no manifest of its leaves (written before elastic "
            "restores), so it restores only onto the device count it was written on."
        )
    per_device = {".opt_state" + p for p in dp.per_device_paths}
    _check_manifest(data["leaves"], manifest(like), per_device, where)
    rows = int(saved_devices)

    def target(path, x, saved):
        if jax.tree_util.keystr(path) not in per_device:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        sharding = _placing(dp.mesh, dp.axes, rows, dp.num_devices)
        return jax.ShapeDtypeStruct(tuple(saved[1]), x.dtype, sharding=sharding)

    leaves = jax.tree_util.tree_leaves_with_path(like)
    abstract = jax.tree.unflatten(
        jax.tree.structure(like),
        [target(p, x, s) for (p, x), s in zip(leaves, data["leaves"], strict=True)],
    )
    saved, data = checkpointer.restore(abstract, step=data["step"])
    return resize(saved, dp, rule=rule), data


def restore(
    checkpointer: Checkpointer,
    train_step: Any,
    *like: Any,
    step: int | None = None,
    rule: str = "mean",
    global_batch: int | None = None,
) -> tuple[Any, dict]:
    """Restores the newest complete checkpoint (or ``step``) onto ``train_step``'s devices,
    written on the same or another device count.

    What each front end gets back:

    * ``data_parallel``: the ``TrainState`` on the step's mesh (``like``: a fresh
      ``dp.init(...)``, for shapes and shardings).
    * NNX: the objects ``like`` (model, ``nnx.Optimizer``, ...), updated in place, as a
      tuple; per-device leaves stacked over the ``M`` devices as the step keeps them.
    * Linen: the ``TrainState`` (a tuple of them for several).
    * pmap: the ``TrainState`` once (unreplicated; its tokens stand for the per-device
      state, which is loaded into the step object with
      :meth:`PmapDataParallel.load_per_device_state`). A script that passes the state in
      pmap's rows (``in_axes=0``) replicates it, as it does a fresh one.

    Args:
      checkpointer: the run's checkpoints.
      train_step: the step on the devices of this run (``data_parallel``: initialised).
      *like: a fresh state of this run, as :func:`save` took it (``dp.init(...)``; the
        NNX objects; the Linen or pmap ``TrainState`` s): its values are not read, only
        its structure, shapes and shardings (a ``shard_optimizer=True`` Flax step lays it
        out sharded first, with ``shard_optimizer_state``).
      step: which checkpoint; default the newest complete one.
      rule: per-device state other than sharded chunks: ``'mean'`` or ``'zero'``.
      global_batch: this run's global batch; refused if the checkpoint's differs or does
        not divide over ``train_step``'s devices. None: not checked.

    Returns:
      ``(state, data)``: the state as above and the checkpoint's JSON item
      (``position``: the next global batch to read).

    Raises:
      FileNotFoundError: no complete checkpoint.
      ValueError: a checkpoint of another model, optimizer or front end, of another
        global batch, a global batch that does not divide, a checkpoint without a manifest
        on another device count, or a per-device leaf the rule cannot re-lay.
      TypeError: ``train_step`` is not a jaxcomm step.
    """
    check_choice("rule", rule, RULES, fix="'mean' keeps the entries' mean, 'zero' resets them")
    kind = _front_end(train_step)
    data = checkpointer.saved_data(step)
    where = f"{checkpointer.directory}/{data['step']}"
    if global_batch is not None:
        per_device_batch(global_batch, train_step.num_devices)
        if data.get("global_batch", global_batch) != global_batch:
            raise ValueError(
                f"checkpoint {where} was written with global batch {data['global_batch']}, "
                f"this run's is {global_batch}: a restart keeps the global batch (the data "
                f"position and the schedule count its batches). Run with global batch "
                f"{data['global_batch']}."
            )
    if kind == "data_parallel":
        (state,) = _one_state(like, "a jaxcomm.TrainState")
        return _restore_data_parallel(checkpointer, train_step, state, data, rule)
    return _restore_flax(checkpointer, train_step, kind, like, data, rule)


# -- every front end: save and restore ---------------------------------------------------


def _front_end(train_step: Any) -> str:
    """The front end's name in the checkpoint (``'data_parallel'``, ``'nnx'``, ...)."""
    from jaxcomm.linen import LinenDataParallel
    from jaxcomm.nnx import NnxDataParallel

    for cls, name in (
        (DataParallel, "data_parallel"),
        (PmapDataParallel, "pmap"),
        (NnxDataParallel, "nnx"),
        (LinenDataParallel, "linen"),
    ):
        if isinstance(train_step, cls):
            return name
    raise TypeError(
        f"jaxcomm.elastic: {type(train_step).__name__} is not a jaxcomm step; pass the step "
        "the state belongs to: jaxcomm.data_parallel(...), a function decorated with "
        "jaxcomm.nnx_data_parallel / linen_data_parallel, or jaxcomm.pmap_data_parallel(...)."
    )


def _encode(x: Any) -> Any:
    """A leaf as orbax writes it: typed PRNG keys as their raw data."""
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _decode(x: Any, like: Any) -> Any:
    """A restored leaf back as ``like``'s kind (a typed key from its raw data)."""
    if jnp.issubdtype(jnp.result_type(like), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(x, impl=jax.random.key_impl(like))
    return x


class _View(NamedTuple):
    """A Flax front end's state as flat leaves: what a checkpoint holds."""

    leaves: list  # arrays (typed keys as their raw data)
    paths: list[str]  # keystr of each leaf, for the manifest and its messages
    per: list[bool]  # stacked one entry per device along the data axes
    step: int  # the step count (the first optimizer's, or TrainState's)
    treedef: Any  # of the objects' state (NNX: nnx.state; Linen, pmap: the TrainStates)


def _stacked(train_step: Any, x: Any) -> bool:
    """Whether ``x`` is one entry per device along the step's data axes."""
    return (
        isinstance(x, jax.Array)
        and x.ndim >= 1
        and x.shape[0] == train_step.num_devices
        and x.sharding.is_equivalent_to(train_step.batch_sharding, x.ndim)
    )


def _flax_view(train_step: Any, kind: str, objs: tuple) -> _View:
    """The leaves of the step's objects (NNX: ``nnx.state`` of them; Linen and pmap: the
    ``TrainState`` s) and which of them are per device."""
    if kind == "nnx":
        from flax import nnx

        states: Any = nnx.state(objs)
        steps = [
            int(np.asarray(o.step[...]))
            for _, o in nnx.iter_graph(objs)
            if isinstance(o, nnx.Optimizer)
        ]
    else:
        states = tuple(objs)
        steps = [int(np.asarray(jax.device_get(s.step)).reshape(-1)[0]) for s in objs]
    flat, treedef = jax.tree_util.tree_flatten_with_path(states)
    leaves = [x for _, x in flat]
    return _View(
        leaves=leaves,
        paths=[jax.tree_util.keystr(p) for p, _ in flat],
        per=[_stacked(train_step, x) for x in leaves],
        step=steps[0] if steps else 0,
        treedef=treedef,
    )


def _pmap_unreplicated(train_step: Any, objs: tuple) -> tuple:
    """The pmap entry's ``TrainState`` s once (row 0 of a state in pmap's rows: its step
    count has one row per device), each leaf read on one device (no collective)."""
    out = []
    for s in objs:
        if np.ndim(s.step) == 1 and np.shape(s.step)[0] == train_step.num_devices:
            s = jax.tree.map(first_row, s)
        out.append(s)
    return tuple(out)


def _pmap_view(train_step: Any, objs: tuple) -> tuple[_View, dict]:
    """The pmap entry's state: the ``TrainState`` s (tokens where the step object holds
    per-device leaves) and the held leaves after them; and each state's held version."""
    view = _flax_view(train_step, "pmap", _pmap_unreplicated(train_step, objs))
    held = train_step.per_device_state()
    leaves, paths = list(view.leaves), list(view.paths)
    per = [False] * len(leaves)
    versions = {}
    for key, entry in sorted(held.items()):
        versions[key] = int(np.asarray(entry["version"]))
        for i, x in enumerate(entry["leaves"]):
            leaves.append(x)
            paths.append(f"per_device.{key}[{i}]")
            per.append(True)
    return view._replace(leaves=leaves, paths=paths, per=per), versions


def save(
    checkpointer: Checkpointer,
    train_step: Any,
    *state: Any,
    position: int,
    meta: dict | None = None,
) -> None:
    """Saves the step's whole state (per-device state included) with the data position,
    for :func:`restore` on any device count.

    Args:
      checkpointer: where to write (asynchronously if it was built so).
      train_step: the step the state belongs to: ``jaxcomm.data_parallel``'s, an NNX or
        Linen decorated step, or ``jaxcomm.pmap_data_parallel``'s.
      *state: ``data_parallel``: its ``TrainState``. NNX: the step's graph objects (model,
        ``nnx.Optimizer``, metrics, in the order :func:`restore` will get them). Linen:
        the ``TrainState`` (s). pmap: the ``TrainState`` (s) as the script holds them
        (once, or in pmap's rows); the step object's per-device state is saved with them.
      position: global batches consumed so far (the next batch to read).
      meta: JSON-serialisable identity of the run (``global_batch`` is checked by
        :func:`restore`).

    Raises:
      TypeError: ``train_step`` is not a jaxcomm step.
    """
    kind = _front_end(train_step)
    meta = {**(meta or {}), "front_end": kind}
    if kind == "data_parallel":
        (st,) = _one_state(state, "a jaxcomm.TrainState")
        checkpointer.save(st, position=position, meta=meta)
        return
    versions: dict = {}
    if kind == "pmap":
        view, versions = _pmap_view(train_step, state)
    else:
        view = _flax_view(train_step, kind, state)
    leaves = [_encode(x) for x in view.leaves]
    checkpointer.save(
        leaves,
        position=position,
        step=view.step,
        meta={
            **meta,
            "devices": train_step.num_devices,
            "leaves": _manifest(view.paths, leaves),
            "per_device": [p for p, f in zip(view.paths, view.per, strict=True) if f],
            "versions": versions,
        },
    )


def _one_state(state: tuple, what: str) -> tuple:
    if len(state) != 1:
        raise TypeError(f"jaxcomm.elastic: expected {what}, got {len(state)} arguments.")
    return state


def _relay_leaf(
    train_step: Any, x: jax.Array, like: Any, rule: str, path: str, chunks: bool
) -> jax.Array:
    """One per-device leaf of ``N`` rows as the step's ``M``: a sharded step's chunk leaf
    exactly (``like`` its ``(M, m)`` chunks), anything else by ``rule``."""
    m = train_step.num_devices
    if x.shape[0] == m:
        return jax.device_put(x, train_step.batch_sharding)
    if chunks and like is not None and _stacked(train_step, like) and like.ndim == 2:
        return relayout_pieces(x, path, m, like.shape[1], train_step.batch_sharding)
    target = jax.ShapeDtypeStruct((m, *x.shape[1:]), x.dtype, sharding=train_step.batch_sharding)
    return _relay(x, target, rule, path)


def _check_inter(train_step: Any, rule: str) -> None:
    if rule == "mean" and any(s.compress_stage == "inter" for s in train_step.syncs):
        raise ValueError(
            "rule='mean' re-lays per-device state whose entries mean the same thing on every "
            "device; a sync_gradients(compress_stage='inter') keeps residuals of the chunk a "
            "device owns in its node. Restore with rule='zero'."
        )


def _restore_flax(
    checkpointer: Checkpointer, train_step: Any, kind: str, like: tuple, data: dict, rule: str
) -> Any:
    """:func:`restore` for the NNX and Linen decorators and the pmap entry."""
    where = f"{checkpointer.directory}/{data['step']}"
    saved_kind = data.get("front_end")
    if saved_kind != kind:
        raise ValueError(
            f"checkpoint {where} was written from a {saved_kind or 'data_parallel'} step "
            f"(jaxcomm.elastic.save), this step is a {kind} one: its leaves are another "
            "state's. Restore it with the front end it was saved from."
        )
    if train_step.shard_optimizer:  # the target's chunks: the sharded layout of M devices
        laid = train_step.shard_optimizer_state(*like)
        if kind != "nnx":
            like = laid if isinstance(laid, tuple) else (laid,)
    if kind == "pmap":
        view = _flax_view(train_step, kind, _pmap_unreplicated(train_step, like))
    else:
        view = _flax_view(train_step, kind, like)
    saved, per_paths = data["leaves"], set(data.get("per_device", []))
    rows = int(data["devices"])
    n_state = len(view.leaves)
    held = [s for s in saved if s[0] in per_paths and s[0].startswith("per_device.")]
    saved_state = saved[: len(saved) - len(held)] if kind == "pmap" else saved
    here = _manifest(view.paths, [jax.eval_shape(_encode, x) for x in view.leaves])
    if kind == "pmap":  # a token stands where the step object holds a per-device leaf
        tokens = {p: e for p, *e in saved_state if e == [[2], "uint32"]}
        here = [[p, *tokens[p]] if p in tokens else [p, *e] for p, *e in here]
    _check_manifest(saved_state, here, per_paths, where)
    _check_inter(train_step, rule)
    replicated = NamedSharding(train_step.mesh, P())

    split = _placing(train_step.mesh, train_step.axes, rows, train_step.num_devices)
    abstract = [
        jax.ShapeDtypeStruct(
            tuple(shape), jnp.dtype(dtype), sharding=split if path in per_paths else replicated
        )
        for path, shape, dtype in saved
    ]
    restored, out = checkpointer.restore(abstract, step=data["step"])
    chunks = train_step.shard_optimizer
    if kind == "pmap":
        state_leaves = [_decode(x, y) for x, y in zip(restored[:n_state], view.leaves, strict=True)]
        # The held leaves pair with the target's per-device leaves in leaf order.
        targets = [x for x in view.leaves if _stacked(train_step, x)] if chunks else []
        relaid = [
            _relay_leaf(train_step, x, targets[i] if i < len(targets) else None, rule, e[0], chunks)
            for i, (x, e) in enumerate(zip(restored[n_state:], held, strict=True))
        ]
        loaded, it = {}, iter(relaid)
        for key, version in data.get("versions", {}).items():
            count = sum(1 for e in held if e[0].startswith(f"per_device.{key}["))
            loaded[key] = {"version": version, "leaves": [next(it) for _ in range(count)]}
        if loaded:
            train_step.load_per_device_state(loaded)
        states = jax.tree.unflatten(view.treedef, state_leaves)
        return (states[0] if len(states) == 1 else states), out
    new = [
        _relay_leaf(train_step, x, y, rule, e[0], chunks) if e[0] in per_paths else _decode(x, y)
        for x, y, e in zip(restored, view.leaves, saved, strict=True)
    ]
    states = jax.tree.unflatten(view.treedef, new)
    if kind == "nnx":
        from flax import nnx

        nnx.update(like, states)
        return like, out
    return (states[0] if len(states) == 1 else states), out


def _manifest(paths: list[str], leaves: list) -> list[list]:
    """``[path, shape, dtype]`` of each leaf, with the paths given."""
    return [[p, *m[1:]] for p, m in zip(paths, manifest(leaves), strict=True)]


# -- an elastic agent's processes ----------------------------------------------------------

# What PyTorch's elastic agent (torchrun) gives each worker it starts.
AGENT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_nodes(text: str) -> tuple[int, int]:
    """``'MIN:MAX'`` (or ``'N'``) node counts of ``--elastic``, as torchrun's ``--nnodes``.

    Raises:
      ValueError: not one or two positive integers with ``MIN <= MAX``.
    """
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if low < 1 or high < low:
        raise ValueError(
            f"--elastic {text!r} must be MIN:MAX node counts with 1 <= MIN <= MAX (as "
            "torchrun's --nnodes), e.g. --elastic 2:3."
        )
    return low, high


def agent_env(local_devices: int, environ: dict | None = None) -> dict[str, str]:
    """The ``JAXCOMM_*`` variables of a process started by PyTorch's elastic agent.

    ``torch.distributed.run`` (torchrun) starts one process per node
    (``--nproc-per-node=1``) and gives it ``RANK``, ``WORLD_SIZE`` and the rank-0 node's
    address (``MASTER_ADDR``, new after every restart). The agent itself listens on
    ``MASTER_PORT`` (its store), so ``jax.distributed``'s coordinator listens on the rank-0
    node at ``JAXCOMM_ELASTIC_PORT`` (default ``MASTER_PORT + 1``). The process then starts
    with ``jaxcomm.init_distributed()`` as under ``jaxcomm.tools.launch``.

    Args:
      local_devices: CPU devices of this process (ignored by accelerators).
      environ: the environment (default ``os.environ``).

    Raises:
      ValueError: a variable of the agent is missing, or the agent starts several
        processes per node.
    """
    env = os.environ if environ is None else environ
    missing = [k for k in AGENT_VARS if not env.get(k)]
    if missing:
        raise ValueError(
            f"an elastic process runs under an elastic agent, and {missing} are not set: start it "
            "with torchrun --nnodes=MIN:MAX --nproc-per-node=1 --rdzv-backend=c10d ... "
            "--no-python python your_script.py (docs/elastic.md)."
        )
    if env["LOCAL_WORLD_SIZE"] != "1":
        raise ValueError(
            f"--nproc-per-node={env['LOCAL_WORLD_SIZE']}: a JAX process drives every device "
            "of its node; start one per node (--nproc-per-node=1)."
        )
    port = env.get("JAXCOMM_ELASTIC_PORT") or str(int(env["MASTER_PORT"]) + 1)
    return {
        distributed.ENV_COORDINATOR: f"{env['MASTER_ADDR']}:{port}",
        distributed.ENV_NUM_PROCESSES: env["WORLD_SIZE"],
        distributed.ENV_PROCESS_ID: env["RANK"],
        distributed.ENV_LOCAL_DEVICES: str(check_int("local_devices", local_devices, minimum=1)),
    }
