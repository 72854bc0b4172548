"""PowerSGD: rank-``r`` gradient approximation with two small all-reduces per step.

Each gradient leaf is viewed as a matrix ``M`` of ``n = prod(shape[:-1])`` rows (inputs,
and a kernel's spatial taps) and ``m = shape[-1]`` columns (outputs). PyTorch's
``powerSGD_hook`` views the same leaf, in PyTorch's layout, as ``T = M^T`` (outputs first,
``tensor.view(shape[0], -1)``); the steps below are the hook's on ``T``, written on ``M``:

1. ``M <- g + e`` (error feedback, per device).
2. Orthogonalize the warm-start ``Q`` (``n x r``; the same on every device, it was
   all-reduced), as the hook does before every use; a column that is exactly zero (a
   matrix whose gradient was zero: a zero-initialised residual branch at step 0) first
   restarts from a seeded random column, else it would stay zero for ever.
3. ``P = M^T Q`` (``m x r``; the hook's ``T Q``), **all-reduce** ``P`` (mean), and
   orthogonalize it (QR, in f32): ``P_hat``.
4. ``Q = M P_hat`` (the hook's ``T^T P_hat``), **all-reduce** ``Q`` (mean).
5. The synchronised gradient is ``Q P_hat^T`` (= ``mean(M) P_hat P_hat^T``); this
   device's residual is ``M - Q_local P_hat^T``, whose mean over devices is exactly what
   the approximation missed.

Matrices are computed in batches (:func:`shape_groups`; a batch zero-pads its matrices
to a shared shape). All ``P`` of one step travel in one all-reduce, all ``Q`` in a second,
through the configured algorithm, padding included (``max_padding`` bounds it). Wire bytes:
``r (n + m)`` instead of ``n m`` per matrix (1024 x 1024, rank 4: 0.0078 of an f32
all-reduce). A matrix with ``n m <= min_compression_rate r (n + m)`` (and every 1-D leaf)
is left to the uncompressed all-reduce, as in the hook.

Hierarchical (``sync_gradients(compress_stage='inter')``): the gradients arrive averaged
over the node (the inner, fast axis), so every device of a node holds the same ``M``;
each then sends ``1/g`` of the packed ``P`` (and ``Q``) across nodes (an all-reduce over
the outer axes only) and the node all-gathers the pieces: the bytes across a node's link
are those of one all-reduce of ``P`` and ``Q`` between nodes, the hook's with one rank per
node, and every device of a node holds the same factors.

The hook's ``start_powerSGD_iter`` (plain all-reduce before it, error feedback from it)
is ``sync_gradients(warmup_steps=...)``. Where the results differ from the hook's, and
why: docs/compression.md (PowerSGD).

References:
  Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization" (NeurIPS 2019); PyTorch ``powerSGD_hook``
  (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm import backend
from jaxcomm.collectives import all_gather_invariant, pad_to_multiple
from jaxcomm.compression import error_feedback as ef
from jaxcomm.compression import keys
from jaxcomm.compression.base import (
    Compressor,
    ReduceContext,
    axes_size,
    check_range,
    decision_axes,
    sum_over,
)
from jaxcomm.packing import plan_groups
from jaxcomm.validate import check_int

__all__ = ["PowerSGDState", "matrix_shape", "orthogonalize", "powersgd", "shape_groups"]


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    The compressed matrices are batched by :func:`shape_groups` (groups in order of first
    appearance): a group holds matrices of one rank ``r``, zero-padded to the group's
    largest ``(N, M)``; the state holds one entry per group, its ``g`` matrices stacked in
    leaf order, so that a step reads and writes one array per group rather than one per
    leaf. A checkpoint restores only into the same layout: the same compressed leaves,
    ``rank`` and ``max_padding``.

    Attributes:
      q: tuple of f32 ``(g, N, r)`` stacks, one per group, rows past a matrix's own ``n``
        zero; replicated (all-reduced every step), the warm start of the next step.
      residual: ``PerDevice`` tuple of f32 ``(g N, M)`` residuals, one per group (the
        group's padded matrices stacked along rows, zero outside each matrix's ``n x m``
        block), or ``()`` without error feedback.
    """

    q: tuple
    residual: Any


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view PowerSGD uses: all but the last axis flattened into rows."""
    return int(np.prod(shape[:-1])), int(shape[-1])


def orthogonalize(p: jax.Array) -> jax.Array:
    """Orthonormal columns spanning ``p`` (reduced QR), zero columns kept zero.

    Zero rows of ``p`` stay exactly zero (a Householder vector is zero wherever its column
    is), so a matrix zero-padded with rows gets its own QR's result, padded.

    Args:
      p: an ``(n, r)`` matrix, or a batch ``(..., n, r)`` of them (one QR per matrix,
        computed together).

    Returns:
      ``p``'s shape: orthonormal columns where ``p``'s QR has a nonzero diagonal, zero
      columns elsewhere.

    Example:
      >>> p_hat = orthogonalize(m @ q)   # PowerSGD's step 3
    """
    if p.ndim > 2 and backend.current().qr_one_at_a_time:  # a CPU deadlock (backend 9)
        flat = p.reshape(-1, *p.shape[-2:])
        q, r = jax.lax.map(jnp.linalg.qr, flat)
        q, r = q.reshape(*p.shape[:-2], *q.shape[-2:]), r.reshape(*p.shape[:-2], *r.shape[-2:])
    else:
        q, r = jnp.linalg.qr(p)
    # A zero column (e.g. a zero gradient) gives a zero diagonal; keep it zero, not NaN.
    # The diagonal as a strided slice (not jnp.diagonal's gather), which XLA fuses into
    # the masking: one kernel fewer per batch.
    k = min(r.shape[-2:])  # = q's columns
    diag = r[..., :k, :k].reshape(*r.shape[:-2], k * k)[..., :: k + 1]
    nonzero = jnp.abs(diag) > 0
    return jnp.where(jnp.isfinite(q), q, 0.0) * jnp.where(nonzero, 1.0, 0.0)[..., None, :]


def shape_groups(
    shapes: list[tuple[int, int, int]], *, max_padding: float = 0.0
) -> list[list[int]]:
    """Batches of ``(n, m, r)`` matrices: equal shapes, then merged by zero padding.

    PowerSGD stacks each group into one batch, so that a ResNet's hundreds of matrices
    cost a few batched products and QRs (PyTorch's ``powerSGD_hook`` batches same-shape
    matrices the same way). Compile time grows with the number of batches (each is its
    own set of XLA kernels), so groups of one rank ``r`` are merged further, a merged
    group padding every matrix to its largest ``n`` and ``m``: greedily, the merge that
    adds the fewest padded elements first, while the padding of all groups stays within
    ``max_padding`` times the matrices' own elements.

    Args:
      shapes: ``(n, m, r)`` per matrix.
      max_padding: padded elements allowed, as a fraction of the real ones (0: equal
        shapes only).

    Returns:
      Lists of matrix indices, each in increasing order, the groups in order of their
      first index.

    Example:
      >>> shape_groups([(4, 3, 2), (5, 3, 2), (4, 3, 2)])
      [[0, 2], [1]]
      >>> shape_groups([(4, 3, 2), (5, 3, 2), (4, 3, 2)], max_padding=0.2)
      [[0, 1, 2]]
    """
    exact: dict[tuple[int, int, int], list[int]] = {}
    for i, s in enumerate(shapes):
        exact.setdefault(tuple(s), []).append(i)
    groups = list(exact.values())

    def padded(g: list[int]) -> int:
        return len(g) * max(shapes[i][0] for i in g) * max(shapes[i][1] for i in g)

    real = sum(int(n) * int(m) for n, m, _ in shapes)
    extra = sum(padded(g) for g in groups) - real
    while len(groups) > 1:
        best = None
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                if shapes[groups[a][0]][2] != shapes[groups[b][0]][2]:
                    continue
                cost = padded(groups[a] + groups[b]) - padded(groups[a]) - padded(groups[b])
                if best is None or cost < best[0]:
                    best = (cost, a, b)
        if best is None or extra + best[0] > max_padding * real:
            break
        cost, a, b = best
        groups[a] = sorted(groups[a] + groups.pop(b))
        extra += cost
    return sorted(groups)


def _pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x`` zero-padded at the end of each axis to ``shape``."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape, strict=True)])


# Zero rows the stacked QRs of _orthogonalize_batches may add, as a fraction of the real
# rows: a QR of (n, r) costs O(n r^2), r / m of a product's O(n m r), so doubling its rows
# is noise, while each batch's QR is a custom call and a masking kernel of its own, to
# lower and compile.
_QR_PADDING = 1.0


def _orthogonalize_batches(ps: list[jax.Array]) -> list[jax.Array]:
    """:func:`orthogonalize` of each ``(g, n, r)`` batch, batches of similar ``n`` stacked
    into one QR: their matrices zero-padded to the stack's largest ``(n, r)`` (zero rows
    stay zero through the QR, zero columns come out masked; the real block is the
    unpadded QR's), grouped by :func:`shape_groups` within ``_QR_PADDING``."""
    items = [(p.shape[1], p.shape[2], 0) for p in ps for _ in range(p.shape[0])]
    owner = [b for b, p in enumerate(ps) for _ in range(p.shape[0])]
    out: list = [None] * len(ps)
    for group in shape_groups(items, max_padding=_QR_PADDING):
        batches = sorted({owner[i] for i in group})
        n = max(ps[b].shape[1] for b in batches)
        r = max(ps[b].shape[2] for b in batches)
        stack = [_pad_to(ps[b], (ps[b].shape[0], n, r)) for b in batches]
        q = orthogonalize(stack[0] if len(stack) == 1 else jnp.concatenate(stack))
        off = 0
        for b in batches:
            g, nb, rb = ps[b].shape
            out[b] = q[off : off + g, :nb, :rb]
            off += g
    return out


class _Layout(NamedTuple):
    """How one step's matrices are batched (:func:`shape_groups`).

    Attributes:
      groups: leaf indices of each batch.
      dims: each leaf's ``(n, m, r)``.
      pads: each batch's padded ``(N, M, r)``.
    """

    groups: list[list[int]]
    dims: list[tuple[int, int, int]]
    pads: list[tuple[int, int, int]]


def _layout(shapes: list[tuple[int, ...]], rank: int, max_padding: float) -> _Layout:
    """The batches of leaves of ``shapes`` at ``rank`` (capped per matrix)."""
    nm = [matrix_shape(tuple(sh)) for sh in shapes]
    dims = [(n, m, min(rank, n, m)) for n, m in nm]
    groups = shape_groups(dims, max_padding=max_padding)
    pads = [(max(dims[i][0] for i in g), max(dims[i][1] for i in g), dims[g[0]][2]) for g in groups]
    return _Layout(groups, dims, pads)


def _first_q(key: jax.Array, lay: _Layout) -> list[jax.Array]:
    """Each batch's initial ``Q`` ``(g, N, r)``: leaf ``i``'s drawn from
    ``fold_in(key, i)`` (the numbers do not depend on the batching), its rows past its own
    ``n`` zero (they would meet zero rows of ``M`` anyway)."""
    return [
        jnp.stack(
            [
                _pad_to(
                    jax.random.normal(jax.random.fold_in(key, i), (lay.dims[i][0], r), jnp.float32),
                    (big_n, r),
                )
                for i in g
            ]
        )
        for g, (big_n, _, r) in zip(lay.groups, lay.pads, strict=True)
    ]


# Salt of the seed of the columns that restart a zero column of Q (:func:`_restarted`).
_RESTART_SALT = 0x5EED0F0


def _restarted(qs: list[jax.Array], lay: _Layout, seed: int) -> list[jax.Array]:
    """Each batch's ``Q`` ``(g, N, r)`` with every column that is exactly zero replaced by
    a seeded uniform ``[-0.5, 0.5)`` column (the same on every device; rows past a
    matrix's own ``n`` zero).

    ``Q = M P_hat`` is zero where ``M`` was (a zero-initialised residual branch at step 0,
    a frozen layer): without a restart ``P = M^T Q`` would stay zero, and so would the
    approximation of that matrix, while its residual grows. The hook's QR returns a unit
    column there instead (its Gram-Schmidt, at rank <= 2, NaN); a seeded random column is
    a direction no structure of ``M`` (a dead input channel) can keep at zero.
    """
    out = []
    for q, g in zip(qs, lay.groups, strict=True):
        seed_u32 = jnp.uint32((seed ^ _RESTART_SALT) & 0xFFFFFFFF)
        fresh = keys.seeded_uniform(seed_u32, q.shape) - 0.5
        rows = np.asarray([lay.dims[i][0] for i in g], np.int32)
        real = lax.broadcasted_iota(jnp.int32, q.shape, 1) < jnp.asarray(rows)[:, None, None]
        zero = jnp.all(q == 0, axis=1, keepdims=True)
        out.append(jnp.where(zero & real, fresh, q))
    return out


def _stacked(xs: list[jax.Array], lay: _Layout) -> list[jax.Array]:
    """Each batch's matrices as one ``(g N, M)`` array: the leaves viewed as ``(n, m)``,
    zero-padded to ``(N, M)``, stacked along rows."""
    return [
        jnp.concatenate([_pad_to(jnp.reshape(xs[i], lay.dims[i][:2]), (n, m)) for i in g])
        for g, (n, m, _) in zip(lay.groups, lay.pads, strict=True)
    ]


def _mean_all(parts: list[jax.Array], ctx: ReduceContext) -> list[jax.Array]:
    """The mean over every data axis of every array of ``parts``, in one all-reduce of them
    packed into one buffer (``jaxcomm.packing``).

    With ``compress_stage='inter'`` (``ctx.axes`` the outer axes only) the parts are the
    same on every device of a node (they are computed from the node's mean): each device
    sends its ``1/g`` of the buffer to the all-reduce over ``ctx.axes`` and the node
    all-gathers the pieces (:func:`_mean_across_nodes`). Else one all-reduce over
    ``ctx.axes`` by ``ctx.algorithm``.
    """
    plan = plan_groups(parts, [range(len(parts))])
    (flat,) = plan.pack(parts)
    inner = tuple(a for a in decision_axes(ctx) if a not in ctx.axes)
    if inner:
        return plan.unpack([_mean_across_nodes(flat, ctx.axes, inner, ctx.algorithm)])
    return plan.unpack([sum_over(flat, ctx.axes, ctx.algorithm) / axes_size(ctx.axes)])


def _mean_across_nodes(
    x: jax.Array, outer: tuple[str, ...], inner: tuple[str, ...], algorithm: str
) -> jax.Array:
    """The mean over ``outer`` of a 1-D ``x`` that is the same on every device of
    ``inner``, typed invariant over both.

    1. device ``j`` of ``inner`` takes piece ``j`` of ``x`` (zero-padded to a multiple of
       ``g = |inner|``): no intra-node reduction, the pieces are equal already;
    2. all-reduce of the piece over ``outer`` (``algorithm``): the node's ``g`` devices
       together send one ``x`` across its link, as one rank per node would;
    3. all-gather of the pieces over ``inner`` (the fast links).
    """
    g = axes_size(inner)
    n = x.shape[0]
    padded, _ = pad_to_multiple(x, g)
    piece = jnp.reshape(padded, (g, -1))[lax.axis_index(inner)]
    piece = sum_over(piece, outer, algorithm) / axes_size(outer)
    return all_gather_invariant(piece, inner)[:n]


def _power_iteration(
    mats: list[jax.Array], qs: list[jax.Array], ctx: ReduceContext
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """Steps 3-4 of the module docstring on batches ``(g, N, M)``, ``qs`` orthonormal
    ``(g, N, r)``.

    Returns:
      ``(p_hat, q_local, q_mean)`` per batch: the orthogonalized mean of ``P = M^T Q``
      ``(g, M, r)``, this device's ``M P_hat`` ``(g, N, r)`` and its mean over the devices.
    """
    ps = [jnp.einsum("gnm,gnr->gmr", mt, q) for mt, q in zip(mats, qs, strict=True)]
    ps = _orthogonalize_batches(_mean_all(ps, ctx))
    q_local = [jnp.einsum("gnm,gmr->gnr", mt, p) for mt, p in zip(mats, ps, strict=True)]
    return ps, q_local, _mean_all(q_local, ctx)


def _unbatched(approx: list[jax.Array], xs: list[jax.Array], lay: _Layout) -> list[jax.Array]:
    """Each leaf's matrix cut out of its batch's ``(g, N, M)`` product, unpadded, in the
    leaf's shape and dtype.

    Static slices; at runtime indices where the backend row says ``runtime_offsets``
    (XLA:CPU), so that the cuts of one shape compile as one kernel (``jaxcomm.backend``).
    """
    index = None
    if backend.current().runtime_offsets:
        index = backend.runtime_ints(range(max(len(g) for g in lay.groups)))
    out: list = [None] * len(xs)
    for g, a in zip(lay.groups, approx, strict=True):
        for j, i in enumerate(g):
            n, m, _ = lay.dims[i]
            if index is None:
                block = a[j : j + 1, :n, :m]
            else:
                block = jax.lax.dynamic_slice(
                    a, (index[j], 0, 0), (1, n, m), allow_negative_indices=False
                )
            out[i] = block.reshape(xs[i].shape).astype(jnp.result_type(xs[i]))
    return out


def powersgd(
    rank: int = 4,
    *,
    warm_start: bool = True,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    seed: int = 0,
    max_padding: float = 0.1,
) -> Compressor:
    """PowerSGD low-rank compression (matrices only; other leaves go uncompressed).

    The algorithm is PyTorch's ``powerSGD_hook`` (module docstring; its remaining
    differences: docs/compression.md). Its ``start_powerSGD_iter`` is
    ``sync_gradients(warmup_steps=...)``: plain all-reduces before, error feedback from
    then on. Hierarchical PowerSGD, the gradients averaged inside the node first and only
    ``P`` and ``Q`` sent across nodes, is ``sync_gradients(compress_stage='inter')``.

    Matrices are computed in batches (:func:`shape_groups`): one ``P = M^T Q`` and one
    ``Q = M P`` per batch; the QRs of batches with similar row counts are stacked into
    one (zero-padded rows, at most doubling the QR's rows). A batch may hold matrices of
    different shapes, zero-padded to its largest ``(n, m)``; the result is the unpadded
    one: zero rows and columns add nothing to the products and stay zero through the QR
    (the padded rows of ``P`` and ``Q`` go over the wire, zeros). All ``P`` of a step
    travel in one all-reduce, all ``Q`` in a second.

    Args:
      rank: approximation rank ``r`` (>= 1); capped at ``min(n, m)`` per matrix.
      warm_start: reuse last step's ``Q`` (else a fresh random ``Q`` each step).
      min_compression_rate: compress a matrix only if ``n m / (r (n + m))`` exceeds this
        (>= 1; the hook's test).
      error_feedback: per-device residuals (recommended; PowerSGD is biased).
      seed: seed of the initial ``Q`` (the same on every device).
      max_padding: zero padding allowed to merge shapes into fewer batches, as a
        fraction of the compressed matrices' elements (>= 0; 0: a batch per shape). It
        costs up to that much more memory in the residual and compute in the products,
        sends the padded rows of ``P`` and ``Q`` too, and cuts compile time (fewer
        batches, fewer kernels).

    Returns:
      A :class:`~jaxcomm.compression.Compressor` (``elementwise=False``) with state
      :class:`PowerSGDState`.

    Raises:
      ValueError: ``rank < 1``, ``min_compression_rate < 1`` or ``max_padding < 0``.

    Example:
      >>> tx = jaxcomm.sync_gradients(compression=jaxcomm.compression.powersgd(rank=4))
      >>> # as powerSGD_hook(start_powerSGD_iter=10), hierarchical across nodes
      >>> tx = jaxcomm.sync_gradients(
      ...     compression=jaxcomm.compression.powersgd(rank=4), warmup_steps=10,
      ...     compress_stage="inter")
    """
    rank = check_int("rank", rank, minimum=1, fix="e.g. 4")
    min_rate = check_range("min_compression_rate", min_compression_rate, 1.0, float("inf"))
    max_padding = check_range("max_padding", max_padding, 0.0, float("inf"), fix="e.g. 0.1")
    cfg = _Config(rank, min_rate, bool(warm_start), bool(error_feedback), seed, max_padding)
    return Compressor(
        f"powersgd(rank={rank})",
        functools.partial(_init, cfg),
        functools.partial(_reduce, cfg),
        elementwise=False,
        supports=functools.partial(_supports, cfg),
    )


class _Config(NamedTuple):
    """The checked arguments of :func:`powersgd`."""

    rank: int
    min_rate: float
    warm_start: bool
    error_feedback: bool
    seed: int
    max_padding: float


def _supports(cfg: _Config, shape: tuple[int, ...]) -> bool:
    """``Compressor.supports``: a matrix whose rank-``r`` factors save more than
    ``min_rate`` (the hook's ``_should_compress``: ``r (n + m) min_rate < n m``)."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = min(cfg.rank, n, m)
    return n * m > cfg.min_rate * r * (n + m)


def _init(cfg: _Config, specs: list[Any]) -> PowerSGDState:
    """``Compressor.init``: the first ``Q`` per batch, zero residuals per batch."""
    lay = _layout([jnp.shape(s) for s in specs], cfg.rank, cfg.max_padding)
    res = ()
    if cfg.error_feedback:
        res = ef.init_residuals(
            [
                jax.ShapeDtypeStruct((len(g) * n, m), jnp.float32)
                for g, (n, m, _) in zip(lay.groups, lay.pads, strict=True)
            ]
        )
    return PowerSGDState(tuple(_first_q(jax.random.key(cfg.seed), lay)), res)


def _reduce(
    cfg: _Config, xs: list[jax.Array], state: PowerSGDState, ctx: ReduceContext
) -> tuple[list[jax.Array], PowerSGDState]:
    """``Compressor.reduce``: steps 1-5 of the module docstring on the batches."""
    lay = _layout([x.shape for x in xs], cfg.rank, cfg.max_padding)
    # Step 1, on (g N, M) batches: one batched product per batch instead of one per
    # matrix (PyTorch's hook batches likewise).
    cs = ef.corrected(_stacked(xs, lay), state.residual if cfg.error_feedback else None)
    mats = [
        c.reshape(len(g), n, m) for c, g, (n, m, _) in zip(cs, lay.groups, lay.pads, strict=True)
    ]
    # Step 2: the hook orthogonalizes Q before every use. In exact arithmetic P_hat is the
    # same without (it spans M^T Q either way), but M^T Q of a warm Q (= M P_hat) is
    # conditioned like M^T M, and its QR then loses the weaker directions in f32.
    qs = _restarted(list(state.q), lay, cfg.seed) if cfg.warm_start else _first_q(ctx.key, lay)
    qs = _orthogonalize_batches(qs)
    # The factors' means go over every data axis. With compress_stage='inter' the
    # matrices arrive averaged over the inner axis (equal within a node, but typed varying
    # there through the per-device residual): _mean_all sends each device's share of
    # them over the outer axes and gathers the node's, typed replicated.
    ps, q_local, q_mean = _power_iteration(mats, qs, ctx)
    approx = [jnp.einsum("gnr,gmr->gnm", q, p) for p, q in zip(ps, q_mean, strict=True)]
    out = _unbatched(approx, xs, lay)  # step 5
    res = state.residual
    if cfg.error_feedback:
        sent = [jnp.einsum("gnr,gmr->gnm", q, p) for p, q in zip(ps, q_local, strict=True)]
        res = ef.new_residuals(cs, [s.reshape(c.shape) for s, c in zip(sent, cs, strict=True)])
    return out, PowerSGDState(tuple(q_mean), res)
