"""Axis names inside a jaxcomm step: a pmap script's name bound to the mesh's data axes,
and the clear error for a name bound nowhere.

A ``jax.pmap`` script names its data axis (``axis_name='batch'``) in its own collectives
(``lax.pmean(metrics, 'batch')``) and in its model (``nn.BatchNorm(axis_name='batch')``,
Flax's ``DynamicScale.value_and_grad(..., axis_name='batch')``). A jaxcomm step runs under
``jax.shard_map`` over the mesh axes ``('inter', 'intra')``, where ``'batch'`` is not
bound. Every front end calls the user's code through :func:`call_step`:

1. Only a step given ``axis_name=`` (the pmap entry and the Flax decorators) binds a name.
   While it traces, :func:`bind` maps the name to the data axes: every ``jax.lax``
   collective and axis query (``psum``, ``pmean``, ``pmax``, ``pmin``, ``all_gather``,
   ``psum_scatter``, ``all_to_all``, ``ppermute``, ``pshuffle``, ``axis_index``,
   ``axis_size``, ``pcast``, ``pbroadcast``) called through the ``jax.lax`` module with
   ``'batch'`` runs over ``('inter', 'intra')`` instead, as the real collective (so
   shard_map's replication check types its result as it would any other). Device ``i`` of
   the name (``lax.axis_index('batch')``) is device ``i`` of the mesh in
   ``('inter', 'intra')`` order, the row ``i`` of a pmap-layout batch. This replaces the
   ``jax.lax`` module attributes while such a step traces: the one place jaxcomm wraps
   another library's functions, because the script's name lives in code jaxcomm does not
   own (Flax's layers call ``lax.pmean(x, self.axis_name)``), and a trace that knew
   ``'batch'`` apart from the mesh axes would type a value varying over the mesh as
   invariant over ``'batch'`` (docs/porting.md).
2. Every other step (``data_parallel``, a Flax step without ``axis_name=``) leaves
   ``jax.lax`` as it is. A name bound nowhere fails in JAX itself, with a bare
   ``AssertionError`` (``lax.pmean``: shard_map's replication check) or a ``NameError``;
   :func:`call_step` catches it where the user's code returns to the step, finds the name
   (from JAX's ``NameError``, or by tracing the user's code once more, abstractly, in a
   thread of its own, under a ``jax.shard_map`` without the replication check, where JAX
   names it) and raises :class:`UnboundAxisError` from it, naming the names in scope and
   the fix. Nothing of this runs unless the step fails.

A name that JAX binds where the call is traced is JAX's: a ``jax.vmap(...,
axis_name='batch')``, ``jax.pmap`` or inner ``jax.shard_map`` inside the step shadows the
step's ``'batch'``, and the call goes to JAX's function with the name unchanged (asked of
the public ``jax.lax.axis_size``). The binding is the tracing thread's own: while a step
traces, another thread's ``jax.lax`` calls (its own ``jax.pmap(..., axis_name='batch')``,
or a jaxcomm step without ``axis_name=``) go to JAX's functions unchanged.

Only calls through the module attribute (``lax.pmean(...)`` after ``from jax import lax``,
as Flax and its examples write) are seen; a function imported by name before the trace
(``from jax.lax import pmean``) is JAX's own and keeps the unbound name (the error then
says so).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import lax

__all__ = [
    "FLAX_FIX",
    "UnboundAxisError",
    "active",
    "bind",
    "bound_names",
    "call_step",
    "check_axis_name",
]

# The jax.lax functions that take an axis name, each with the name of that argument.
_FUNCTIONS = (
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pshuffle",
    "axis_index",
    "axis_size",
    "pcast",
    "pbroadcast",
)

# What a user does about an unbound name, per front end ({name}, {axes}: the name, the axes).
FLAX_FIX = (
    "Bind the name to them with jaxcomm.{entry}(mesh, axis_name={name!r}) (what "
    "jax.pmap(..., axis_name={name!r}) bound), or name the mesh axes where it is used, e.g. "
    "nn.BatchNorm(axis_name={axes})."
)
# JAX's own functions, read before any bind (the module is imported before a step traces).
_ORIGINAL: dict[str, Callable] = {f: getattr(lax, f) for f in _FUNCTIONS if hasattr(lax, f)}


class _Binds(threading.local):
    """The steps this thread is tracing, innermost last: another thread's collectives,
    traced meanwhile (a plain ``jax.pmap`` of its own), are JAX's, whatever this one binds."""

    def __init__(self):
        self.stack: list[tuple[dict[str, tuple[str, ...]], tuple[str, ...], str, str]] = []
        self.aliased = 0  # entries of the stack that bind a name


_BINDS = _Binds()
# Guards only the module attributes and the count of binds in effect in all threads, never a
# trace: the first bind of any thread installs the wrappers, the last one out restores JAX's.
_LOCK = threading.Lock()
_INSTALLED = 0


class UnboundAxisError(NameError):
    """An axis name used inside a jaxcomm step is bound neither by the mesh nor by the
    step's ``axis_name=``. A ``NameError``, as JAX's own unbound-name error; ``name`` is
    the axis name."""


def _unbound_error(name: Any, note: str = "") -> UnboundAxisError:
    """The error for ``name``, bound nowhere in the innermost step of this thread."""
    aliases, axes, where, fix = _BINDS.stack[-1]
    scope = list(axes) + [a for a in bound_names() if a not in axes]
    return UnboundAxisError(
        f"{where}: axis name {name!r} is not bound inside the data-parallel step; "
        f"the names in scope are {scope} (the step runs under jax.shard_map over "
        f"the mesh axes {axes}). " + (note or fix.format(name=name, axes=axes, entry=where)),
        name=name,
    )


def active() -> bool:
    """Whether this thread is tracing a jaxcomm step with :func:`bind` in effect."""
    return bool(_BINDS.stack)


def bound_names() -> dict[str, tuple[str, ...]]:
    """The names :func:`bind` maps now in this thread, each to its mesh axes (empty outside
    a step)."""
    out: dict[str, tuple[str, ...]] = {}
    for aliases, *_ in _BINDS.stack:
        out.update(aliases)
    return out


def _jax_binds(name: str) -> bool:
    """Whether JAX binds ``name`` where the call is traced (the mesh, or a transformation
    inside the step: ``jax.vmap``, ``jax.pmap``, an inner ``jax.shard_map``).

    ``jax.lax.axis_size`` raises ``NameError`` for a name bound nowhere, whatever
    collective would be called, and only reads the trace's axis environment: no operation
    is added. Asked before the call, so an error of the call itself reaches the caller as
    JAX raised it."""
    try:
        _ORIGINAL["axis_size"](name)
    except NameError:
        return False
    return True


def _resolve(name: Any) -> tuple[Any, list[str]]:
    """``name`` (one axis name or a tuple of them) with every alias that JAX does not bind
    replaced by its mesh axes, and the names bound by a transformation inside the step;
    raises :class:`UnboundAxisError` for a name bound nowhere.

    A name JAX binds is left as it is: a ``jax.vmap(..., axis_name='batch')`` inside the
    step shadows the step's ``'batch'``, as it would shadow pmap's."""
    aliases = bound_names()
    mesh_axes = {a for _, axes, *_ in _BINDS.stack for a in axes}
    names = name if isinstance(name, tuple | list) else (name,)
    out: list = []
    inner: list[str] = []
    for n in names:
        if not isinstance(n, str):
            out.append(n)
        elif _jax_binds(n):
            out.append(n)
            if n not in mesh_axes:
                inner.append(n)
        elif n in aliases:
            out.extend(a for a in aliases[n] if a not in out)
        else:
            raise _unbound_error(n)
    if isinstance(name, tuple | list) or len(out) > 1:
        return tuple(out), inner
    return out[0], inner


def _wrapped(fname: str, original: Callable) -> Callable:
    params = list(inspect.signature(original).parameters)
    position = params.index("axis_name")

    @functools.wraps(original)
    def call(*args, **kwargs):
        if not _BINDS.aliased:  # a thread that binds no name: JAX's function as it is
            return original(*args, **kwargs)
        inner: list[str] = []
        if "axis_name" in kwargs:
            kwargs["axis_name"], inner = _resolve(kwargs["axis_name"])
        elif len(args) > position:
            resolved, inner = _resolve(args[position])
            args = (*args[:position], resolved, *args[position + 1 :])
        try:
            return original(*args, **kwargs)
        except AssertionError as e:
            if not inner:
                raise
            # JAX's own failure, named: the step's shard_map checks replication
            # (check_vma=True), and JAX's check asserts on an axis that is not the mesh's.
            where = _BINDS.stack[-1][2]
            raise NotImplementedError(
                f"{where}: lax.{fname} over {inner[0]!r}, an axis that a transformation "
                f"inside the step binds (jax.vmap(..., axis_name={inner[0]!r})): JAX "
                f"{jax.__version__} cannot reduce a vmapped value over a vmap axis inside "
                "jax.shard_map(check_vma=True), which the step runs under (its "
                "replication check fails with the AssertionError above); lax.axis_index "
                "and lax.axis_size work there. Reduce over the vmapped axis outside the "
                "vmap instead, e.g. jnp.sum(jax.vmap(f)(xs), axis=0) for lax.psum."
            ) from e

    return call


_WRAPPED = {f: _wrapped(f, original) for f, original in _ORIGINAL.items()}


@contextlib.contextmanager
def bind(
    aliases: Mapping[str, tuple[str, ...]],
    *,
    axes: tuple[str, ...],
    where: str,
    fix: str = FLAX_FIX,
) -> Iterator[None]:
    """Within, in this thread: a jaxcomm step is traced (:func:`active`), and ``jax.lax``
    collectives map each name of ``aliases`` that JAX does not bind to its mesh axes and
    refuse names bound nowhere (:class:`UnboundAxisError`).

    With ``aliases`` empty, ``jax.lax`` is left as it is: only the step is recorded (its
    axes, ``where`` and ``fix``, for :func:`call_step`'s error). Otherwise the wrappers are
    installed while any thread binds a name; they are the calling thread's: other threads'
    calls go to JAX's functions unchanged, and traces in several threads bind at once (no
    lock is held across a trace). Nested binds add their names to the outer ones.

    Args:
      aliases: e.g. ``{'batch': ('inter', 'intra')}``, the step's ``axis_name=``; empty for
        a step without one.
      axes: the step's data mesh axes (named in errors).
      where: the front end, e.g. ``'linen_data_parallel'`` (named in errors).
      fix: what to do about an unbound name, a template of ``{name}``, ``{axes}`` and
        ``{entry}`` (``where``); by default the Flax front ends' ``axis_name=``.

    Example:
      >>> with bind({'batch': ('inter', 'intra')}, axes=('inter', 'intra'),
      ...           where='linen_data_parallel'):
      ...     mean = lax.pmean(x, 'batch')  # inside shard_map over ('inter', 'intra')
    """
    global _INSTALLED
    aliases = dict(aliases)
    if aliases:
        with _LOCK:
            if not _INSTALLED:
                for fname, wrapped in _WRAPPED.items():
                    setattr(lax, fname, wrapped)
            _INSTALLED += 1
        _BINDS.aliased += 1
    _BINDS.stack.append((aliases, tuple(axes), where, fix))
    try:
        yield
    finally:
        _BINDS.stack.pop()
        if aliases:
            _BINDS.aliased -= 1
            with _LOCK:
                _INSTALLED -= 1
                if not _INSTALLED:
                    for fname, original in _ORIGINAL.items():
                        setattr(lax, fname, original)


def call_step(
    fn: Callable,
    args: Sequence[Any],
    *,
    aliases: Mapping[str, tuple[str, ...]],
    axes: tuple[str, ...],
    where: str,
    fix: str = FLAX_FIX,
) -> Any:
    """``fn(*args)``, the user's code inside a step being traced, under :func:`bind`; an
    axis name bound nowhere raises :class:`UnboundAxisError` (the names in scope, the fix)
    from JAX's own error.

    1. Calls ``fn(*args)`` under ``bind(aliases, ...)`` (``jax.lax`` untouched when
       ``aliases`` is empty).
    2. On a ``NameError`` or ``AssertionError`` from JAX (a collective over a name the
       trace does not bind fails with either), finds the name: from the ``NameError``'s
       text, or by tracing ``fn`` once more, abstractly (``jax.eval_shape``), in a thread of
       its own, under ``jax.shard_map`` over the same mesh without the replication check,
       where JAX's error names it. Any other outcome re-raises JAX's error unchanged.

    Args:
      fn: the user's loss or step.
      args: its arguments (tracers of the step's trace, and any other values).
      aliases, axes, where, fix: as :func:`bind`.

    Returns:
      What ``fn`` returns.
    """
    with bind(aliases, axes=axes, where=where, fix=fix):
        try:
            return fn(*args)
        except UnboundAxisError:
            raise
        except (NameError, AssertionError) as e:
            name = _named_in(e) if isinstance(e, NameError) else _retraced_name(fn, args)
            if name is None or _jax_binds(name):
                raise
            note = ""
            if name in bound_names():
                note = (
                    f"axis_name={name!r} binds it for calls through the jax.lax module "
                    f"(lax.pmean(x, {name!r})); a function imported by name before the step "
                    "(from jax.lax import pmean) is JAX's own: call it as lax.pmean."
                )
            raise _unbound_error(name, note) from e


# JAX's NameError for an axis name bound nowhere: "unbound axis name: batch" (all_gather,
# axis_size, psum under shard_map(check_vma=False)), "Found an unbound axis name: batch.
# To fix this, ..." (axis_index).
_JAX_UNBOUND = re.compile(r"unbound axis name: (.+?)(?:\. |\.?$)", re.DOTALL)


def _named_in(error: NameError) -> str | None:
    """The axis name of JAX's unbound-name error, or None for another ``NameError``."""
    if isinstance(error, UnboundAxisError):
        return error.name
    found = _JAX_UNBOUND.search(str(error))
    return found.group(1) if found else None


def _retraced_name(fn: Callable, args: Sequence[Any]) -> str | None:
    """The axis name bound nowhere that made ``fn(*args)`` fail, asked of JAX by tracing
    it again, abstractly, under ``jax.shard_map`` over the step's mesh with
    ``check_vma=False`` (where JAX raises a ``NameError`` naming it, not the replication
    check's bare ``AssertionError``); None when that trace does not name one.

    The trace runs in a thread of its own, so that it starts outside the step's trace;
    it binds the same names as the step (this thread's :func:`bind`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        return None
    leaves, treedef = jax.tree.flatten(tuple(args))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    shapes = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in arrays]
    binds = list(_BINDS.stack)

    def again(*values):
        filled = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            filled[i] = v
        with contextlib.ExitStack() as stack:
            for aliases, axes, where, fix in binds:
                stack.enter_context(bind(aliases, axes=axes, where=where, fix=fix))
            fn(*jax.tree.unflatten(treedef, filled))
        return ()

    found: list[str | None] = [None]

    def run():
        step = jax.shard_map(
            again,
            mesh=jax.sharding.AbstractMesh(mesh.axis_sizes, mesh.axis_names),
            in_specs=jax.P(),
            out_specs=(),
            check_vma=False,
        )
        try:
            jax.eval_shape(step, *shapes)
        except NameError as e:
            found[0] = _named_in(e)
        except Exception:  # noqa: BLE001 - another failure names nothing: JAX's error stands
            pass

    thread = threading.Thread(target=run, name="jaxcomm-axis-name", daemon=True)
    thread.start()
    thread.join()
    return found[0]


def check_axis_name(axis_name: Any, axes: tuple[str, ...], where: str) -> str | None:
    """``axis_name`` checked for a decorator's ``axis_name=``: None or a string that is not
    one of the mesh axes (those are bound already)."""
    if axis_name is None:
        return None
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(
            f"{where}(axis_name={axis_name!r}): pass the one axis name the script's pmap "
            "bound, a string such as 'batch' (jax.pmap(..., axis_name='batch'))."
        )
    if axis_name in axes:
        raise ValueError(
            f"{where}(axis_name={axis_name!r}) is a mesh axis already; axis_name= binds "
            f"another name to the data axes {axes}. Leave it out."
        )
    return axis_name
