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
import math
from typing import NamedTuple

import numpy as np

from jaxcomm.topology.model import Topology

__all__ = [
    "ALGORITHMS",
    "CANDIDATES",
    "busbw",
    "choose",
    "halving_doubling_time",
    "hierarchical_time",
    "lower_bound",
    "predict",
    "predict_allgather",
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
    r = np.arange(p)
    node, local = r // g, r % g
    intra = _ring_steps(topo, r, node * g + (local + 1) % g, 1.0 / g, g - 1) if g > 1 else ()
    steps = list(intra)
    reduce_fraction = (g - 1) / g
    if m > 1:  # the inter psum on n/g: NCCL's faster of ring and double binary tree
        ring = _ring_steps(topo, r, ((node + 1) % m) * g + local, 1.0 / (g * m), 2 * (m - 1))
        lat = []
        for sd, dd in _binomial_pairs(m):
            src = (sd[:, None] * g + np.arange(g)).ravel()
            dst = (dd[:, None] * g + np.arange(g)).ravel()
            lat.append(_step(topo, src, dst, 0.0))
        inv_rate = max(st.inv_rates.max() for st in lat)
        tree = (*lat, *lat, _Step(2.0 / g, np.zeros(1), np.array([inv_rate])))
        steps.append(("min", ring, tree))
        reduce_fraction += (m - 1) / m / g
    steps += list(intra)
    return _Plan(tuple(steps), reduce_fraction)


_PLANNERS = {
    "ring": _plan_ring,
    "tree": _plan_tree,
    "halving_doubling": _plan_halving_doubling,
    "hierarchical": _plan_hierarchical,
    "dbtree": _plan_dbtree,
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
) -> str:
    """The algorithm with the smallest predicted time (ties: the earlier candidate).

    Args:
      nbytes: bytes per device.
      topology: the cluster.
      candidates: names to choose from; default :data:`CANDIDATES`.
      compression_ratio: as in :func:`predict`.

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
    times = [predict(c, nbytes, topology, compression_ratio=compression_ratio) for c in cands]
    return cands[int(np.argmin(times))]
