"""Resume a run on another device count: what a restart on the nodes left keeps.

A checkpoint written on ``N`` devices (:class:`experiments.checkpoint.Checkpointer`) is
restored onto the ``M`` devices of a new step (:func:`restore`), or a live state is moved
to them (:func:`resize`, the same rule without a checkpoint). What is kept, and how:

* **params, batch statistics, step count, replicated optimizer state** (Adam's moments of
  a replicated optimizer, the adaptive compressor's level, window and hold, PowerSGD's
  warm start): as they are, bit for bit. The learning-rate schedule is a function of the
  step count, so it goes on where it was.
* **sharded optimizer state** (``shard_optimizer=True``): resharded exactly
  (``DataParallel.reshard``: each per-device chunk leaf read row after row is its param
  leaf, cut anew into ``M`` pieces).
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
anything is read: a checkpoint of another model or optimizer is refused naming the first
leaf that differs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.checkpoint import Checkpointer, manifest
from jaxcomm.validate import check_choice, check_int

__all__ = ["RULES", "check_minimum", "per_device_batch", "resize", "restore"]

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
    if dp.sharded is not None:
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
            "saved with, or use another --checkpoint-dir."
        )
    for (path, shape, dtype), (_, shape2, dtype2) in zip(saved, here, strict=True):
        if dtype != dtype2 or (path not in per_device and shape != shape2):
            raise ValueError(
                f"checkpoint {where}: {path} is {dtype}{shape}, this run's {dtype2}{shape2}. "
                "It was written by another model (or optimizer): resume with the settings it "
                "was saved with, or use another --checkpoint-dir."
            )


def restore(
    checkpointer: Checkpointer,
    dp: Any,
    like: Any,
    *,
    step: int | None = None,
    rule: str = "mean",
    global_batch: int | None = None,
) -> tuple[Any, dict]:
    """Restores the newest complete checkpoint (or ``step``) onto ``dp``'s devices, written
    on the same or another device count.

    Args:
      checkpointer: the run's checkpoints.
      dp: the step on the devices of this run (initialised).
      like: a fresh state of this run (``dp.init(...)``), for shapes and shardings.
      step: which checkpoint; default the newest complete one.
      rule: per-device state other than sharded chunks: ``'mean'`` or ``'zero'``.
      global_batch: this run's global batch; refused if the checkpoint's differs or does
        not divide over ``dp``'s devices. None: not checked.

    Returns:
      ``(state, data)``: the state on ``dp``'s mesh and the checkpoint's JSON item
      (``position``: the next global batch to read).

    Raises:
      FileNotFoundError: no complete checkpoint.
      ValueError: a checkpoint of another model or optimizer, of another global batch, a
        global batch that does not divide, a checkpoint without a manifest on another
        device count, or a per-device leaf the rule cannot re-lay.
    """
    check_choice("rule", rule, RULES, fix="'mean' keeps the entries' mean, 'zero' resets them")
    data = checkpointer.saved_data(step)
    where = f"{checkpointer.directory}/{data['step']}"
    if global_batch is not None:
        per_device_batch(global_batch, dp.num_devices)
        if data.get("global_batch", global_batch) != global_batch:
            raise ValueError(
                f"checkpoint {where} was written with global batch {data['global_batch']}, "
                f"this run's is {global_batch}: a restart keeps the global batch (the data "
                f"position and the schedule count its batches). Run with global batch "
                f"{data['global_batch']}."
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
