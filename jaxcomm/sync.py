"""``sync_gradients``: the optax transform that averages gradients across data-parallel devices.

With ``compression=``, one step runs:

1. **leaves -> policy**: every gradient leaf is either *compressed* (``min_size``
   elements or more, or what the ``compress_leaf`` predicate says, and a shape the
   compressor supports) or *plain*.
2. **plain leaves** go through ``jaxcomm.allreduce(algorithm=...)`` in full precision.
3. **compressed leaves** are packed (elementwise compressors: one flat 1-D buffer per
   dtype; matrix compressors such as PowerSGD: the leaves themselves) and handed to
   ``compressor.reduce``; with ``compress_stage='inter'`` only the inter-node stage is
   compressed (full-precision reduce-scatter inside a node; the all-gather inside a node
   moves the compressor's encoded means where it can, ``Compressor.gathers``: int8/int4).
   A step the compressor would send whole (``Compressor.exact``: adaptive's f32 rung) is a
   ``lax.cond`` branch instead that all-reduces the f32 leaves plus its residual unpacked,
   as plain leaves are (``compress_stage='all'``).
4. during the first ``warmup_steps`` steps a ``lax.cond`` sends the compressed leaves
   uncompressed instead (no branch at all when ``warmup_steps=0``).

The compressor's state (error-feedback residuals, PowerSGD's ``Q``, the adaptive level)
is nested in :class:`SyncGradientsState`, hence in the optimizer state and in every
checkpoint.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import cost, ordering
from jaxcomm.buckets import AutoBuckets, check_bucket_bytes, plan_buckets
from jaxcomm.collectives import (
    all_gather_invariant,
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
from jaxcomm.compression.base import Compressor, ReduceContext, step_key
from jaxcomm.mesh import DATA_AXES, INTRA
from jaxcomm.policy import LeafPlan
from jaxcomm.state import PerDevice, marked_per_device, varying_axes
from jaxcomm.topology import detect
from jaxcomm.validate import check_int

__all__ = [
    "COMPRESS_STAGES",
    "SyncGradientsState",
    "is_pre_reduced",
    "pre_reduced",
    "reducer_probe",
    "sync_gradients",
    "sync_probe",
]

COMPRESS_STAGES = ("all", "inter")
# Leaves under this many elements (biases, norm scales) stay uncompressed by default: they
# are a small share of the bytes and the most sensitive to quantization.
DEFAULT_MIN_SIZE = 1024


class SyncGradientsState(NamedTuple):
    """State of :func:`sync_gradients`.

    Attributes:
      count: number of synchronised steps (int32); compressors key their randomness and
        warm-up on it.
      compression: the compressor's state (``()`` without compression).
    """

    count: jax.Array
    compression: Any = ()


# Trace-time record of sync_gradients calls, so the step builder can refuse an optimizer
# that never synchronises (its params would silently drift apart across devices).
_SYNC_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxcomm_sync_calls", default=None
)


# Set by the microbatch loop of ``data_parallel``: gradients that reach sync_gradients were
# already reduced (one microbatch at a time, overlapped with the next one's compute).
_PRE_REDUCED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxcomm_pre_reduced", default=False
)
# Trace-time record of the stateful gradient reducers of sync_gradients (for the microbatch
# loop of data_parallel(..., accumulate='overlap')).
_REDUCERS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxcomm_reducers", default=None
)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value: Any):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def sync_probe():
    """Context manager yielding a list that gets one entry per traced ``sync_gradients``."""
    return _scoped(_SYNC_CALLS, [])


def reducer_probe():
    """Context manager yielding a list that gets the stateful reducer
    ``(grads, SyncGradientsState) -> (reduced grads, SyncGradientsState)`` of each traced
    ``sync_gradients`` (its own update; used by ``jaxcomm.microbatch`` in 'overlap' mode)."""
    return _scoped(_REDUCERS, [])


def pre_reduced():
    """Context manager inside which ``sync_gradients`` passes gradients through (they were
    reduced already, or this is the profiler's compute-only twin)."""
    return _scoped(_PRE_REDUCED, True)


_UNBOUND_FIX = (
    "Call the optimizer's update inside jax.shard_map over a mesh with these axes, e.g. "
    "through jaxcomm.data_parallel(...)."
)


def is_pre_reduced() -> bool:
    """Whether :func:`pre_reduced` is active (``data_parallel`` then builds a step whose
    params may differ across devices, so it cannot run shard_map's replication check)."""
    return _PRE_REDUCED.get()


def _predicted_seconds(algorithm: str, axes: tuple[str, ...], topology: Any):
    """``nbytes -> seconds`` of one all-reduce over ``axes`` from ``jaxcomm.cost`` (inside
    shard_map): the topology (given, or detected) fitted to the mesh as 'auto' does."""
    topo = topology or detect()
    sizes = [int(lax.axis_size(a)) for a in axes]
    g = sizes[-1] if axes[-1] == INTRA else 1
    topo = fit_to_mesh(topo, int(np.prod(sizes)) // g, g)
    name = algorithm if algorithm in cost.ALGORITHMS else "auto"
    return lambda nbytes: cost.predict(name, nbytes, topo)


def _vary_per_device(cstate: Any, axes: tuple[str, ...]) -> Any:
    """Types ``PerDevice`` leaves as varying over ``axes`` (inside shard_map; free at run
    time), so that state carried through ``lax.scan`` / ``lax.cond`` keeps one type: the
    update makes residuals varying, and a carry must not change type."""
    try:
        for a in axes:
            lax.axis_size(a)
    except NameError:
        return cstate  # outside shard_map (abstract init for specs): nothing to type

    def vary(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(
        lambda n: PerDevice(jax.tree.map(vary, n.value)) if isinstance(n, PerDevice) else n,
        cstate,
        is_leaf=lambda n: isinstance(n, PerDevice),
    )


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


def sync_gradients(
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
) -> optax.GradientTransformation:
    """Averages gradients over the data-parallel mesh axes, optionally compressed.

    Put it first in an ``optax.chain``; its ``update`` must run inside ``jax.shard_map``
    (``jaxcomm.data_parallel`` does that).

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
        (``jaxcomm.cost.predict`` of ``algorithm`` on ``topology``). With an elementwise
        compressor the compressed leaves are bucketed the same way, one compressed
        collective per bucket.
      compression: a compressor from ``jaxcomm.compression`` (``None``: no compression).
      warmup_steps: the first ``warmup_steps`` steps are sent uncompressed (``lax.cond``
        on the step count). With 0 no uncompressed branch is compiled.
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
        of a step is ``jaxcomm.compression.base.step_key(seed, count)``. Two
        ``sync_gradients`` in one program with the same seed draw the same stream at equal
        counts (correlated rounding errors): give each its own seed (``local_sgd`` does,
        per fragment: ``jaxcomm.diloco.fragment_seed``).

    Returns:
      An ``optax.GradientTransformation`` with state :class:`SyncGradientsState`.

    Raises:
      ValueError: unknown ``algorithm`` or ``compress_stage``, malformed ``axes`` or
        ``bucket_bytes``, a
        negative ``warmup_steps``/``min_size`` (at construction).
      TypeError: ``compression`` is not a ``jaxcomm.compression.Compressor``, or
        ``topology`` is not a Topology.

    Example:
      >>> tx = optax.chain(
      ...     jaxcomm.sync_gradients(compression=jaxcomm.compression.int8(),
      ...                            warmup_steps=100, min_size=1024),
      ...     optax.adamw(1e-3))
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

    def bucket_bounds(leaves) -> tuple[int, int]:
        if isinstance(bucket_bytes, AutoBuckets):
            return bucket_bytes.choose(leaves, _predicted_seconds(algorithm, axes, topology))
        return bucket_bytes

    def reduce_plain(leaves: list) -> list:
        """Full-precision mean of a list of leaves: leaves -> buckets -> all-reduce each."""
        if not leaves:
            return []
        if bucket_bytes is None:
            return allreduce(leaves, axes=axes, algorithm=algorithm, op="mean", topology=topology)
        lo, hi = bucket_bounds(leaves)
        plan = plan_buckets(leaves, min_bytes=lo, max_bytes=hi)
        reduced = [
            allreduce(b, axes=axes, algorithm=algorithm, op="mean", topology=topology)
            for b in plan.pack(leaves)
        ]
        return plan.unpack(reduced)

    def reduce_tree(grads: Any) -> Any:
        check_float_tree(grads)
        leaves, treedef = jax.tree.flatten(grads)
        return jax.tree.unflatten(treedef, reduce_plain([jnp.asarray(x) for x in leaves]))

    def plan_for(tree):
        bounds = None if bucket_bytes is None else bucket_bounds
        return LeafPlan(tree, compression, min_size, compress_leaf, compress_stage, bounds)

    def init(params: Any) -> SyncGradientsState:
        count = jnp.zeros((), jnp.int32)
        if compression is None:
            return SyncGradientsState(count=count)
        plan = plan_for(params)
        inner = None
        if compress_stage == "inter" and plan.elementwise:
            try:
                inner = lax.axis_size(axes[-1])
            except NameError as e:
                raise ValueError(
                    "sync_gradients(compress_stage='inter').init must run inside "
                    f"jax.shard_map over axes {axes} (jaxcomm.data_parallel does), because "
                    "its per-device state is one intra-node shard."
                ) from e
        return SyncGradientsState(
            count, _vary_per_device(compression.init(plan.buffer_specs(inner)), axes)
        )

    def reduce_compressed(buffers, cstate, ctx: ReduceContext):
        if compress_stage == "all":
            return compression.reduce(buffers, cstate, ctx)
        inner, outer = axes[-1], axes[:-1]
        g = lax.axis_size(inner)
        ctx = ctx._replace(axes=outer)
        if not compression.elementwise:
            means = [lax.pmean(b, inner) for b in buffers]
            return compression.reduce(means, cstate, ctx)
        # Full precision inside the node: each device keeps the intra-node mean of 1/g.
        shards, sizes = [], []
        for b in buffers:
            padded, _ = pad_to_multiple(b, g)
            shard = reduce_scatter(padded, inner)
            shards.append((shard / g).astype(b.dtype))
            sizes.append(b.shape[0])
        if compression.gathers:
            # The compressor gathers its encoded means over the node (int8: 1/4 of the f32
            # bytes on the intra-node all-gather), then decodes.
            outs, cstate = compression.reduce(shards, cstate, ctx._replace(gather_axis=inner))
            for o, sh in zip(outs, shards, strict=True):
                if o.shape != (g * sh.shape[0],):
                    raise ValueError(
                        f"compressor {compression.name!r} has gathers=True but returned a mean "
                        f"of shape {o.shape} for a shard of {sh.shape[0]} elements over "
                        f"{g} devices; it must return {(g * sh.shape[0],)} (every device's "
                        "mean, concatenated), or set gathers=False."
                    )
            return [o[:n] for o, n in zip(outs, sizes, strict=True)], cstate
        outs, cstate = compression.reduce(shards, cstate, ctx)
        outs = [all_gather_invariant(o, inner)[:n] for o, n in zip(outs, sizes, strict=True)]
        return outs, cstate

    def update(grads: Any, state: SyncGradientsState, params: Any = None):
        del params
        calls = _SYNC_CALLS.get()
        if calls is not None:
            calls.append(axes)
        check_bound(axes, "sync_gradients", _UNBOUND_FIX)
        reducers = _REDUCERS.get()
        if reducers is not None:
            # The microbatch loop calls this very update once per microbatch, threading the
            # state (count, compressor state) through its scan.
            reducers.append(update)
        if _PRE_REDUCED.get():
            # Gradients were reduced already (microbatch loop), or this is the profiler's
            # compute-only twin: no collective at all, compressor state untouched.
            return grads, state._replace(count=state.count + 1)
        if compression is None:
            return reduce_tree(grads), SyncGradientsState(count=state.count + 1)

        check_float_tree(grads)
        plan = plan_for(grads)
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(grads)]
        out: list = [None] * len(leaves)
        # 2. compressed leaves (warm-up, exact steps and adaptive rungs are conditionals).
        ok = jnp.ones((), jnp.bool_)
        cstate = state.compression
        if plan.compressed:
            ctx = ReduceContext(
                axes=axes,
                algorithm=algorithm,
                step=state.count,
                key=step_key(seed, state.count),
                data_axes=axes,
            )

            def compressed(bufs, cs):
                reduced, cs = reduce_compressed(bufs, cs, ctx)
                good = compression.finite(cs) if compression.finite else jnp.ones((), bool)
                return reduced, cs, good

            def packed(cs):
                buffers = plan.pack(leaves)
                if warmup_steps > 0:
                    # 4. warm-up: the same leaves, uncompressed, while count < warmup_steps.
                    def uncompressed(bufs, cs):
                        reduced = allreduce(
                            bufs, axes=axes, algorithm=algorithm, op="mean", topology=topology
                        )
                        return reduced, cs, jnp.ones((), bool)

                    reduced, cs, good = lax.cond(
                        state.count < warmup_steps, uncompressed, compressed, buffers, cs
                    )
                else:
                    reduced, cs, good = compressed(buffers, cs)
                restored = [None] * len(leaves)
                plan.unpack(reduced, restored)
                return [restored[i] for i in plan.compressed], cs, good

            f32 = all(plan.dtypes[i] == jnp.float32 for i in plan.compressed)
            if compression.exact is not None and compress_stage == "all" and f32:
                # A step the compressor would send in full precision (adaptive's 'f32'
                # rung): the leaves plus its residual, reduced unpacked as plain leaves
                # are; packing them costs as much as the all-reduce on a CPU.
                is_exact, residual, after = compression.exact(cstate, ctx)

                def exact(cs):
                    del cs
                    extra = [None] * len(leaves)
                    if residual is not None:
                        plan.unpack(list(residual), extra)
                    xs = [leaves[i] if extra[i] is None else leaves[i] + extra[i]
                          for i in plan.compressed]  # fmt: skip
                    return reduce_plain(xs), _vary_per_device(after, axes), jnp.ones((), bool)

                def lossy(cs):  # both branches type the residual alike
                    reduced, cs, good = packed(cs)
                    return reduced, _vary_per_device(cs, axes), good

                reduced, cstate, ok = lax.cond(is_exact, exact, lossy, cstate)
            else:
                reduced, cstate, ok = packed(cstate)
            for i, r in zip(plan.compressed, reduced, strict=True):
                out[i] = r
            _check_shared_state(compression.name, cstate, axes)
        # 3. plain leaves, full precision, after everything the compressed path computed
        # (means, compressor state, the finiteness flag) is complete: its conditionals
        # could still be running their collectives otherwise (jaxcomm.ordering).
        if plan.plain:
            done = ([out[i] for i in plan.compressed], cstate, ok)
            plain = reduce_plain(ordering.after([leaves[i] for i in plan.plain], *done))
            for i, r in zip(plan.plain, plain, strict=True):
                out[i] = r
        if compression.finite is not None:
            # fp16 overflow: skip the whole step (all leaves), counted in the state.
            out = [jnp.where(ok, o, jnp.zeros_like(o)) for o in out]
        out = [o.astype(x.dtype) for o, x in zip(out, leaves, strict=True)]
        reduced_tree = jax.tree.unflatten(plan.treedef, out)
        return reduced_tree, SyncGradientsState(count=state.count + 1, compression=cstate)

    return optax.GradientTransformation(init, update)
