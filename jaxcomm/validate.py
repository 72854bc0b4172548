"""Argument checks shared by every jaxcomm constructor, with one message shape.

Internal: modules import :func:`check_int` and :func:`check_choice` from here; nothing is
re-exported publicly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_choice", "check_int"]


def _allowed(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    fix: str | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """Checks that ``value`` is an integer within ``[minimum, maximum]``; returns it as ``int``.

    Python and NumPy integers (``np.int32(4)``) are accepted; bools (``True`` is an ``int``
    subclass, almost always a mistake here), floats (``2.0``) and everything else are refused
    with one message shape: ``"NAME=VALUE must be an integer >= MIN (got TYPE); FIX."``.

    Args:
      name: the argument's name as the caller wrote it (e.g. ``'bucket_bytes'``,
        ``'make_mesh(intra)'``).
      value: the value to check.
      minimum: smallest allowed value (inclusive), or None.
      maximum: largest allowed value (inclusive), or None.
      fix: what to do instead (appended after ``'; '``), or None.
      error: the exception class to raise (a ``ValueError`` subclass of the calling module).

    Returns:
      ``int(value)``.

    Raises:
      ``error`` (``ValueError`` by default) with the message above.

    Example:
      >>> check_int('warmup_steps', np.int64(5), minimum=0)
      5
      >>> check_int('rank', True, minimum=1)
      ValueError: rank=True must be an integer >= 1 (got bool).
    """
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    if ok:
        v = int(value)
        ok = (minimum is None or v >= minimum) and (maximum is None or v <= maximum)
    if not ok:
        tail = f"; {fix}" if fix else ""
        raise error(
            f"{name}={value!r} must be {_allowed(minimum, maximum)} "
            f"(got {type(value).__name__}){tail}."
        )
    return v


def check_choice(
    name: str,
    value: Any,
    allowed: tuple,
    *,
    fix: str | None = None,
    error: type[Exception] = ValueError,
) -> Any:
    """Checks that ``value`` is one of ``allowed``; returns it.

    One message shape with :func:`check_int`: ``"NAME=VALUE must be one of (...); FIX."``.

    Args:
      name: the argument's name as the caller wrote it.
      value: the value to check.
      allowed: the allowed values.
      fix: what to do instead (appended after ``'; '``), or None.
      error: the exception class to raise.

    Returns:
      ``value``.

    Example:
      >>> check_choice('op', 'avg', ('mean', 'sum'))
      ValueError: op='avg' must be one of ('mean', 'sum').
    """
    try:
        ok = value in allowed
    except TypeError:  # an unhashable or incomparable value
        ok = False
    if not ok:
        tail = f"; {fix}" if fix else ""
        raise error(f"{name}={value!r} must be one of {tuple(allowed)!r}{tail}.")
    return value
