"""Whether what reaches each ``sync_gradients`` may be averaged: the build-time probe.

A sync averages what it receives on each device. Where that is the step's gradients, the
mean equals the one-device run; where it is a function of them (a transform before the
sync in a chain, a wrapper's accumulated mean), it does only if the function commutes with
the mean over devices. :func:`check_sync_inputs` decides that once, when a step is built,
for ``jaxcomm.data_parallel`` and the Flax front ends alike.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomm.microbatch import update_with_value
from jaxcomm.sync import NOT_COMMUTING, SyncRequest, other_input_message

__all__ = ["check_sync_inputs"]

_PROBE_SCALES = (1e-3, 1.0, 1e3)
_PROBE_RTOL = 1e-3


def check_sync_inputs(optimizer: Any, params: Any, mesh: Mesh, where: str) -> None:
    """Checks that every sync of ``optimizer`` that receives arrays other than the step's
    gradients receives a function of them that commutes with the mean over devices.

    Such a sync (:class:`~jaxcomm.sync.SyncRequest`: a transform before it in a chain, or
    a wrapper such as ``optax.MultiSteps`` handing it its accumulated mean, of any
    structure) averages each device's image of its own gradient, which equals the
    one-device run only if the map commutes with the mean. The probe runs the optimizer's
    ``update`` (from its ``init`` state) compiled on one device of the mesh's axes, the
    syncs passing their input through, fed two random gradients and their mean at three
    scales; at each place the trace reaches such a sync it hands the sync's input to the
    host (``jax.debug.callback``, so a sync inside a ``lax.cond`` branch or a loop reports
    what it received when it runs). Each call's input for the mean must be the mean of
    the inputs for the two gradients (``scale``, ``add_decayed_weights``, an accumulator's
    running mean; not ``clip_by_global_norm``). A sync none of whose places runs in the
    probe (only in a branch not taken from the initial state), or whose places run a
    different number of times for different gradients, cannot be checked and is refused.
    Syncs are told apart by identity within the probe's one trace (a wrapper that builds
    its transforms anew at each update, ``optax.inject_hyperparams``, is traced once).

    Raises:
      ValueError: a sync's input does not commute with the mean, or cannot be checked,
        or the probe could not run the optimizer (never a silent pass).
    """
    params = jax.tree.map(_host_value, params)
    leaves, treedef = jax.tree.flatten(params)
    sites: list[Any] = []  # the sync at each place the probe's trace reaches one
    runs: list[dict[int, list]] = []

    def record(k, x):
        runs[-1].setdefault(k, []).append(jax.tree.map(np.asarray, x))

    def other_input(sync, x):
        sites.append(sync)
        jax.debug.callback(functools.partial(record, len(sites) - 1), x)

    def run(g, p):
        request = SyncRequest(communicate=False, grads=g, other_input=other_input)

        def update(*args, **kwargs):
            sites.clear()  # a failed attempt's places (no value= given) are not in the program
            return optimizer.update(*args, sync_request=request, **kwargs)

        update_with_value(update, g, optimizer.init(p), p, lambda: jnp.zeros((), jnp.float32))
        return jnp.zeros(())

    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    one = Mesh(np.array(mine[:1]).reshape((1,) * mesh.devices.ndim), mesh.axis_names)
    probe = jax.jit(
        jax.shard_map(run, mesh=one, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    )
    rng = np.random.default_rng(0)
    draw = functools.partial(_draw, rng, leaves)
    verdict = None
    try:
        for scale in _PROBE_SCALES:
            g1, g2 = draw(scale), draw(scale)
            mean = [
                ((a.astype(np.float64) + b) / 2).astype(a.dtype)
                for a, b in zip(g1, g2, strict=True)
            ]
            for g in (g1, g2, mean):
                runs.append({})
                # Run, not staged, also when the step is built under a trace (eval_shape).
                with jax.ensure_compile_time_eval():
                    probe(jax.tree.unflatten(treedef, g), params)
                jax.effects_barrier()
            verdict = verdict or _sites_verdict(sites, runs[-3:], scale)
    except Exception as e:  # a probe that fails is no verdict: say so, never pass silently
        raise ValueError(
            f"{where}: jaxcomm.sync_gradients receives arrays other than the step's "
            "gradients (a transform before it, or a wrapper around it), and the probe that "
            "checks they commute with the mean over devices failed to run the optimizer on "
            f"one device: {type(e).__name__}: {e}. Put jaxcomm.sync_gradients() first in "
            "the optax.chain."
        ) from e
    if verdict is not None:
        raise ValueError(other_input_message(where, verdict))


def _draw(rng: np.random.Generator, leaves: list, scale: float) -> list[np.ndarray]:
    """A random gradient like ``leaves`` at ``scale`` (zeros for integer leaves)."""
    return [
        (scale * rng.standard_normal(np.shape(x))).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else np.zeros_like(x)
        for x in leaves
    ]


def _sites_verdict(sites: list, runs: list[dict[int, list]], scale: float) -> str | None:
    """What is wrong with the inputs the syncs at ``sites`` received in the probe's three
    ``runs`` (two gradients, their mean) at gradient ``scale``, or None."""
    unchecked = (
        "and the probe that checks such a transform commutes with the mean could not check "
        "it (the sync did not run from the initial state, or ran a different number of "
        "times for different gradients)"
    )
    for sync in {id(s): s for s in sites}.values():
        ran = False
        for k in (k for k, s in enumerate(sites) if s is sync):
            calls = [r.get(k, []) for r in runs]
            if len({len(x) for x in calls}) != 1:
                return unchecked
            ran = ran or bool(calls[0])
            for xa, xb, xc in zip(*calls, strict=True):
                if not _mean_commutes(xa, xb, xc):
                    return f"{NOT_COMMUTING} (at gradient scale {scale:g})"
        if not ran:
            return unchecked
    return None


def _mean_commutes(a: Any, b: Any, c: Any) -> bool:
    """Whether ``c`` (the image of the mean) equals the mean of ``a`` and ``b`` (the images
    of two gradients), to :data:`_PROBE_RTOL` of their norms."""
    f = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]  # noqa: E731
    a, b, c = f(a), f(b), f(c)
    if [x.shape for x in a] != [x.shape for x in c] or [x.shape for x in b] != [x.shape for x in c]:
        return False
    want = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
    norm = lambda xs: float(np.sqrt(sum(np.sum(x * x) for x in xs)))  # noqa: E731
    num = norm([w - z for w, z in zip(want, c, strict=True)])
    return bool(num <= _PROBE_RTOL * (norm(want) + norm(c)) + 1e-30)


def _host_value(x: Any) -> Any:
    """``x`` as a value on the host (ones for an abstract leaf), for build-time probes."""
    if isinstance(x, jax.ShapeDtypeStruct | jax.core.Tracer):  # abstract (eval_shape)
        return np.ones(x.shape, x.dtype)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_shards[0].data
    return np.asarray(jax.device_get(x))
