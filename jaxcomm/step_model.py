"""Step-time schedule of one data-parallel configuration: when gradients are ready in the
backward pass, how they are bucketed, and when each collective runs.

Used by :mod:`jaxcomm.simulate`. Collective times come from :func:`jaxcomm.cost.predict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxcomm import cost
from jaxcomm.topology import Topology

__all__ = ["DEFAULT_COMPUTE_S", "Workload", "step_time", "workload"]

# Seconds per step of compute on one H100 (bf16, batch 128 per device) assumed when no
# --compute-ms is given: ~3,000 img/s for ResNet-50 and FLOP-proportional for the others
# (4.1 / 7.8 / 11.5 GFLOPs per image).
DEFAULT_COMPUTE_S = {"resnet50": 0.045, "resnet101": 0.08, "resnet152": 0.12}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Gradient tensors in forward order, their share of backward compute, step compute.

    Attributes:
      name: label.
      leaf_bytes: bytes of each gradient tensor (f32), forward order.
      leaf_weight: share of backward compute ending at each tensor (0 for a norm's scale
        and bias, ready together with their convolution).
      compute_s: forward + backward seconds per step.
      backward_fraction: the backward pass's share of ``compute_s``.
    """

    name: str
    leaf_bytes: tuple[int, ...]
    leaf_weight: tuple[float, ...]
    compute_s: float
    backward_fraction: float = 2.0 / 3.0

    @property
    def total_bytes(self) -> int:
        return int(sum(self.leaf_bytes))

    def ready_times(self) -> np.ndarray:
        """When each tensor's gradient is ready (seconds from step start), forward order.

        The backward pass walks the tensors in reverse, spending time in proportion to
        ``leaf_weight`` (equal per convolution / dense layer)."""
        w = np.asarray(self.leaf_weight, float)
        done = np.cumsum(w[::-1])[::-1] / max(w.sum(), 1e-30)
        fwd = (1 - self.backward_fraction) * self.compute_s
        return fwd + self.backward_fraction * self.compute_s * done


def _forward_key(path: str) -> int:
    return 0 if "stem" in path else (2 if "head" in path else 1)


def workload(model: str | int, compute_s: float | None = None) -> Workload:
    """A :class:`Workload` for a ResNet name or a gradient size in bytes.

    Args:
      model: 'resnet50', 'resnet101', 'resnet152' (shapes from
        ``jaxcomm.models.gradient_shapes``, i.e. ``jax.eval_shape``), or an int byte count
        (then one tensor per 25 MB, equal compute each).
      compute_s: seconds of compute per step; default ``DEFAULT_COMPUTE_S`` (ResNets) or
        required for a byte count.

    Returns:
      The workload.
    """
    if isinstance(model, (int, np.integer)):
        if compute_s is None:
            raise ValueError("workload(bytes): pass compute_s (--compute-ms), e.g. 0.1.")
        n = max(1, int(model) // 25_000_000)
        sizes = [int(model) // n] * n
        sizes[-1] += int(model) - sum(sizes)
        return Workload(f"{int(model)} bytes", tuple(sizes), (1.0,) * n, float(compute_s))
    import jax

    from jaxcomm.models import gradient_shapes

    if compute_s is None and model not in DEFAULT_COMPUTE_S:
        raise ValueError(
            f"no default compute time for {model!r}: pass --compute-ms, or choose one of "
            f"{sorted(DEFAULT_COMPUTE_S)}."
        )
    flat = jax.tree_util.tree_flatten_with_path(gradient_shapes(model))[0]
    items = sorted(
        ((jax.tree_util.keystr(p), x) for p, x in flat), key=lambda kv: _forward_key(kv[0])
    )  # stable: blocks keep their order; stem first, head last
    sizes = tuple(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for _, x in items)
    weights = tuple(1.0 if len(x.shape) >= 2 else 0.0 for _, x in items)
    return Workload(model, sizes, weights, float(compute_s or DEFAULT_COMPUTE_S[model]))


def _buckets(wl: Workload, bucket_bytes: int | None) -> list[tuple[int, float]]:
    """(bytes, ready time) per collective, in the order they are issued."""
    ready = wl.ready_times()
    order = np.argsort(-np.arange(len(ready)), kind="stable")  # reverse forward order
    if not bucket_bytes:
        return [(wl.leaf_bytes[i], float(ready[i])) for i in order]
    out, size, last = [], 0, 0.0
    for i in order:
        size += wl.leaf_bytes[i]
        last = max(last, float(ready[i]))
        if size >= bucket_bytes:
            out.append((size, last))
            size = 0
    if size:
        out.append((size, last))
    return out


def step_time(
    wl: Workload,
    topology: Topology,
    *,
    algorithm: str,
    overlap: bool,
    compression_ratio: float = 1.0,
    bucket_bytes: int | None = None,
    launch_s: float = 10e-6,
) -> dict[str, Any]:
    """Step time of one configuration.

    Collectives run one at a time in issue order on one communication stream; with
    ``overlap`` each starts at ``max(ready, previous end)``, without it after the backward
    pass. The step ends when compute and the last collective have both finished.

    Returns:
      ``{step_s, comm_s, exposed_s, comm_fraction, collectives, algorithms}``.
    """
    memo: dict[int, tuple[str, float]] = {}
    t_end, comm, used = 0.0, 0.0, {}
    for nbytes, ready in _buckets(wl, bucket_bytes):
        if nbytes not in memo:
            alg = algorithm
            if alg == "auto":
                alg = cost.choose(nbytes, topology, compression_ratio=compression_ratio)
            t = launch_s + cost.predict(alg, nbytes, topology, compression_ratio=compression_ratio)
            memo[nbytes] = (alg, t)
        alg, t = memo[nbytes]
        used[alg] = used.get(alg, 0) + 1
        start = max(ready if overlap else wl.compute_s, t_end)
        t_end = start + t
        comm += t
    step = max(wl.compute_s, t_end)
    exposed = step - wl.compute_s
    return {
        "step_s": step,
        "comm_s": comm,
        "exposed_s": exposed,
        "comm_fraction": exposed / step,
        "collectives": sum(used.values()),
        "algorithms": used,
    }
