"""Alpha-beta-gamma cost model of the all-reduce algorithms on a :class:`Topology`.

Each algorithm is a sequence of synchronous steps; in a step every participating device
sends ``f * n`` bytes to one partner (a ``ppermute``). A step takes the time of its slowest
pair: ``alpha_L + f n / rate``, where ``L`` is the lowest common level of the pair
(its latency and bandwidth apply) and ``rate`` is the pair's share of every uplink it climbs
(link sharing: a node has ``g * bandwidth_1 / oversubscription_1`` of uplink, a
level-(j-1) group ``children * child uplink / oversubscription_j``, shared by all its pairs
that leave it in that step). Reduction costs ``gamma`` per byte
added. On a one-level topology (all devices alike) this is exactly the textbook model:

- ring:  ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``
- recursive halving-doubling (Rabenseifner), p a power of two:
  ``2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma``; other p fold the extra ranks first
  (two more steps of ``n`` bytes and one more reduction, Thakur et al. 2005)
- binomial tree (what ``collectives/tree.py`` emits): a binomial reduce of the whole buffer
  (``s = ceil(lg p)`` steps), a binomial scatter (step ``k`` moves ``k/p n``; ``2^s - 1``
  chunks in all) and an all-gather (modelled as a ring, like the ring's second half):
  ``(2 s + p - 1) alpha + (s + (2^s - 1)/p + (p-1)/p) n beta + s n gamma``
- hierarchical (``m`` nodes x ``g`` devices): ring reduce-scatter inside the node, an
  all-reduce of ``n/g`` across nodes (``g`` in parallel, one per local rank, as NCCL would run
  the ``psum``: the faster of ring and double binary tree), ring all-gather inside the node.
- flat (``psum``): what NCCL picks, the faster of ring and double binary tree
  (``2 lg p alpha + 2 n beta``).

Compressed traffic passes ``compression_ratio`` (> 1): bandwidth and reduction terms scale
with the wire bytes ``n / ratio`` (all-reduce compatible codecs: bf16/fp16 casts, same-seed
random-k). Codecs that gather instead use :func:`predict_allgather` with their wire bytes.

A named compressor (:func:`parse_compression`: ``'int4(block=64, stochastic=False)'``,
``'adaptive(int4)'``, ``'topk(0.01)'``, ...) is priced by :func:`compressed_time` as
``jaxcomm.sync_gradients`` runs it: the collectives of its pattern (all-reduce of the cast or
sampled values; all-to-all + all-gather of quantized chunks; all-gather of (index, value)
pairs) with its wire bytes, on the inter-node stage only (full-precision reduce-scatter and
all-gather inside the node) or on the whole reduction; its codec (:class:`Codec`: encode
and decode seconds per f32 byte, measured by ``python -m experiments.bench compression
--calibration``; :data:`H200_CODEC` for an H200 from the GPU check's kernel figures in
``jaxcomm/data/h200_codec.json``); the packing of the leaves into one buffer and back;
adaptive's error sketch and its all-reduce; and a fixed cost per collective call by kind
(``call_s``).

References:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
  MPICH" (IJHPCA 2005); Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations" (JPDC 2009); nccl-tests PERFORMANCE.md (bus bandwidth).

Example:
  >>> topo = jaxcomm.topology.dgx_h100(64)
  >>> jaxcomm.cost.predict('hierarchical', 100e6, topo)   # seconds
  >>> jaxcomm.cost.choose(4096, topo)
  'halving_doubling'
"""

from __future__ import annotations

import functools
import json
import math
import re
from importlib import resources
from typing import NamedTuple

import numpy as np

from jaxcomm.topology.model import Topology

__all__ = [
    "ALGORITHMS",
    "CALL_KINDS",
    "CANDIDATES",
    "CODEC_KERNELS",
    "COMPRESSORS",
    "H200_CODEC",
    "Codec",
    "Compression",
    "busbw",
    "call_kinds",
    "choose",
    "codec_counts",
    "codec_seconds",
    "compressed_time",
    "halving_doubling_time",
    "hierarchical_time",
    "kernel_codecs",
    "lower_bound",
    "measured",
    "parse_compression",
    "predict",
    "predict_allgather",
    "reduction_time",
    "sharded_time",
    "ring_time",
    "tree_time",
]

ALGORITHMS: tuple[str, ...] = ("flat", "ring", "tree", "halving_doubling", "hierarchical")
# 'flat' is left out of the default choice: its schedule is the backend's, not ours.
CANDIDATES: tuple[str, ...] = ("ring", "tree", "halving_doubling", "hierarchical")


# --- textbook formulas (one uniform level) ------------------------------------------------
def ring_time(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Ring all-reduce: ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma


def halving_doubling_time(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Recursive halving-doubling: ``2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma``
    for p a power of two; otherwise the ``p - 2^floor(lg p)`` extra ranks fold into
    neighbours first and get the result back (``+ 2(alpha + n beta) + n gamma``)."""
    if p == 1:
        return 0.0
    q = 1 << (p.bit_length() - 1)
    t = 2 * math.log2(q) * alpha + 2 * (q - 1) / q * n * beta + (q - 1) / q * n * gamma
    if q != p:
        t += 2 * (alpha + n * beta) + n * gamma
    return t


def tree_time(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Binomial tree reduce, then a binomial scatter and an all-gather (``s = ceil(lg p)``):
    ``(2 s + p - 1) alpha + (s + (2^s - 1)/p + (p-1)/p) n beta + s n gamma``."""
    if p == 1:
        return 0.0
    s = math.ceil(math.log2(p))
    scatter = s * alpha + (2**s - 1) / p * n * beta
    gather = (p - 1) * (alpha + n / p * beta)
    return s * (alpha + n * beta) + scatter + gather + s * n * gamma


def hierarchical_time(
    n: float,
    m: int,
    g: int,
    alpha_intra: float,
    beta_intra: float,
    alpha_inter: float,
    beta_inter: float,
    gamma: float = 0.0,
) -> float:
    """Ring reduce-scatter over ``g``, ring all-reduce of ``n/g`` over ``m``, ring all-gather
    over ``g``: ``2(g-1)(alpha_intra + n/g beta_intra) + ring_time(n/g, m, alpha_inter,
    beta_inter) + (g-1)/g n gamma + (m-1)/m n/g gamma``."""
    t = 2 * (g - 1) * alpha_intra + 2 * (g - 1) / g * n * beta_intra + (g - 1) / g * n * gamma
    return t + ring_time(n / g, m, alpha_inter, beta_inter, gamma)


def lower_bound(n: float, p: int, bandwidth: float) -> float:
    """No all-reduce moves its data faster than ``2(p-1)/p n / B`` (nccl-tests)."""
    return 2 * (p - 1) / p * n / bandwidth


def busbw(n: float, p: int, seconds: float) -> float:
    """nccl-tests bus bandwidth of an all-reduce: ``n / t * 2(p-1)/p`` (bytes/s)."""
    return n / seconds * 2 * (p - 1) / p


# --- topology-aware model ------------------------------------------------------------------
class _Step(NamedTuple):
    fraction: float  # bytes sent per pair = fraction * n
    alphas: np.ndarray  # per distinct pair class
    inv_rates: np.ndarray  # seconds per byte for that class
    count: int = 1  # identical steps in a row (a ring repeats one pattern)


class _Plan(NamedTuple):
    steps: tuple[_Step, ...]
    reduce_fraction: float  # gamma term = reduce_fraction * n * gamma


def _pairs_cost(topo: Topology, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, seconds per byte) of each distinct kind of pair in one step."""
    if src.size == 0:
        return np.zeros(1), np.zeros(1)
    g = topo.devices_per_node
    slots = np.asarray(
        topo.placement if topo.placement is not None else range(topo.num_nodes), np.int64
    )
    sa, sb = slots[src // g], slots[dst // g]
    spans = topo.spans()
    lat = np.array([lv.latency for lv in topo.levels])
    bw = np.array([lv.bandwidth for lv in topo.levels])
    level = np.zeros(src.shape, np.int64)
    for span in spans[:-1]:
        level += (sa // span) != (sb // span)
    rate = bw[level].astype(float)
    # Uplink capacity of one level-(j-1) group (bytes/s): a node has g devices' worth of
    # level-1 links over its oversubscription (shared NICs); a higher group has its
    # children's uplinks over its own oversubscription (a fat tree's switch tiers).
    cap = g * topo.levels[1].bandwidth / topo.levels[1].oversubscription if len(bw) > 1 else 0
    for j in range(1, len(topo.levels)):
        if j > 1:
            cap = topo.levels[j - 1].size * cap / topo.levels[j].oversubscription
        crossing = level >= j
        if not crossing.any():
            break
        for side in (sa, sb):  # uplink out of the source group, downlink into the target's
            grp = side // spans[j - 1]
            flows = np.bincount(grp[crossing], minlength=int(grp.max()) + 1)
            share = cap / np.maximum(flows[grp], 1)
            rate = np.where(crossing, np.minimum(rate, share), rate)
    keys = np.unique(np.stack([lat[level], 1.0 / rate], 1), axis=0)
    return keys[:, 0], keys[:, 1]


def _step(topo, src, dst, fraction) -> _Step:
    a, ir = _pairs_cost(topo, np.asarray(src, np.int64), np.asarray(dst, np.int64))
    return _Step(float(fraction), a, ir)


def _ring_steps(topo, ranks: np.ndarray, nxt: np.ndarray, fraction: float, count: int):
    return (_step(topo, ranks, nxt, fraction)._replace(count=count),)


def _binomial_pairs(p: int):
    """Reduce steps of a binomial tree rooted at 0: (senders, receivers) per step."""
    out = []
    k = 1
    while k < p:
        src = np.arange(k, p, 2 * k)
        out.append((src, src - k))
        k *= 2
    return out


def _plan_ring(topo, p):
    r = np.arange(p)
    return _Plan(_ring_steps(topo, r, (r + 1) % p, 1.0 / p, 2 * (p - 1)), (p - 1) / p)


def _plan_tree(topo, p):
    # collectives/tree.py: the reduce moves the whole buffer along the binomial edges; the
    # scatter walks them back, step k moving k of the p chunks of n/p (the upper half of
    # the sender's 2k chunks); the all-gather is the backend's, modelled as a ring.
    pairs = _binomial_pairs(p)
    steps = [_step(topo, s, d, 1.0) for s, d in pairs]
    steps += [_step(topo, d, s, (s[0] - d[0]) / p) for s, d in reversed(pairs)]
    r = np.arange(p)
    steps += _ring_steps(topo, r, (r + 1) % p, 1.0 / p, p - 1) if p > 1 else ()
    return _Plan(tuple(steps), float(len(pairs)))


def _plan_dbtree(topo, p):
    """NCCL double binary tree: binomial-depth latency, ``2 n`` bytes pipelined."""
    pairs = _binomial_pairs(p)
    if not pairs:
        return _Plan((), 0.0)
    lat = [_step(topo, s, d, 0.0) for s, d in pairs] * 2
    bw = _Step(2.0, np.zeros(1), np.array([max(st.inv_rates.max() for st in lat)]))
    return _Plan((*lat, bw), 1.0)


def _plan_halving_doubling(topo, p):
    if p == 1:
        return _Plan((), 0.0)
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    # Thakur et al.: among the first 2*rem ranks the even ones fold into their odd
    # neighbour; the q survivors run halving-doubling on new ranks 0..q-1.
    survivors = np.array([2 * i + 1 for i in range(rem)] + list(range(2 * rem, p)), np.int64)
    steps = []
    if rem:
        steps.append(_step(topo, np.arange(0, 2 * rem, 2), np.arange(1, 2 * rem, 2), 1.0))
    rs = []
    for k in range(int(math.log2(q))):
        new = np.arange(q)
        rs.append(_step(topo, survivors[new], survivors[new ^ (1 << k)], 1.0 / (2 << k)))
    steps += rs + rs[::-1]
    if rem:
        steps.append(_step(topo, np.arange(1, 2 * rem, 2), np.arange(0, 2 * rem, 2), 1.0))
    return _Plan(tuple(steps), (q - 1) / q + (1.0 if rem else 0.0))


def _plan_hierarchical(topo, p):
    g, m = topo.devices_per_node, topo.num_nodes
    intra, inter = _plan("intra", topo).steps, _plan("inter", topo).steps
    reduce_fraction = (g - 1) / g + ((m - 1) / m / g if m > 1 else 0.0)
    return _Plan((*intra, *inter, *intra), reduce_fraction)


def _plan_intra(topo, p):
    """Ring reduce-scatter (or all-gather) inside every node: ``g - 1`` steps of ``n/g``."""
    g = topo.devices_per_node
    r = np.arange(p)
    node, local = r // g, r % g
    intra = _ring_steps(topo, r, node * g + (local + 1) % g, 1.0 / g, g - 1) if g > 1 else ()
    return _Plan(intra, (g - 1) / g)


def _plan_inter(topo, p):
    """The inter psum on ``n/g`` per device (``g`` in parallel, one per local rank):
    NCCL's faster of ring and double binary tree."""
    g, m = topo.devices_per_node, topo.num_nodes
    if m == 1:
        return _Plan((), 0.0)
    r = np.arange(p)
    node, local = r // g, r % g
    ring = _ring_steps(topo, r, ((node + 1) % m) * g + local, 1.0 / (g * m), 2 * (m - 1))
    lat = []
    for sd, dd in _binomial_pairs(m):
        src = (sd[:, None] * g + np.arange(g)).ravel()
        dst = (dd[:, None] * g + np.arange(g)).ravel()
        lat.append(_step(topo, src, dst, 0.0))
    inv_rate = max(st.inv_rates.max() for st in lat)
    tree = (*lat, *lat, _Step(2.0 / g, np.zeros(1), np.array([inv_rate])))
    return _Plan((("min", ring, tree),), (m - 1) / m / g)


def _plan_exchange_inter(topo, p):
    """All-to-all over the nodes (``g`` in parallel, one per local rank), then a ring
    all-gather: the two phases of a quantized mean on ``n/g`` per device. The all-to-all
    is ``m - 1`` shifts (rank ``i`` to ``i + k``), each ``n / (g m)``."""
    g, m = topo.devices_per_node, topo.num_nodes
    if m == 1:
        return _Plan((), 0.0)
    r = np.arange(p)
    node, local = r // g, r % g
    shifts = tuple(_step(topo, r, ((node + k) % m) * g + local, 1.0 / (g * m)) for k in range(1, m))
    gather = _ring_steps(topo, r, ((node + 1) % m) * g + local, 1.0 / (g * m), m - 1)
    return _Plan((*shifts, *gather), (m - 1) / m / g)


def _plan_exchange_all(topo, p):
    """All-to-all over every device (``p - 1`` shifts of ``n/p``), then a ring all-gather."""
    r = np.arange(p)
    shifts = tuple(_step(topo, r, (r + k) % p, 1.0 / p) for k in range(1, p))
    gather = _ring_steps(topo, r, (r + 1) % p, 1.0 / p, p - 1) if p > 1 else ()
    return _Plan((*shifts, *gather), (p - 1) / p)


def _plan_gather_inter(topo, p):
    """Ring all-gather over the nodes where every device contributes ``n`` bytes."""
    g, m = topo.devices_per_node, topo.num_nodes
    r = np.arange(p)
    node, local = r // g, r % g
    steps = _ring_steps(topo, r, ((node + 1) % m) * g + local, 1.0, m - 1) if m > 1 else ()
    return _Plan(steps, 0.0)


def _plan_gather_all(topo, p):
    """Ring all-gather over every device, each contributing ``n`` bytes."""
    r = np.arange(p)
    return _Plan(_ring_steps(topo, r, (r + 1) % p, 1.0, p - 1) if p > 1 else (), 0.0)


def _plan_scatter_inter(topo, p):
    """Ring reduce-scatter (or all-gather) over the nodes on ``n/g`` per device (``g`` in
    parallel, one per local rank): ``m - 1`` steps of ``n / (g m)``."""
    g, m = topo.devices_per_node, topo.num_nodes
    r = np.arange(p)
    node, local = r // g, r % g
    steps = _ring_steps(topo, r, ((node + 1) % m) * g + local, 1.0 / (g * m), m - 1)
    return _Plan(steps if m > 1 else (), (m - 1) / m / g if m > 1 else 0.0)


def _plan_shift_intra(topo, p):
    """All-to-all inside every node: ``g - 1`` shifts of ``n/g``."""
    g = topo.devices_per_node
    r = np.arange(p)
    node, local = r // g, r % g
    steps = tuple(_step(topo, r, node * g + (local + k) % g, 1.0 / g) for k in range(1, g))
    return _Plan(steps, (g - 1) / g)


def _plan_shift_inter(topo, p):
    """All-to-all over the nodes on ``n/g`` per device: ``m - 1`` shifts of ``n/(g m)``."""
    g, m = topo.devices_per_node, topo.num_nodes
    r = np.arange(p)
    node, local = r // g, r % g
    steps = tuple(_step(topo, r, ((node + k) % m) * g + local, 1.0 / (g * m)) for k in range(1, m))
    return _Plan(steps, (m - 1) / m / g if m > 1 else 0.0)


_PLANNERS = {
    "ring": _plan_ring,
    "tree": _plan_tree,
    "halving_doubling": _plan_halving_doubling,
    "hierarchical": _plan_hierarchical,
    "dbtree": _plan_dbtree,
    "intra": _plan_intra,
    "inter": _plan_inter,
    "exchange_inter": _plan_exchange_inter,
    "exchange_all": _plan_exchange_all,
    "gather_inter": _plan_gather_inter,
    "gather_all": _plan_gather_all,
    "scatter_inter": _plan_scatter_inter,
    "shift_intra": _plan_shift_intra,
    "shift_inter": _plan_shift_inter,
}


@functools.lru_cache(maxsize=256)
def _plan(algorithm: str, topo: Topology) -> _Plan:
    return _PLANNERS[algorithm](topo, topo.num_devices)


def _steps_time(steps, n: float) -> float:
    t = 0.0
    for s in steps:
        if isinstance(s, tuple) and s and s[0] == "min":
            t += min(_steps_time(s[1], n), _steps_time(s[2], n))
        else:
            t += s.count * float(np.max(s.alphas + s.fraction * n * s.inv_rates))
    return t


def _check(algorithm: str, nbytes: float, ratio: float) -> None:
    if algorithm not in ALGORITHMS and algorithm != "auto":
        raise ValueError(
            f"cost.predict: algorithm={algorithm!r} is not modelled; choose one of "
            f"{[*ALGORITHMS, 'auto']}."
        )
    if not nbytes >= 0:
        raise ValueError(f"nbytes={nbytes!r} must be >= 0 (bytes per device before the sum).")
    if not ratio >= 1:
        raise ValueError(f"compression_ratio={ratio!r} must be >= 1 (uncompressed = 1).")


def predict(
    algorithm: str, nbytes: float, topology: Topology, *, compression_ratio: float = 1.0
) -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` per device on ``topology``.

    Args:
      algorithm: 'flat', 'ring', 'tree', 'halving_doubling', 'hierarchical' or 'auto'.
      nbytes: bytes of the buffer on each device (uncompressed).
      topology: the cluster; ranks are ``node * devices_per_node + local`` with nodes at
        ``topology.placement``.
      compression_ratio: uncompressed / wire bytes (e.g. 2 for a bf16 cast of f32).

    Returns:
      Seconds.

    Raises:
      ValueError: unknown algorithm, negative size, ratio below 1.
    """
    _check(algorithm, nbytes, compression_ratio)
    if algorithm == "auto":
        algorithm = choose(nbytes, topology, compression_ratio=compression_ratio)
    if topology.num_devices == 1 or nbytes == 0:
        return 0.0
    n = nbytes / compression_ratio
    if algorithm == "flat":
        ring, tree = _plan("ring", topology), _plan("dbtree", topology)
        return min(
            _steps_time(ring.steps, n) + ring.reduce_fraction * n * topology.gamma,
            _steps_time(tree.steps, n) + tree.reduce_fraction * n * topology.gamma,
        )
    plan = _plan(algorithm, topology)
    return _steps_time(plan.steps, n) + plan.reduce_fraction * n * topology.gamma


def predict_allgather(wire_bytes: float, topology: Topology) -> float:
    """Ring all-gather where every device contributes ``wire_bytes`` (sparse or quantized
    codecs that cannot be summed on the wire): ``(p-1)`` steps of ``wire_bytes``."""
    p = topology.num_devices
    if p == 1 or wire_bytes == 0:
        return 0.0
    r = np.arange(p)
    step = _step(topology, r, (r + 1) % p, 1.0)._replace(count=p - 1)
    return _steps_time((step,), wire_bytes)


def choose(
    nbytes: float,
    topology: Topology,
    *,
    candidates: tuple[str, ...] | None = None,
    compression_ratio: float = 1.0,
    call_s=None,
) -> str:
    """The algorithm with the smallest predicted time (ties: the earlier candidate).

    Args:
      nbytes: bytes per device.
      topology: the cluster.
      candidates: names to choose from; default :data:`CANDIDATES`.
      compression_ratio: as in :func:`predict`.
      call_s: fixed seconds per collective call (a number, or a dict by
        :data:`CALL_KINDS`) added to each candidate's time for its calls
        (:func:`call_kinds`); None: none.

    Returns:
      An algorithm name.

    Example:
      >>> topo = fat_tree(64)
      >>> choose(1 << 10, topo, candidates=('ring', 'tree')), choose(1 << 30, topo)
      ('tree', 'ring')
    """
    cands = CANDIDATES if candidates is None else tuple(candidates)
    bad = [c for c in cands if c not in ALGORITHMS]
    if not cands or bad:
        raise ValueError(f"candidates={cands!r}: choose from {list(ALGORITHMS)}.")
    times = [
        predict(c, nbytes, topology, compression_ratio=compression_ratio)
        + _call_seconds(call_kinds(c, topology), call_s)
        for c in cands
    ]
    return cands[int(np.argmin(times))]


# --- named compressors: wire bytes, collectives, codec, calls ------------------------------
#: Kinds of collective call; ``call_s`` (a number, or one per kind) is charged per call.
CALL_KINDS: tuple[str, ...] = (
    "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute",
)  # fmt: skip
#: Names accepted by :func:`parse_compression`.
COMPRESSORS: tuple[str, ...] = (
    "none", "bf16", "fp16", "int8", "int4", "topk", "random_k", "powersgd", "adaptive",
)  # fmt: skip
#: Kernels of a codec table (:class:`Codec` each): the compressors' encode/decode, the
#: packing copy (``'copy'``: leaves into one buffer and back) and adaptive's error sketch.
CODEC_KERNELS: tuple[str, ...] = (
    "bf16", "fp16", "int8", "int8-nearest", "int4", "int4-nearest", "topk", "random_k",
    "powersgd", "sketch", "copy",
)  # fmt: skip
_RUNGS = ("f32", "bf16", "int8", "int4", "topk:R", "random_k:R")
# Each compressor's arguments, in its factory's order, with their types.
_PARAMS: dict[str, tuple[tuple[str, type], ...]] = {
    "none": (), "bf16": (), "fp16": (), "int8": (("block", int), ("stochastic", bool)),
    "int4": (("block", int), ("stochastic", bool)), "topk": (("ratio", float),),
    "random_k": (("ratio", float),), "powersgd": (("rank", int),),
    "adaptive": (("rung", str), ("block", int), ("stochastic", bool)),
}  # fmt: skip
# Adaptive's error of the mean: one all-reduce of 2 x 1021 f32 over every data axis.
_SKETCH_BYTES = 2 * 1021 * 4


class Codec(NamedTuple):
    """Encode and decode cost of one compressor's kernels on one device.

    Attributes:
      encode_s_per_byte: seconds per f32 byte encoded (error-feedback add, quantize or
        cast or select, pack to bytes, and the local decode that error feedback needs).
      decode_s_per_byte: seconds per f32 byte decoded (unpack, dequantize or cast back or
        scatter, the sum of received rows).
      source: where the figures come from (a command and machine, or a note).
    """

    encode_s_per_byte: float
    decode_s_per_byte: float
    source: str = ""


class Compression(NamedTuple):
    """A compressor as the cost model sees it (build with :func:`parse_compression`).

    Attributes:
      spec: the canonical text, e.g. ``'int4(block=64, stochastic=False)'``.
      kind: 'f32', 'bf16', 'fp16', 'int8', 'int4', 'topk', 'random_k' or 'powersgd'.
      pattern: its collectives: 'allreduce' (casts, random-k, PowerSGD's factors),
        'two_phase' (quantized all-to-all + all-gather) or 'allgather' (top-k pairs).
      param: top-k / random-k fraction sent, PowerSGD's rank; 0 otherwise.
      block: elements per scale of int8/int4.
      stochastic: stochastic rounding (int8/int4).
      gathers: the encoded means travel the intra-node all-gather (int8/int4).
      sketch: adaptive's error-of-mean sketch and its all-reduce run every step.
    """

    spec: str
    kind: str
    pattern: str
    param: float = 0.0
    block: int = 256
    stochastic: bool = True
    gathers: bool = False
    sketch: bool = False

    @property
    def elementwise(self) -> bool:
        """Whether it takes the packed buffer (everything but PowerSGD's matrices)."""
        return self.kind != "powersgd"

    @property
    def codec_kernel(self) -> str | None:
        """Its :data:`CODEC_KERNELS` entry (None for the exact f32 rung)."""
        if self.kind == "f32":
            return None
        if self.kind in ("int8", "int4") and not self.stochastic:
            return f"{self.kind}-nearest"
        return self.kind

    def wire_fraction(self, matrices: tuple[tuple[int, int], ...] | None = None) -> float:
        """Bytes one device sends per f32 byte it holds (its contribution, per phase).

        Args:
          matrices: ``(rows, cols)`` of every compressed matrix; PowerSGD only.

        Returns:
          1 for f32, 0.5 for the casts, ``(bits/8 + 4/block)/4`` for int8/int4, ``2 R``
          for top-k (an int32 index and an f32 value per entry), ``R`` for random-k, and
          ``r (rows + cols) / (rows cols)`` over PowerSGD's matrices.

        Raises:
          ValueError: PowerSGD without ``matrices``.
        """
        if self.kind == "f32":
            return 1.0
        if self.kind in ("bf16", "fp16"):
            return 0.5
        if self.kind in ("int8", "int4"):
            return (int(self.kind[3:]) / 8 + 4 / self.block) / 4
        if self.kind == "topk":
            return 2.0 * self.param
        if self.kind == "random_k":
            return self.param
        if not matrices:
            raise ValueError(
                f"{self.spec}: PowerSGD's wire bytes depend on the matrix shapes; give a "
                "model with shapes (e.g. --model resnet152), not a byte count."
            )
        r = int(self.param)
        num = sum(min(r, a, b) * (a + b) for a, b in matrices)
        return num / sum(a * b for a, b in matrices)


_COMPRESSION_FORMS = (
    "none | bf16 | fp16 | int8(block=256, stochastic=True) | int4(...) | topk(0.01) | "
    "random_k(0.01) | powersgd(4) | adaptive(RUNG, block=256, stochastic=True) with RUNG one "
    f"of {list(_RUNGS)}"
)


def _bad(text: str, why: str) -> ValueError:
    return ValueError(
        f"compression {text!r}: {why}. Write one of: {_COMPRESSION_FORMS}; e.g. "
        "'int4(block=64, stochastic=False)' or 'adaptive(int4)'."
    )


def _value(text: str, raw: str, kind: type):
    v = raw.strip()
    if kind is bool:
        low = v.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise _bad(text, f"{v!r} is not a bool (True/False)")
    try:
        return kind(v)
    except ValueError:
        raise _bad(text, f"{v!r} is not a {kind.__name__}") from None


def parse_compression(text: str | None) -> Compression | None:
    """A compressor named like its ``jaxcomm.compression`` factory call.

    Args:
      text: ``'none'``, ``'bf16'``, ``'fp16'``, ``'int8'`` / ``'int4'`` (optional
        ``block``, ``stochastic``), ``'topk(R)'``, ``'random_k(R)'`` (``R`` the fraction
        sent), ``'powersgd(r)'`` (rank, default 4), or ``'adaptive(RUNG)'`` (adaptive held
        at one rung: ``f32``, ``bf16``, ``int8``, ``int4``, ``topk:R``, ``random_k:R``;
        optional ``block``, ``stochastic`` as the factory's). Arguments are positional
        in the factory's order or ``key=value``.

    Returns:
      A :class:`Compression`, or None for ``'none'`` / None.

    Raises:
      ValueError: an unknown name, argument or value; the message lists the forms.

    Example:
      >>> parse_compression('adaptive(int4, block=64, stochastic=False)').wire_fraction()
      0.140625
    """
    if text is None:
        return None
    m = re.fullmatch(r"\s*([A-Za-z_0-9]+)\s*(?:\((.*)\))?\s*", str(text))
    if not m:
        raise _bad(text, "not of the form NAME or NAME(ARGS)")
    name, inner = m.group(1), (m.group(2) or "").strip()
    if name not in COMPRESSORS:
        raise _bad(text, f"unknown compressor {name!r}; allowed: {list(COMPRESSORS)}")
    got = _arguments(text, name, inner)
    if name == "none":
        return None
    block = got.get("block", 256)
    stochastic = got.get("stochastic", True)
    if name == "int8" and block < 1:
        raise _bad(text, f"block={block} must be an int >= 1")
    if name != "int8" and (block < 2 or block % 2):
        raise _bad(text, f"block={block} must be an even int >= 2 (int8: any int >= 1)")
    if name in ("bf16", "fp16"):
        return Compression(name, name, "allreduce")
    if name in ("int8", "int4"):
        spec = f"{name}(block={block}, stochastic={stochastic})"
        return Compression(spec, name, "two_phase", 0.0, block, stochastic, gathers=True)
    if name in ("topk", "random_k"):
        if "ratio" not in got or not 0 < got["ratio"] <= 1:
            raise _bad(text, f"{name} needs a fraction sent in (0, 1], e.g. {name}(0.01)")
        pattern = "allgather" if name == "topk" else "allreduce"
        return Compression(f"{name}({got['ratio']:g})", name, pattern, got["ratio"])
    if name == "powersgd":
        rank = got.get("rank", 4)
        if rank < 1:
            raise _bad(text, f"rank={rank} must be >= 1")
        return Compression(f"powersgd({rank})", "powersgd", "allreduce", float(rank))
    return _adaptive_at(text, got.get("rung"), block, stochastic)


def _arguments(text: str, name: str, inner: str) -> dict:
    """The arguments of ``name(inner)``, positional or ``key=value``, by name and typed."""
    params = _PARAMS[name]
    kinds = dict(params)
    got: dict = {}
    keyword = False
    for i, arg in enumerate(a for a in (x.strip() for x in inner.split(",")) if a):
        key, eq, raw = arg.partition("=")
        keyword = keyword or bool(eq)
        if not eq:
            if i >= len(params) or keyword:
                raise _bad(
                    text,
                    f"unexpected argument {arg!r} (positional after the "
                    f"{len(params)} of {name}, or after a key=value)",
                )
            key, raw = params[i][0], arg
        key = key.strip()
        if key not in kinds:
            allowed = [k for k, _ in params] or "no arguments"
            raise _bad(text, f"{name} takes {allowed}, not {key!r}")
        got[key] = _value(text, raw, kinds[key])
    return got


def _adaptive_at(text: str, rung: str | None, block: int, stochastic: bool) -> Compression:
    """``adaptive(rung, ...)``: the compressor of its rung, priced with the error sketch."""
    if rung is None:
        raise _bad(text, "adaptive needs the rung it is held at, e.g. adaptive(int4)")
    rk, _, rr = rung.partition(":")
    if rk in ("f32", "bf16", "int8", "int4") and not rr:
        base = (Compression("f32", "f32", "allreduce") if rk == "f32" else
                parse_compression(rk if rk == "bf16" else
                                  f"{rk}(block={block}, stochastic={stochastic})"))  # fmt: skip
    elif rk in ("topk", "random_k") and rr:
        base = parse_compression(f"{rk}({rr})")
    else:
        raise _bad(text, f"unknown rung {rung!r}; allowed: {list(_RUNGS)} (R a fraction)")
    extra = f", block={block}, stochastic={stochastic}" if rk in ("int8", "int4") else ""
    return base._replace(spec=f"adaptive({rung}{extra})", sketch=rk != "f32")


def measured(name: str) -> dict:
    """A file of measured figures shipped in ``jaxcomm/data/`` (JSON), read as a dict.

    Each file names the command, date and machine its figures came from.

    Example:
      >>> measured("h200_codec.json")["machine"]
      "one NVIDIA H200 (device_kind 'NVIDIA H200', 4.8 TB/s HBM3e)"
    """
    return json.loads(resources.files("jaxcomm").joinpath("data", name).read_text())


def kernel_codecs(figures: dict) -> dict[str, Codec]:
    """A codec table from a file of kernel times (the form of ``h200_codec.json``).

    Each codec's encode (decode) seconds per f32 byte is the sum of its ``encode``
    (``decode``) kernels' times in ``kernels_s``, divided by the bytes they processed
    (``bytes[codec['bytes']]``).

    Args:
      figures: the file's dict (:func:`measured`).

    Returns:
      ``{codec name: Codec}``.
    """
    kernels, sizes = figures["kernels_s"], figures["bytes"]

    def per_byte(names: list[str], nbytes: float) -> float:
        return sum(kernels[k] for k in names) / nbytes

    return {
        name: Codec(
            per_byte(c["encode"], sizes[c["bytes"]]),
            per_byte(c["decode"], sizes[c["bytes"]]),
            c["source"],
        )
        for name, c in figures["codecs"].items()
    }


#: Codec of an H200 from the GPU check's kernel figures (``jaxcomm/data/h200_codec.json``:
#: its command, date and machine). ``source`` names each figure; a kernel the check did
#: not time has a stand-in, named as such (an upper bound where it reads or writes more
#: bytes than the kernel it stands for).
H200_CODEC: dict[str, Codec] = kernel_codecs(measured("h200_codec.json"))


def call_kinds(algorithm: str, topology: Topology) -> tuple[str, ...]:
    """The collective calls one all-reduce of ``algorithm`` issues (kinds of
    :data:`CALL_KINDS`): flat one all-reduce; hierarchical a reduce-scatter, an all-reduce
    and an all-gather; ring / tree / halving-doubling their ``ppermute`` steps and one
    all-gather (``jaxcomm.collectives``)."""
    p, g, m = topology.num_devices, topology.devices_per_node, topology.num_nodes
    if p == 1:
        return ()
    if algorithm == "flat":
        return ("all-reduce",)
    if algorithm == "hierarchical":
        return (("reduce-scatter",) if g > 1 else ()) + (("all-reduce",) if m > 1 else ()) + (
            ("all-gather",) if g > 1 else ())  # fmt: skip
    steps = {"ring": p - 1, "tree": 2 * math.ceil(math.log2(p))}.get(algorithm)
    if steps is None:  # halving_doubling
        q = 1 << (p.bit_length() - 1)
        steps = int(math.log2(q)) + (2 if q != p else 0)
    return ("collective-permute",) * steps + ("all-gather",)


def _call_seconds(kinds, call_s) -> float:
    if not call_s:
        return 0.0
    if isinstance(call_s, (int, float)):
        return len(kinds) * float(call_s)
    return float(sum(call_s.get(k, 0.0) for k in kinds))


def reduction_time(
    algorithm: str, nbytes: float, topology: Topology, *, call_s=None
) -> dict[str, float]:
    """One uncompressed all-reduce with its calls: ``{'total_s', 'comm_s', 'call_s',
    'calls'}`` (``call_s``: seconds per call, a number or a dict by kind)."""
    alg = choose(nbytes, topology, call_s=call_s) if algorithm == "auto" else algorithm
    comm = predict(alg, nbytes, topology)
    kinds = call_kinds(alg, topology) if nbytes > 0 else ()
    calls = _call_seconds(kinds, call_s)
    return {"total_s": comm + calls, "comm_s": comm, "codec_s": 0.0, "call_s": calls,
            "calls": len(kinds), "algorithm": alg}  # fmt: skip


def codec_counts(
    compression: Compression, nbytes: float, ranks: int, *, gather: int = 1
) -> tuple[float, float]:
    """f32 bytes one device encodes and decodes in one compressed reduction.

    ``nbytes`` f32 bytes enter the compressor on each device and ``ranks`` devices reduce
    them. 'two_phase' encodes ``n (1 + 1/ranks)`` (the buffer, then the mean chunk it
    owns) and decodes ``n`` (the received chunks, summed) plus ``n * gather`` (the
    gathered means; ``gather`` = devices per node when they travel the intra-node
    all-gather encoded); 'allreduce' and 'allgather' encode and decode ``n`` once.

    Args:
      compression: the compressor.
      nbytes: f32 bytes per device entering it.
      ranks: devices in its reduction.
      gather: see above.

    Returns:
      ``(encoded bytes, decoded bytes)``.
    """
    n = float(nbytes)
    if compression.pattern == "two_phase":
        return n * (1 + 1 / max(ranks, 1)), n * (1 + gather)
    return n, n


def codec_seconds(
    compression: Compression,
    nbytes: float,
    ranks: int,
    codec: dict[str, Codec] | None,
    *,
    gather: int = 1,
) -> float:
    """Encode + decode time of one compressed reduction on one device: the bytes of
    :func:`codec_counts` times the kernel's :class:`Codec` rates.

    Args:
      compression: the compressor.
      nbytes: f32 bytes per device entering it.
      ranks: devices in its reduction.
      codec: kernel name -> :class:`Codec`; None or a missing kernel costs 0.
      gather: as in :func:`codec_counts`.

    Returns:
      Seconds.
    """
    kernel = compression.codec_kernel
    if not codec or kernel is None or kernel not in codec:
        return 0.0
    c = codec[kernel]
    enc, dec = codec_counts(compression, nbytes, ranks, gather=gather)
    return c.encode_s_per_byte * enc + c.decode_s_per_byte * dec


def compressed_time(
    nbytes: float,
    topology: Topology,
    compression: Compression,
    *,
    stage: str = "inter",
    algorithm: str = "hierarchical",
    codec: dict[str, Codec] | None = None,
    call_s=None,
    wire: float | None = None,
) -> dict[str, float]:
    """One compressed reduction of ``nbytes`` f32 bytes per device, as ``sync_gradients``
    runs it.

    ``stage='inter'`` (``compress_stage='inter'``): a full-precision reduce-scatter inside
    the node, the compressor over the nodes on ``n/g`` per device (``g`` in parallel), and
    an all-gather inside the node of its means (encoded when ``gathers``, else f32);
    PowerSGD instead averages the whole buffer inside the node (an all-reduce) and
    compresses all of it over the nodes. ``stage='all'``: the compressor over every
    device. Patterns: 'allreduce' is ``algorithm``'s all-reduce of the wire bytes (over
    the nodes: NCCL's faster of ring and tree); 'two_phase' an all-to-all then a ring
    all-gather; 'allgather' a ring all-gather of every device's pairs (two calls:
    indices, values). Elementwise compressors also pay the packing (one copy into the
    buffer, one out: :data:`CODEC_KERNELS` 'copy'); adaptive the error sketch (kernel
    'sketch' on ``n/g``) and a 8 KiB all-reduce over every device.

    Args:
      nbytes: f32 bytes per device.
      topology: the cluster.
      compression: from :func:`parse_compression`.
      stage: 'inter' or 'all'.
      algorithm: the all-reduce algorithm of 'allreduce' patterns with ``stage='all'``
        ('auto': :func:`choose`).
      codec: kernel name -> :class:`Codec` (None: no codec time).
      call_s: seconds per collective call: a number, or a dict by :data:`CALL_KINDS`.
      wire: wire fraction; default ``compression.wire_fraction()`` (PowerSGD: required).

    Returns:
      ``{'total_s', 'comm_s', 'codec_s', 'call_s', 'calls'}`` (seconds; calls a count).

    Raises:
      ValueError: unknown ``stage``.

    Example:
      >>> c = parse_compression('int4(block=64)')
      >>> compressed_time(46.8e6, topo, c, codec=H200_CODEC)['total_s']
    """
    if stage not in ("inter", "all"):
        raise ValueError(f"stage={stage!r} is not known; choose 'inter' or 'all'.")
    n = float(nbytes)
    w = compression.wire_fraction() if wire is None else float(wire)
    g, p = topology.devices_per_node, topology.num_devices
    if p == 1 or n == 0:
        return {"total_s": 0.0, "comm_s": 0.0, "codec_s": 0.0, "call_s": 0.0, "calls": 0}
    # 1. The collectives of the compressor's pattern and its encode/decode.
    if stage == "inter" and g > 1 and not compression.elementwise:
        comm, codec_s, kinds = _intra_mean_inter_compressed(n, w, topology, compression, codec)
    elif stage == "inter" and g > 1:
        comm, codec_s, kinds = _inter_stage_compressed(n, w, topology, compression, codec)
    else:
        comm, codec_s, kinds = _all_stages_compressed(
            n, w, topology, compression, codec, algorithm, call_s
        )
    # 2. Packing: elementwise compressors copy the leaves into one buffer and back.
    if compression.elementwise and codec and "copy" in codec:
        codec_s += (codec["copy"].encode_s_per_byte + codec["copy"].decode_s_per_byte) * n
    # 3. Adaptive's error sketch and its all-reduce over every device.
    if compression.sketch:
        if codec and "sketch" in codec:
            codec_s += codec["sketch"].encode_s_per_byte * (n / g if stage == "inter" else n)
        comm += predict("flat", _SKETCH_BYTES, topology)
        kinds.append("all-reduce")
    # 4. A fixed cost per collective call.
    calls = _call_seconds(kinds, call_s)
    return {"total_s": comm + codec_s + calls, "comm_s": comm, "codec_s": codec_s,
            "call_s": calls, "calls": len(kinds)}  # fmt: skip


def _intra_mean_inter_compressed(
    n: float,
    w: float,
    topology: Topology,
    compression: Compression,
    codec: dict[str, Codec] | None,
) -> tuple[float, float, list[str]]:
    """A non-elementwise compressor (PowerSGD) on the inter-node stage: a full-precision
    all-reduce of the whole buffer inside the node, then the compressor (two all-reduces,
    P and Q) over the nodes on all of it, ``g`` ranks in parallel.

    Args:
      n: f32 bytes per device.
      w: the wire fraction.
      topology: the cluster.
      compression: the compressor.
      codec: kernel name -> :class:`Codec`, or None.

    Returns:
      ``(comm seconds, codec seconds, collective kinds)``.
    """
    g, m, gamma = topology.devices_per_node, topology.num_nodes, topology.gamma
    kinds: list[str] = []
    comm = codec_s = 0.0
    intra = _plan("intra", topology)
    comm += 2 * _steps_time(intra.steps, n) + intra.reduce_fraction * n * gamma
    kinds.append("all-reduce")
    if m > 1:
        inter = _plan("inter", topology)
        comm += _steps_time(inter.steps, g * n * w) + inter.reduce_fraction * g * n * w * gamma
        kinds += ["all-reduce", "all-reduce"]
    codec_s += codec_seconds(compression, n, m, codec)
    return comm, codec_s, kinds


def _inter_stage_compressed(
    n: float,
    w: float,
    topology: Topology,
    compression: Compression,
    codec: dict[str, Codec] | None,
) -> tuple[float, float, list[str]]:
    """An elementwise compressor on the inter-node stage.

    1. A full-precision reduce-scatter inside the node.
    2. The compressor's pattern over the nodes on ``n/g`` per device: 'two_phase' an
       all-to-all and an all-gather, 'allgather' two all-gathers (indices, values),
       'allreduce' one all-reduce.
    3. An all-gather of the means inside the node, encoded when the compressor
       ``gathers`` (then decoded ``g`` times), else f32.

    Args and returns as :func:`_intra_mean_inter_compressed`.
    """
    g, m, gamma = topology.devices_per_node, topology.num_nodes, topology.gamma
    kinds: list[str] = []
    comm = codec_s = 0.0
    intra = _plan("intra", topology)
    comm += _steps_time(intra.steps, n) + intra.reduce_fraction * n * gamma
    kinds.append("reduce-scatter")
    if m > 1:
        if compression.pattern == "two_phase":
            ex = _plan("exchange_inter", topology)
            comm += _steps_time(ex.steps, n * w) + ex.reduce_fraction * n * gamma
            kinds += ["all-to-all", "all-gather"]
        elif compression.pattern == "allgather":
            comm += _steps_time(_plan("gather_inter", topology).steps, n / g * w)
            comm += (m - 1) * n / g * w * gamma
            kinds += ["all-gather", "all-gather"]
        else:
            inter = _plan("inter", topology)
            comm += _steps_time(inter.steps, n * w) + inter.reduce_fraction * n * w * gamma
            kinds.append("all-reduce")
    comm += _steps_time(intra.steps, n * (w if compression.gathers else 1.0))
    kinds.append("all-gather")
    codec_s += codec_seconds(compression, n / g, m, codec,
                             gather=g if compression.gathers else 1)  # fmt: skip
    return comm, codec_s, kinds


def _all_stages_compressed(
    n: float,
    w: float,
    topology: Topology,
    compression: Compression,
    codec: dict[str, Codec] | None,
    algorithm: str,
    call_s,
) -> tuple[float, float, list[str]]:
    """The compressor over every device (``stage='all'``, or one device per node).

    'two_phase' is an all-to-all and an all-gather, 'allgather' two all-gathers (indices,
    values), 'allreduce' ``algorithm``'s all-reduce of the wire bytes (PowerSGD: two, P
    and Q).

    Args:
      n: f32 bytes per device.
      w: the wire fraction.
      topology: the cluster.
      compression: the compressor.
      codec: kernel name -> :class:`Codec`, or None.
      algorithm: the all-reduce algorithm ('auto': :func:`choose`).
      call_s: seconds per collective call (for 'auto').

    Returns:
      ``(comm seconds, codec seconds, collective kinds)``.
    """
    p, gamma = topology.num_devices, topology.gamma
    kinds: list[str] = []
    comm = codec_s = 0.0
    if compression.pattern == "two_phase":
        ex = _plan("exchange_all", topology)
        comm += _steps_time(ex.steps, n * w) + ex.reduce_fraction * n * gamma
        kinds += ["all-to-all", "all-gather"]
    elif compression.pattern == "allgather":
        comm += _steps_time(_plan("gather_all", topology).steps, n * w)
        comm += (p - 1) * n * w * gamma
        kinds += ["all-gather", "all-gather"]
    else:
        alg = choose(n * w, topology, call_s=call_s) if algorithm == "auto" else algorithm
        comm += predict(alg, n * w, topology)
        kinds += list(call_kinds(alg, topology))
        if compression.kind == "powersgd":
            kinds += list(call_kinds(alg, topology))  # P and Q
    codec_s += codec_seconds(compression, n, p, codec)
    return comm, codec_s, kinds


def sharded_time(
    nbytes: float,
    topology: Topology,
    *,
    grad: Compression | None = None,
    params: Compression | None = None,
    codec: dict[str, Codec] | None = None,
    call_s=None,
) -> dict[str, float]:
    """The collectives of one sharded-optimizer step (``data_parallel(shard_optimizer=True)``,
    ZeRO-1/2) on ``nbytes`` f32 bytes of gradients per device, as ``jaxcomm.sharded`` runs
    them, none overlapped with compute.

    1. Gradients reduce-scattered inside the node, then over the nodes on ``n/g``: f32 by
       ring reduce-scatters; with ``grad`` (bf16, int8, int4: ZeRO++'s qgZ) each hop an
       all-to-all of its wire bytes, encoded and decoded per hop.
    2. Params all-gathered over the nodes, then inside the node (``params``: bf16 or int8,
       ZeRO++'s qwZ; encoded once, decoded whole).

    f32 both ways sends what a hierarchical all-reduce sends (its reduce-scatter and
    all-gather halves, the inter all-reduce split the same way).

    Args:
      nbytes: f32 gradient bytes per device (the parameter bytes too).
      topology: the cluster.
      grad: the gradient codec (None: f32).
      params: the param gather's codec (None: f32).
      codec: kernel -> :class:`Codec`; None: no codec time.
      call_s: seconds per call, a number or a dict by kind.

    Returns:
      ``{'total_s', 'comm_s', 'codec_s', 'call_s', 'calls', 'wire_bytes'}``; ``wire_bytes``
      what one device sends per step.

    Example:
      >>> sharded_time(240e6, topo, grad=parse_compression('int8'),
      ...              params=parse_compression('bf16'))['wire_bytes']
    """
    n, g, m = float(nbytes), topology.devices_per_node, topology.num_nodes
    wg = 1.0 if grad is None else grad.wire_fraction()
    wp = 1.0 if params is None else params.wire_fraction()
    scatter = ("intra", "scatter_inter") if grad is None else ("shift_intra", "shift_inter")
    gather = ("scatter_inter", "intra")
    comm = sum(_steps_time(_plan(k, topology).steps, wg * n) for k in scatter)
    comm += sum(_steps_time(_plan(k, topology).steps, wp * n) for k in gather)
    if grad is None:  # the sums of the ring reduce-scatters
        comm += sum(_plan(k, topology).reduce_fraction for k in scatter) * n * topology.gamma
    codec_s = 0.0
    if grad is not None:  # each hop encodes its input and decodes what it receives
        codec_s += codec_seconds(grad._replace(pattern="allreduce"), n + n / g, 1, codec)
    if params is not None:  # the owned chunk encoded once, every chunk decoded
        c = (codec or {}).get(params.codec_kernel or "", None)
        if c is not None:
            codec_s += c.encode_s_per_byte * n / (g * m) + c.decode_s_per_byte * n
    levels = [g > 1, m > 1]
    kinds = ["reduce-scatter" if grad is None else "all-to-all"] * sum(levels)
    kinds += ["all-gather"] * sum(levels)
    calls = _call_seconds(kinds, call_s)
    half = (g - 1) / g * n + (m - 1) / m * n / g  # one device's bytes of one f32 half
    return {
        "total_s": comm + codec_s + calls,
        "comm_s": comm,
        "codec_s": codec_s,
        "call_s": calls,
        "calls": len(kinds),
        "wire_bytes": wg * half + wp * half,
    }
