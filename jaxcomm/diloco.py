"""``local_sgd``: local steps with a rare, compressed outer sync (DiLoCo), as an optax transform.

Every device takes ``sync_every`` (H) steps of the *inner* optimizer on its own copy of the
parameters, with no collective. Then the devices average the change of their parameters
since the last sync, the *outer gradient* ``anchor - local``, through
:func:`jaxcomm.sync_gradients` (any algorithm, any compressor, error feedback included),
and the *outer* optimizer (default: Nesterov SGD, lr 0.7, momentum 0.9, as in DiLoCo,
arXiv 2311.08105) applies it to the anchor. With ``fragments=F`` (Streaming DiLoCo, arXiv
2501.18512) the parameter leaves are split into F contiguous fragments of about equal bytes,
each synchronised every H steps on its own staggered step, so a sync step moves about 1/F of
the bytes.

How it fits ``jaxcomm.data_parallel``:

* ``TrainState.params`` are the *anchor*: the parameters of the last sync, replicated and
  typed invariant (proven by ``check_vma``). The transform's update is zero on steps
  without a sync and the outer optimizer's update on sync steps, so the replicated params
  change only there, to the same bits on every device.
* Each device's own parameters between syncs live in the optimizer state,
  ``LocalSGDState.local`` (``PerDevice``: stored with one row per device, checkpointed
  and resumed like any per-device state), as does the inner optimizer's state
  (``LocalSGDState.inner``): they are *declared* different across devices.
* ``data_parallel`` takes the gradient at the local parameters when the optimizer state
  holds a :class:`LocalSGDState` (:func:`gradient_params`). Right after a fragment's sync,
  its local leaves are set to the new anchor: every device's row holds the anchor's bits.
* The state records ``sync_every`` and ``fragments`` (:class:`LocalSGDState`), and every
  update compares them with the transform's own: a state checkpointed under one schedule
  and resumed into a ``local_sgd`` built with another is refused instead of silently
  re-phasing the syncs (see :func:`local_sgd`, "Raises").
* Each fragment's outer sync draws its compressor randomness (dither, random-k) from its
  own seed (:func:`fragment_seed`), so fragments never share a dither stream.
* Only sync steps communicate. ``jaxcomm.data_parallel`` picks the branch on the host
  (``jaxcomm.HostPhase.local_sgd``, from its copy of the count: ``jaxcomm.phase_clock``)
  and runs one program per branch, with no conditional; the program that decides on the
  devices (``dp.step_fn(state)``) holds one ``lax.switch`` on the step count (branch f
  synchronises fragment f, the last branch nothing), and ``jaxcomm.wire_bytes`` counts it
  as its largest branch, the bytes of one sync; the bytes per step averaged over H steps
  are that total over H (:func:`amortized_bytes`).

One ``update`` of :func:`local_sgd`:

1. The local step: ``inner`` on this device's params (no collective).
2. The phase ``(count + 1) % H`` picks one branch (the host's, or of a ``lax.switch``):
   the outer sync of the fragment whose phase it is, no sync, or (a state built for
   another H or F) a refusal.
3. The outer sync of fragment f: ``sync_gradients`` averages ``anchor - local`` over the
   fragment's leaves, ``outer`` turns the mean into the update of the anchor.
4. The synced fragment's local leaves become the new anchor, bit for bit.

The default ``outer`` (DiLoCo's, Nesterov SGD, lr 0.7, momentum 0.9) is tuned for hundreds
of inner steps per sync and many syncs. For short runs with few syncs (tens, not
hundreds), ``optax.sgd(1.0, momentum=0.5, nesterov=True)`` fits better (the digits runs
of docs/benchmarks.md): the average of the devices' local runs moves about half as far as
per-step sync would in the same steps, which an outer lr of 1 with momentum 0.5 makes up
without the overshoot of momentum 0.9.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm.compression.base import Compressor
from jaxcomm.mesh import DATA_AXES
from jaxcomm.state import PerDevice, typed_alike
from jaxcomm.sync import DEFAULT_MIN_SIZE, sync_gradients, vary_per_device
from jaxcomm.validate import check_int

__all__ = [
    "LocalSGDState",
    "amortized_bytes",
    "fragment_of_leaves",
    "fragment_seed",
    "gradient_params",
    "local_sgd",
    "sync_schedule",
]


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`.

    Attributes:
      count: steps taken (int32, replicated); fragment f syncs after step t when
        ``sync_schedule(H, F)[(t + 1) % H] == f``.
      local: ``PerDevice``: this device's parameters (equal to the anchor, the replicated
        params, right after its fragment's sync; different between syncs).
      inner: ``PerDevice``: this device's inner optimizer state.
      outer: the outer optimizer's state, one per fragment (replicated).
      sync: the ``SyncGradientsState`` of the outer-gradient all-reduce, one per fragment
        (count, compressor state: error-feedback residuals are per device).
      sync_every: int32 scalar (replicated), the H the state was built for; ``update``
        refuses a state whose H differs from its own (the phase of every sync depends on it).
      fragments: int32 scalar (replicated), the F the state was built for; checked likewise.

    Checkpoints: a saved state without ``sync_every`` and ``fragments`` has two leaves
    fewer and does not restore into this structure; restore it into a structure without
    them and rebuild with ``state._replace(sync_every=jnp.int32(H), fragments=jnp.int32(F))``
    using the H and F it was trained with.
    """

    count: jax.Array
    local: PerDevice
    inner: PerDevice
    outer: tuple
    sync: tuple
    sync_every: jax.Array
    fragments: jax.Array


def sync_schedule(sync_every: int, fragments: int) -> np.ndarray:
    """Which fragment syncs at each phase of the H-step period.

    Args:
      sync_every: the period H.
      fragments: the number of fragments F (``1 <= F <= H``).

    Returns:
      An int32 array of length H: entry ``s`` is the fragment that syncs after a step t
      with ``(t + 1) % H == s``, or F (no sync). Fragment f's phase is ``(f * H // F)``, so
      with one fragment the sync is after steps H-1, 2H-1, ...; further fragments are
      staggered by about H/F steps.

    Example:
      >>> sync_schedule(4, 2)
      array([0, 2, 1, 2], dtype=int32)
    """
    table = np.full(sync_every, fragments, np.int32)
    for f in range(fragments):
        table[(f * sync_every) // fragments] = f
    return table


def fragment_of_leaves(params: Any, fragments: int) -> list[int]:
    """Splits the leaves of ``params`` (``jax.tree.leaves`` order) into ``fragments``
    contiguous, non-empty runs of about equal bytes.

    Args:
      params: the parameter tree (arrays or shape/dtype structs).
      fragments: the number of fragments F.

    Returns:
      The fragment index of each leaf (non-decreasing, every index in ``range(F)`` used).

    Raises:
      ValueError: fewer leaves than fragments (a leaf is never split).

    Example:
      >>> fragment_of_leaves({'a': jnp.zeros(100), 'b': jnp.zeros(10), 'c': jnp.zeros(90)}, 2)
      [0, 1, 1]
    """
    sizes = [
        int(np.prod(jnp.shape(x))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)
    ]
    n = len(sizes)
    if n < fragments:
        raise ValueError(
            f"local_sgd(fragments={fragments}): the params have only {n} leaves and a leaf is "
            f"never split across fragments; use fragments <= {n}."
        )
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = max(int(np.sum(sizes)), 1)
    cuts = [0]
    for k in range(1, fragments):
        # The first leaf that starts at or after k/F of the bytes, keeping every run non-empty.
        at = int(np.searchsorted(starts, k * total / fragments, side="left"))
        cuts.append(min(max(at, cuts[-1] + 1), n - (fragments - k)))
    cuts.append(n)
    return [f for f in range(fragments) for _ in range(cuts[f], cuts[f + 1])]


def fragment_seed(seed: int, fragment: int) -> int:
    """The seed of fragment ``fragment``'s outer ``sync_gradients`` in :func:`local_sgd`.

    Each fragment's sync keeps its own step count, so with one shared seed fragment f's
    n-th sync would draw exactly the dither of fragment 0's n-th sync (correlated
    rounding errors across the model). Fragment 0 uses ``seed`` (so with ``fragments=1``
    the sync draws what ``sync_gradients(seed=seed)`` draws); fragment f > 0 gets a 31-bit
    hash of ``(seed, f)``.

    Args:
      seed: the user's seed (an integer >= 0).
      fragment: the fragment index (>= 0).

    Returns:
      A non-negative int: ``seed`` for fragment 0, distinct per fragment otherwise.

    Example:
      >>> [fragment_seed(0, f) for f in range(3)][0]
      0
    """
    if fragment == 0:
        return seed
    x = (seed * 0x9E3779B1 + fragment * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x & 0x7FFFFFFF


def gradient_params(opt_state: Any) -> Any | None:
    """The parameters the gradient is to be taken at: the local parameters of the one
    :class:`LocalSGDState` in ``opt_state`` (this device's, unstacked), or ``None`` if there
    is none (ordinary data parallelism: the replicated params).

    Raises:
      ValueError: more than one ``local_sgd`` in the optimizer.
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LocalSGDState))
        if isinstance(s, LocalSGDState)
    ]
    if len(found) > 1:
        raise ValueError(
            f"the optimizer holds {len(found)} jaxcomm.local_sgd transforms; use one (it "
            "owns the local parameters the gradient is taken at)."
        )
    return found[0].local.value if found else None


def amortized_bytes(wire: dict, sync_every: int, fragments: int = 1) -> float:
    """Bytes per device per step averaged over one H-step period, from ``jaxcomm.wire_bytes``
    of a ``local_sgd`` step.

    ``wire['total']`` counts every step as its largest branch (a sync step); over H steps
    each of the F fragments syncs once, so the average is the unconditional bytes plus the
    sum of the fragments' branches over H.

    Args:
      wire: the dict ``jaxcomm.wire_bytes`` returns for the step.
      sync_every: H.
      fragments: F.

    Returns:
      The average bytes per device per step.
    """
    syncs = 0.0
    for branches in wire["branches"].values():
        # The switch has F + 2 branches (F fragments, then "no sync" and "refused", which
        # send nothing); any other conditional (a compressor's warm-up) is counted at its
        # largest branch per sync.
        if len(branches) == fragments + 2:
            syncs += sum(b for i, b in branches.items() if int(i) < fragments)
        else:
            syncs += max(branches.values())
    return wire["unconditional"] + syncs / sync_every


def local_sgd(
    inner: optax.GradientTransformation,
    *,
    outer: optax.GradientTransformation | None = None,
    sync_every: int,
    fragments: int = 1,
    compression: Compressor | None = None,
    algorithm: str = "hierarchical",
    axes: tuple[str, ...] = DATA_AXES,
    topology: Any = None,
    min_size: int = DEFAULT_MIN_SIZE,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Local steps on each device, an outer sync every ``sync_every`` steps (DiLoCo).

    Pass it as the whole optimizer of :func:`jaxcomm.data_parallel` (no ``sync_gradients``
    around it: it holds its own for the outer gradient). Between syncs each device trains
    its own copy of the params (``LocalSGDState.local``, per device) with ``inner`` and no
    collective; after every H-th step the outer gradient ``anchor - local`` is averaged with
    ``sync_gradients(algorithm=..., compression=...)`` and ``outer`` updates the anchor,
    the replicated ``TrainState.params``, which change only then (one ``update``, step
    by step: module docstring).

    Args:
      inner: the optimizer of the local steps (its state is per device), e.g.
        ``optax.adamw(1e-3)``.
      outer: the optimizer of the averaged outer gradient; default DiLoCo's
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (short runs: module docstring).
        ``optax.sgd(1.0)`` with ``sync_every=1`` is plain data parallelism with ``inner``.
      sync_every: H, steps between two syncs of a fragment (1: every step).
      fragments: F, the number of fragments synchronised on staggered steps (whole leaves,
        contiguous, about equal bytes; 1 <= F <= H). Each sync step moves one fragment.
      compression: a ``jaxcomm.compression`` compressor for the outer gradient (with its
        error feedback), or ``None`` (full precision).
      algorithm: the all-reduce algorithm (``jaxcomm.collectives.ALGORITHMS``).
      axes: the data-parallel mesh axes.
      topology: the topology 'auto' plans with (see ``sync_gradients``).
      min_size: outer-gradient leaves with fewer elements stay uncompressed.
      seed: seed of the compressor's randomness. Fragment 0's sync uses ``seed``, fragment
        f's :func:`fragment_seed` ``(seed, f)``, so the fragments draw distinct streams.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`LocalSGDState`; its
      ``update`` needs ``params`` (the anchor), runs inside ``jax.shard_map`` over ``axes``
      and forwards optax's extra argument ``sync_request`` to the outer syncs.

    Raises:
      ValueError: ``sync_every`` not an integer >= 1, ``fragments`` not in
        ``[1, sync_every]`` (at construction), more fragments than param leaves (at
        ``init``); bad ``algorithm``/``axes`` as ``sync_gradients`` says.
      TypeError: ``inner``/``outer`` not optax transforms, or a bad ``compression``.
      ValueError: at ``update``, a state built for another ``sync_every`` or ``fragments``
        (e.g. a checkpoint resumed into a differently configured ``local_sgd``, which
        would otherwise re-phase the syncs silently; another ``fragments`` also changes
        the state's structure, which ``data_parallel`` refuses before the step). Inside
        ``jit`` a host callback raises it: the step fails with a
        ``jax.errors.JaxRuntimeError`` carrying its text when its results are read.

    Example:
      >>> tx = jaxcomm.local_sgd(optax.adam(3e-3), sync_every=50,
      ...                        compression=jaxcomm.compression.int8())
      >>> dp = jaxcomm.data_parallel(loss_fn, tx, mesh)
    """
    sync_every, fragments, seed = _checked_schedule(sync_every, fragments, seed)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
    _check_transforms(inner=inner, outer=outer)
    # One sync per fragment, each with its own seed (their step counts run in lockstep, so
    # a shared seed would give every fragment the same dither stream).
    syncs = tuple(
        sync_gradients(axes=axes, algorithm=algorithm, topology=topology,
                       compression=compression, min_size=min_size, seed=fragment_seed(seed, f))
        for f in range(fragments)
    )  # fmt: skip
    schedule = jnp.asarray(sync_schedule(sync_every, fragments))
    cfg = _Config(inner, outer, syncs, sync_every, fragments, axes, schedule)
    return optax.GradientTransformationExtraArgs(
        functools.partial(_init, cfg), functools.partial(_update, cfg)
    )


def _checked_schedule(sync_every: int, fragments: int, seed: int) -> tuple[int, int, int]:
    """``sync_every``, ``fragments`` and ``seed`` as ints, checked (see :func:`local_sgd`)."""
    sync_every = check_int(
        "sync_every", sync_every, minimum=1, fix="H local steps between syncs; 1 syncs every step"
    )
    fragments = check_int(
        "fragments",
        fragments,
        minimum=1,
        maximum=sync_every,
        fix=f"each fragment syncs on its own step of the {sync_every}-step period; 1 syncs "
        "all params at once",
    )
    return sync_every, fragments, check_int("seed", seed, minimum=0)


def _check_transforms(**transforms: Any) -> None:
    """Raises ``TypeError`` for a value that is not an ``optax.GradientTransformation``."""
    for name, tx in transforms.items():
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"local_sgd: {name}={tx!r} is not an optax.GradientTransformation; pass e.g. "
                "optax.adam(1e-3)."
            )


class _Config(NamedTuple):
    """What one :func:`local_sgd` was built with (checked)."""

    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    syncs: tuple  # one sync_gradients transform per fragment
    sync_every: int
    fragments: int
    axes: tuple[str, ...]
    schedule: jax.Array  # sync_schedule(sync_every, fragments), indexed by the phase


def _split(tree: Any, owner: list[int], fragments: int) -> list[Any]:
    """``tree`` once per fragment, leaves of other fragments as ``None`` (paths kept).

    Args:
      tree: a tree with the params' structure.
      owner: the fragment of each leaf (:func:`fragment_of_leaves`).
      fragments: F.

    Returns:
      F trees; tree f holds the leaves of fragment f and ``None`` elsewhere.
    """
    leaves, treedef = jax.tree.flatten(tree)
    return [
        jax.tree.unflatten(
            treedef, [x if o == f else None for x, o in zip(leaves, owner, strict=True)]
        )
        for f in range(fragments)
    ]


def _init(cfg: _Config, params: Any) -> LocalSGDState:
    """The state of :func:`local_sgd` at step 0: every device's local params the anchor."""
    frags = _split(params, fragment_of_leaves(params, cfg.fragments), cfg.fragments)
    return LocalSGDState(
        count=jnp.zeros((), jnp.int32),
        local=vary_per_device(PerDevice(params), cfg.axes),
        inner=vary_per_device(PerDevice(cfg.inner.init(params)), cfg.axes),
        outer=tuple(cfg.outer.init(p) for p in frags),
        sync=tuple(s.init(p) for s, p in zip(cfg.syncs, frags, strict=True)),
        sync_every=jnp.asarray(cfg.sync_every, jnp.int32),
        fragments=jnp.asarray(cfg.fragments, jnp.int32),
    )


def _refuse(cfg: _Config, saved_every: Any, saved_fragments: Any) -> None:
    """Raises the ``ValueError`` of a state built for another schedule."""
    raise ValueError(
        f"local_sgd: the optimizer state was built for sync_every={int(saved_every)}, "
        f"fragments={int(saved_fragments)}, but this local_sgd has sync_every="
        f"{cfg.sync_every}, fragments={cfg.fragments}; resuming it would re-phase the syncs "
        "(which fragment syncs after which step) silently. Build local_sgd with the "
        "values the state was trained with, or start a new state with init()."
    )


def _schedule_mismatch(cfg: _Config, state: LocalSGDState) -> jax.Array | None:
    """Whether ``state`` was built for another ``sync_every`` or ``fragments``.

    Returns:
      ``None`` when the saved schedule is concrete and matches (a concrete mismatch raises
      here); else a traced bool, which picks the switch's refusing branch in :func:`_update`.

    Raises:
      ValueError: a concrete saved schedule other than ``cfg``'s.
    """
    saved = (state.sync_every, state.fragments)
    if not any(isinstance(x, jax.core.Tracer) for x in saved):
        if (int(saved[0]), int(saved[1])) != (cfg.sync_every, cfg.fragments):
            _refuse(cfg, *saved)
        return None
    return (state.sync_every != cfg.sync_every) | (state.fragments != cfg.fragments)


def _update(cfg: _Config, grads: Any, state: LocalSGDState, params: Any = None, **extra_args: Any):
    """One step of :func:`local_sgd` (its steps are listed there).

    Args:
      cfg: the transform's configuration.
      grads: this device's gradient, taken at its local params.
      state: the :class:`LocalSGDState`.
      params: the anchor (the replicated params of the last sync).
      **extra_args: optax's extra arguments; ``sync_request`` (``jaxcomm.SyncRequest``) is
        passed on to the outer syncs, the others are not used.

    Returns:
      ``(updates, state)``: ``updates`` zero except on a sync step, where they move the
      synced fragment's anchor leaves.

    Raises:
      ValueError: ``params`` missing, or a concrete ``state`` built for another schedule.
    """
    if params is None:
        raise ValueError(
            "local_sgd's update needs params (the anchor: the replicated params of the "
            "last sync); jaxcomm.data_parallel passes them."
        )
    request = {k: v for k, v in extra_args.items() if k == "sync_request"}
    host = request["sync_request"].phase.local_sgd if request else None
    if host is not None and host[1:] != (cfg.sync_every, cfg.fragments):
        _refuse(cfg, *host[1:])  # the schedule the host read from the state
    mismatch = None if host is not None else _schedule_mismatch(cfg, state)
    # 1. The local step: no collective.
    local = state.local.value
    inner_updates, inner_state = cfg.inner.update(grads, state.inner.value, local)
    local = optax.apply_updates(local, inner_updates)

    # 2. The outer sync of the fragment whose phase this is (if any): the host's branch, or
    # one lax.switch, so steps without a sync run no collective.
    owner = fragment_of_leaves(params, cfg.fragments)
    branches = _branches(cfg, params, owner, state, request)
    if host is not None:  # the branch the host chose (jaxcomm.HostPhase): no switch
        phase = host[0]
        updates, outer_states, sync_states = branches[phase](local, state.outer, state.sync)
        _report_syncs(cfg, params, owner, state, request, skip=phase)
    else:
        phase = cfg.schedule[(state.count + 1) % cfg.sync_every]
        if mismatch is not None:  # replicated values: every process takes one branch
            phase = jnp.where(mismatch, len(branches) - 1, phase)
        # A sync branch may return its compressor's state more varying than it came in
        # (PowerSGD's factors of hybrid sharding's blocks: per device).
        operands = (local, state.outer, state.sync)
        updates, outer_states, sync_states = lax.switch(
            phase, typed_alike(branches, *operands), *operands
        )
    local = _reset_synced(cfg, params, updates, local, owner, phase)
    return updates, LocalSGDState(
        count=state.count + 1,
        local=PerDevice(local),
        inner=PerDevice(inner_state),
        outer=outer_states,
        sync=sync_states,
        sync_every=state.sync_every,
        fragments=state.fragments,
    )


def _branches(
    cfg: _Config, params: Any, owner: list[int], state: LocalSGDState, request: dict
) -> list:
    """The branches of the step's ``lax.switch``: fragment 0 .. F-1's sync, no sync, refused.

    Every branch maps ``(local, outer_states, sync_states)`` to ``(updates, outer_states,
    sync_states)``; the updates are zero outside the synced fragment.

    Args:
      cfg: the transform's configuration.
      params: the anchor.
      owner: the fragment of each leaf.
      state: the step's state (its saved schedule, for the refusal's message).
      request: the extra arguments of the outer syncs' ``update`` (``sync_request``).

    Returns:
      F + 2 callables, in switch order.
    """
    leaves, treedef = jax.tree.flatten(params)
    zeros = [jnp.zeros_like(p) for p in leaves]

    def sync_fragment(f: int) -> Callable:
        def branch(local, outer_states, sync_states):
            anchor = _split(params, owner, cfg.fragments)[f]
            local_f = _split(local, owner, cfg.fragments)[f]
            delta = jax.tree.map(lambda a, x: a - x, anchor, local_f)
            outer_grad, sync_state = cfg.syncs[f].update(
                delta, sync_states[f], **_stating(request, delta)
            )
            step, outer_state = cfg.outer.update(outer_grad, outer_states[f], anchor)
            upd = list(zeros)
            members = [k for k, o in enumerate(owner) if o == f]
            for k, u in zip(members, jax.tree.leaves(step), strict=True):
                upd[k] = u
            outer_states = outer_states[:f] + (outer_state,) + outer_states[f + 1 :]
            sync_states = sync_states[:f] + (sync_state,) + sync_states[f + 1 :]
            return jax.tree.unflatten(treedef, upd), outer_states, sync_states

        return branch

    def no_sync(local, outer_states, sync_states):
        return jax.tree.unflatten(treedef, zeros), outer_states, sync_states

    def refused(local, outer_states, sync_states):
        # A saved schedule other than this one: the host callback's ValueError fails the
        # step. A branch of the switch the step already has, so checking costs no extra
        # conditional (on a GPU, no extra host round trip).
        jax.debug.callback(functools.partial(_refuse, cfg), state.sync_every, state.fragments)
        return no_sync(local, outer_states, sync_states)

    return [sync_fragment(f) for f in range(cfg.fragments)] + [no_sync, refused]


def _report_syncs(
    cfg: _Config, params: Any, owner: list[int], state: LocalSGDState, request: dict, skip: int
) -> None:
    """Traces every outer sync but fragment ``skip``'s as a pass-through (the request's
    ``communicate=False``; its outputs are dropped, so nothing of it runs), so that each
    reports itself to the step builder (``SyncRequest.on_sync``), as the switch's
    branches do when all of them are traced."""
    if not request:
        return
    passing = {"sync_request": request["sync_request"]._replace(communicate=False)}
    anchors = _split(params, owner, cfg.fragments)
    for f in range(cfg.fragments):
        if f != skip:
            cfg.syncs[f].update(anchors[f], state.sync[f], **_stating(passing, anchors[f]))


def _stating(request: dict, outer_grad: Any) -> dict:
    """The outer sync's extra arguments, its ``sync_request`` stating what the sync is
    handed: the outer gradient (anchor minus local params), which local SGD averages by
    design, not the step's gradients (``jaxcomm.SyncRequest.grads``)."""
    r = request.get("sync_request")
    return {} if r is None else {"sync_request": r._replace(grads=outer_grad)}


def _reset_synced(
    cfg: _Config, params: Any, updates: Any, local: Any, owner: list[int], phase: jax.Array
) -> Any:
    """``local`` with the leaves of the fragment synced at ``phase`` set to the new anchor.

    The new anchor is ``params + updates``, the very expression ``data_parallel`` applies,
    computed here outside the switch so that its bits are the anchor's (inside a branch
    XLA:CPU fuses it differently and can round 1 ulp apart), then typed varying again (free
    at run time).

    Args:
      cfg: the transform's configuration.
      params: the anchor before the step.
      updates: the switch's updates (zero outside the synced fragment).
      local: this device's params after the local step.
      owner: the fragment of each leaf.
      phase: the switch's branch index (a fragment, F: no sync, F + 1: refused).

    Returns:
      The local params, a tree like ``params``.
    """
    new = vary_per_device(PerDevice(optax.apply_updates(params, updates)), cfg.axes).value
    treedef = jax.tree.structure(params)
    return jax.tree.unflatten(
        treedef,
        [
            jnp.where(phase == o, n, x)
            for o, n, x in zip(owner, jax.tree.leaves(new), jax.tree.leaves(local), strict=True)
        ],
    )
