"""An optimizer state of a chain without ``sync_gradients``, put into the ported chain's.

Porting a script adds ``jaxcomm.sync_gradients()`` to its optimizer
(``optax.chain(jaxcomm.sync_gradients(), tx)``), which adds an entry to the optimizer
state. A checkpoint the unported script wrote holds the state of ``tx`` alone; restored into
the ported structure (Flax's ``restore_checkpoint`` with a target), it does not fit, and the
momentum and the schedule's count would start again from ``tx.init``'s values.
:func:`lift_opt_state` carries them over.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from jaxcomm.sync import SyncGradientsState

__all__ = ["lift_opt_state"]


def _is_sync(x: Any) -> bool:
    return isinstance(x, SyncGradientsState)


def _children(node: Any) -> list[tuple[str, Any]] | None:
    """``(key, child)`` of a container as Flax's state dicts key it; None for a leaf."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return [(f, getattr(node, f)) for f in node._fields]
    if isinstance(node, (tuple, list)):
        return [(str(i), x) for i, x in enumerate(node)]
    if isinstance(node, dict):
        return [(str(k), x) for k, x in node.items()]
    return None


def _rebuild(node: Any, values: list) -> Any:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*values)
    if isinstance(node, (tuple, list)):
        return type(node)(values)
    return type(node)(zip(node.keys(), values, strict=True))


def _fits(new: Any, old: Any) -> bool:
    """Whether ``old`` (a state dict) has the structure and leaf shapes of ``new`` with
    its sync states left out."""
    kids = _children(new)
    if kids is None:
        return not isinstance(old, dict) and np.shape(old) == np.shape(new)
    if not kids:  # an EmptyState: Flax restores it without a target as None
        return _empty(old)
    if not isinstance(old, dict):
        return False
    kept = [(k, x) for k, x in kids if not _is_sync(x)]
    if len(kept) != len(kids):  # a chain holding a sync: its other entries
        return any(True for _ in _pairings(kept, old))
    return set(old) == {k for k, _ in kids} and all(_fits(x, old[k]) for k, x in kids)


def _pairings(kept: list[tuple[str, Any]], old: dict):
    """How the entries of a chain left after its syncs pair with ``old``: entry by entry
    (``chain(sync, a, b)`` from ``chain(a, b)``), or the one entry left as ``old`` itself
    (``chain(sync, tx)`` from ``tx``)."""
    if len(old) == len(kept) and all(str(i) in old for i in range(len(kept))):
        if all(_fits(x, old[str(i)]) for i, (_, x) in enumerate(kept)):
            yield [old[str(i)] for i in range(len(kept))]
    if set(old) == {k for k, _ in kept} and all(_fits(x, old[k]) for k, x in kept):
        yield [old[k] for k, _ in kept]  # optax.named_chain: by name
    if len(kept) == 1 and _fits(kept[0][1], old):
        yield [old]


def _lift(new: Any, old: Any, count: jax.Array, path: str) -> Any:
    kids = _children(new)
    if kids is None:
        x = jnp.asarray(old)
        if x.shape != np.shape(new):
            raise ValueError(
                f"lift_opt_state: leaf {path or '(root)'} has shape {x.shape} in the old "
                f"state and {np.shape(new)} in tx.init's; the old state is not of tx's chain."
            )
        return x.astype(jnp.result_type(new))
    if not kids:
        return new
    kept = [(k, x) for k, x in kids if not _is_sync(x)]
    if len(kept) != len(kids):
        olds = next(_pairings(kept, old), None)
        if olds is None:
            raise ValueError(_mismatch(path))
        it = iter(olds)
        values = [
            x._replace(count=count.astype(x.count.dtype))
            if _is_sync(x)
            else _lift(x, next(it), count, f"{path}.{k}")
            for k, x in kids
        ]
        return _rebuild(new, values)
    if not isinstance(old, dict) or set(old) != {k for k, _ in kids}:
        raise ValueError(_mismatch(path))
    return _rebuild(new, [_lift(x, old[k], count, f"{path}.{k}") for k, x in kids])


def _mismatch(path: str) -> str:
    return (
        f"lift_opt_state: the old optimizer state does not fit tx at {path or '(root)'}: "
        "pass the state of the chain the unported script used, and tx as that chain with "
        "jaxcomm.sync_gradients() added (optax.chain(jaxcomm.sync_gradients(), old_tx), or "
        "the sync first among the old chain's transforms)."
    )


def _state_dict(x: Any) -> Any:
    """``x`` as nested dicts keyed as Flax's state dicts (field names, indices as strings,
    dict keys), at every level (an ``OrderedDict``, ``named_chain``'s state, too)."""
    kids = _children(x)
    if kids is None:
        return serialization.to_state_dict(x)
    return {k: _state_dict(v) for k, v in kids}


def _fill(new: Any, old: Any) -> Any:
    """``new``'s structure holding ``old``'s leaves (same keys)."""
    kids = _children(new)
    if kids is None:
        return jnp.asarray(old)
    if not kids:
        return new
    return _rebuild(new, [_fill(x, old[k]) for k, x in kids])


def _empty(x: Any) -> bool:
    return x is None or (isinstance(x, dict) and not x)


def _same_keys(a: Any, b: Any) -> bool:
    """Whether two state dicts have the same keys at every level (an empty container is
    restored without a target as None)."""
    if _empty(a) and _empty(b):
        return True
    if isinstance(a, dict) != isinstance(b, dict):
        return False
    if not isinstance(a, dict):
        return True
    return set(a) == set(b) and all(_same_keys(a[k], b[k]) for k in a)


def _counts(old: Any) -> list[int]:
    """The ``count`` entries of a state dict (schedules, adam, the step of a wrapper)."""
    found = []
    if isinstance(old, dict):
        for k, v in old.items():
            if k == "count" and not isinstance(v, dict) and np.ndim(v) == 0:
                found.append(int(np.asarray(v)))
            else:
                found.extend(_counts(v))
    return found


def lift_opt_state(old_opt_state: Any, tx: optax.GradientTransformation, params: Any, *,
                   step: int | None = None) -> Any:  # fmt: skip
    """The optimizer state of the unported chain, in the structure of ``tx`` (the same
    chain with ``jaxcomm.sync_gradients()``), its momentum and counts kept.

    1. ``tx.init(params)`` gives the structure and the sync's own fresh state.
    2. Each ``SyncGradientsState`` is left out of its chain; the chain's other entries are
       paired with the old state, entry by entry (``chain(sync, a, b)`` from ``chain(a,
       b)``) or the one entry as the old state itself (``chain(sync, tx)`` from ``tx``).
    3. Every other leaf is the old state's (shape checked, dtype as ``tx.init``'s).
    4. The sync's count is ``step``, or the largest ``count`` of the old state (the steps
       taken): its warm-up does not start again; its compressor state (error-feedback
       residuals) is ``tx.init``'s, zero, as the unported run had none.

    A state of ``tx``'s own structure (a checkpoint the ported script wrote) is returned
    as it is, so a script may lift whatever it restores.

    Args:
      old_opt_state: the unported script's optimizer state: as its ``tx.init`` made it
        (NamedTuples), or as restored without a target
        (``checkpoints.restore_checkpoint(dir, target=None)``: nested dicts).
      tx: the ported optimizer, ``optax.chain(jaxcomm.sync_gradients(...), old_tx)``.
      params: the params (unreplicated) the state is for.
      step: the steps taken, for the sync's count; None: read from the old state.

    Returns:
      ``tx``'s optimizer state holding the old momentum, moments and counts.

    Raises:
      ValueError: the old state does not fit ``tx`` (the path named), or ``tx`` holds no
        ``sync_gradients``.

    Example:
      >>> restored = checkpoints.restore_checkpoint(workdir, target=None)  # unported run's
      >>> params, old_opt_state, step = restored['0'], restored['1'], int(restored['2'])
      >>> opt_state = jaxcomm.lift_opt_state(old_opt_state, tx, params)
    """
    fresh = jax.jit(tx.init)(params)
    if not any(_is_sync(x) for x in jax.tree.leaves(fresh, is_leaf=_is_sync)):
        raise ValueError(
            "lift_opt_state: tx holds no jaxcomm.sync_gradients(); pass the ported "
            "optimizer, optax.chain(jaxcomm.sync_gradients(), old_tx)."
        )
    old = _state_dict(old_opt_state)
    if _same_keys(_state_dict(fresh), old):
        # tx's own structure (a checkpoint of the ported run): as it is. Leaf shapes are
        # not compared: a pmap step's token stands in for per-device state.
        return _fill(fresh, old)
    if step is None:
        step = max(_counts(old), default=0)
    return _lift(fresh, old, jnp.asarray(step, jnp.int32), "")
