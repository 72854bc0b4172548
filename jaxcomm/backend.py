"""Per-platform choices of jaxcomm in one table: :class:`Backend`, one row per platform.

jaxcomm writes its math once, as the plain program any backend compiles (as jax keeps
its per-platform lowering rules apart from ``lax``). A few of those programs compile into
too many kernels on XLA:CPU, or meet a limitation of gloo (XLA:CPU's transport between
processes). Every such choice is a field of :class:`Backend`; a platform's row says
which it takes, and a call site reads a field of the row::

    if backend.current().all_to_all_rows_at_runtime_offsets:
        x = backend.rows_at_runtime_offsets(x)
    return lax.all_to_all(x, axes, 0, 0, tiled=True)

The helpers below (:func:`runtime_ints`, :func:`materialized`, :func:`tie`, ...) are the
rewrites the CPU row turns on; each keeps every value, bit for bit (but ``bf16_route``).

**The row.** :func:`current` gives the row of the program being traced: inside
``jax.shard_map`` (or under ``jax.set_mesh``) the abstract mesh names the platform of its
devices (``jax.sharding.get_abstract_mesh().abstract_device.platform``). It is decided at
trace time from the mesh the program runs on, not from ``jax.default_backend()``: a
program traced for a GPU mesh on a machine whose default backend is the CPU (or lowered
for ``'cuda'`` from an ``AbstractMesh``) takes the GPU row. The mesh in context does not
change inside a ``shard_map`` body, so one trace sees one row. With no mesh in context,
or an ``AbstractMesh`` without ``abstract_device``, it is :data:`PLAIN`: every collective
of jaxcomm runs inside ``shard_map``, so a caller outside one computes no collective and
loses at most a compile-time rewrite, never a correctness one. On the host (dispatch,
compile checks) :func:`for_mesh` reads the row of a concrete mesh. :func:`use` traces
under another row (tests comparing two routes on one CPU mesh; a caller that knows more
than the platform, such as a ``lax.switch`` branch whose outputs are buffers already).

**The table** (:data:`ROWS`; an unknown platform gets :data:`PLAIN`):

==========================================  ==============  ================  ======
field                                       ``cpu``         ``gpu``, ``tpu``  reason
==========================================  ==============  ================  ======
``runtime_offsets``                         True            False             1
``runtime_constants``                       True            False             1
``all_to_all_rows_at_runtime_offsets``      True            False             2
``materialize``                             True            False             3
``bf16_route``                              ``all_to_all``  ``allreduce``     4
``ring_reduce_scatter``                     True            False             5
``tie_collective_order``                    True            False             6
``check_collective_order``                  True            False             6
``one_step_in_flight``                      True            False             7
``synchronous_collectives``                 True            False             8
``qr_one_at_a_time``                        True            False             9
``initializer_compiler_options``            LLVM level 1    none              10
==========================================  ==============  ================  ======

**Why the CPU row differs** (on GPU and TPU the compiled program is the plain one:
constant offsets, a plain all-to-all, a bf16 all-reduce, asynchronous dispatch):

1. *One kernel per distinct fusion* (``runtime_offsets``, ``runtime_constants``:
   :func:`runtime_ints`, :func:`runtime_f32`). XLA:CPU compiles each distinct fusion
   into a kernel of its own, and a slice at a constant offset is a fusion of its own:
   cutting a model's hundreds of gradient leaves out of one packed buffer compiles
   hundreds of kernels. With the offset a fusion *parameter* the slices of one size
   share one kernel. A parameter must be a buffer that some unfusible instruction
   produces: the offsets are carried through a stable ``lax.sort`` on a key of equal
   runtime zeros (``lax.optimization_barrier``), which leaves them in place and which
   XLA neither folds nor fuses. Read by ``jaxcomm.packing`` (unpacking), PowerSGD
   (matrices out of their batch) and adaptive (its new scalars, read out of one vector);
   ``runtime_constants`` by the quantizers' ``1 / qmax`` (int8 and int4 then share
   their scale kernels).
2. *All-to-all operands* (``all_to_all_rows_at_runtime_offsets``:
   :func:`rows_at_runtime_offsets`). XLA:CPU runs an all-to-all as one operand per
   device, each cut from the payload by a slice at a constant offset: a kernel per
   device and payload shape. The rows are cut at runtime offsets (1.) and concatenated;
   XLA's own cuts of the concatenation fold back to the rows. The same collective,
   operands and bytes.
3. *Fusion into every consumer* (``materialize``: :func:`materialized`). XLA:CPU fuses
   a cheap elementwise producer into each consumer: the decoding of a gathered int8
   mean then runs once per gradient leaf cut from it, and a dither seed's hash chain
   runs inside the encoding loop of every element. A conditional's output is a buffer,
   so the producer runs once, as the root of the taken branch of a ``lax.cond`` on a
   runtime value that is always true (1.). The branch computes the same operations. A
   ``lax.switch`` branch's outputs are buffers already: adaptive traces its rungs under
   the row with ``materialize=False``.
4. *bf16 all-reduce in f32* (``bf16_route``). XLA:CPU has no bf16 reductions: it
   promotes a bf16 all-reduce to f32, so the wire carries 32 bits. ``bf16()`` then
   takes the two-phase route (``'all_to_all'``: all-to-all of bf16 words, f32 sum,
   all-gather of the bf16 mean): 16 bits on the wire. The only choice that is not
   bit-identical by construction: a bf16 all-reduce rounds where its backend does, the
   two-phase mean once after an f32 sum (on 8 CPU devices the two agree bit for bit:
   ``tests/test_backend.py``); see ``jaxcomm.compression.cast``.
5. *gloo's reduce-scatter* (``ring_reduce_scatter``). On several processes XLA:CPU's
   ``psum_scatter`` calls gloo's ``ReduceScatterHalvingDoubling``, which intermittently
   returns wrong values at the end of rank 0's chunk for chunks above about 256 KiB,
   with no error (jax-ml/jax#40830). ``jaxcomm.collectives.reduce_scatter`` then
   computes it, in a program of several processes, as a ring of ``lax.ppermute`` s: the
   same sum (added in the ring's order), the same bytes.
6. *Collectives paired by order* (``tie_collective_order``: :func:`tie`;
   ``check_collective_order``). XLA:CPU chains collectives only by scheduling edges; a
   ``lax.cond`` / ``lax.switch`` / ``lax.scan`` runs its body on a nested executor that
   can return before the collectives inside it finish, so a later collective that does
   not depend on its result may run concurrently with them. Gloo pairs the operations of
   one communicator in the order they are issued: devices that interleave them
   differently exchange the wrong buffers or wait until the collective timeout.
   :func:`tie` adds a data dependency XLA cannot remove: an int32 zero read out of the
   dependencies, added to the value's bits (``jaxcomm.ordering.after``). On several
   processes the step builders also refuse a compiled step whose collectives' order is
   still open (``check_collective_order``, ``jaxcomm.hlo.ordering_hazards``).
7. *One step in flight* (``one_step_in_flight``, on the host). Several queued
   executions of a program with collectives can deadlock XLA:CPU's in-process
   rendezvous of fake devices, so the step builders wait for each CPU step before
   dispatching the next; other platforms keep asynchronous dispatch.
8. *Synchronous collectives* (``synchronous_collectives``). XLA:CPU runs each
   collective synchronously on the thread that reaches it (docs/overlap.md), so nothing
   the backward pass computes hides a bucket's communication: ``bucket_bytes='auto'``
   then chooses the fewest buckets (``jaxcomm.buckets.AutoBuckets.choose``,
   ``overlap=False``), where buckets sized for overlap would only add collectives, each
   paying the link's latency.
9. *QR one at a time* (``qr_one_at_a_time``). XLA:CPU's batched LAPACK call splits a
   batch of QRs into tasks on the intra-op thread pool that runs the devices' programs
   and waits for them there: with several fake devices on few cores every pool thread
   can be such a waiter, and the step deadlocks (PowerSGD on ResNet-18's gradient
   shapes, 4 devices on 2 cores, jaxlib 0.10.2). ``jaxcomm.compression.powersgd``'s
   orthogonalization then runs its batch as a loop of single QRs (``lax.map``): the
   same Householder QR per matrix.
10. *Initializers compiled at LLVM level 1* (``initializer_compiler_options``). A
   model's initializer (``jaxcomm.models.initialize``) is threefry's rounds for every
   weight: XLA:CPU's LLVM pipeline at its default level spends 3-4x as long on them as
   at level 1 (ResNet-tiny's 6.6 s -> 2.1 s, ResNet-18's 8.1 s -> 2.9 s), for a program
   that runs once. The bits are the same (integer rounds, and no contraction of float
   ops without fast math; tested).

Only 1 to 3 and 10 are about compile time; 4 to 6 are about what reaches the wire; 7
about dispatch; 8 about how the gradient is cut; 9 about a deadlock of the CPU runtime.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm.state import varying_axes

__all__ = [
    "CPU",
    "GPU",
    "PLAIN",
    "ROWS",
    "TPU",
    "Backend",
    "MATERIALIZE_SCOPE",
    "current",
    "for_mesh",
    "for_platform",
    "materialized",
    "rows_at_runtime_offsets",
    "runtime_f32",
    "runtime_ints",
    "slices_at_runtime_offsets",
    "tie",
    "tie_all",
    "use",
]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One platform's choices (the module docstring gives each field's reason).

    Attributes:
      platform: the platform the row is for (``'cpu'``, ``'gpu'``, ``'tpu'``, ``'plain'``).
      runtime_offsets: cut slices at runtime offsets (:func:`runtime_ints`), so that the
        slices of one size compile as one kernel.
      runtime_constants: pass kernel constants (the quantizers' ``1 / qmax``) as runtime
        values (:func:`runtime_f32`), so that kernels differing only in them are one.
      all_to_all_rows_at_runtime_offsets: rebuild an all-to-all's payload from its rows
        cut at runtime offsets (:func:`rows_at_runtime_offsets`).
      materialize: compute cheap producers read by many consumers into buffers of their
        own (:func:`materialized`).
      bf16_route: ``bf16()``'s mean: ``'allreduce'`` (a bf16 all-reduce through the
        configured algorithm) or ``'all_to_all'`` (all-to-all + all-gather of bf16 words,
        where a bf16 all-reduce would run in f32).
      ring_reduce_scatter: in a program of several processes, compute a reduce-scatter
        as a ring of ``lax.ppermute`` s (the transport's own is faulty).
      tie_collective_order: order collectives after a conditional or loop holding
        collectives by a data dependency (:func:`tie`, ``jaxcomm.ordering.after``).
      check_collective_order: on several processes, refuse a compiled step whose
        collectives' order is not fixed (``jaxcomm.hlo.ordering_hazards``).
      one_step_in_flight: the host waits for each step before dispatching the next.
      synchronous_collectives: a collective blocks the step's compute until it ends, so
        nothing hides it (``bucket_bytes='auto'`` then chooses the fewest buckets).
      qr_one_at_a_time: a batch of QRs as a loop of single QRs (``lax.map``), not one
        batched LAPACK call.
      initializer_compiler_options: XLA options a model's initializer compiles with
        (``jaxcomm.models.initialize``), as ``(name, value)`` pairs.
    """

    platform: str
    runtime_offsets: bool = False
    runtime_constants: bool = False
    all_to_all_rows_at_runtime_offsets: bool = False
    materialize: bool = False
    bf16_route: Literal["allreduce", "all_to_all"] = "allreduce"
    ring_reduce_scatter: bool = False
    tie_collective_order: bool = False
    check_collective_order: bool = False
    one_step_in_flight: bool = False
    synchronous_collectives: bool = False
    qr_one_at_a_time: bool = False
    initializer_compiler_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.bf16_route not in ("allreduce", "all_to_all"):
            raise ValueError(
                f"bf16_route={self.bf16_route!r} is not known; use 'allreduce' or 'all_to_all'."
            )


#: The plain program: no rewrite (a platform without a row, or no mesh in context).
PLAIN = Backend("plain")
#: XLA:CPU, with gloo between processes: every rewrite of the module docstring.
CPU = Backend(
    "cpu",
    runtime_offsets=True,
    runtime_constants=True,
    all_to_all_rows_at_runtime_offsets=True,
    materialize=True,
    bf16_route="all_to_all",
    ring_reduce_scatter=True,
    tie_collective_order=True,
    check_collective_order=True,
    one_step_in_flight=True,
    synchronous_collectives=True,
    qr_one_at_a_time=True,
    initializer_compiler_options=(("xla_backend_optimization_level", 1),),
)
#: GPU (NCCL sums bf16 natively; a GPU conditional reads its predicate on the host, and
#: its kernels index cheaply): the plain program.
GPU = Backend("gpu")
#: TPU: the plain program.
TPU = Backend("tpu")
#: The table: one row per platform name (``jax.Device.platform``).
ROWS: Mapping[str, Backend] = types.MappingProxyType({"cpu": CPU, "gpu": GPU, "tpu": TPU})

# The row :func:`use` installs for the traces it encloses (None: the mesh's row).
_OVERRIDE: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "jaxcomm_backend_override", default=None
)


def for_platform(platform: str | None) -> Backend:
    """The row of ``platform`` (a ``jax.Device.platform``); :data:`PLAIN` for None or a
    platform without a row.

    Example:
      >>> for_platform("cpu").one_step_in_flight
      True
    """
    return ROWS.get(platform, PLAIN) if platform is not None else PLAIN


def for_mesh(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> Backend:
    """The row of the platform ``mesh``'s devices are of (for the host: dispatch, compile
    checks). An ``AbstractMesh`` without ``abstract_device`` gets :data:`PLAIN`.

    Example:
      >>> if backend.for_mesh(mesh).one_step_in_flight:
      ...     jax.block_until_ready(out)
    """
    if isinstance(mesh, jax.sharding.Mesh):
        return for_platform(mesh.devices.flat[0].platform)
    device = getattr(mesh, "abstract_device", None)
    return for_platform(None if device is None else device.platform)


def current() -> Backend:
    """The row of the program being traced: the row :func:`use` installed, else that of
    the mesh in context (inside ``jax.shard_map`` or under ``jax.set_mesh``), else
    :data:`PLAIN` (module docstring).

    Example:
      >>> if backend.current().runtime_offsets:
      ...     pieces = backend.slices_at_runtime_offsets(cuts)
    """
    row = _OVERRIDE.get()
    return for_mesh(jax.sharding.get_abstract_mesh()) if row is None else row


@contextlib.contextmanager
def use(row: Backend) -> Iterator[Backend]:
    """Traces the enclosed code under ``row`` instead of the mesh's (this thread only).

    For tests that compare a platform's route with another on one CPU mesh, and for a
    caller that knows more than the platform: ``jaxcomm.compression.adaptive`` traces its
    ``lax.switch`` branches under ``materialize=False`` (their outputs are buffers
    already). jax caches traces by function, not by this context: trace a fresh function
    under each row.

    Args:
      row: the row, e.g. ``dataclasses.replace(backend.current(), materialize=False)``.

    Yields:
      ``row``.

    Raises:
      TypeError: ``row`` is not a :class:`Backend`.

    Example:
      >>> with backend.use(dataclasses.replace(backend.CPU, bf16_route="allreduce")):
      ...     out = jax.jit(shard_map(fresh_fn, ...))(x)
    """
    if not isinstance(row, Backend):
        raise TypeError(f"use(row={row!r}): expected a jaxcomm.backend.Backend row.")
    token = _OVERRIDE.set(row)
    try:
        yield row
    finally:
        _OVERRIDE.reset(token)


# -- the rewrites the CPU row turns on --------------------------------------------------
# Largest value runtime_ints carries (an int32).
INT32_MAX = 2**31 - 1

# Values per sort in runtime_ints: a kernel takes every operand as a parameter.
_SORT_OPERANDS = 64


def runtime_ints(values: Sequence[int]) -> list[jax.Array]:
    """The int32 scalars ``values`` as values XLA cannot constant-fold (``runtime_offsets``).

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
    """Pieces ``buf[start:stop]`` of 1-D buffers, cut at runtime offsets (``runtime_offsets``).

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
    (``all_to_all_rows_at_runtime_offsets``): the operand of an all-to-all whose
    per-device cuts XLA:CPU then compiles as one kernel.

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


#: The name scope of :func:`materialized`'s conditional (the CPU row only).
MATERIALIZE_SCOPE = "materialize"


def materialized(f: Callable[..., Any], *args: jax.Array) -> Any:
    """``f(*args)`` (an array or a tuple of arrays), computed into buffers of its own
    (``materialize``).

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

    # The scope names these conditionals in the compiled program's metadata
    # (``op_name=".../materialize/cond"``), where the steady-state check tells them from
    # a decision: on XLA:CPU the host runs the program, so they cost no round trip.
    with jax.named_scope(MATERIALIZE_SCOPE):
        return lax.cond(one == 1, f, unused, *args)


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
    """``x``, bit for bit, computed from an int32 zero read out of ``deps``
    (``tie_collective_order``).

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
