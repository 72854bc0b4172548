"""Axis names a step was written for, bound to the mesh's data axes while it is traced.

A ``jax.pmap`` script names its data axis (``axis_name='batch'``) in its own collectives
(``lax.pmean(metrics, 'batch')``) and in its model (``nn.BatchNorm(axis_name='batch')``,
Flax's ``DynamicScale.value_and_grad(..., axis_name='batch')``). A jaxcomm step runs under
``jax.shard_map`` over the mesh axes ``('inter', 'intra')``, where ``'batch'`` is not
bound. :func:`bind` maps such names to the data axes while the step traces: every
``jax.lax`` collective and axis query (``psum``, ``pmean``, ``pmax``, ``pmin``,
``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``pshuffle``,
``axis_index``, ``axis_size``, ``pcast``, ``pbroadcast``) called through the ``jax.lax``
module with ``'batch'`` runs over ``('inter', 'intra')`` instead, as the real collective
(so shard_map's replication check types its result as it would any other). Device ``i``
of the name (``lax.axis_index('batch')``) is device ``i`` of the mesh in
``('inter', 'intra')`` order, the row ``i`` of a pmap-layout batch.

A name that JAX binds where the call is traced is JAX's: a ``jax.vmap(...,
axis_name='batch')``, ``jax.pmap`` or inner ``jax.shard_map`` inside the step shadows the
step's ``'batch'``, and the call goes to JAX's function with the name unchanged (asked of
the public ``jax.lax.axis_size``). The binding is the tracing thread's own: while a step
traces, another thread's ``jax.lax`` calls (its own ``jax.pmap(..., axis_name='batch')``)
go to JAX's functions unchanged.

An axis name that is bound neither by the mesh nor by :func:`bind` raises
:class:`UnboundAxisError`, naming the names in scope and the fix, where JAX would fail
with a bare ``AssertionError`` (``lax.pmean``) or ``NameError``.

Only calls through the module attribute (``lax.pmean(...)`` after ``from jax import lax``,
as Flax and its examples write) are seen; a function imported by name before the trace
(``from jax.lax import pmean``) is JAX's own and keeps the unbound name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax import lax

__all__ = ["FLAX_FIX", "UnboundAxisError", "active", "bind", "bound_names", "check_axis_name"]

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
    """The binds of the thread that traces: another thread's collectives, traced meanwhile
    (a plain ``jax.pmap`` of its own), are JAX's, whatever this one binds."""

    def __init__(self):
        self.stack: list[tuple[dict[str, tuple[str, ...]], tuple[str, ...], str, str]] = []


_BINDS = _Binds()
# Guards only the module attributes and the count of binds in effect in all threads, never a
# trace: the first bind of any thread installs the wrappers, the last one out restores JAX's.
_LOCK = threading.Lock()
_INSTALLED = 0


class UnboundAxisError(NameError):
    """An axis name used inside a jaxcomm step is bound neither by the mesh nor by the
    step's ``axis_name=``. A ``NameError``, as JAX's own unbound-name error."""


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
            _, axes, where, fix = _BINDS.stack[-1]
            scope = list(axes) + [a for a in aliases if a not in axes]
            raise UnboundAxisError(
                f"{where}: axis name {n!r} is not bound inside the data-parallel step; "
                f"the names in scope are {scope} (the step runs under jax.shard_map over "
                f"the mesh axes {axes}). " + fix.format(name=n, axes=axes, entry=where)
            )
    if isinstance(name, tuple | list) or len(out) > 1:
        return tuple(out), inner
    return out[0], inner


def _wrapped(fname: str, original: Callable) -> Callable:
    params = list(inspect.signature(original).parameters)
    position = params.index("axis_name")

    @functools.wraps(original)
    def call(*args, **kwargs):
        if not _BINDS.stack:  # a thread that binds nothing: JAX's function as it is
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
    """Within, in this thread: ``jax.lax`` collectives map each name of ``aliases`` that
    JAX does not bind to its mesh axes and refuse names bound nowhere
    (:class:`UnboundAxisError`).

    The binding is the calling thread's: other threads' calls go to JAX's functions
    unchanged, and traces in several threads bind at once (no lock is held across a trace).
    Nested binds add their names to the outer ones.

    Args:
      aliases: e.g. ``{'batch': ('inter', 'intra')}``; may be empty (then only the check
        of unbound names applies).
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
    with _LOCK:
        if not _INSTALLED:
            for fname, wrapped in _WRAPPED.items():
                setattr(lax, fname, wrapped)
        _INSTALLED += 1
    _BINDS.stack.append((dict(aliases), tuple(axes), where, fix))
    try:
        yield
    finally:
        _BINDS.stack.pop()
        with _LOCK:
            _INSTALLED -= 1
            if not _INSTALLED:
                for fname, original in _ORIGINAL.items():
                    setattr(lax, fname, original)


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
