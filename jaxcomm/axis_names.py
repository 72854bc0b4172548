"""Axis names a step was written for, bound to the mesh's data axes while it is traced.

A ``jax.pmap`` script names its data axis (``axis_name='batch'``) in its own collectives
(``lax.pmean(metrics, 'batch')``) and in its model (``nn.BatchNorm(axis_name='batch')``,
Flax's ``DynamicScale.value_and_grad(..., axis_name='batch')``). A jaxcomm step runs under
``jax.shard_map`` over the mesh axes ``('inter', 'intra')``, where ``'batch'`` is not
bound. :func:`bind` maps such names to the data axes for the duration of a trace: every
``jax.lax`` collective and axis query (``psum``, ``pmean``, ``pmax``, ``pmin``,
``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``pshuffle``,
``axis_index``, ``axis_size``, ``pcast``, ``pbroadcast``) called through the ``jax.lax``
module with ``'batch'`` runs over ``('inter', 'intra')`` instead, as the real collective
(so shard_map's replication check types its result as it would any other). Device ``i``
of the name (``lax.axis_index('batch')``) is device ``i`` of the mesh in
``('inter', 'intra')`` order, the row ``i`` of a pmap-layout batch.

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

_LOCK = threading.RLock()
_STACK: list[tuple[dict[str, tuple[str, ...]], tuple[str, ...], str, str]] = []
# What a user does about an unbound name, per front end ({name}, {axes}: the name, the axes).
FLAX_FIX = (
    "Bind the name to them with jaxcomm.{entry}(mesh, axis_name={name!r}) (what "
    "jax.pmap(..., axis_name={name!r}) bound), or name the mesh axes where it is used, e.g. "
    "nn.BatchNorm(axis_name={axes})."
)
_ORIGINAL: dict[str, Callable] = {}


class UnboundAxisError(NameError):
    """An axis name used inside a jaxcomm step is bound neither by the mesh nor by the
    step's ``axis_name=``. A ``NameError``, as JAX's own unbound-name error."""


def active() -> bool:
    """Whether a jaxcomm step is being traced with :func:`bind` in effect."""
    return bool(_STACK)


def bound_names() -> dict[str, tuple[str, ...]]:
    """The names :func:`bind` maps now, each to its mesh axes (empty outside a step)."""
    out: dict[str, tuple[str, ...]] = {}
    for aliases, *_ in _STACK:
        out.update(aliases)
    return out


def _is_bound(name: Any) -> bool:
    try:
        _ORIGINAL.get("axis_size", lax.axis_size)(name)
    except NameError:
        return False
    return True


def _resolve(name: Any) -> Any:
    """``name`` (one axis name or a tuple of them) with every bound alias replaced by its
    mesh axes; raises :class:`UnboundAxisError` for a name bound nowhere."""
    aliases = bound_names()
    names = name if isinstance(name, tuple | list) else (name,)
    out: list = []
    for n in names:
        if isinstance(n, str) and n in aliases:
            out.extend(a for a in aliases[n] if a not in out)
            continue
        if isinstance(n, str) and not _is_bound(n):
            _, axes, where, fix = _STACK[-1]
            scope = list(axes) + [a for a in aliases if a not in axes]
            raise UnboundAxisError(
                f"{where}: axis name {n!r} is not bound inside the data-parallel step; "
                f"the names in scope are {scope} (the step runs under jax.shard_map over "
                f"the mesh axes {axes}). " + fix.format(name=n, axes=axes, entry=where)
            )
        out.append(n)
    if isinstance(name, tuple | list) or len(out) > 1:
        return tuple(out)
    return out[0]


def _patched(original: Callable) -> Callable:
    params = list(inspect.signature(original).parameters)
    position = params.index("axis_name")

    @functools.wraps(original)
    def call(*args, **kwargs):
        if "axis_name" in kwargs:
            kwargs["axis_name"] = _resolve(kwargs["axis_name"])
        elif len(args) > position:
            args = (*args[:position], _resolve(args[position]), *args[position + 1 :])
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def bind(
    aliases: Mapping[str, tuple[str, ...]],
    *,
    axes: tuple[str, ...],
    where: str,
    fix: str = FLAX_FIX,
) -> Iterator[None]:
    """Within: ``jax.lax`` collectives map each name of ``aliases`` to its mesh axes and
    refuse names bound nowhere (:class:`UnboundAxisError`).

    Traces that bind are serialised by a lock (the patch is of a module shared by every
    thread); nested binds add their names to the outer ones.

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
    with _LOCK:
        if not _STACK:
            for fname in _FUNCTIONS:
                original = getattr(lax, fname, None)
                if original is None:
                    continue  # not in this JAX version
                _ORIGINAL[fname] = original
                setattr(lax, fname, _patched(original))
        _STACK.append((dict(aliases), tuple(axes), where, fix))
        try:
            yield
        finally:
            _STACK.pop()
            if not _STACK:
                for fname, original in _ORIGINAL.items():
                    setattr(lax, fname, original)
                _ORIGINAL.clear()


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
