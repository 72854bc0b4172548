"""Gradient accumulation over microbatches inside the data-parallel step.

``data_parallel(..., microbatches=N)`` splits each device's batch into ``N`` microbatches and
runs them one after the other in a ``lax.scan`` (activation memory of one microbatch). Two
ways to get from ``N`` microbatch gradients to the optimizer's one update:

* ``accumulate='local'`` (the default): sum the ``N`` gradients on each device (f32
  accumulators), divide by ``N``, then run the optimizer as in an ordinary step, so
  ``sync_gradients`` -- with its compressor, error feedback and warm-up -- reduces once.
  Bytes on the wire: those of one ``microbatches=1`` step, i.e. ``1/N`` of 'overlap'.
* ``accumulate='overlap'``: reduce microbatch ``i`` inside the scan iteration that computes
  microbatch ``i+1`` (no data dependency between the two, so the collective can run while
  the next microbatch computes), then run the optimizer with ``sync_gradients`` passing the
  reduced mean through. Sends ``N`` reductions per step.

Step-time model (compute ``C`` per microbatch, one reduction ``R``): 'local' takes about
``N C + R``; 'overlap' about ``C + (N-1) max(C, R) + R`` -- never less, equal only while the
link keeps up (``R <= C``), and with ``N`` times the bytes on a link other traffic shares.
That is why 'local' is the default.

In 'overlap' mode the compressor's state (error-feedback residuals, PowerSGD's ``Q``, the
count that keys its randomness) is threaded through the scan: every microbatch reduction is
one ``sync_gradients`` update, so *transmitted + residual = true gradient* holds per
microbatch, and ``SyncGradientsState.count`` advances once per reduction (``N`` per step;
``warmup_steps`` and the compressors' random keys count reductions in this mode).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm.outputs import combine_microbatches
from jaxcomm.sync import GradientSync, SyncGradientsState, SyncRequest

__all__ = [
    "ACCUMULATE",
    "Accumulated",
    "accumulate_gradients",
    "check_accumulate",
    "update_with_value",
]

ACCUMULATE = ("local", "overlap")


class Accumulated(NamedTuple):
    """What :func:`accumulate_gradients` returns.

    Attributes:
      value: mean loss over the microbatches (this device).
      aux: the loss function's metrics over the microbatches, each marked with its
        reduction (``jaxcomm.outputs.combine_microbatches``: means averaged, sums summed,
        maxima and minima kept, per-example values concatenated in batch order).
      grads: mean gradient over the microbatches, this device's ('local') or already
        reduced over the data axes ('overlap').
      update: ``update(grads, opt_state, params) -> (updates, opt_state)`` to run the
        optimizer with: ``optimizer.update`` ('local'), or the same with
        ``sync_gradients`` passing the reduced gradients through and its state set to the
        one carried through the reductions ('overlap').
    """

    value: jax.Array
    aux: Any
    grads: Any
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def check_accumulate(accumulate: str) -> str:
    """Returns ``accumulate`` if it is one of :data:`ACCUMULATE`, else raises ValueError."""
    if not isinstance(accumulate, str) or accumulate not in ACCUMULATE:
        raise ValueError(
            f"accumulate={accumulate!r} is not known; choose one of {list(ACCUMULATE)} "
            "('local': sum microbatch gradients on each device and reduce once per step; "
            "'overlap': reduce each microbatch while the next one computes, N times the bytes)."
        )
    return accumulate


def update_with_value(
    update: Callable, grads: Any, state: Any, params: Any, value: Callable[[], Any]
) -> tuple[Any, Any]:
    """``update(grads, state, params)``, or, where the optimizer needs optax's extra
    argument ``value`` (``optax.contrib.reduce_on_plateau``, ``optax.polyak_sgd``),
    ``update(grads, state, params, value=value())``: the step's loss (the caller computes
    it only then, e.g. its mean over the devices)."""
    try:
        return update(grads, state, params)
    except TypeError as e:
        if "'value'" not in str(e):
            raise
    return update(grads, state, params, value=value())


def _split(batch: Any, n: int, axes: tuple[str, ...]) -> Any:
    """Per-device batch -> leaves with a leading microbatch axis of ``n``."""

    def split(x):
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            devices = int(np.prod([lax.axis_size(a) for a in axes]))
            raise ValueError(
                f"data_parallel(microbatches={n}): the per-device batch leading dimension "
                f"{x.shape[0] if x.ndim else '()'} does not divide by {n}. Use a global "
                f"batch that is a multiple of {n * devices}."
            )
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(split, batch)


def _f32_zeros(tree: Any) -> Any:
    """Accumulators for ``tree``: zeros in at least f32 (low-precision gradients summed
    ``N`` times in bf16 would lose the small ones). Fresh constants, so they are typed
    replicated under ``check_vma`` (the 'overlap' accumulator sums replicated values)."""
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), jnp.promote_types(x.dtype, jnp.float32)), tree
    )


def _add(acc: Any, tree: Any) -> Any:
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, tree)


def _per_device(params: Any, axes: tuple[str, ...]) -> Any:
    """``params`` typed as varying over ``axes`` (a no-op without ``check_vma``).

    Under ``check_vma=True`` the gradient with respect to a replicated (invariant) value is
    summed over the devices by the transpose of the implicit broadcast -- one all-reduce
    per microbatch, before ``sync_gradients``. Differentiating with respect to a varying copy
    keeps each microbatch gradient on its device, so 'local' mode reduces once.
    """

    def cast(x):
        for a in axes:
            try:
                x = lax.pcast(x, (a,), to="varying")
            except ValueError:  # "Unsupported pcast from=varying": already varying over a
                pass
        return x

    return jax.tree.map(cast, params)


def _sync_state(opt_state: Any) -> SyncGradientsState:
    found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SyncGradientsState))
    found = [s for s in found if isinstance(s, SyncGradientsState)]
    if len(found) != 1:
        raise ValueError(
            f"data_parallel(microbatches=N, accumulate='overlap') needs the optimizer state to "
            f"hold exactly one SyncGradientsState (found {len(found)}); put one "
            "jaxcomm.sync_gradients() in the optax.chain, or use accumulate='local'."
        )
    return found[0]


def _with_sync_state(opt_state: Any, sync_state: SyncGradientsState) -> Any:
    return jax.tree.map(
        lambda s: sync_state if isinstance(s, SyncGradientsState) else s,
        opt_state,
        is_leaf=lambda x: isinstance(x, SyncGradientsState),
    )


def _the_sync(optimizer: Any, params: Any, opt_state: Any, n: int) -> GradientSync:
    """The optimizer's one :class:`~jaxcomm.sync.GradientSync`, found by tracing its update
    abstractly with a :class:`~jaxcomm.sync.SyncRequest` that collects it."""
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), p.dtype), params)
    found: list[GradientSync] = []
    update = functools.partial(optimizer.update, sync_request=SyncRequest(on_sync=found.append))
    zero = lambda: jnp.zeros((), jnp.float32)  # noqa: E731 (value= for the trace only)
    jax.eval_shape(lambda g, s: update_with_value(update, g, s, params, zero), abstract, opt_state)
    # A retry with value= traces the sync again: the same sync, reported twice.
    syncs = list({id(s): s for s in found}.values())
    if len(syncs) != 1:
        raise ValueError(
            f"data_parallel(microbatches={n}, accumulate='overlap') needs exactly one "
            f"jaxcomm.sync_gradients in the optimizer (found {len(syncs)}): it reduces "
            "each microbatch's gradient as the next one computes."
        )
    return syncs[0]


def _passed(grads: Any, state: SyncGradientsState) -> tuple[Any, SyncGradientsState]:
    """The compute-only twin's reduction: the gradients as they are, the count advanced."""
    return grads, state._replace(count=state.count + 1)


def _overlapped(optimizer, reduce: Callable, grad_of: Callable, g0: Any, rest: Any, opt_state):
    """'overlap': a scan whose step ``i`` computes microbatch ``i + 1``'s gradient while
    ``reduce`` (the sync's own) reduces microbatch ``i``'s, threading the sync's state.
    Returns ``(summed means, per-microbatch stats, update)``; ``update`` runs the optimizer
    with its sync passing the reduced gradients through and the threaded state put back."""

    def body(carry, mb):
        acc, pending, sstate = carry
        g, st = grad_of(mb)  # microbatch i+1 computes ...
        reduced, sstate = reduce(pending, sstate)  # ... while i is reduced
        return (_add(acc, reduced), g, sstate), st

    carry = (_f32_zeros(g0), g0, _sync_state(opt_state))
    (acc, last, sstate), stats = lax.scan(body, carry, rest)
    reduced, sstate = reduce(last, sstate)
    acc = _add(acc, reduced)

    def update(grads, state, params, **extra_args):
        request = extra_args.pop("sync_request", SyncRequest())
        request = request._replace(communicate=False)  # reduced above
        updates, state = optimizer.update(grads, state, params, sync_request=request, **extra_args)
        return updates, _with_sync_state(state, sstate)

    return acc, stats, update


def accumulate_gradients(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batch: Any,
    *,
    microbatches: int,
    accumulate: str = "local",
    has_aux: bool = False,
    axes: tuple[str, ...],
    communicate: bool = True,
) -> Accumulated:
    """Mean loss, metrics and gradient over ``microbatches`` microbatches of ``batch``.

    Runs inside ``jax.shard_map`` over ``axes`` (``jaxcomm.data_parallel`` calls it); see
    the module docstring for the two modes.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, metrics)`` with ``has_aux``),
        a mean over its batch.
      optimizer: the optax transform, containing one ``jaxcomm.sync_gradients``.
      params: replicated parameters.
      opt_state: this device's optimizer state (per-device parts unstacked).
      batch: this device's batch; each leaf's leading dimension divides by ``microbatches``.
      microbatches: number of microbatches ``N``.
      accumulate: ``'local'`` or ``'overlap'`` (:data:`ACCUMULATE`).
      has_aux: ``loss_fn`` returns ``(loss, metrics)``.
      axes: the data-parallel mesh axes.
      communicate: False (the profiler's compute-only twin): 'overlap' passes each
        microbatch's gradient through instead of reducing it.

    Returns:
      An :class:`Accumulated`; run the optimizer with its ``update``.

    Example:
      >>> acc = accumulate_gradients(loss_fn, tx, params, opt_state, batch,
      ...                            microbatches=4, accumulate='local', axes=axes)
      >>> updates, opt_state = acc.update(acc.grads, opt_state, params)
    """
    check_accumulate(accumulate)
    n = microbatches
    mbs = _split(batch, n, axes)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
    local_params = _per_device(params, axes)

    def grad_of(mb):
        out, g = grad_fn(local_params, mb)
        value, aux = out if has_aux else (out, {})
        return g, (value, dict(aux or {}))

    # Microbatch 0 outside the scan: its gradient types the carry (shapes, dtypes and, under
    # check_vma, the varying-ness) without a zero that would have to be cast to match.
    g0, stats0 = grad_of(jax.tree.map(lambda x: x[0], mbs))
    rest = jax.tree.map(lambda x: x[1:], mbs)

    if accumulate == "local":

        def body(acc, mb):
            g, st = grad_of(mb)
            return _add(acc, g), st

        acc0 = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), g0)
        acc, stats = lax.scan(body, acc0, rest)
        update = optimizer.update
    else:
        sync = _the_sync(optimizer, params, opt_state, n)
        reduce = sync.reduce if communicate else _passed
        acc, stats, update = _overlapped(optimizer, reduce, grad_of, g0, rest, opt_state)
    grads = jax.tree.map(lambda a, g: (a / n).astype(g.dtype), acc, g0)
    # Each microbatch's outputs, in batch order, combined by their kind: means averaged,
    # sums summed, maxima kept, per-example values concatenated (jaxcomm.outputs).
    values, aux = jax.tree.map(
        lambda first, later: jnp.concatenate([jnp.asarray(first)[None], later]),
        stats0,
        stats,
    )
    return Accumulated(
        values.mean(0).astype(values.dtype), combine_microbatches(aux), grads, update
    )
