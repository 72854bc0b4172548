"""The cost model reduces to the textbook formulas, respects the bandwidth bound, and picks
latency-optimal algorithms for small buffers and bandwidth-optimal ones for large buffers."""

import math

import pytest

from jaxcomm import cost
from jaxcomm import topology as T

ALPHA, BETA, GAMMA = 7e-6, 1 / 12.5e9, 1 / 200e9


def _flat(p, alpha=ALPHA, beta=BETA, gamma=GAMMA):
    return T.Topology((T.Level("node", p, 1 / beta, alpha),), gamma=gamma)


@pytest.mark.parametrize("p", [2, 3, 6, 8, 16])
@pytest.mark.parametrize("n", [1e3, 1e6, 3e8])
def test_one_level_equals_textbook(p, n):
    topo = _flat(p)
    for name, formula in [
        ("ring", cost.ring_time),
        ("tree", cost.tree_time),
        ("halving_doubling", cost.halving_doubling_time),
    ]:
        assert cost.predict(name, n, topo) == pytest.approx(formula(n, p, ALPHA, BETA, GAMMA))


def test_textbook_formulas_by_hand():
    n, p = 1e6, 8
    assert cost.ring_time(n, p, ALPHA, BETA, GAMMA) == pytest.approx(
        2 * 7 * ALPHA + 2 * 7 / 8 * n * BETA + 7 / 8 * n * GAMMA
    )
    assert cost.halving_doubling_time(n, p, ALPHA, BETA) == pytest.approx(
        2 * 3 * ALPHA + 2 * 7 / 8 * n * BETA
    )
    # Tree (collectives/tree.py): reduce 3 whole buffers, scatter 4 + 2 + 1 chunks of n/8,
    # all-gather 7 chunks of n/8 in 7 steps.
    assert cost.tree_time(n, p, ALPHA, BETA) == pytest.approx(
        3 * (ALPHA + n * BETA) + 3 * ALPHA + 7 / 8 * n * BETA + 7 * (ALPHA + n / 8 * BETA)
    )
    # Non-power-of-two: fold 2 extra ranks into 4 (Thakur et al. 2005).
    assert cost.halving_doubling_time(n, 6, ALPHA, BETA) == pytest.approx(
        2 * 2 * ALPHA + 2 * 3 / 4 * n * BETA + 2 * (ALPHA + n * BETA)
    )


def test_hierarchical_two_levels_equals_formula():
    # 2 nodes x 4 devices; large n so the inter psum is a ring (NCCL's faster choice).
    intra = T.Level("node", 4, 300e9, 2e-6)
    inter = T.Level("leaf", 2, 12.5e9, 8e-6)
    topo = T.Topology((intra, inter), gamma=GAMMA)
    n = 4e8
    want = cost.hierarchical_time(n, 2, 4, 2e-6, 1 / 300e9, 8e-6, 1 / 12.5e9, GAMMA)
    assert cost.predict("hierarchical", n, topo) == pytest.approx(want)


TOPOS = [
    T.fat_tree(16, 4, 2),
    T.fat_tree(64, 4, 4, oversubscription=4).with_random_placement(1),
    T.dgx_h100(64),
    T.cpu_local(2, 4),
    _flat(6),
]


@pytest.mark.parametrize("topo", TOPOS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [4, 1e4, 1e7, 1e9])
@pytest.mark.parametrize("ratio", [1.0, 4.0])
def test_no_prediction_beats_bandwidth_bound(topo, n, ratio):
    p = topo.num_devices
    fastest = max(lv.bandwidth for lv in topo.levels)
    bound = cost.lower_bound(n / ratio, p, fastest)
    for name in cost.ALGORITHMS:
        assert cost.predict(name, n, topo, compression_ratio=ratio) >= bound * (1 - 1e-12)


@pytest.mark.parametrize("topo", TOPOS[:4], ids=lambda t: t.name)
def test_small_latency_optimal_large_bandwidth_optimal(topo):
    p = topo.num_devices
    latency_optimal = {"tree", "halving_doubling"}  # O(lg p) messages
    bandwidth_optimal = {"ring", "halving_doubling", "hierarchical"}  # 2(p-1)/p n bytes
    assert cost.choose(256, topo) in latency_optimal
    assert cost.choose(1e9, topo) in bandwidth_optimal
    # Between the two classical extremes the switch happens where the formulas cross.
    assert cost.choose(256, topo, candidates=("ring", "tree")) == "tree"
    assert cost.choose(1e9, topo, candidates=("ring", "tree")) == "ring"
    assert math.log2(p) >= 1


def test_non_power_of_two_large_prefers_ring_over_halving_doubling():
    topo = _flat(6)
    assert cost.choose(1e9, topo, candidates=("ring", "halving_doubling")) == "ring"
    assert cost.choose(64, topo, candidates=("ring", "halving_doubling")) == "halving_doubling"


def test_oversubscription_and_placement():
    topo = T.fat_tree(64, 4, 4, oversubscription=4)
    rand = topo.with_random_placement(0)
    n = 1e8
    # Random placement sends most ring edges through oversubscribed uplinks.
    assert cost.predict("ring", n, rand) > 1.5 * cost.predict("ring", n, topo)
    # Without oversubscription only latency differs, and the worst edge crosses pods in both.
    flat_os = T.fat_tree(64, 4, 4)
    assert cost.predict("ring", n, flat_os.with_random_placement(0)) == pytest.approx(
        cost.predict("ring", n, flat_os)
    )


def test_compression_ratio_scales_bandwidth_terms():
    topo = _flat(8, gamma=0.0)
    n = 1e8
    full = cost.predict("ring", n, topo)
    half = cost.predict("ring", n, topo, compression_ratio=2)
    lat = 2 * 7 * ALPHA
    assert half - lat == pytest.approx((full - lat) / 2)
    assert cost.predict_allgather(1e6, topo) == pytest.approx(7 * (ALPHA + 1e6 * BETA))


def test_busbw_and_auto():
    assert cost.busbw(1e9, 8, 1.0) == pytest.approx(1e9 * 2 * 7 / 8)
    topo = T.dgx_h100(16)
    assert cost.predict("auto", 1e6, topo) == min(
        cost.predict(c, 1e6, topo) for c in cost.CANDIDATES
    )


def test_errors():
    topo = _flat(4)
    with pytest.raises(ValueError, match="choose one of"):
        cost.predict("butterfly", 1e3, topo)
    with pytest.raises(ValueError, match="compression_ratio"):
        cost.predict("ring", 1e3, topo, compression_ratio=0.5)
    with pytest.raises(ValueError, match="nbytes"):
        cost.predict("ring", -1, topo)
    with pytest.raises(ValueError, match="candidates"):
        cost.choose(1e3, topo, candidates=("psum",))
    assert cost.predict("ring", 1e3, _flat(1)) == 0.0
