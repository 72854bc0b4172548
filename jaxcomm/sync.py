"""Gradient synchronisation: a pure :class:`GradientSync` and its optax adapter.

A :class:`GradientSync` holds the configuration of one data-parallel gradient mean and two
pure functions, ``init(params) -> state`` and ``reduce(grads, state) -> (mean, state)``.
:func:`sync_gradients` wraps one as an ``optax.GradientTransformation`` to put first in an
``optax.chain``; ``jaxcomm.data_parallel``, the microbatch loop and the profiler's
compute-only twin reach the same object through optax's extra argument ``sync_request=``
(:class:`SyncRequest`) and call it directly.

``reduce`` runs these stages, top to bottom:

1. **policy**: each gradient leaf is *compressed* (``min_size`` elements or more, or what
   ``compress_leaf`` says, and a shape the compressor supports) or *plain*
   (``jaxcomm.policy.LeafPlan``).
2. **pack**: compressed leaves into flat buffers (one per dtype, or the buckets of
   ``bucket_bytes``; a matrix compressor such as PowerSGD gets the leaves themselves).
3. **codec**: the compressor's mean of the buffers over the data axes; with
   ``compress_stage='inter'`` a full-precision reduce-scatter inside the node first and an
   all-gather after. Wrappers around this stage: warm-up (the first ``warmup_steps`` steps
   uncompressed) and a compressor's exact steps (adaptive's ``'f32'`` rung), each a
   ``lax.cond`` on a value every device shares.
4. **unpack**: the means back into leaves.
5. **plain leaves**: ``jaxcomm.allreduce`` in full precision, after stage 3 completes.
6. **finite**: an fp16 overflow zeroes the whole step's update.

The compressor's state (error-feedback residuals, PowerSGD's ``Q``, the adaptive level) is
nested in :class:`SyncGradientsState`, hence in the optimizer state and in every checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import backend, cost, deprecated, ordering
from jaxcomm.buckets import AutoBuckets, check_bucket_bytes, plan_buckets
from jaxcomm.collectives import (
    allreduce,
    check_algorithm,
    check_axes,
    check_bound,
    check_float_tree,
    check_topology,
    fit_to_mesh,
    pad_to_multiple,
    reduce_scatter,
)
from jaxcomm.compression.base import Compressor, ReduceContext
from jaxcomm.compression.keys import step_key
from jaxcomm.mesh import DATA_AXES, INTRA
from jaxcomm.policy import LeafPlan
from jaxcomm.state import PerDevice, marked_per_device, varying_axes
from jaxcomm.topology import detect
from jaxcomm.validate import check_int

__all__ = [
    "COMPRESS_STAGES",
    "GradientSync",
    "NO_HOST_PHASE",
    "HostPhase",
    "SyncGradientsState",
    "SyncRequest",
    "accepting_requests",
    "gradient_sync",
    "sync_gradients",
    "vary_per_device",
]

COMPRESS_STAGES = ("all", "inter")
# Leaves under this many elements (biases, norm scales) stay uncompressed by default: they
# are a small share of the bytes and the most sensitive to quantization.
DEFAULT_MIN_SIZE = 1024

_UNBOUND_FIX = (
    "Call the optimizer's update inside jax.shard_map over a mesh with these axes, e.g. "
    "through jaxcomm.data_parallel(...)."
)


class SyncGradientsState(NamedTuple):
    """State of a :class:`GradientSync` (and of :func:`sync_gradients`).

    Attributes:
      count: number of synchronised steps (int32); compressors key their randomness and
        warm-up on it.
      compression: the compressor's state (``()`` without compression).
    """

    count: jax.Array
    compression: Any = ()


class HostPhase(NamedTuple):
    """Decisions that change rarely, taken on the host from values every process shares
    (``jaxcomm.phase_clock.PhaseClock``), so that each phase is a program of its own with
    no conditional for them (on a GPU each executed ``conditional`` copies its predicate
    to the host). Hashable: step builders key their programs by it. A field left None is
    decided on the devices, inside the step.

    Attributes:
      warming_up: whether this step is within the sync's ``warmup_steps`` (True: the
        gradients go uncompressed; False: compressed).
      local_sgd: ``(branch, sync_every, fragments)`` of ``jaxcomm.local_sgd``: the branch
        this step takes (fragment f's outer sync, or ``fragments``: no sync), and the
        schedule read from the state it was decided from (a state built for another
        schedule is refused when the step is traced).
      codec_choice: the compressor's choice for this step (``Compressor.host_choice``:
        adaptive's rung).
    """

    warming_up: bool | None = None
    local_sgd: tuple[int, int, int] | None = None
    codec_choice: int | None = None


#: Every decision on the devices: one program for every step.
NO_HOST_PHASE = HostPhase()


class _SyncRequestFields(NamedTuple):
    """What a step builder asks of every ``sync_gradients`` in an optimizer.

    Passed as optax's extra argument: ``tx.update(grads, state, params,
    sync_request=SyncRequest(...))``; ``optax.chain`` and optax's wrappers forward it.

    Attributes:
      communicate: False: the gradients pass through unchanged (they were reduced already,
        one microbatch at a time, or this is the profiler's compute-only twin); the count
        advances, the compressor state does not change.
      on_sync: ``on_sync(sync)``, called with its :class:`GradientSync` by each
        ``sync_gradients`` this request reaches, while its update traces: how the step
        builder learns which syncs its optimizer runs (and that the request reaches
        them: a wrapper that drops optax's extra arguments would hide a sync), and how the
        microbatch loop finds the sync whose ``reduce`` it calls itself. None: not asked.
      grads: the gradients the step computed and hands the optimizer (each device's own),
        or None (not stated: nothing is checked). A sync that receives other arrays (a
        transform before it in the chain, a wrapper's accumulator) averages a function of
        each device's gradients, which equals the one-device run only if that function
        commutes with the mean; it then calls ``other_input``. Compared leaf by leaf by
        identity (the traced arrays themselves), so it holds for any wrapper that hands
        the gradients on untouched (``optax.chain``, ``named_chain``, ``masked``,
        ``partition``, ``inject_hyperparams``), whatever its structure.
      other_input: ``other_input(sync, inputs)``, called (while tracing) when the sync
        receives arrays other than ``grads``: the step builder records them for its
        build-time probe, or accepts a sync the probe checked; it raises to refuse. None:
        refused (``ValueError``) at once.
      sharded_over: the data axes the updates are split over: the sharded step
        (``shard_optimizer=True``) runs the optimizer on this device's pieces of the
        reduced gradients, so a transform that takes a statistic of all of the updates
        (``jaxcomm.sharded.clip_by_global_norm``'s norm) reduces it over these axes.
        ``()``: every device holds the whole updates. A sync asked to communicate under
        such a request (hybrid sharding's ``jaxcomm.local_sgd``) is handed each device's
        block, reduced over these axes already, and reduces it over its other axes
        (:meth:`GradientSync.of_blocks`).
      phase: the decisions the step builder took on the host for this step
        (:class:`HostPhase`), so that the program holds no conditional for them; its
        fields left None are decided on the devices.
    """

    communicate: bool = True
    on_sync: Callable[[GradientSync], None] | None = None
    grads: Any = None
    other_input: Callable[[GradientSync, Any], None] | None = None
    sharded_over: tuple[str, ...] = ()
    phase: HostPhase = NO_HOST_PHASE


class SyncRequest(_SyncRequestFields):
    __doc__ = _SyncRequestFields.__doc__
    __slots__ = ()

    def __new__(cls, *args: Any, found: list | None = None, warming_up: Any = None, **kwargs):
        """The fields of :class:`_SyncRequestFields`; ``found=`` and ``warming_up=``, the
        names before 0.2.0, still work for one release and warn."""
        if found is not None:
            deprecated.warn("SyncRequest(found=[...])", "SyncRequest(on_sync=found.append)")
            kwargs["on_sync"] = found.append
        if warming_up is not None:
            deprecated.warn(
                "SyncRequest(warming_up=...)",
                "SyncRequest(phase=jaxcomm.HostPhase(warming_up=...))",
            )
            phase = kwargs.get("phase", NO_HOST_PHASE)
            kwargs["phase"] = phase._replace(warming_up=warming_up)
        return super().__new__(cls, *args, **kwargs)


_DEFAULT_REQUEST = SyncRequest()


class GradientSync(NamedTuple):
    """One data-parallel gradient mean: its configuration, ``init`` and ``reduce``.

    Build it with :func:`gradient_sync` (which checks every argument); the fields are the
    arguments documented there, and ``decision_axes``, which a step builder sets. Immutable;
    ``reduce`` runs inside ``jax.shard_map`` over ``axes`` (and ``decision_axes``).

    Attributes:
      decision_axes: the data axes of the step, over which the compressor's shared
        decisions are reduced (``ReduceContext.data_axes``: fp16's overflow skip,
        adaptive's error sketch) and over which its per-device state is typed and its
        other state checked (:attr:`shared_over`); ``()``: ``axes``. A layout that
        reduces over fewer axes than the step's, each device of the others holding a
        different part of the gradients (hybrid sharding's blocks over ``'intra'``), sets
        every data axis here, so that every device takes the same decision (hybrid
        sharding leaves them at ``axes`` for PowerSGD, whose factors are each block's).
      block_axes: the data axes each device's gradients are a block over, reduced over
        them already (set by :meth:`of_blocks`); a matrix compressor's state is then
        typed per device over them too. ``()``: whole gradients.

    Example:
      >>> sync = jaxcomm.gradient_sync(compression=jaxcomm.compression.int8())
      >>> state = sync.init(params)                 # inside shard_map
      >>> mean, state = sync.reduce(grads, state)   # inside shard_map
    """

    axes: tuple[str, ...] = DATA_AXES
    algorithm: str = "hierarchical"
    topology: Any = None
    bucket_bytes: Any = None
    compression: Compressor | None = None
    warmup_steps: int = 0
    min_size: int = DEFAULT_MIN_SIZE
    compress_leaf: Callable[[str, Any], bool] | None = None
    compress_stage: str = "all"
    seed: int = 0
    decision_axes: tuple[str, ...] = ()
    block_axes: tuple[str, ...] = ()

    def of_blocks(self, over: tuple[str, ...]) -> GradientSync:
        """This sync as it runs on each device's *block* of the gradients: split over the
        data axes ``over`` (hybrid sharding's ``'intra'``) and reduced over them already
        (the node's reduce-scatter), so it reduces over its other axes only, compressing
        the whole reduction (``compress_stage='all'``).

        An elementwise compressor's shared decisions (fp16's overflow skip, adaptive's
        rung) are still reduced over every data axis (``decision_axes``), so every device
        decides alike. A matrix compressor (PowerSGD) compresses each device's block as a
        matrix of its own: its factors are averaged over the other axes only
        (``decision_axes`` left at them) and, like its residuals, are this device's, typed
        per device over every data axis (``block_axes``), so that they keep one type
        through the warm-up's ``lax.cond`` and ``jaxcomm.local_sgd``'s ``lax.switch``.

        Args:
          over: the data axes the gradients are split over, a non-empty proper subset of
            ``axes``.

        Raises:
          ValueError: ``over`` names no axis of ``axes``, or all of them.
        """
        axes = tuple(a for a in self.axes if a not in over)
        if not axes or len(axes) == len(self.axes):
            raise ValueError(
                f"GradientSync.of_blocks(over={tuple(over)}): the blocks must be split over "
                f"some but not all of the sync's axes {self.axes}; e.g. over=('intra',)."
            )
        blockwise = self.compression is not None and not self.compression.elementwise
        return self._replace(
            axes=axes,
            compress_stage="all",
            decision_axes=axes if blockwise else self.axes,
            block_axes=tuple(a for a in self.axes if a in over),
        )

    @property
    def shared_over(self) -> tuple[str, ...]:
        """Every data axis of the step: ``decision_axes``, or ``axes`` without them."""
        return self.decision_axes or self.axes

    @property
    def codec_axes(self) -> tuple[str, ...]:
        """The axes the compressor reduces over (``ReduceContext.axes``): every axis, or
        with ``compress_stage='inter'`` the outer ones."""
        return self.axes if self.compress_stage == "all" else self.axes[:-1]

    def init(self, params: Any) -> SyncGradientsState:
        """The state for gradients shaped like ``params``."""
        count = jnp.zeros((), jnp.int32)
        if self.compression is None:
            return SyncGradientsState(count=count)
        plan = _leaf_plan(self, params)
        inner = None
        if self.compress_stage == "inter" and plan.elementwise:
            try:
                inner = lax.axis_size(self.axes[-1])
            except NameError as e:
                raise ValueError(
                    "sync_gradients(compress_stage='inter').init must run inside "
                    f"jax.shard_map over axes {self.axes} (jaxcomm.data_parallel does), because "
                    "its per-device state is one intra-node shard."
                ) from e
        cstate = self.compression.init(plan.buffer_specs(inner))
        return SyncGradientsState(count, vary_per_device(cstate, self.shared_over))

    def reduce(
        self,
        grads: Any,
        state: SyncGradientsState,
        *,
        phase: HostPhase = NO_HOST_PHASE,
        warming_up: bool | None = None,
    ) -> tuple[Any, SyncGradientsState]:
        """The mean of ``grads`` over ``axes`` (each device's own gradients in, the same
        mean on every device out) and the next state; see the module docstring's stages.
        ``phase``: :class:`SyncRequest`'s (its None fields decided on the devices);
        ``warming_up``: deprecated since 0.2.0 (it warns), ``phase=HostPhase(warming_up=...)``."""
        if warming_up is not None:
            deprecated.warn(
                "GradientSync.reduce(..., warming_up=...)",
                "GradientSync.reduce(..., phase=jaxcomm.HostPhase(warming_up=...))",
            )
            phase = phase._replace(warming_up=warming_up)
        check_bound(self.axes, "sync_gradients", _UNBOUND_FIX)
        check_float_tree(grads)
        if self.compression is None:
            leaves, treedef = jax.tree.flatten(grads)
            means = _mean_plain(self, [jnp.asarray(x) for x in leaves])
            return jax.tree.unflatten(treedef, means), SyncGradientsState(count=state.count + 1)
        plan = _leaf_plan(self, grads)  # 1. policy
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(grads)]
        out: list = [None] * len(leaves)
        cstate, finite, done = state.compression, jnp.ones((), jnp.bool_), ()
        if plan.compressed:  # 2.-4. pack, codec, unpack
            ctx = ReduceContext(
                axes=self.axes,
                algorithm=self.algorithm,
                step=state.count,
                key=step_key(self.seed, state.count),
                data_axes=self.shared_over,
                choice=phase.codec_choice,
            )
            means, cstate, finite, done = _mean_compressed(
                self, plan, leaves, cstate, ctx, phase.warming_up
            )
            for i, m in zip(plan.compressed, means, strict=True):
                out[i] = m
            if not (self.block_axes and not self.compression.elementwise):
                # (a matrix compressor's state of the blocks is all per device: of_blocks)
                _check_shared_state(self.compression.name, cstate, self.shared_over)
        if plan.plain:  # 5. after everything stage 3 computed (jaxcomm.ordering)
            done = (done, cstate, finite)
            means = _mean_plain(self, [leaves[i] for i in plan.plain], after=done)
            for i, m in zip(plan.plain, means, strict=True):
                out[i] = m
        if self.compression.finite is not None:  # 6. fp16 overflow: skip the whole step
            out = [jnp.where(finite, o, jnp.zeros_like(o)) for o in out]
        out = [o.astype(x.dtype) for o, x in zip(out, leaves, strict=True)]
        new = SyncGradientsState(count=state.count + 1, compression=cstate)
        return jax.tree.unflatten(plan.treedef, out), new


def gradient_sync(
    *,
    axes: tuple[str, ...] = DATA_AXES,
    algorithm: str = "hierarchical",
    topology: Any = None,
    bucket_bytes: tuple[int, int] | str | AutoBuckets | None = None,
    compression: Compressor | None = None,
    warmup_steps: int = 0,
    min_size: int = DEFAULT_MIN_SIZE,
    compress_leaf: Callable[[str, Any], bool] | None = None,
    compress_stage: str = "all",
    seed: int = 0,
) -> GradientSync:
    """A checked :class:`GradientSync`: every argument is validated here, at construction.

    Args:
      axes: mesh axis names to average over, outermost first.
      algorithm: all-reduce algorithm, one of ``jaxcomm.collectives.ALGORITHMS``, for the
        uncompressed leaves (and the all-reduce-compatible compressors: bf16, fp16,
        random_k, PowerSGD); 'auto' picks one per packed buffer with
        ``jaxcomm.cost.choose``.
      topology: the ``jaxcomm.topology.Topology`` that 'auto' plans with; None:
        ``jaxcomm.topology.detect()`` at trace time.
      bucket_bytes: ``None``: leaves are packed as in :func:`jaxcomm.allreduce` (large
        leaves alone, small ones concatenated per dtype; all of a dtype in one buffer for
        'ring', 'tree', 'halving_doubling'). ``(min_bytes, max_bytes)``: the
        leaves of each dtype, in reverse parameter order, are cut into 1-D buckets, the
        first of ``min_bytes``, the others of ``max_bytes`` (``jaxcomm.buckets``), one
        collective per bucket. ``'auto'`` or a ``jaxcomm.buckets.AutoBuckets``: bucket
        sizes chosen at trace time to minimise predicted exposed communication
        (``jaxcomm.cost.predict`` of ``algorithm`` on ``topology``); on a platform whose
        collectives run synchronously (XLA:CPU, ``jaxcomm.backend``) nothing is hidden,
        and the fewest buckets are chosen. With an elementwise
        compressor the compressed leaves are bucketed the same way, one compressed
        collective per bucket.
      compression: a compressor from ``jaxcomm.compression`` (``None``: no compression).
      warmup_steps: the first ``warmup_steps`` steps are sent uncompressed. The step
        builders (``data_parallel``, the Flax decorators) decide on the host from the sync
        count and run one program per phase, with no conditional (``jaxcomm.phase_clock``);
        elsewhere (the sync in a ``shard_map`` of your own, the profiler's feedback step,
        microbatches reduced one by one) a ``lax.cond`` on the count decides. With 0 no
        uncompressed branch is compiled.
      min_size: leaves with fewer elements stay uncompressed (biases, norms).
      compress_leaf: optional predicate ``(path, leaf) -> bool`` (``path`` as
        ``jax.tree_util.keystr``, e.g. ``"['dense']['kernel']"``) that replaces the
        ``min_size`` rule. Leaves the compressor cannot take (PowerSGD: 1-D) stay
        uncompressed either way.
      compress_stage: ``'all'`` compresses the whole reduction; ``'inter'`` keeps full
        precision inside a node (reduce-scatter over the innermost axis, compressed mean
        over the outer axes, all-gather) -- the slow inter-node links carry compressed
        bytes, the fast intra-node links the full-precision gradient; the final intra
        all-gather carries int8/int4's quantized means (they are the result, so no
        precision is lost). Needs two or more axes.
        Decisions every device must share (fp16's overflow skip, adaptive's level) are
        still reduced over all ``axes``.
      seed: seed of the compressors' randomness (stochastic rounding, random-k); the key
        of a step is ``jaxcomm.compression.keys.step_key(seed, count)``. Two
        ``sync_gradients`` in one program with the same seed draw the same stream at equal
        counts (correlated rounding errors): give each its own seed (``local_sgd`` does,
        per fragment: ``jaxcomm.diloco.fragment_seed``).

    Returns:
      A :class:`GradientSync`.

    Raises:
      ValueError: unknown ``algorithm`` or ``compress_stage``, malformed ``axes`` or
        ``bucket_bytes``, a negative ``warmup_steps``/``min_size`` (at construction).
      TypeError: ``compression`` is not a ``jaxcomm.compression.Compressor``, or
        ``topology`` is not a Topology.

    Example:
      >>> sync = jaxcomm.gradient_sync(compression=jaxcomm.compression.int8(), min_size=1024)
    """
    axes = check_axes(axes)
    check_algorithm(algorithm)
    check_topology(topology)
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    if compression is not None and not isinstance(compression, Compressor):
        raise TypeError(
            f"compression={compression!r} is not a jaxcomm.compression.Compressor; build one "
            "with e.g. jaxcomm.compression.int8() or pass None."
        )
    for name, v in (("warmup_steps", warmup_steps), ("min_size", min_size), ("seed", seed)):
        check_int(name, v, minimum=0)
    if compress_stage not in COMPRESS_STAGES:
        raise ValueError(
            f"compress_stage={compress_stage!r} is not known; choose one of "
            f"{list(COMPRESS_STAGES)}."
        )
    if compress_stage == "inter" and len(axes) < 2:
        raise ValueError(
            f"compress_stage='inter' needs an inner (intra-node) axis, but axes={axes}; use "
            "axes=('inter', 'intra') or compress_stage='all'."
        )
    if compress_leaf is not None and not callable(compress_leaf):
        raise TypeError(f"compress_leaf={compress_leaf!r} must be a callable (path, leaf) -> bool.")
    return GradientSync(
        axes, algorithm, topology, bucket_bytes, compression, warmup_steps, min_size,
        compress_leaf, compress_stage, seed,
    )  # fmt: skip


def sync_gradients(**kwargs: Any) -> optax.GradientTransformationExtraArgs:
    """Averages gradients over the data-parallel mesh axes, optionally compressed.

    Put it first in an ``optax.chain``; its ``update`` must run inside ``jax.shard_map``
    (``jaxcomm.data_parallel`` does that). It is the optax adapter of one
    :class:`GradientSync`: ``init`` is the sync's ``init``, ``update`` its ``reduce``
    (or, with ``sync_request=SyncRequest(communicate=False)``, a pass-through).

    Args:
      **kwargs: the keyword arguments of :func:`gradient_sync` (``axes``, ``algorithm``,
        ``topology``, ``bucket_bytes``, ``compression``, ``warmup_steps``, ``min_size``,
        ``compress_leaf``, ``compress_stage``, ``seed``), documented there.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`SyncGradientsState`.

    Raises:
      ValueError, TypeError: a bad argument, at construction (:func:`gradient_sync`).

    Example:
      >>> tx = optax.chain(
      ...     jaxcomm.sync_gradients(compression=jaxcomm.compression.int8(),
      ...                            warmup_steps=100, min_size=1024),
      ...     optax.adamw(1e-3))
    """
    sync = gradient_sync(**kwargs)

    def update(grads, state, params=None, *, sync_request=None, **extra_args):
        del params, extra_args
        sync_request = sync_request or _DEFAULT_REQUEST
        if sync_request.on_sync is not None:
            sync_request.on_sync(sync)
        if sync_request.grads is not None and not _same_leaves(grads, sync_request.grads):
            if sync_request.other_input is None:
                raise ValueError(
                    other_input_message("a step", "which the step's request does not accept")
                )
            sync_request.other_input(sync, grads)
        if not sync_request.communicate:
            check_bound(sync.axes, "sync_gradients", _UNBOUND_FIX)
            return grads, state._replace(count=state.count + 1)
        if sync_request.sharded_over:  # each device's block (hybrid sharding's local_sgd)
            return sync.of_blocks(sync_request.sharded_over).reduce(
                grads, state, phase=sync_request.phase
            )
        return sync.reduce(grads, state, phase=sync_request.phase)

    return optax.GradientTransformationExtraArgs(sync.init, update)


def _same_leaves(received: Any, computed: Any) -> bool:
    """Whether every array ``received`` holds is one of ``computed`` itself (identity: the
    very traced values, so no transform ran on them; a subtree, as ``optax.masked`` or
    ``optax.partition`` hand on, is the same leaves)."""
    ids = {id(x) for x in jax.tree.leaves(computed)}
    return all(id(x) in ids for x in jax.tree.leaves(received))


NOT_COMMUTING = (
    "and that transform does not commute with the mean over devices (e.g. "
    "clip_by_global_norm, clip, per-leaf or adaptive clipping, normalisation: checked on two "
    "random gradients and their mean)"
)


def other_input_message(where: str, verdict: str = NOT_COMMUTING) -> str:
    """The refusal of a sync whose input is not the step's gradients (``where``: the step
    builder; ``verdict``: what its check found, :data:`NOT_COMMUTING` or why there is no
    check)."""
    return (
        f"{where}: jaxcomm.sync_gradients receives gradients transformed by what runs "
        "before it in the optimizer (a transform earlier in the chain, or a wrapper around "
        f"it), {verdict}. Each device would apply that transform to its own local gradient, "
        "and the average of those equals what one device computes on the whole batch only "
        "if it commutes with the mean. Put jaxcomm.sync_gradients() first, e.g. "
        "optax.chain(jaxcomm.sync_gradients(), optax.clip_by_global_norm(1.0), "
        "optax.adamw(1e-3)); a linear transform (scale, add_decayed_weights) gives the same "
        "result after it."
    )


def accepting_requests(tx: Any) -> Any:
    """``tx`` itself if its ``update`` takes keyword arguments (optax's extra arguments,
    such as ``sync_request=``), else ``optax.with_extra_args_support(tx)``.

    Objects with ``init``/``update`` methods that forward ``**extra_args`` themselves
    (``optax.MultiSteps``) are kept as they are: wrapping them would drop the arguments.
    """
    try:
        params = inspect.signature(tx.update).parameters.values()
    except (TypeError, ValueError):
        return optax.with_extra_args_support(tx)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return tx
    return optax.with_extra_args_support(tx)


# The adapter's signature is the sync's (help(), IDEs and inspect show every argument).
sync_gradients.__signature__ = inspect.signature(gradient_sync).replace(
    return_annotation=optax.GradientTransformationExtraArgs
)


# -- stages ----------------------------------------------------------------------------


def _leaf_plan(sync: GradientSync, tree: Any) -> LeafPlan:
    """Stage 1: which leaves are compressed and how they are packed."""
    bounds = None if sync.bucket_bytes is None else lambda leaves: _bucket_bounds(sync, leaves)
    return LeafPlan(
        tree, sync.compression, sync.min_size, sync.compress_leaf, sync.compress_stage, bounds
    )


def _bucket_bounds(sync: GradientSync, leaves: list) -> tuple[int, int]:
    """``(min_bytes, max_bytes)`` of the gradient buckets (chosen by the cost model for
    ``bucket_bytes='auto'``)."""
    if isinstance(sync.bucket_bytes, AutoBuckets):
        seconds = _predicted_seconds(sync.algorithm, sync.axes, sync.topology)
        overlap = not backend.current().synchronous_collectives
        return sync.bucket_bytes.choose(leaves, seconds, overlap=overlap)
    return sync.bucket_bytes


def _predicted_seconds(algorithm: str, axes: tuple[str, ...], topology: Any):
    """``nbytes -> seconds`` of one all-reduce over ``axes`` from ``jaxcomm.cost`` (inside
    shard_map): the topology (given, or detected) fitted to the mesh as 'auto' does."""
    topo = topology or detect()
    sizes = [int(lax.axis_size(a)) for a in axes]
    g = sizes[-1] if axes[-1] == INTRA else 1
    topo = fit_to_mesh(topo, int(np.prod(sizes)) // g, g)
    name = algorithm if algorithm in cost.ALGORITHMS else "auto"
    return lambda nbytes: cost.predict(name, nbytes, topo)


def _mean_plain(sync: GradientSync, leaves: list, after: Any = ()) -> list:
    """Full-precision mean of a list of leaves: leaves -> buckets -> all-reduce each; the
    collectives wait for ``after`` (``jaxcomm.ordering``)."""
    if not leaves:
        return []
    kw = {"axes": sync.axes, "algorithm": sync.algorithm, "op": "mean", "topology": sync.topology}
    if sync.bucket_bytes is None:
        return allreduce(leaves, after=after, **kw)
    lo, hi = _bucket_bounds(sync, leaves)
    plan = plan_buckets(leaves, min_bytes=lo, max_bytes=hi)
    buckets = ordering.after(plan.pack(leaves), after)
    return plan.unpack([allreduce(b, **kw) for b in buckets])


def _mean_compressed(
    sync: GradientSync, plan: LeafPlan, leaves: list, cstate: Any, ctx, warming_up=None
):
    """Stages 2-4 for the compressed leaves: ``(means, compressor state, finite, done)``,
    ``done`` the outputs the plain leaves' collectives wait for (the reduced buffers, or
    the exact step's conditional's outputs).

    A step the compressor would send in full precision (``Compressor.exact``: adaptive's
    'f32' rung) reduces the leaves plus the compressor's residual unpacked, as plain
    leaves are: packing them would cost a copy of every gradient for no compression.
    """
    f32 = all(plan.dtypes[i] == jnp.float32 for i in plan.compressed)
    codec = sync.compression
    if codec.exact is None or sync.compress_stage != "all" or not f32:
        return _mean_packed(sync, plan, leaves, cstate, ctx, warming_up)
    is_exact, residual, after = codec.exact(cstate, ctx)

    def exact(cs):
        del cs
        extra = [None] * len(leaves)
        if residual is not None:
            plan.unpack(list(residual), extra)
        xs = [leaves[i] if extra[i] is None else leaves[i] + extra[i] for i in plan.compressed]
        return _mean_plain(sync, xs), vary_per_device(after, sync.shared_over), jnp.ones((), bool)

    def lossy(cs):  # both branches type the residual alike
        means, cs, finite, _ = _mean_packed(sync, plan, leaves, cs, ctx, warming_up)
        return means, vary_per_device(cs, sync.shared_over), finite

    if isinstance(is_exact, bool):  # decided on the host (ReduceContext.choice)
        means, cstate, finite = (exact if is_exact else lossy)(cstate)
    else:
        means, cstate, finite = lax.cond(is_exact, exact, lossy, cstate)
    return means, cstate, finite, means


def _mean_packed(
    sync: GradientSync, plan: LeafPlan, leaves: list, cstate: Any, ctx, warming_up=None
):
    """Pack, the codec (behind warm-up), unpack: ``(means of the compressed leaves,
    compressor state, finite, reduced buffers)``."""
    buffers = plan.pack(leaves)
    codec = _with_warmup(sync, _codec_mean(sync, ctx), ctx.step, warming_up)
    reduced, cstate, finite = codec(buffers, cstate)
    restored = [None] * len(leaves)
    plan.unpack(reduced, restored)
    # What the plain leaves' collectives wait for: every reduced buffer; a matrix
    # compressor's many matrices are represented by the first (its state covers the rest,
    # and DataParallel.compile refuses a module whose order is still open).
    done = reduced if plan.elementwise else reduced[:1]
    return [restored[i] for i in plan.compressed], cstate, finite, done


def _codec_mean(sync: GradientSync, ctx: ReduceContext) -> Callable:
    """Stage 3: ``(buffers, state) -> (means, state, finite)`` by the compressor."""
    codec = sync.compression

    def mean(buffers, cstate):
        if sync.compress_stage == "all":
            means, cstate = codec.reduce(buffers, cstate, ctx)
        else:
            means, cstate = _codec_mean_inter(sync, buffers, cstate, ctx)
        if sync.block_axes and not codec.elementwise:
            # a matrix compressor's state of this device's blocks: per device (of_blocks)
            cstate = _vary(cstate, (*sync.axes, *sync.block_axes))
        finite = codec.finite(cstate) if codec.finite else jnp.ones((), bool)
        return means, cstate, finite

    return mean


def _with_warmup(
    sync: GradientSync, codec: Callable, step: jax.Array, warming_up: bool | None = None
) -> Callable:
    """``codec`` during the first ``warmup_steps`` steps replaced by the uncompressed mean:
    as the step builder decided on the host (``warming_up``: one program per phase, no
    conditional), else a ``lax.cond`` on the shared step count; ``codec`` itself without
    warm-up."""
    if sync.warmup_steps == 0 or warming_up is False:
        return codec

    def uncompressed(buffers, cstate):
        kw = {"axes": sync.axes, "algorithm": sync.algorithm, "topology": sync.topology}
        return allreduce(buffers, op="mean", **kw), cstate, jnp.ones((), bool)

    if warming_up:
        return uncompressed
    return lambda buffers, cstate: lax.cond(
        step < sync.warmup_steps, uncompressed, codec, buffers, cstate
    )


def _codec_mean_inter(sync: GradientSync, buffers: list, cstate: Any, ctx: ReduceContext):
    """``compress_stage='inter'``: full precision inside the node, compressed across.

    1. reduce-scatter each buffer over the inner axis (each device keeps the intra-node
       mean of ``1/g`` of it);
    2. the compressor's mean of the shards over the outer axes;
    3. all-gather over the inner axis, by the compressor (``ReduceContext.gather_axis``):
       a codec that can gathers its encoded means (int8/int4 send a quarter of the f32
       bytes), the others their means.
    """
    codec = sync.compression
    inner = sync.axes[-1]
    g = lax.axis_size(inner)
    ctx = ctx._replace(axes=sync.codec_axes)
    if not codec.elementwise:
        return codec.reduce([lax.pmean(b, inner) for b in buffers], cstate, ctx)
    shards, sizes = [], []
    for b in buffers:
        padded, _ = pad_to_multiple(b, g)
        shards.append((reduce_scatter(padded, inner) / g).astype(b.dtype))
        sizes.append(b.shape[0])
    outs, cstate = codec.reduce(shards, cstate, ctx._replace(gather_axis=inner))
    for o, sh in zip(outs, shards, strict=True):
        if o.shape != (g * sh.shape[0],):
            raise ValueError(
                f"compressor {codec.name!r} returned a mean of shape {o.shape} for a shard "
                f"of {sh.shape[0]} elements over {g} devices with ReduceContext.gather_axis="
                f"{inner!r}; it must return {(g * sh.shape[0],)} (every device's mean, "
                "concatenated): build it with compression.base.from_codec, or gather the "
                "means with compression.base.gather_means."
            )
    return [o[:n] for o, n in zip(outs, sizes, strict=True)], cstate


# -- state typing ----------------------------------------------------------------------


def _vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Every leaf of ``tree`` typed varying over ``axes`` (inside shard_map; free)."""

    def vary(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(vary, tree)


def vary_per_device(cstate: Any, axes: tuple[str, ...]) -> Any:
    """Types ``PerDevice`` leaves as varying over ``axes`` (inside shard_map; free at run
    time), so that state carried through ``lax.scan`` / ``lax.cond`` keeps one type: the
    update makes residuals varying, and a carry must not change type."""
    try:
        for a in axes:
            lax.axis_size(a)
    except NameError:
        return cstate  # outside shard_map (abstract init for specs): nothing to type

    return jax.tree.map(
        lambda n: PerDevice(_vary(n.value, axes)) if isinstance(n, PerDevice) else n,
        cstate,
        is_leaf=lambda n: isinstance(n, PerDevice),
    )


# The name jaxcomm.diloco imports until it takes the public one.


def _check_shared_state(name: str, cstate: Any, axes: tuple[str, ...]) -> None:
    """Refuses compressor state that varies across devices without a ``PerDevice`` mark.

    Such state (a level, a skip flag, a shared factor) steers later steps; if it differed
    between devices they would run different ``lax.switch`` branches or skip different
    steps. Inside ``shard_map(check_vma=True)`` its type says whether it can differ; with
    the check off nothing is known and nothing is refused.
    """
    marked = marked_per_device(cstate)
    flat = jax.tree_util.tree_flatten_with_path(cstate)[0]
    for (path, x), per in zip(flat, marked, strict=True):
        vary = sorted(varying_axes(x) & set(axes))
        if vary and not per:
            raise ValueError(
                f"compressor {name!r}: its state field {jax.tree_util.keystr(path)} varies "
                f"over mesh axes {vary} but is not marked jaxcomm.PerDevice. State that steers "
                "later steps must be the same on every device: reduce the signals it is "
                "computed from over every data axis (compression.base.decision_axes), or wrap "
                "genuinely per-device state (error-feedback residuals) in PerDevice."
            )
