"""XLA:CPU and gloo workarounds, in one place, behind one switch: :func:`active`.

The rest of jaxcomm writes the math once, as the plain program any backend compiles. A
few of those programs compile into too many kernels on XLA:CPU, or meet a limitation of
gloo (XLA:CPU's transport between processes). The helpers here rewrite them into
programs with the same values (bit for bit, but for 4 and 5 below) that XLA:CPU compiles
and gloo runs well.
Callers apply a helper only where ``active()`` is True::

    if xla_cpu.active():
        x = xla_cpu.rows_at_runtime_offsets(x)
    return lax.all_to_all(x, axes, 0, 0, tiled=True)

so on any other platform (GPU, TPU) the compiled program is the plain one: constant
offsets, a plain all-to-all, a bf16 all-reduce, no limit on buffer sizes.

**The switch.** :func:`active` is True iff the mesh in context is a CPU mesh: inside
``jax.shard_map`` (or under ``jax.set_mesh``) the abstract mesh names the platform of its
devices (``jax.sharding.get_abstract_mesh().abstract_device.platform``). It is decided at
trace time, from the mesh the program runs on, not from ``jax.default_backend()``: a
program traced for a GPU mesh on a machine whose default backend is the CPU (or lowered
for ``'cuda'`` from an ``AbstractMesh``) is the plain one. With no mesh in context, or
an ``AbstractMesh`` built without ``abstract_device``, it is False: every collective of
jaxcomm runs inside ``shard_map``, so a caller outside one computes no collective and
loses at most the compile-time rewrites (1 to 3 below), never a correctness one.

**What XLA:CPU does, and the workarounds**:

1. *One kernel per distinct fusion* (:func:`runtime_ints`). XLA:CPU compiles each
   distinct fusion into a kernel of its own, and a slice at a constant offset is a
   fusion of its own: cutting a model's hundreds of gradient leaves out of one packed
   buffer compiles hundreds of kernels. With the offset a fusion *parameter* the slices
   of one size share one kernel. A parameter must be a buffer that some unfusible
   instruction produces: the offsets are carried through a stable ``lax.sort`` on a key
   of equal runtime zeros (``lax.optimization_barrier``), which leaves them in place and
   which XLA neither folds nor fuses. The offsets keep their values, so the slices do.
   Used by ``jaxcomm.packing`` (unpacking), PowerSGD (matrices out of their batch) and
   the quantizers' ``1 / qmax`` (:func:`runtime_f32`: int8 and int4 then share their
   scale kernels).
2. *All-to-all operands* (:func:`rows_at_runtime_offsets`). XLA:CPU runs an
   all-to-all as one operand per device, each cut from the payload by a slice at a
   constant offset: a kernel per device and payload shape. The rows are cut at runtime
   offsets (1.) and concatenated; XLA's own cuts of the concatenation fold back to the
   rows. The same collective, operands and bytes.
3. *Fusion into every consumer* (:func:`materialized`). XLA:CPU fuses a cheap
   elementwise producer into each consumer: the decoding of a gathered int8 mean then
   runs once per gradient leaf cut from it, and a dither seed's hash chain runs inside
   the encoding loop of every element. A conditional's output is a buffer, so the
   producer runs once, as the root of the taken branch of a ``lax.cond`` on a runtime
   value that is always true (1.). The branch computes the same operations.
4. *bf16 all-reduce in f32*. XLA:CPU has no bf16 reductions: it promotes a bf16
   all-reduce to f32, so the wire carries 32 bits. ``jaxcomm.compression.bf16`` then
   takes the two-phase route (all-to-all of bf16 words, f32 sum, all-gather of the bf16
   mean): 16 bits on the wire. The only workaround that is not bit-identical by
   construction: a bf16 all-reduce rounds where its backend does, the two-phase mean
   once after an f32 sum (on 8 CPU devices the two agree bit for bit:
   ``tests/test_xla_cpu.py``); see ``jaxcomm.compression.cast``.
5. *gloo's reduce-scatter* (:func:`gloo_reduce_scatter_unsafe`). On several processes
   XLA:CPU's ``psum_scatter`` calls gloo's ``ReduceScatterHalvingDoubling``, which
   intermittently returns wrong values at the end of rank 0's chunk for chunks above
   about 256 KiB, with no error (jax-ml/jax#40830). ``jaxcomm.collectives`` then
   computes the reduce-scatter as a ring of ``lax.ppermute`` s: the same sum (added in
   the ring's order), the same bytes.
6. *Collective order across control flow* (:func:`tie`). XLA:CPU chains collectives
   only by scheduling edges; a ``lax.cond`` / ``lax.switch`` / ``lax.scan`` runs its body
   on a nested executor that can return before the collectives inside it finish, so a
   later collective that does not depend on its result may run concurrently with them.
   Gloo pairs the operations of one communicator in the order they are issued: devices
   that interleave them differently exchange the wrong buffers or wait until the
   collective timeout. :func:`tie` adds a data dependency XLA cannot remove: an int32
   zero read out of the dependencies, added to the value's bits
   (``jaxcomm.ordering.after``).

7. *One step in flight* (:func:`one_step_in_flight`, on the host). Several queued
   executions of a program with collectives can deadlock XLA:CPU's in-process rendezvous
   of fake devices, so the step builders wait for each CPU step before dispatching the
   next; other platforms keep asynchronous dispatch.

Only 1 to 3 are about compile time; 4 to 6 are about what reaches the wire; 7 about
dispatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.state import varying_axes

__all__ = [
    "active",
    "gloo_reduce_scatter_unsafe",
    "materialized",
    "one_step_in_flight",
    "rows_at_runtime_offsets",
    "runtime_f32",
    "runtime_ints",
    "slices_at_runtime_offsets",
    "tie",
    "tie_all",
]

# Largest value runtime_ints carries (an int32).
INT32_MAX = 2**31 - 1

# Values per sort in runtime_ints: a kernel takes every operand as a parameter.
_SORT_OPERANDS = 64


def active() -> bool:
    """Whether the program being traced runs on a CPU mesh (the module docstring).

    Returns:
      True inside ``jax.shard_map`` over (or under ``jax.set_mesh`` of) a mesh of CPU
      devices; False for a mesh of another platform, an ``AbstractMesh`` without
      ``abstract_device``, or no mesh in context.

    Example:
      >>> if xla_cpu.active():
      ...     x = xla_cpu.rows_at_runtime_offsets(x)
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device is not None and device.platform == "cpu"


def one_step_in_flight(mesh: jax.sharding.Mesh) -> bool:
    """Whether a step on ``mesh`` must finish before the next one is dispatched
    (workaround 7): True for a mesh of CPU devices.

    Example:
      >>> if xla_cpu.one_step_in_flight(mesh):
      ...     jax.block_until_ready(out)
    """
    return mesh.devices.flat[0].platform == "cpu"


def runtime_ints(values: Sequence[int]) -> list[jax.Array]:
    """The int32 scalars ``values`` as values XLA cannot constant-fold (workaround 1).

    1. Deduplicate and sort the values; rows ``(v, v ^ 1)`` (a constant of two equal
       elements would become a broadcast kernel).
    2. Sort them stably, at most ``_SORT_OPERANDS`` rows per sort, on a key of two equal
       runtime zeros (``lax.optimization_barrier``): every row stays in place.
    3. Read element 0 of each sorted row.

    A constant through an optimization barrier alone is not enough: XLA removes the
    barrier before fusion and fuses the constant into each consumer.

    Args:
      values: integers in ``[0, 2**31)``.

    Returns:
      One int32 scalar per value, in order (equal values share one).

    Raises:
      ValueError: a value outside ``[0, 2**31)``.

    Example:
      >>> start = runtime_ints([1024])[0]
      >>> piece = jax.lax.dynamic_slice(buf, (start,), (256,))
    """
    uniq = sorted({int(v) for v in values})
    if not uniq:
        return []
    if not 0 <= uniq[0] <= uniq[-1] <= INT32_MAX:
        raise ValueError(f"runtime_ints: values must be in [0, 2**31), got {uniq[0]}..{uniq[-1]}.")
    zero = lax.optimization_barrier(jnp.zeros((), jnp.int32))
    key = jnp.stack([zero, zero])
    scalars = []
    for k in range(0, len(uniq), _SORT_OPERANDS):
        rows = [np.array([v, v ^ 1], np.int32) for v in uniq[k : k + _SORT_OPERANDS]]
        out = lax.sort([key, *rows], num_keys=1, is_stable=True)
        scalars += [lax.squeeze(lax.slice(r, (0,), (1,)), (0,)) for r in out[1:]]
    table = dict(zip(uniq, scalars, strict=True))
    return [table[int(v)] for v in values]


def runtime_f32(value: float) -> jax.Array:
    """The f32 scalar ``value`` as a value XLA cannot constant-fold: its bits through
    :func:`runtime_ints`. Kernels that differ only in such a constant then share one.

    Args:
      value: a float, rounded to f32.

    Returns:
      f32 scalar with exactly the bits of ``np.float32(value)``.

    Example:
      >>> inv = runtime_f32(np.float32(1) / np.float32(127))
    """
    (word,) = runtime_ints([int(np.float32(value).view(np.uint32))])
    return lax.bitcast_convert_type(word, jnp.float32)


def slices_at_runtime_offsets(cuts: Sequence[tuple[jax.Array, int, int]]) -> list[jax.Array]:
    """Pieces ``buf[start:stop]`` of 1-D buffers, cut at runtime offsets (workaround 1).

    The offsets of all pieces go through one :func:`runtime_ints` call (one sort kernel).
    A piece whose start does not fit an int32 index is cut by a static slice instead, so
    a buffer may be as long as the plain program allows.

    Args:
      cuts: ``(buf, start, stop)`` per piece: a 1-D array and an element range in it.

    Returns:
      One 1-D array per piece, in order, with the values of ``buf[start:stop]``.

    Example:
      >>> a, b = slices_at_runtime_offsets([(buf, 0, 6), (buf, 6, 9)])
    """
    small = [s for _, s, _ in cuts if s <= INT32_MAX]
    starts = dict(zip(small, runtime_ints(small), strict=True))
    out = []
    for buf, s, e in cuts:
        if s in starts:
            out.append(lax.dynamic_slice(buf, (starts[s],), (e - s,), allow_negative_indices=False))
        else:
            out.append(lax.slice(buf, (s,), (e,)))
    return out


def rows_at_runtime_offsets(x: jax.Array) -> jax.Array:
    """``x`` (shape ``(p, ...)``) rebuilt from its rows cut at runtime offsets
    (workaround 2): the operand of an all-to-all whose per-device cuts XLA:CPU then
    compiles as one kernel.

    Args:
      x: an array with at least one axis.

    Returns:
      ``x``, the same values, computed as a concatenation of its rows.

    Example:
      >>> recv = lax.all_to_all(rows_at_runtime_offsets(x), axes, 0, 0, tiled=True)
    """
    if x.shape[0] <= 1:
        return x
    size = (1, *x.shape[1:])
    zeros = (0,) * (x.ndim - 1)
    starts = runtime_ints(range(x.shape[0]))
    return jnp.concatenate(
        [lax.dynamic_slice(x, (i, *zeros), size, allow_negative_indices=False) for i in starts]
    )


def materialized(f: Callable[..., Any], *args: jax.Array) -> Any:
    """``f(*args)`` (an array or a tuple of arrays), computed into buffers of its own
    (workaround 3).

    ``f`` is the taken branch of a ``lax.cond`` on ``runtime_ints([1])[0] == 1``; the
    other branch never runs and returns zeros typed as ``f``'s result (shard_map's
    varying axes included). ``f`` must be cheap to trace twice (``jax.eval_shape``).

    Args:
      f: a function of arrays.
      *args: its operands (they become the conditional's operands: a producer of them
        is not fused into ``f``).

    Returns:
      ``f(*args)``.

    Example:
      >>> mean = materialized(decode, gathered)
    """
    (one,) = runtime_ints([1])
    out = jax.eval_shape(f, *args)

    def zeros(spec):
        z = jnp.zeros(spec.shape, spec.dtype)
        axes = tuple(varying_axes(spec))
        return lax.pcast(z, axes, to="varying") if axes else z

    def unused(*_):
        return jax.tree.map(zeros, out)

    return lax.cond(one == 1, f, unused, *args)


def gloo_reduce_scatter_unsafe() -> bool:
    """True where ``psum_scatter`` would run through gloo's faulty reduce-scatter
    (workaround 5): a CPU mesh (:func:`active`) in a program of several processes.

    Returns:
      Whether to compute a reduce-scatter from ``lax.ppermute`` s instead.
    """
    return active() and jax.process_count() > 1


def _word(x: jax.Array) -> jax.Array:
    """One int32 read from ``x`` (its first element's bits): a read of ``x``'s buffer."""
    first = jnp.ravel(x)[:1]
    size = np.dtype(first.dtype).itemsize
    if first.dtype == jnp.bool_:
        return first[0].astype(jnp.int32)
    if size == 8:
        return lax.bitcast_convert_type(first, jnp.int32)[0, 0]
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}[size]
    return lax.bitcast_convert_type(first[0], ints).astype(jnp.int32)


def _zero(deps: Sequence[jax.Array]) -> jax.Array:
    """An int32 zero that XLA cannot fold, computed from one element of each of ``deps``.

    The rows ``(0, 1)`` sorted stably on two equal runtime keys stay in place: the first
    is 0 whatever the keys hold, and no XLA pass knows it.
    """
    key = sum((_word(d) for d in deps), jnp.zeros((), jnp.int32))
    _, rows = lax.sort([jnp.stack([key, key]), jnp.arange(2, dtype=jnp.int32)], num_keys=1)
    return rows[0]


def _plus(x: jax.Array, zero: jax.Array) -> jax.Array:
    """``x`` with ``zero`` added to its bits (the same bits, now computed from ``zero``)."""
    if x.dtype == jnp.bool_:
        return x ^ (zero != 0)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x + zero.astype(x.dtype)
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[np.dtype(x.dtype).itemsize]
    if ints == jnp.int64 and not jax.config.jax_enable_x64:
        return lax.bitcast_convert_type(
            lax.bitcast_convert_type(x, jnp.int32) + zero, x.dtype
        )  # f64 as pairs of words
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, ints) + zero.astype(ints), x.dtype)


def tie(x: jax.Array, deps: Sequence[jax.Array]) -> jax.Array:
    """``x``, bit for bit, computed from an int32 zero read out of ``deps`` (workaround 6).

    1. Read one int32 word out of each array of ``deps`` and sum them: the key.
    2. Sort the rows ``(0, 1)`` stably on two copies of the key: row 0 is a zero XLA
       cannot fold.
    3. Add that zero to the bits of ``x`` (as integers of ``x``'s width).

    Whatever consumes the result runs after ``deps`` are complete. Under ``shard_map``,
    ``deps`` must vary over no more mesh axes than ``x`` (else ``x``'s replication type
    would change); ``jaxcomm.ordering.after`` picks them.

    Args:
      x: an array of any dtype.
      deps: non-empty arrays whose completion ``x`` must wait for.

    Returns:
      ``x``, unchanged in value.

    Example:
      >>> y = tie(y, [reduced])   # a collective on y now waits for ``reduced``
    """
    return tie_all([x], deps)[0]


def tie_all(xs: Sequence[jax.Array], deps: Sequence[jax.Array]) -> list[jax.Array]:
    """:func:`tie` of each of ``xs`` to ``deps``, through one shared zero (one read of
    ``deps``, one sort, whatever the number of arrays tied).

    Example:
      >>> plain = tie_all(plain, [reduced, state])
    """
    zero = _zero(deps)
    return [_plus(jnp.asarray(x), zero) for x in xs]
