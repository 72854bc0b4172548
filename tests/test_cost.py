"""The cost model reduces to the textbook formulas, respects the bandwidth bound, and picks
latency-optimal algorithms for small buffers and bandwidth-optimal ones for large buffers."""

import json
import math
import pathlib

import pytest

from jaxcomm import cost
from jaxcomm import topology as T

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


# --- named compressors, codec and calls ----------------------------------------------------
@pytest.mark.parametrize(
    "text, spec, kernel, wire",
    [
        ("bf16", "bf16", "bf16", 0.5),
        ("int8", "int8(block=256, stochastic=True)", "int8", (1 + 4 / 256) / 4),
        ("int4(64, False)", "int4(block=64, stochastic=False)", "int4-nearest", (0.5 + 4 / 64) / 4),
        ("int4(block=64,stochastic=false)", "int4(block=64, stochastic=False)", "int4-nearest",
         0.140625),
        ("topk(0.01)", "topk(0.01)", "topk", 0.02),
        ("random_k(0.1)", "random_k(0.1)", "random_k", 0.1),
        ("adaptive(int4, block=64, stochastic=False)", "adaptive(int4, block=64, stochastic=False)",
         "int4-nearest", 0.140625),
        ("adaptive(f32)", "adaptive(f32)", None, 1.0),
        ("adaptive(topk:0.05)", "adaptive(topk:0.05)", "topk", 0.1),
    ],
)  # fmt: skip
def test_parse_compression(text, spec, kernel, wire):
    c = cost.parse_compression(text)
    assert (c.spec, c.codec_kernel) == (spec, kernel)
    assert c.wire_fraction() == pytest.approx(wire)
    assert c.sketch == (text.startswith("adaptive") and "f32" not in text)
    assert cost.parse_compression("none") is None and cost.parse_compression(None) is None


def test_powersgd_wire_from_matrices():
    c = cost.parse_compression("powersgd(4)")
    # r (rows + cols) / (rows cols) over all matrices: 4 * (10 + 20) + 2 * (2 + 30), rank
    # capped at 2 for the 2-row matrix; over 10 * 20 + 2 * 30 elements.
    assert c.wire_fraction(((10, 20), (2, 30))) == pytest.approx((120 + 64) / 260)
    with pytest.raises(ValueError, match="shapes"):
        c.wire_fraction()


@pytest.mark.parametrize(
    "text, why",
    [
        ("int3", r"unknown compressor 'int3'; allowed: \['none', 'bf16'"),
        ("int4(block=3)", "block=3 must be an even int"),
        ("int8(block=0)", "block=0 must be an int >= 1"),
        ("topk", r"fraction sent in \(0, 1\]"),
        ("topk(1.5)", r"fraction sent in \(0, 1\]"),
        ("adaptive", "the rung it is held at"),
        ("adaptive(int5)", "unknown rung 'int5'"),
        ("int4(foo=1)", r"int4 takes \['block', 'stochastic'\], not 'foo'"),
        ("int8(64, maybe)", "'maybe' is not a bool"),
        ("int8(block=64, True)", "unexpected argument 'True'"),
        ("powersgd(0)", "rank=0 must be >= 1"),
        ("int8[64]", "not of the form NAME or NAME"),
    ],
)
def test_parse_compression_errors_name_value_and_forms(text, why):
    with pytest.raises(ValueError, match=why) as e:
        cost.parse_compression(text)
    assert "Write one of" in str(e.value) and "adaptive(int4)" in str(e.value)


def _two_by_two(b0=4e9, a0=3e-6, b1=1e9, a1=7e-6):
    # 2 nodes x 2 devices; every device has its own b1 link (uplink 2 b1): the 2 flows of a
    # node's exchange get b1 each.
    return T.Topology((T.Level("node", 2, b0, a0), T.Level("switch", 2, b1, a1)), gamma=0.0)


def test_compressed_time_two_phase_by_hand():
    topo, n = _two_by_two(), 8e6
    c = cost.parse_compression("int4(block=64, stochastic=False)")
    w = 0.140625
    codec = {"int4-nearest": cost.Codec(2e-9, 1e-9), "copy": cost.Codec(3e-10, 3e-10)}
    got = cost.compressed_time(n, topo, c, codec=codec, call_s=1e-4)
    # reduce-scatter in the node (one step of n/2); all-to-all and all-gather over the 2
    # nodes (one step each of n w / 4); the int4 means gathered in the node (n w / 2).
    comm = (3e-6 + n / 2 / 4e9) + 2 * (7e-6 + n * w / 4 / 1e9) + (3e-6 + n * w / 2 / 4e9)
    # codec on the shard s = n/2 over 2 nodes, means of 2 devices decoded: encode s + s/2,
    # decode s + 2 s; packing: one copy in, one out.
    codec_s = 2e-9 * 0.75 * n + 1e-9 * 1.5 * n + 6e-10 * n
    assert got["comm_s"] == pytest.approx(comm)
    assert got["codec_s"] == pytest.approx(codec_s)
    assert (got["calls"], got["call_s"]) == (4, pytest.approx(4e-4))
    assert got["total_s"] == pytest.approx(comm + codec_s + 4e-4)


def test_compressed_time_stage_all_allreduce_pattern():
    topo, n = _flat(8, gamma=0.0), 1e7
    c = cost.parse_compression("bf16")
    got = cost.compressed_time(n, topo, c, stage="all", algorithm="ring", call_s=0.0)
    assert got["comm_s"] == pytest.approx(cost.ring_time(n / 2, 8, ALPHA, BETA))
    assert got["codec_s"] == 0.0  # no codec table given


def test_codec_makes_compression_cost_more_and_adaptive_pays_its_sketch():
    topo = T.fat_tree(64, 16, 8, oversubscription=2)
    n = 240e6
    for text in ("bf16", "int8", "int4", "topk(0.01)", "adaptive(int8)"):
        c = cost.parse_compression(text)
        free = cost.compressed_time(n, topo, c)
        gpu = cost.compressed_time(n, topo, c, codec=cost.H200_CODEC)
        assert gpu["comm_s"] == free["comm_s"] and gpu["total_s"] > free["total_s"]
    plain = cost.compressed_time(n, topo, cost.parse_compression("int8"), codec=cost.H200_CODEC)
    adapt = cost.compressed_time(n, topo, cost.parse_compression("adaptive(int8)"),
                                 codec=cost.H200_CODEC)  # fmt: skip
    assert adapt["calls"] == plain["calls"] + 1 and adapt["total_s"] > plain["total_s"]


def test_compression_cuts_the_inter_stage_only():
    # At compress_stage='inter' the intra-node stages stay f32: on a topology whose
    # network is free, compression saves nothing (and int8's gather is the only gain).
    free_net = T.Topology((T.Level("node", 8, 100e9, 0.0), T.Level("leaf", 4, 1e18, 0.0)))
    n = 1e8
    f32 = cost.predict("hierarchical", n, free_net)
    bf = cost.compressed_time(n, free_net, cost.parse_compression("bf16"))
    assert bf["comm_s"] == pytest.approx(f32, rel=1e-6)
    q = cost.compressed_time(n, free_net, cost.parse_compression("int8"))
    assert f32 / 2 < q["comm_s"] < f32


def test_call_kinds_and_reduction_time():
    topo = T.fat_tree(4, 4, None, devices_per_node=2)
    assert cost.call_kinds("flat", topo) == ("all-reduce",)
    assert cost.call_kinds("hierarchical", topo) == ("reduce-scatter", "all-reduce", "all-gather")
    assert cost.call_kinds("ring", topo) == ("collective-permute",) * 7 + ("all-gather",)
    r = cost.reduction_time("hierarchical", 1e6, topo, call_s={"all-gather": 1e-3})
    assert r["calls"] == 3 and r["call_s"] == pytest.approx(1e-3)
    assert r["total_s"] == pytest.approx(cost.predict("hierarchical", 1e6, topo) + 1e-3)


def test_h200_codec_figures_are_the_gpu_check_kernels():
    # int8 dequantize of 60,192,808 f32 took 0.095 ms on the H200 (docs/benchmarks.md).
    c = cost.H200_CODEC["int8"]
    assert c.decode_s_per_byte * 60_192_808 * 4 == pytest.approx(0.095e-3, rel=0.01)
    assert set(cost.H200_CODEC) == set(cost.CODEC_KERNELS)
    stand_ins = [k for k, v in cost.H200_CODEC.items() if v.source.startswith("not measured")]
    assert {"int4-nearest", "bf16", "fp16", "random_k", "sketch"} <= set(stand_ins)


def test_h200_codec_figures_come_from_the_gpu_check_file():
    """The shipped figures name their source and are its kernels' best times."""
    figures = cost.measured("h200_codec.json")
    assert {"command", "date", "machine", "result_file"} <= set(figures)
    result = json.loads((ROOT / "docs/results/gpu_check_2026-11-30_run1.json").read_text())
    kernels = result["parts"]["kernels"]["data"]["kernels"]
    for name, seconds in figures["kernels_s"].items():
        assert seconds == kernels[name]["best_s"], name
    assert cost.kernel_codecs(figures) == cost.H200_CODEC
