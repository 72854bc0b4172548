"""Sharded optimizer state: ZeRO stage 1/2 with ZeRO++-style quantized collectives.

``jaxcomm.data_parallel(..., shard_optimizer=True)`` runs its step over a
:class:`ShardedOptimizer` (the layout strategy of the step core, ``jaxcomm.layout``);
``jaxcomm.nnx_data_parallel(mesh, shard_optimizer=True)`` and ``linen_data_parallel`` run
the same :class:`ShardedOptimizer` inside the user's step.
Params stay replicated (every device computes the forward and backward pass on them, as in
data parallelism), but the optimizer state and the update are split into ``N`` equal
shards, one per device of the data axes (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020: stages 1 and 2). One step:

1. **pack**: each gradient leaf is zero-padded to a multiple of ``N`` and cut into ``N``
   equal *pieces*, device ``r`` owning piece ``r`` of every leaf (:class:`ShardPlan`);
   the leaves are packed into flat buffers (``jaxcomm.packing.BufferPlan``): buckets of
   whole leaves of one dtype, at most ``bucket_bytes`` each (64 MiB; XLA frees each
   bucket's buffers after its collectives, so the step's temporaries stay near one copy
   of the gradients), laid out so that chunk ``r`` of a buffer is device ``r``'s pieces.
2. **reduce-scatter**, hierarchical: over the innermost axis first (``'intra'``, inside a
   node), then over the outer ones (``'inter'``, across nodes, on ``1/g`` of the data),
   so device ``r`` (``lax.axis_index`` over the axes innermost first) ends with the mean
   of chunk ``r``. f32 by default; with the sync's compressor where it has a
   ``reduce_scatter`` (``bf16``, ``int8``, ``int4``: quantized per stage, ZeRO++'s qgZ,
   Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
   Training", 2023).
3. **optimizer on the shard**: the transforms after ``sync_gradients`` run on this
   device's pieces of the gradient and of the params, in the params' own tree (the same
   paths, every leaf 1-D: a weight-decay mask chosen by path picks the same leaves as
   without sharding), with their state for those pieces only: Adam's moments take
   ``1/N`` of the memory.
   ``optax.clip_by_global_norm`` is replaced by a twin whose squared norm is summed over
   the data axes (:func:`clip_by_global_norm`).
4. **all-gather** the updated param chunks, outermost axis first (the reverse of step 2):
   f32 by default; with ``param_gather=`` a compressor with an ``all_gather``
   (``bf16()``, ``int8()``: ZeRO++'s qwZ), in which case each device keeps its f32 master
   chunk in the optimizer state and every device, the owner included, computes with the
   decoded gathered values, so the replicated params agree bit for bit.

Which optimizers shard: those whose update acts elementwise on each leaf (Adam, AdamW,
SGD with momentum, Lion, schedules, weight decay and masks chosen by path), plus
``clip_by_global_norm``. The decision is a **probe** at build time
(:func:`refuse_unshardable`): the transforms run on random gradients (the last with an
``inf``), on the params' own tree as data parallelism runs them and on the ``N`` devices'
pieces (a ``jax.vmap`` per data axis standing in for the devices), and must give the same
updates; one that does not (a transform that reads a leaf's shape or a per-leaf norm, a
Shampoo-style preconditioner, a mask chosen by a leaf's shape, ``optax.apply_if_finite``
deciding from one device's piece) is refused naming its position in the ``optax.chain``.

The stored state is a ``TrainState`` like data parallelism's (orbax saves it as it is):
a per-device leaf ``(N, m)`` read row after row is its param leaf, flattened and padded,
whatever ``bucket_bytes`` was, so :meth:`ShardedOptimizer.reshard`
(``DataParallel.reshard``) lays out a state written on another device count and a state
written with other buckets restores as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import all_gather_invariant, reduce_scatter
from jaxcomm.compression.base import BufferCodec, Compressor
from jaxcomm.compression.keys import dither_seed, step_key
from jaxcomm.layout import ReplicatedParams
from jaxcomm.microbatch import update_with_value
from jaxcomm.packing import BufferPlan, plan_groups
from jaxcomm.state import (
    infer_per_device,
    leaf_specs,
    marked_per_device,
    stack_leaves,
    varying_axes,
)
from jaxcomm.sync import (
    DEFAULT_MIN_SIZE,
    NO_HOST_PHASE,
    GradientSync,
    HostPhase,
    SyncGradientsState,
    SyncRequest,
    accepting_requests,
)
from jaxcomm.validate import check_int

__all__ = [
    "ShardPlan",
    "ShardedOptimizer",
    "ShardedState",
    "clip_by_global_norm",
    "make_shard_plan",
    "per_device_bytes",
    "refuse_unshardable",
    "shard_options",
]

# Bytes of one bucket of packed gradients and params (make_shard_plan): XLA frees each
# bucket's buffers after its collective, so the step's temporaries stay near one model's
# gradients instead of two more copies (the packed buffer and the gathered one).
DEFAULT_BUCKET_BYTES = 64 * 2**20

# The probe runs on the real parameter shapes up to this many elements, beyond on the
# same tree with every dimension capped at _PROBE_DIM (a build-time cost, not a step's).
_PROBE_ELEMENTS = 1 << 22
_PROBE_DIM = 16


class ShardedState(NamedTuple):
    """Optimizer state of a sharded step (``TrainState.opt_state``).

    Attributes:
      inner: the state of the transforms after ``sync_gradients`` for this device's
        piece of each param leaf, in the params' tree (stored with a leading axis of one
        entry per device, sharded along the data axes: Adam's ``mu`` is a tree like the
        params whose leaves are ``(N, m_i)``; scalars such as Adam's count stay
        replicated).
      master: with a lossy ``param_gather``, this device's f32 pieces of the params (the
        master copy the update applies to), in the params' tree; ``()`` otherwise.
    """

    inner: Any
    master: Any = ()


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which device owns which slice of each param leaf, and how the slices are packed.

    Attributes:
      plan: the ``jaxcomm.packing.BufferPlan``: buckets of whole leaves of one dtype
        (:func:`make_shard_plan`), one collective each.
      devices: ``N``, the number of devices over the data axes.
      axes: the data axes, outermost first.

    Each leaf is split on its own: leaf ``i`` of ``n_i`` elements, zero-padded to ``N
    m_i`` (``m_i = ceil(n_i / N)``), gives device ``r = lax.axis_index(axes)`` (row-major,
    its row in the stacked state) its *piece*, elements ``[r m_i, (r + 1) m_i)``. The
    optimizer runs on the tree of pieces (the params' own tree structure, every leaf
    1-D), so a state leaf stacked ``(N, m_i)`` read row after row is its param leaf,
    flattened and padded, whatever the buckets: the buckets only say which pieces travel
    in one collective. A bucket's buffer is its leaves' ``(N, m_i)`` rows side by side,
    flattened: device ``r``'s chunk (the concatenation of its pieces, ``M = sum m_i``
    elements) is ``[r M, (r + 1) M)``.

    Example:
      >>> splan = make_shard_plan(jax.tree.leaves(params), 8, ('inter', 'intra'))
      >>> pieces = splan.local(jax.tree.leaves(params))        # inside shard_map
    """

    plan: BufferPlan
    devices: int
    axes: tuple[str, ...]

    @property
    def piece_elements(self) -> list[int]:
        """``m_i`` of each leaf: the elements of that leaf one device owns."""
        return [-(-int(np.prod(s, dtype=np.int64)) // self.devices) for s in self.plan.shapes]

    @property
    def chunk_elements(self) -> list[int]:
        """``M`` of each buffer: the elements one device owns (its pieces, side by side)."""
        m = self.piece_elements
        return [sum(m[i] for i, _, _ in b.pieces) for b in self.plan.buffers]

    def rows(self, leaf: jax.Array, i: int) -> jax.Array:
        """Leaf ``i`` flattened, zero-padded and cut into ``(N, m_i)``: row ``r`` is device
        ``r``'s piece."""
        m = self.piece_elements[i]
        flat = jnp.ravel(leaf)
        return jnp.pad(flat, (0, self.devices * m - flat.shape[0])).reshape(self.devices, m)

    def padded(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """The leaves packed into the buffers (``N M`` elements each, chunk ``r`` at
        ``[r M, (r + 1) M)``)."""
        out = []
        for b in self.plan.buffers:
            rows = [self.rows(leaves[i], i) for i, _, _ in b.pieces]
            out.append((rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)).reshape(-1))
        return out

    def split(self, chunks: Sequence[jax.Array]) -> list[jax.Array]:
        """One chunk per buffer -> the pieces, one per leaf (in leaf order)."""
        m, out = self.piece_elements, [None] * len(self.plan.shapes)
        for b, chunk in zip(self.plan.buffers, chunks, strict=True):
            start = 0
            for i, _, _ in b.pieces:
                out[i] = chunk[start : start + m[i]]
                start += m[i]
        return out

    def join(self, pieces: Sequence[jax.Array]) -> list[jax.Array]:
        """The inverse of :meth:`split`: one piece per leaf -> one chunk per buffer."""
        out = []
        for b in self.plan.buffers:
            parts = [pieces[i] for i, _, _ in b.pieces]
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return out

    def rank(self) -> jax.Array:
        """This device's chunk index (inside ``jax.shard_map``): its row-major position
        over the data axes, the row it has in the stacked optimizer state."""
        return lax.axis_index(self.axes)

    def scatter_order(self, buf: jax.Array) -> jax.Array:
        """A padded buffer with its chunks reordered (the axes reversed: ``(M, g, m)`` ->
        ``(g, M, m)``), so that a reduce-scatter over the innermost axis and then the outer
        ones leaves device ``r`` chunk ``r`` (inside ``jax.shard_map``)."""
        return _reverse_axes(buf, [lax.axis_size(a) for a in self.axes])

    def natural_order(self, full: jax.Array) -> jax.Array:
        """The inverse of :meth:`scatter_order`, for what the gathers (outermost axis first)
        return."""
        return _reverse_axes(full, [lax.axis_size(a) for a in reversed(self.axes)])

    def local(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """This device's piece of each leaf (inside ``jax.shard_map``)."""
        r = self.rank()
        return [
            lax.dynamic_index_in_dim(self.rows(x, i), r, keepdims=False)
            for i, x in enumerate(leaves)
        ]

    def unpack(self, full: Sequence[jax.Array]) -> list[jax.Array]:
        """Gathered buffers (``N M`` elements each, in natural order) -> the leaves."""
        m, out = self.piece_elements, [None] * len(self.plan.shapes)
        for b, f in zip(self.plan.buffers, full, strict=True):
            rows, start = f.reshape(self.devices, -1), 0
            for i, _, _ in b.pieces:
                shape = self.plan.shapes[i]
                n = int(np.prod(shape, dtype=np.int64))
                out[i] = rows[:, start : start + m[i]].reshape(-1)[:n].reshape(shape)
                start += m[i]
        return out


def _reverse_axes(buf: jax.Array, sizes: Sequence[int]) -> jax.Array:
    """``buf`` viewed as ``(*sizes, m)`` with its first ``len(sizes)`` axes reversed."""
    k = len(sizes)
    if k < 2:
        return buf
    x = buf.reshape(*sizes, -1)
    return x.transpose(*range(k - 1, -1, -1), k).reshape(-1)


def make_shard_plan(
    leaves: Sequence[Any],
    devices: int,
    axes: tuple[str, ...],
    bucket_bytes: int | None = None,
) -> ShardPlan:
    """A :class:`ShardPlan` of ``leaves`` (arrays or ``ShapeDtypeStruct`` s).

    The leaves of each dtype (dtypes in order of their first leaf), in tree order, are cut
    into buckets of whole leaves of at most ``bucket_bytes`` each (a larger leaf is a
    bucket of its own; ``None``: one bucket per dtype); each bucket is one buffer. The
    stored state does not depend on the buckets (each leaf is split on its own,
    :class:`ShardPlan`), so a state written with one ``bucket_bytes`` or device count
    restores under another (:meth:`ShardedOptimizer.reshard` for the device count).
    """
    buckets: dict[Any, list[list[int]]] = {}
    filled: dict[Any, int] = {}
    for i, x in enumerate(leaves):
        dtype = jnp.result_type(x)
        nbytes = int(np.prod(np.shape(x))) * jnp.dtype(dtype).itemsize
        runs = buckets.setdefault(dtype, [[]])
        if runs[-1] and bucket_bytes is not None and filled[dtype] + nbytes > bucket_bytes:
            runs.append([])
            filled[dtype] = 0
        runs[-1].append(i)
        filled[dtype] = filled.get(dtype, 0) + nbytes
    groups = [run for runs in buckets.values() for run in runs]
    return ShardPlan(plan_groups(leaves, groups), int(devices), tuple(axes))


def clip_by_global_norm(
    max_norm: float, axes: tuple[str, ...] | None = None
) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` that also clips updates split over devices: the
    squared norm of this device's updates summed over the axes they are split over (zero
    padding adds nothing; a leaf typed the same on every device along them, as hybrid
    sharding's leaves kept whole, counted once), then optax's rule: scale every update
    by ``max_norm / norm`` where the norm exceeds it.

    The axes are ``axes`` if given, else those the step's request names
    (``jaxcomm.SyncRequest.sharded_over``: the data axes with ``shard_optimizer=True``,
    none otherwise), so the same chain clips alike sharded or not.

    Args:
      max_norm: the maximum global norm.
      axes: the mesh (or ``jax.vmap``) axes the updates are split over; None: the
        request's.

    Returns:
      A stateless ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> tx = optax.chain(jaxcomm.sync_gradients(), clip_by_global_norm(1.0),
      ...                  optax.adam(1e-3))
    """

    def update(updates, state, params=None, *, sync_request=None, **extra_args):
        del params, extra_args
        over = tuple(axes if axes is not None else getattr(sync_request, "sharded_over", ()))
        g_norm = jnp.sqrt(_squared_norm(updates, over))
        trigger = g_norm < max_norm
        clip = lambda t: lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def _squared_norm(updates: Any, over: tuple[str, ...]) -> jax.Array:
    """The squared global norm of updates split over the axes ``over``: each leaf's
    squares summed over the axes of ``over`` it is typed varying over, so a leaf typed
    the same along them (hybrid sharding's leaves kept whole on every device of a node)
    counts once, not once per device. Without replication types (``check_vma=False``, a
    ``jax.vmap`` axis) every leaf is taken as split over all of ``over``."""
    if not over:
        return optax.tree.norm(updates, squared=True)
    # The device index varies over its axis exactly when shard_map types values.
    typed = bool(varying_axes(lax.axis_index(over[0])))
    groups: dict[tuple[str, ...], list] = {}
    for x in jax.tree.leaves(updates):
        split = tuple(a for a in over if a in varying_axes(x)) if typed else tuple(over)
        groups.setdefault(split, []).append(x)
    parts = []
    for split, xs in groups.items():
        squared = optax.tree.norm(xs, squared=True)
        parts.append(lax.psum(squared, split) if split else squared)
    return functools.reduce(jnp.add, parts) if parts else jnp.zeros((), jnp.float32)


_CHAIN_FIX = (
    "{where}(shard_optimizer=True) needs the optimizer as "
    "optax.chain(jaxcomm.sync_gradients(...), *transforms), the sync first: the "
    "sync's compressor reduce-scatters the gradients and the transforms after it "
    "run on each device's shard, e.g. optax.chain(jaxcomm.sync_gradients(), "
    "optax.adamw(1e-3))."
)


def split_state(state: Any, where: str = "data_parallel") -> tuple[Any, tuple]:
    """The state of ``optax.chain(jaxcomm.sync_gradients(...), *transforms)`` (a tuple,
    one entry per transform) -> ``(the sync's SyncGradientsState, the transforms'
    states)``; ``where`` names the step builder in the errors.

    Raises:
      ValueError: the state is not such a chain's (another optimizer, a wrapper around
        the chain, the sync elsewhere), or holds a second sync's state.
    """
    chain = isinstance(state, tuple) and not hasattr(state, "_fields") and len(state) > 0
    if not chain or not isinstance(state[0], SyncGradientsState):
        raise ValueError(_CHAIN_FIX.format(where=where))
    is_sync = lambda x: isinstance(x, SyncGradientsState)  # noqa: E731
    for k, rest in enumerate(state[1:], start=1):
        if any(is_sync(x) for x in jax.tree.leaves(rest, is_leaf=is_sync)):
            raise ValueError(
                f"{where}(shard_optimizer=True): a second jaxcomm.sync_gradients at "
                f"optax.chain position [{k}]; keep one, first in the chain."
            )
    return state[0], tuple(state[1:])


def _check_sync(sync: GradientSync, axes: tuple[str, ...], where: str) -> None:
    """Refuses sync settings the sharded step does not implement."""
    if tuple(sync.axes) != tuple(axes):
        raise ValueError(
            f"{where}(shard_optimizer=True): sync_gradients(axes={sync.axes}) differs "
            f"from the step's axes={axes}; give both the same data axes."
        )
    unsupported = [
        (name, value)
        for name, value, default in (
            ("algorithm", sync.algorithm, "hierarchical"),
            ("min_size", sync.min_size, DEFAULT_MIN_SIZE),
            ("warmup_steps", sync.warmup_steps, 0),
            ("bucket_bytes", sync.bucket_bytes, None),
            ("compress_leaf", sync.compress_leaf, None),
        )
        if value != default
    ]
    if unsupported:
        name, value = unsupported[0]
        raise NotImplementedError(
            f"{where}(shard_optimizer=True) does not implement sync_gradients("
            f"{name}={value!r}): the sharded step reduce-scatters each packed buffer whole "
            "(compressed whole, small leaves too), hierarchically. Leave it at its default."
        )
    comp = sync.compression
    if comp is not None and (
        comp.codec is None or comp.codec.reduce_scatter is None or _keeps_residuals(comp)
    ):
        raise ValueError(
            f"{where}(shard_optimizer=True): compressor {comp.name!r} has no "
            "reduce-scatter (a compressed reduce-scatter is what the sharded step sends), "
            "or keeps error-feedback residuals (a shard has no place for them). "
            "Use compression=None (f32), jaxcomm.compression.bf16(), int8() or int4() "
            "(without error_feedback), or shard_optimizer=False."
        )


def _keeps_residuals(comp: Compressor) -> bool:
    """Whether ``comp``'s state holds per-device residuals (error feedback)."""
    state = comp.init([jax.ShapeDtypeStruct((8,), jnp.float32)])
    return any(marked_per_device(state))


def check_param_gather(param_gather: Any, where: str = "data_parallel") -> BufferCodec | None:
    """The codec of ``param_gather`` if it is None or a compressor whose codec has an
    ``all_gather``, else raises."""
    if param_gather is None:
        return None
    codec = getattr(param_gather, "codec", None) if isinstance(param_gather, Compressor) else None
    if codec is None or codec.all_gather is None:
        raise ValueError(
            f"{where}(param_gather={param_gather!r}): expected None (f32 gathers) or "
            "a compressor with an all_gather: jaxcomm.compression.bf16(), int8() or int4() "
            "(ZeRO++ qwZ: blockwise int8 weights); it needs shard_optimizer=True."
        )
    return codec


def _check_bucket_bytes(bucket_bytes: Any, where: str) -> int:
    return check_int(
        f"{where}(shard_bucket_bytes)",
        bucket_bytes,
        minimum=1,
        fix="give a positive number of bytes, e.g. 64 * 2**20",
    )


def shard_options(
    where: str, shard_optimizer: Any, param_gather: Any, bucket_bytes: Any
) -> dict | None:
    """The sharding arguments of a step builder (``data_parallel``, the Flax decorators),
    checked at construction: the :class:`ShardedOptimizer` keyword arguments, or None
    without ``shard_optimizer``.

    Raises:
      TypeError: ``shard_optimizer`` is not a bool.
      ValueError: ``param_gather`` or ``shard_bucket_bytes`` without
        ``shard_optimizer=True``, or a value they do not take.
    """
    if not isinstance(shard_optimizer, bool):
        raise TypeError(f"{where}(shard_optimizer={shard_optimizer!r}) must be True or False.")
    if not shard_optimizer:
        for arg, value in (("param_gather", param_gather), ("shard_bucket_bytes", bucket_bytes)):
            if value is not None:
                raise ValueError(
                    f"{where}({arg}={value!r}) needs shard_optimizer=True: without sharding "
                    "every device holds the updated params already."
                )
        return None
    check_param_gather(param_gather, where)
    if bucket_bytes is None:
        bucket_bytes = DEFAULT_BUCKET_BYTES
    return {"param_gather": param_gather, "bucket_bytes": _check_bucket_bytes(bucket_bytes, where)}


def _scatter_mean(
    buf: jax.Array,
    axes: tuple[str, ...],
    codec: BufferCodec | None,
    seed: Callable,
    *,
    compress_inner: bool = True,
) -> jax.Array:
    """Step 2: the mean of this device's chunk of ``buf``, innermost axis first; each
    stage through ``codec`` where there is one, but the innermost (inside the node) in
    f32 with ``compress_inner=False`` (the sync's ``compress_stage='inter'``)."""
    if codec is None or buf.dtype != jnp.float32:
        for a in reversed(axes):
            buf = reduce_scatter(buf, a)
        n = int(np.prod([lax.axis_size(a) for a in axes]))
        return (buf / n).astype(buf.dtype)
    for stage, a in enumerate(reversed(axes)):
        if compress_inner or stage > 0:
            buf = codec.reduce_scatter(buf, a, seed(stage))
        else:
            buf = reduce_scatter(buf, a) / lax.axis_size(a)
    return buf


def _gather(chunk: jax.Array, axes: tuple[str, ...], codec: BufferCodec | None) -> jax.Array:
    """Step 4: every device's chunk, outermost axis first, typed invariant."""
    if codec is None or chunk.dtype != jnp.float32:
        for a in axes:
            chunk = all_gather_invariant(chunk, a)
        return chunk
    return codec.all_gather(chunk, axes).astype(chunk.dtype)


def _relayout(x: Any, devices: int, m: int, sharding: NamedSharding) -> jax.Array:
    """A stacked ``(N', m')`` chunk leaf as ``(devices, m)``: the rows read as one buffer,
    cut or zero-padded to ``devices * m``."""

    def move(x):
        flat = x.reshape(-1)[: devices * m]
        return jnp.pad(flat, (0, devices * m - flat.shape[0])).reshape(devices, m)

    return jax.jit(move, out_shardings=sharding)(x)


def _check_piece(path: str, shape: tuple, devices: int, m: int) -> None:
    """Refuses a stored ``(N', m')`` piece leaf that cannot hold the same leaf as this
    step's ``(devices, m)``: the leaf's ``n`` elements give ``m' = ceil(n / N')`` and
    ``m = ceil(n / devices)``, so some ``n`` must fit both."""
    n_old, m_old = shape
    low = max((m_old - 1) * n_old, (m - 1) * devices) + 1
    if min(m_old * n_old, m * devices) < low:
        raise ValueError(
            f"reshard: the optimizer state's {path} has {n_old} pieces of {m_old} elements "
            f"(a leaf of {(m_old - 1) * n_old + 1}..{m_old * n_old} elements), this step's "
            f"{devices} pieces of {m} (a leaf of {(m - 1) * devices + 1}..{m * devices}): "
            "it was written for other params. Restore a state written by a sharded step "
            "with the same params and optimizer."
        )


def relayout_pieces(x: Any, path: str, devices: int, m: int, sharding: NamedSharding) -> jax.Array:
    """A sharded optimizer's stacked ``(N', m')`` chunk leaf laid out as ``(devices, m)``
    pieces (the rule of :meth:`ShardedOptimizer.reshard`, for one leaf): its rows read as
    one buffer are its param leaf, cut or zero-padded to ``devices * m``.

    Args:
      x: the leaf written on ``N'`` devices; path: its path, for the message.
      devices, m: this step's pieces and their size; sharding: where they go.

    Raises:
      ValueError: no leaf size fits both layouts (the state of other params).
    """
    _check_piece(path, tuple(jnp.shape(x)), devices, m)
    return _relayout(x, devices, m, sharding)


def per_device_bytes(tree: Any) -> int:
    """Bytes of ``tree`` held by one device, read from each leaf's sharding: a concrete
    array's first addressable shard, or a ``jax.ShapeDtypeStruct``'s ``shard_shape``."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += x.addressable_shards[0].data.nbytes
        else:
            shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
            total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return total


def _probe_updates(tx: Any, params: Any, grads: tuple, axes: tuple, sizes: tuple):
    """Updates of ``tx`` (from init, one per gradient of ``grads``, its sync passing the
    gradients through) on the params' own tree, as data parallelism runs it, and on the
    tree of the ``N`` devices' pieces, as the sharded step runs it (vmapped over ``axes``
    of ``sizes``; the whole tree under axes of size 1, so the sync finds its axes):
    ``(whole, sharded)``, per update one flat array per leaf (its ``n_i`` real
    elements)."""
    leaves, treedef = jax.tree.flatten(params)
    splan = make_shard_plan(leaves, int(np.prod(sizes)), axes)
    sizes_of = [int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves]

    def updates(over, p, *gs):
        s, out = tx.init(p), []
        for g in gs:
            request = SyncRequest(communicate=False, grads=g, sharded_over=over)
            update = functools.partial(tx.update, sync_request=request)
            u, s = update_with_value(update, g, s, p, lambda: jnp.zeros((), jnp.float32))
            p = optax.apply_updates(p, u)
            out.append(u)
        return out

    def flat(tree, cut):  # one 1-D array per leaf, its real elements
        return [
            cut(x).reshape(-1)[:n]
            for x, n in zip(treedef.flatten_up_to(tree), sizes_of, strict=True)
        ]

    def lift(tree):  # a leading axis of size 1 per data axis
        return jax.tree.map(lambda x: jnp.asarray(x)[(None,) * len(axes)], tree)

    def vmapped(fn):
        for a in reversed(axes):
            fn = jax.vmap(fn, axis_name=a)
        return fn

    # One program each: op by op, every operation of every leaf is a dispatch (and a
    # compile per shape) of its own (ResNet-50's 161 leaves: 15.2 s op by op, 11.6 s
    # compiled).
    drop = lambda x: jnp.ravel(x.reshape(x.shape[len(axes) :]))  # noqa: E731
    whole_fn = jax.jit(vmapped(functools.partial(updates, ())))
    whole = whole_fn(lift(params), *(lift(g) for g in grads))
    whole = [flat(u, drop) for u in whole]

    def split(tree):  # each leaf as (sizes..., m_i): the devices' pieces, row-major
        m = splan.piece_elements
        rows = [
            splan.rows(x, i).reshape(*sizes, m[i])
            for i, x in enumerate(treedef.flatten_up_to(tree))
        ]
        return jax.tree.unflatten(treedef, rows)

    fn = vmapped(functools.partial(updates, tuple(axes)))
    sharded = jax.jit(fn)(split(params), *(split(g) for g in grads))
    return whole, [flat(u, lambda x: x) for u in sharded]


def _agree(whole: list, sharded: list) -> bool:
    for w, s in zip(whole, sharded, strict=True):
        for a, b in zip(w, s, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            finite = np.isfinite(a)
            if not np.array_equal(finite, np.isfinite(b)) or not np.array_equal(
                a[~finite], b[~finite], equal_nan=True
            ):
                return False  # inf, -inf and NaN in the same places
            a, b = a[finite], b[finite]
            if np.linalg.norm(a - b) > 1e-4 * (np.linalg.norm(a) + 1e-30):
                return False
    return True


def _probe_gradients(p: list, rng: np.random.Generator) -> tuple:
    """Three gradients (lists of leaves like ``p``) for the probe: a large one and a small
    one (so clipping shows), then a small one with one ``inf`` (in the first float leaf),
    so a decision taken on each device's piece alone (``optax.apply_if_finite``) shows."""

    def draw(scale):
        return [(scale * rng.standard_normal(x.shape)).astype(x.dtype) for x in p]

    large, small, bad = draw(1e2), draw(1e-3), draw(1e-3)
    for x in bad:
        if x.size and jnp.issubdtype(x.dtype, jnp.inexact):
            x.reshape(-1)[0] = np.inf
            break
    return large, small, bad


def refuse_unshardable(
    optimizer: Any,
    params: Any,
    axes: tuple[str, ...],
    sizes: tuple,
    where: str = "data_parallel",
) -> None:
    """Refuses an optimizer whose update on the devices' pieces differs from data
    parallelism's on the whole params.

    The probe: three updates from ``init`` on random gradients (a large one and a small
    one, so clipping shows; then one with an ``inf``), the sync passing them through
    (``SyncRequest(communicate=False)``), once on the params' own tree (what data
    parallelism runs) and once on the tree of the ``N`` devices' pieces (what the sharded
    step runs: the same tree structure and paths, every leaf a 1-D piece; a ``jax.vmap``
    per data axis, named like it, with ``SyncRequest.sharded_over`` naming them, so
    :func:`clip_by_global_norm`'s sum over the axes runs). The updates must agree to 1e-4
    relative, with non-finite values in the same places. Parameter trees over ``2**22``
    elements are probed on the same tree with each dimension capped at 16.

    Args:
      optimizer: the optimizer, ``optax.chain(jaxcomm.sync_gradients(...), *transforms)``.
      params: the params (a pytree of arrays or ``ShapeDtypeStruct`` s), in the tree
        the optimizer is given.
      axes: the data axes; sizes: their sizes.
      where: the step builder, for the error.

    Raises:
      ValueError: saying why the transforms do not shard.
    """
    leaves, treedef = jax.tree.flatten(params)
    shapes = [tuple(np.shape(x)) for x in leaves]
    if sum(int(np.prod(s)) for s in shapes) > _PROBE_ELEMENTS:
        shapes = [tuple(min(d, _PROBE_DIM) for d in s) for s in shapes]
    rng = np.random.default_rng(0)
    dtypes = [jnp.result_type(x) for x in leaves]
    p = [np.asarray(rng.standard_normal(s), dtype=t) for s, t in zip(shapes, dtypes, strict=True)]
    p, *grads = [jax.tree.unflatten(treedef, x) for x in (p, *_probe_gradients(p, rng))]
    why = _unshardable(optimizer, p, tuple(grads), axes, sizes)
    if why is not None:
        raise ValueError(
            f"{where}(shard_optimizer=True): the transforms after jaxcomm.sync_gradients "
            f"do not shard: {why}. Sharded optimizer state needs transforms that act "
            "elementwise on each leaf (adam, adamw, sgd, lion, add_decayed_weights, masks "
            "chosen by path, schedules) or jaxcomm.sharded.clip_by_global_norm. Use "
            "shard_optimizer=False for this optimizer."
        )


def _unshardable(tx: Any, p: Any, grads: tuple, axes: tuple, sizes: tuple) -> str | None:
    """Why the probe of :func:`refuse_unshardable` refuses ``tx``, or None."""
    try:
        # The third gradient holds an inf on purpose: numpy's warnings about it
        # (0 * inf in sgd(0.0)) would only alarm the user.
        with np.errstate(invalid="ignore", over="ignore"):
            whole, sharded = _probe_updates(tx, p, grads, axes, sizes)
    except Exception as e:  # noqa: BLE001 (the reason is reported)
        return f"they fail on the flat 1-D pieces ({type(e).__name__}: {e})"
    if not _agree(whole[:2], sharded[:2]):
        return (
            "on the devices' flat 1-D pieces of the params they give another update "
            "than on whole leaves (a transform reads a leaf's shape or a statistic of a "
            "leaf or of all the updates: a Shampoo-style preconditioner, per-leaf "
            "clipping or normalisation, a mask or label chosen by a leaf's shape or ndim, "
            "optax.clip_by_global_norm's norm of each device's pieces alone: use "
            "jaxcomm.sharded.clip_by_global_norm)"
        )
    if not _agree(whole[2:], sharded[2:]):
        return (
            "after a gradient with one inf they give another update than data "
            "parallelism: a transform decides from each device's piece alone (optax."
            "apply_if_finite, a skip on non-finite values: one device would skip the "
            "step, the others take it)"
        )
    return None


class ShardedOptimizer(ReplicatedParams):
    """The sharded update of one ``optax.chain(jaxcomm.sync_gradients(...), *transforms)``:
    steps 1-4 of the module docstring on lists of leaves, and the layout of its
    :class:`ShardedState`. ``data_parallel(shard_optimizer=True)`` and the Flax front ends
    (``nnx_data_parallel(mesh, shard_optimizer=True)``) build one and run it inside their
    ``jax.shard_map`` step.

    Args:
      optimizer: the chain, the sync first.
      mesh: the mesh; axes: its data axes.
      param_gather: None (f32 gathers) or a compressor with an ``all_gather``.
      bucket_bytes: the bound of one bucket of packed leaves (:func:`make_shard_plan`).
      where: the step builder, named in errors.

    Raises:
      ValueError / NotImplementedError: at construction, a ``param_gather`` or
        ``bucket_bytes`` it does not take (:func:`check_param_gather`); at
        :meth:`infer_layout`, an optimizer that is not such a chain (:func:`split_state`),
        sync settings the sharded step does not implement, or transforms that do not
        shard (:func:`refuse_unshardable`).

    The optimizer runs whole on this device's pieces: its ``sync_gradients``, told by the
    request that the step reduce-scattered the gradients already
    (``SyncRequest(communicate=False)``), passes them through, and reports its
    :class:`~jaxcomm.GradientSync` (``SyncRequest.on_sync``), whose configuration
    (compressor, seed, ``compress_stage``) the reduce-scatter uses; the chain's state is
    stored without the sync's (``ShardedState.inner``: the transforms' states).

    Example:
      >>> engine = ShardedOptimizer(tx, mesh, ('inter', 'intra'))
      >>> per = engine.infer_layout(params)
      >>> state = engine.init_fn(per)(params)          # chunks stacked along the axes
      >>> new_leaves, opt = engine.update(grads, opt, params, step, value)  # in shard_map
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        mesh: Any,
        axes: tuple[str, ...],
        *,
        param_gather: Compressor | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        where: str = "data_parallel",
    ):
        self.where = where
        self.param_gather = check_param_gather(param_gather, where)
        self.bucket_bytes = _check_bucket_bytes(bucket_bytes, where)
        self.optimizer = accepting_requests(optimizer)
        self.sync: GradientSync | None = None  # reported by the chain's sync (infer_layout)
        self.mesh, self.axes = mesh, tuple(axes)
        self.num_devices = int(np.prod([mesh.shape[a] for a in axes]))
        self.shard_plan: ShardPlan | None = None
        self.treedef: Any = None  # of the params: the optimizer sees its pieces in it
        self.paths: list[str] = []  # of the ShardedState's leaves
        self.local: Any = None  # one device's ShardedState, abstract
        self.per: list[bool] = []  # per leaf of the ShardedState: stored per device
        self.local_sgd = False  # the gradient is taken at the replicated params

    @property
    def syncs(self) -> list[GradientSync]:
        """The one sync the step runs (its configuration reduce-scatters), once
        :meth:`infer_layout` found it."""
        return [] if self.sync is None else [self.sync]

    def _pieces(self, pieces: Sequence[jax.Array]) -> Any:
        """This device's pieces (one per leaf) in the params' tree: what the transforms see,
        so that a mask or label chosen by path (``optax.adamw(..., mask=...)``,
        ``optax.masked``, ``optax.partition``) picks the same leaves as without sharding."""
        return jax.tree.unflatten(self.treedef, list(pieces))

    def init_local(self, leaves: Sequence[jax.Array]) -> ShardedState:
        """This device's :class:`ShardedState` for the param ``leaves`` (in shard_map)."""
        pieces = self._pieces(self.shard_plan.local(leaves))
        master = pieces if self.param_gather is not None else ()
        _, inner = split_state(self.optimizer.init(pieces), self.where)
        return ShardedState(inner, master)

    def _request(self, grads: Any, on_sync: Callable | None = None) -> SyncRequest:
        """What the chain's sync is told: the step reduced ``grads`` (this device's pieces)
        already, over :attr:`axes`; a sync that receives anything else is refused."""

        def other_input(sync, _):
            del sync
            raise ValueError(_CHAIN_FIX.format(where=self.where))

        return SyncRequest(False, on_sync, grads, other_input, self.axes)

    def _chain_update(self, grads: Any, inner: Any, own: Any, value: Callable) -> tuple:
        """The whole chain on the pieces (its sync passing them through, its state for
        the occasion): ``(updates, the transforms' new states)``."""
        state = (self.sync.init(grads), *inner)
        update = functools.partial(self.optimizer.update, sync_request=self._request(grads))
        updates, state = update_with_value(update, grads, state, own, value)
        return updates, tuple(state[1:])

    def update(
        self,
        grads: Sequence[jax.Array],
        opt: ShardedState,
        params: Sequence[jax.Array],
        step: jax.Array,
        value: Callable[[], jax.Array],
    ) -> tuple[list[jax.Array], ShardedState]:
        """Steps 1-4 of the module docstring (inside ``jax.shard_map``).

        Args:
          grads: this device's gradient leaves; opt: its :class:`ShardedState`.
          params: the replicated param leaves (both in the leaf order of the params
            :meth:`infer_layout` was given); step: the step count (dither seeds).
          value: returns the loss, for a transform that takes optax's ``value``.

        Returns:
          ``(new param leaves, new ShardedState)``, the params typed invariant.
        """
        splan, comp = self.shard_plan, self.sync.compression
        codec = comp.codec if comp is not None else None
        key = step_key(self.sync.seed, step)
        device = lax.axis_index(self.axes)
        compress_inner = self.sync.compress_stage == "all"
        chunks = []
        for k, buf in enumerate(splan.padded(grads)):
            seed = lambda stage, k=k: dither_seed(key, device, k, stage)  # noqa: E731
            buf = splan.scatter_order(buf)
            chunks.append(_scatter_mean(buf, self.axes, codec, seed, compress_inner=compress_inner))
        gathered = self.param_gather is not None
        own = opt.master if gathered else self._pieces(splan.local(params))
        updates, inner = self._chain_update(
            self._pieces(splan.split(chunks)), opt.inner, own, value
        )
        new = optax.apply_updates(own, updates)
        sent = splan.join(self.treedef.flatten_up_to(new))
        full = [splan.natural_order(_gather(x, self.axes, self.param_gather)) for x in sent]
        return splan.unpack(full), ShardedState(inner, new if gathered else ())

    def infer_layout(self, params: Any) -> list[bool]:
        """Which leaves of the :class:`ShardedState` are per device: those typed varying
        over the data axes after ``init`` or after an update (``state.infer_per_device``);
        then the transforms are probed (:func:`refuse_unshardable`).

        Args:
          params: the params (arrays or ``jax.ShapeDtypeStruct`` s), as the optimizer
            sees them.
        """
        leaves, self.treedef = jax.tree.flatten(params)
        self.shard_plan = make_shard_plan(leaves, self.num_devices, self.axes, self.bucket_bytes)
        replicated = NamedSharding(self.mesh, P())
        abstract = [
            jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p), sharding=replicated)
            for p in leaves
        ]
        axes = frozenset(self.axes)
        rec: dict[str, Any] = {}

        def init_probe(p):
            s = self.init_local(p)
            self._find_sync(p)
            flat, rec["treedef"] = jax.tree_util.tree_flatten_with_path(s)
            rec["paths"] = [jax.tree_util.keystr(k) for k, _ in flat]
            rec["local"] = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in flat]
            rec["vary"] = [bool(varying_axes(x) & axes) for _, x in flat]
            return jnp.zeros(())

        probe_map = functools.partial(
            jax.shard_map, mesh=self.mesh, in_specs=(P(),), out_specs=P(), check_vma=True
        )
        jax.eval_shape(probe_map(init_probe), abstract)
        local = jax.tree.unflatten(rec["treedef"], rec["local"])

        def update_probe(s, p):
            g = lax.pcast([jnp.zeros_like(x) for x in p], self.axes, to="varying")
            _, s2 = self.update(g, s, p, jnp.zeros((), jnp.int32), lambda: jnp.zeros(()))
            return [bool(varying_axes(x) & axes) for x in jax.tree.leaves(s2)]

        per = infer_per_device(
            update_probe, local, rec["vary"], self.mesh, self.axes, args=(abstract,),
            arg_specs=(P(),),
        )  # fmt: skip
        self.paths, self.local, self.per = rec["paths"], local, per
        sizes = tuple(int(self.mesh.shape[a]) for a in self.axes)
        refuse_unshardable(self.optimizer, params, self.axes, sizes, self.where)
        return per

    def _find_sync(self, leaves: Sequence[jax.Array]) -> None:
        """Sets :attr:`sync`: the chain's one sync, as it reports itself when the update
        traces (inside the layout probe's ``shard_map``), checked for what the sharded
        step implements."""
        pieces = self._pieces(self.shard_plan.local(leaves))
        found: list[GradientSync] = []
        update = functools.partial(
            self.optimizer.update, sync_request=self._request(pieces, found.append)
        )
        zero = lambda: jnp.zeros((), jnp.float32)  # noqa: E731 (value= for the trace only)
        update_with_value(update, pieces, self.optimizer.init(pieces), pieces, zero)
        syncs = list({id(x): x for x in found}.values())
        if len(syncs) != 1:
            raise ValueError(_CHAIN_FIX.format(where=self.where))
        _check_sync(syncs[0], self.axes, self.where)
        self.sync = syncs[0]

    def init_fn(self, per: list[bool]) -> Callable:
        """The init: the replicated params (their tree, or its leaves) -> the
        :class:`ShardedState`, its per-device leaves stacked along the data axes (one
        chunk per device), jitted."""

        def init(p):
            s = self.init_local(p)
            leaves, treedef = jax.tree.flatten(s)
            missing = lambda x: tuple(a for a in self.axes if a not in varying_axes(x))  # noqa: E731
            leaves = [
                lax.pcast(x, missing(x), to="varying") if f and missing(x) else x
                for x, f in zip(leaves, per, strict=True)
            ]
            return stack_leaves(jax.tree.unflatten(treedef, leaves), per)

        jitted = jax.jit(
            jax.shard_map(
                init,
                mesh=self.mesh,
                in_specs=(P(),),
                out_specs=leaf_specs(self.local, per, self.axes),
            )
        )
        return lambda params: jitted(jax.tree.leaves(params))

    def check_step(self, *, feedback: bool, communicate: bool) -> None:
        """Refuses the profiler's feedback input and the compute-only twin."""
        if feedback or not communicate:
            raise NotImplementedError(
                f"{self.where}(shard_optimizer=True): the profiler's feedback and its "
                "compute-only twin are not implemented for sharded optimizer state."
            )

    def step(
        self,
        grads: Any,
        opt_state: ShardedState,
        params: Any,
        step: jax.Array,
        value: Callable[[], jax.Array],
        *,
        update: Callable | None = None,
        communicate: bool = True,
        phase: HostPhase = NO_HOST_PHASE,
    ) -> tuple[Any, ShardedState, Any]:
        """:meth:`update` on trees (``jaxcomm.layout.OptimizerLayout.step``): ``(new
        params, new ShardedState, done)``, ``done`` the new params (the outputs'
        collectives wait for the gathers). ``update``, ``communicate`` and ``phase``
        do not apply (the step reduce-scatters itself, with no warm-up; :meth:`check_step`
        refuses the twin)."""
        del update, communicate, phase
        leaves, new_opt = self.update(
            jax.tree.leaves(grads), opt_state, jax.tree.leaves(params), step, value
        )
        new = jax.tree.unflatten(jax.tree.structure(params), leaves)
        return new, new_opt, new

    def reshard(self, opt_state: Any, stacked: NamedSharding) -> Any:
        """``opt_state`` of a sharded step on another device count laid out for this one
        (after :meth:`infer_layout`), its per-device leaves placed with ``stacked``.

        Each per-device leaf ``(N', m')`` read row after row is its param leaf, flattened
        (device ``r`` owns piece ``r``; zero padding at the end; :class:`ShardPlan`): it
        is cut or zero-padded to ``N m`` and split into this step's ``(N, m)``. The
        padding is never unpacked into params, so the real elements move unchanged;
        replicated leaves are copied. The layout does not depend on ``bucket_bytes``.

        Raises:
          ValueError: the optimizer state does not have this step's structure, a
            per-device leaf is not one piece per device, or its size fits no leaf of
            the size this step's leaf has (another params tree).
        """
        replicated = NamedSharding(self.mesh, P())
        leaves, treedef = jax.tree.flatten(opt_state)
        if len(leaves) != len(self.per):
            raise ValueError(
                f"reshard: the optimizer state has {len(leaves)} leaves, this step's "
                f"{len(self.per)}; restore a state written by a sharded step with the same "
                "optimizer and params."
            )
        out = []
        local = jax.tree.leaves(self.local)
        for x, f, loc, path in zip(leaves, self.per, local, self.paths, strict=True):
            if not f:
                out.append(jax.device_put(x, replicated))
                continue
            if loc.ndim != 1 or jnp.ndim(x) != 2:
                raise ValueError(
                    f"reshard: a per-device leaf of shape {jnp.shape(x)} is not one 1-D chunk "
                    "per device; only chunked state (Adam's moments, master chunks) reshards."
                )
            _check_piece(path, jnp.shape(x), self.num_devices, loc.shape[0])
            out.append(_relayout(x, self.num_devices, loc.shape[0], stacked))
        return jax.tree.unflatten(treedef, out)
