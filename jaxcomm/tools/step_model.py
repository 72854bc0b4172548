"""Step-time schedule of one data-parallel configuration: when gradients are ready in the
backward pass, how they are packed or bucketed, and when each collective runs.

Used by :mod:`jaxcomm.tools.simulate`. Uncompressed collectives cost
:func:`jaxcomm.cost.reduction_time`, compressed ones :func:`jaxcomm.cost.compressed_time`
(wire bytes, codec, packing, calls), each plus a fixed cost per collective call.

Example:
  >>> wl = workload('resnet152')
  >>> step_time(wl, fat_tree(64, 16, 8), algorithm='hierarchical', overlap=True,
  ...           compression=jaxcomm.cost.parse_compression('int8'))['step_s']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxcomm import cost
from jaxcomm.topology import Topology

__all__ = [
    "DEFAULT_COMPUTE_S",
    "MIN_SIZE",
    "PACKINGS",
    "SMALL_LEAF_ELEMENTS",
    "Workload",
    "step_time",
    "workload",
]

# Seconds per step of compute on one H100 (bf16, batch 128 per device) assumed when no
# --compute-ms is given: ~3,000 img/s for ResNet-50 and FLOP-proportional for the others
# (4.1 / 7.8 / 11.5 GFLOPs per image).
DEFAULT_COMPUTE_S = {"resnet50": 0.045, "resnet101": 0.08, "resnet152": 0.12}
#: ``sync_gradients``' default ``min_size``: smaller leaves are never compressed.
MIN_SIZE = 1024
#: ``jaxcomm.allreduce`` reduces a leaf of this many elements or more alone, the smaller
#: ones together (one buffer per dtype).
SMALL_LEAF_ELEMENTS = 1 << 14
#: How uncompressed leaves become collectives: 'tensor' one per leaf; 'allreduce' as
#: ``jaxcomm.allreduce`` packs them (large leaves alone, the small ones in one buffer).
PACKINGS = ("tensor", "allreduce")
# PowerSGD compresses a matrix when n m > 2 r (n + m) (its min_compression_rate default).
_POWERSGD_MIN_RATE = 2.0


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
      leaf_shapes: each tensor's shape (None for a byte-count workload); PowerSGD's
        matrices come from it.
    """

    name: str
    leaf_bytes: tuple[int, ...]
    leaf_weight: tuple[float, ...]
    compute_s: float
    backward_fraction: float = 2.0 / 3.0
    leaf_shapes: tuple[tuple[int, ...], ...] | None = None

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


def workload(
    model: str | int, compute_s: float | None = None, *, num_classes: int = 1000
) -> Workload:
    """A :class:`Workload` for a ResNet name or a gradient size in bytes.

    Args:
      model: 'resnet18' ... 'resnet152' (shapes from ``jaxcomm.models.gradient_shapes``,
        i.e. ``jax.eval_shape``), or an int byte count (then one tensor per 25 MB, equal
        compute each).
      compute_s: seconds of compute per step; default ``DEFAULT_COMPUTE_S`` (ResNet-50,
        101, 152) or required.
      num_classes: classifier outputs of a ResNet.

    Returns:
      The workload.

    Raises:
      ValueError: no ``compute_s`` where there is no default.

    Example:
      >>> workload('resnet18', 0.28, num_classes=10).total_bytes
      44726568
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
    flat = jax.tree_util.tree_flatten_with_path(gradient_shapes(model, num_classes))[0]
    items = sorted(
        ((jax.tree_util.keystr(p), x) for p, x in flat), key=lambda kv: _forward_key(kv[0])
    )  # stable: blocks keep their order; stem first, head last
    sizes = tuple(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for _, x in items)
    weights = tuple(1.0 if len(x.shape) >= 2 else 0.0 for _, x in items)
    shapes = tuple(tuple(int(d) for d in x.shape) for _, x in items)
    name = model if num_classes == 1000 else f"{model} ({num_classes} classes)"
    compute = float(compute_s or DEFAULT_COMPUTE_S[model])
    return Workload(name, sizes, weights, compute, leaf_shapes=shapes)


def _check_buckets(bucket_bytes) -> tuple[int, int] | None:
    if bucket_bytes is None:
        return None
    lo, hi = (bucket_bytes, bucket_bytes) if np.isscalar(bucket_bytes) else bucket_bytes
    if not (int(lo) >= 1 and int(hi) >= 1):
        raise ValueError(
            f"bucket_bytes={bucket_bytes!r}: expected bytes >= 1, or (first, max) bytes, e.g. "
            "(1 << 20, 25 << 20)."
        )
    return int(lo), int(hi)


def _streams(
    sizes: list[int], ready: list[float], bounds: tuple[int, int] | None
) -> list[tuple[int, float]]:
    """(bytes, ready) per buffer: all in one, or cut into buckets of ``bounds[0]`` then
    ``bounds[1]`` bytes (a leaf may straddle two, as ``jaxcomm.buckets.plan_buckets``)."""
    if not sizes:
        return []
    if bounds is None:
        return [(int(sum(sizes)), max(ready))]
    out, cap, fill, last = [], bounds[0], 0, 0.0
    for size, r in zip(sizes, ready, strict=True):
        left = size
        while left > 0:
            take = min(left, cap - fill)
            fill, left, last = fill + take, left - take, max(last, r)
            if fill == cap:
                out.append((fill, last))
                cap, fill, last = bounds[1], 0, 0.0
    if fill:
        out.append((fill, last))
    return out


def _plain(
    wl: Workload, idx: list[int], ready: np.ndarray, packing: str, bounds
) -> list[tuple[int, float]]:
    if bounds is not None:
        return _streams([wl.leaf_bytes[i] for i in idx], [float(ready[i]) for i in idx], bounds)
    if packing == "tensor":
        return [(wl.leaf_bytes[i], float(ready[i])) for i in idx]
    big = [i for i in idx if wl.leaf_bytes[i] // 4 >= SMALL_LEAF_ELEMENTS]
    small = [i for i in idx if wl.leaf_bytes[i] // 4 < SMALL_LEAF_ELEMENTS]
    out = [(wl.leaf_bytes[i], float(ready[i])) for i in big]
    if small:
        out.append((sum(wl.leaf_bytes[i] for i in small), max(float(ready[i]) for i in small)))
    return out


def _powersgd_ok(shape: tuple[int, ...] | None, rank: int) -> bool:
    if shape is None or len(shape) < 2:
        return False
    n, m = int(np.prod(shape[:-1])), int(shape[-1])
    r = min(rank, n, m)
    return n * m > _POWERSGD_MIN_RATE * r * (n + m)


def step_time(
    wl: Workload,
    topology: Topology,
    *,
    algorithm: str,
    overlap: bool,
    compression_ratio: float = 1.0,
    compression: cost.Compression | None = None,
    compress_stage: str = "inter",
    bucket_bytes: int | tuple[int, int] | None = None,
    launch_s: float = 10e-6,
    call_s: float | dict[str, float] | None = None,
    codec: dict[str, cost.Codec] | None = None,
    packing: str = "tensor",
    min_size: int = MIN_SIZE,
) -> dict[str, Any]:
    """Step time of one configuration.

    Collectives run one at a time in the order their gradients are ready, on one
    communication stream; with ``overlap`` each starts at ``max(ready, previous end)``,
    without it after the backward pass. The step ends when compute and the last collective
    have both finished.

    With ``compression``, the leaves of ``min_size`` elements or more (PowerSGD: the
    matrices it takes) are compressed: packed into one buffer, or cut into buckets, and
    priced by :func:`jaxcomm.cost.compressed_time` (its wire bytes and collectives, codec,
    packing and calls); the other leaves are reduced in full precision. Without it, leaves
    become collectives by ``packing`` or ``bucket_bytes``, each
    :func:`jaxcomm.cost.reduction_time` with the wire bytes divided by
    ``compression_ratio`` (a ratio alone: no codec, no change of collective).

    Args:
      wl: the workload.
      topology: the cluster.
      algorithm: all-reduce algorithm ('auto': :func:`jaxcomm.cost.choose` per buffer).
      overlap: start each collective when its gradients are ready.
      compression_ratio: wire ratio of the uncompressed path (>= 1); ignored with
        ``compression``.
      compression: a compressor (:func:`jaxcomm.cost.parse_compression`), or None.
      compress_stage: 'inter' (the node-spanning stage only) or 'all'.
      bucket_bytes: bytes per bucket, or (first, max); None: no buckets.
      launch_s: seconds per collective call where ``call_s`` is None.
      call_s: seconds per call, one number or by kind (:data:`jaxcomm.cost.CALL_KINDS`).
      codec: kernel -> :class:`jaxcomm.cost.Codec` (None: no codec time).
      packing: :data:`PACKINGS` (uncompressed leaves without buckets).
      min_size: leaves with fewer elements stay uncompressed.

    Returns:
      ``{step_s, comm_s, codec_s, call_s, exposed_s, comm_fraction, collectives, calls,
      algorithms}``: ``comm_s`` the communication stream's busy time (codec and calls
      included), ``collectives`` the reductions, ``calls`` the collective calls.

    Raises:
      ValueError: unknown ``packing`` or ``compress_stage``, bad ``bucket_bytes``.
    """
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r} is not known; choose one of {list(PACKINGS)}.")
    if compress_stage not in ("inter", "all"):
        raise ValueError(
            f"compress_stage={compress_stage!r} is not known; choose 'inter' or 'all'."
        )
    bounds = _check_buckets(bucket_bytes)
    calls = launch_s if call_s is None else call_s
    jobs, wire = _jobs(wl, compression, bounds, packing, min_size)
    ratio = 1.0 if compression is not None else compression_ratio

    def price(nbytes: int, compressed: bool) -> dict[str, Any]:
        if not compressed:
            return cost.reduction_time(algorithm, nbytes / ratio, topology, call_s=calls)
        res = cost.compressed_time(nbytes, topology, compression, stage=compress_stage,
                                   algorithm=algorithm, codec=codec, call_s=calls,
                                   wire=wire)  # fmt: skip
        res["algorithm"] = compression.spec
        return res

    return _schedule(jobs, price, wl.compute_s, overlap)


def _jobs(
    wl: Workload,
    compression: cost.Compression | None,
    bounds: tuple[int, int] | None,
    packing: str,
    min_size: int,
) -> tuple[list[tuple[float, int, bool]], float | None]:
    """The step's reductions in the order they can start, and the compressor's wire fraction.

    1. The leaves in backward order (head first).
    2. With ``compression``, the leaves it takes (``min_size`` elements or more; PowerSGD:
       the matrices it compresses) become one buffer or buckets (PowerSGD: one buffer).
    3. The other leaves become collectives by ``packing`` or ``bounds`` (:func:`_plain`).
    4. All sorted by the time their last gradient is ready.

    Args:
      wl: the workload.
      compression: the compressor, or None.
      bounds: ``(first, max)`` bucket bytes, or None.
      packing: :data:`PACKINGS`.
      min_size: leaves with fewer elements stay uncompressed.

    Returns:
      ``(jobs, wire)``: jobs ``(ready, bytes, compressed)`` sorted by ready time; ``wire``
      PowerSGD's wire fraction for the workload's matrices, else None (the compressor's).
    """
    ready = wl.ready_times()
    order = list(range(len(wl.leaf_bytes)))[::-1]  # the backward pass: head first
    jobs: list[tuple[float, int, bool]] = []  # (ready, bytes, compressed)
    wire = None
    if compression is None:
        plain = order
    else:
        if compression.kind == "powersgd":
            rank = int(compression.param)
            shapes = wl.leaf_shapes or (None,) * len(order)
            comp = [i for i in order if _powersgd_ok(shapes[i], rank)]
            mats = tuple((int(np.prod(shapes[i][:-1])), int(shapes[i][-1])) for i in comp)
            wire = compression.wire_fraction(mats) if comp else 1.0
        else:
            comp = [i for i in order if wl.leaf_bytes[i] // 4 >= min_size]
        plain = [i for i in order if i not in set(comp)]
        cb = None if compression.kind == "powersgd" else bounds
        for nbytes, r in _streams(
            [wl.leaf_bytes[i] for i in comp], [float(ready[i]) for i in comp], cb
        ):
            jobs.append((r, nbytes, True))
    for nbytes, r in _plain(wl, plain, ready, packing, bounds):
        jobs.append((r, nbytes, False))
    jobs.sort(key=lambda j: j[0])
    return jobs, wire


def _schedule(
    jobs: list[tuple[float, int, bool]],
    price: Callable[[int, bool], dict[str, Any]],
    compute_s: float,
    overlap: bool,
) -> dict[str, Any]:
    """Runs ``jobs`` one at a time on one communication stream; the dict of :func:`step_time`.

    Each job starts at ``max(ready, previous end)`` with ``overlap``, else at
    ``max(compute_s, previous end)``, and takes ``price(bytes, compressed)['total_s']``
    (priced once per distinct ``(bytes, compressed)``). The step ends when compute and the
    last job have both finished.

    Args:
      jobs: ``(ready, bytes, compressed)`` in start order.
      price: the cost of one job, a dict of :func:`jaxcomm.cost.reduction_time`'s keys.
      compute_s: forward + backward seconds.
      overlap: start each job when its gradients are ready.

    Returns:
      The dict :func:`step_time` returns.
    """
    memo: dict[tuple[int, bool], dict[str, Any]] = {}
    t_end = comm = codec_s = call_total = 0.0
    n_calls, used = 0, {}
    for r, nbytes, compressed in jobs:
        key = (nbytes, compressed)
        if key not in memo:
            memo[key] = price(nbytes, compressed)
        res = memo[key]
        used[res["algorithm"]] = used.get(res["algorithm"], 0) + 1
        start = max(r if overlap else compute_s, t_end)
        t_end = start + res["total_s"]
        comm += res["total_s"]
        codec_s += res["codec_s"]
        call_total += res["call_s"]
        n_calls += res["calls"]
    step = max(compute_s, t_end)
    exposed = step - compute_s
    return {
        "step_s": step,
        "comm_s": comm,
        "codec_s": codec_s,
        "call_s": call_total,
        "exposed_s": exposed,
        "comm_fraction": exposed / step,
        "collectives": sum(used.values()),
        "calls": n_calls,
        "algorithms": used,
    }
