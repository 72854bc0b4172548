"""Argument checks shared by every jaxcomm constructor, with one message shape.

Internal: modules import :func:`check_int` and :func:`check_choice` from here; nothing is
re-exported publicly.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["check_choice", "check_int", "refuse_pmap_layout"]


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


def refuse_pmap_layout(batch: Any, num_devices: int, where: str, laid_out: Any = None) -> None:
    """Refuses a batch in ``jax.pmap``'s layout where the global batch is taken.

    A pmap-shaped batch ``(devices, per_device, ...)`` taken as the global batch gives each
    device one example whose first axis is the per-device batch: models that broadcast over
    leading axes (``nn.Dense``, ``nn.Conv``) run on it, pooling then mixes examples, and
    the run trains badly without an error. The two layouts cannot always be told apart by
    shape; this refuses the shape a pmap script makes: every leaf has at least two axes, the
    first is the devices and the second, of at least 2, is the same for every leaf. A batch
    of exactly that shape meant as the global batch passes laid out already (``laid_out``:
    the step's batch sharding).

    Args:
      batch: the batch pytree as the step was called with it.
      num_devices: the data-parallel devices.
      where: the step builder, in the message.
      laid_out: leaves that are ``jax.Array`` s with this sharding are taken as they are.

    Raises:
      ValueError: naming the shapes and both fixes.
    """
    leaves = [
        x
        for x in jax.tree.leaves(batch)
        if not (laid_out is not None and getattr(x, "sharding", None) == laid_out)
    ]
    shapes = [np.shape(x) for x in leaves]
    if not shapes or any(len(s) < 2 or s[0] != num_devices for s in shapes):
        return
    per_device = {s[1] for s in shapes}
    if len(per_device) != 1 or per_device.pop() < 2:
        return
    raise ValueError(
        f"{where}: the batch has shapes {shapes}, jax.pmap's layout (devices, per_device, "
        f"...) for {num_devices} devices; {where} takes the global batch and splits its "
        "leading axis over the devices, so each device would get one example. Pass "
        "x.reshape(-1, *x.shape[2:]) for each leaf (or the batch before "
        "common_utils.shard). If it really is a global batch of one example per device, pass "
        "it laid out already: jax.device_put(batch, step.batch_sharding)."
    )
