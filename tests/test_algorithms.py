"""Ring, tree and halving-doubling equal psum, compile to the expected collective-permutes
plus one all-gather (which makes the result typed invariant under ``check_vma=True``), and
'auto' runs what the cost model picks. (tests/test_allreduce.py also runs every
registered algorithm on pytrees in f32/bf16/f16.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import AX, abstract_per_device, assert_replicas_equal, per_device, sharded
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import cost
from jaxcomm import topology as T
from jaxcomm.collectives import ALGORITHMS, fit_to_mesh
from jaxcomm.collectives.base import ring_reduce_scatter


@pytest.fixture(scope="module")
def mesh6():
    """2 x 3 mesh over 6 of the 8 fake devices: p = 6 is not a power of two."""
    return jaxcomm.make_mesh(intra=3, devices=jax.devices()[:6])


@pytest.fixture(scope="module")
def line6():
    """1 x 6 mesh: one node of 6 devices."""
    return jaxcomm.make_mesh(intra=6, devices=jax.devices()[:6])


def expected_permutes(algorithm: str, p: int) -> int:
    """Collective-permutes besides the one all-gather: the ring's reduce-scatter, the
    tree's reduce and scatter, halving-doubling's halving (and its fold)."""
    if algorithm == "ring":
        return p - 1
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(p))
    q = 1 << (p.bit_length() - 1)
    return int(math.log2(q)) + (1 if q != p else 0)


def _compile(mesh, fn, x):
    # check_vma=True: the result over ('inter', 'intra') must be typed invariant, or the
    # out_specs P() of the all-axes cases below fail to trace.
    f = sharded(fn, mesh, out_specs=P(AX))
    compiled = f.lower(x).compile()
    return compiled, jaxcomm.hlo.parse_collectives(compiled.as_text(), mesh)


def _reference(x: np.ndarray, mesh, axes) -> np.ndarray:
    """numpy sum of the per-device rows over the devices that share the non-reduced axes."""
    shape = mesh.devices.shape
    v = x.reshape(*shape, -1).astype(np.float64)
    for i, name in enumerate(mesh.axis_names):
        if name in axes:
            v = np.broadcast_to(v.sum(axis=i, keepdims=True), v.shape)
    return v.reshape(x.shape)


CASES = [("mesh", AX), ("mesh", ("intra",)), ("mesh6", AX)]


@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling"])
@pytest.mark.parametrize("mesh_name, axes", CASES)
def test_equals_psum_and_permute_count(request, algorithm, mesh_name, axes):
    mesh = request.getfixturevalue(mesh_name)
    nd = mesh.devices.size
    p = int(np.prod([mesh.shape[a] for a in axes]))
    x = np.random.default_rng(p).normal(size=(nd, 13)).astype(np.float32)  # 13: not / p
    xs = per_device(mesh, x)
    compiled, mod = _compile(mesh, lambda v: ALGORITHMS[algorithm](v[0], axes)[None], xs)
    np.testing.assert_allclose(np.asarray(compiled(xs)), _reference(x, mesh, axes), atol=1e-5)
    kinds = [c.kind for c in mod.collectives]
    assert kinds.count("all-gather") == 1
    assert kinds.count("collective-permute") == expected_permutes(algorithm, p)
    assert len(kinds) == expected_permutes(algorithm, p) + 1
    if axes == AX:  # typed invariant: it may leave shard_map replicated, bit-equal
        out = sharded(lambda v: ALGORITHMS[algorithm](v[0], axes), mesh)(xs)
        assert assert_replicas_equal(out) == 1


@pytest.mark.parametrize("mesh_name, axes", CASES)
def test_ring_reduce_scatter_equals_psum_scatter(request, mesh_name, axes):
    # The intra stage of hierarchical on multi-process CPU (gloo's reduce-scatter is wrong
    # there, jax-ml/jax#40830): rank r must end with chunk r of the sum, as psum_scatter.
    mesh = request.getfixturevalue(mesh_name)
    p = int(np.prod([mesh.shape[a] for a in axes]))
    x = np.random.default_rng(p).normal(size=(mesh.devices.size, 5 * p)).astype(np.float32)
    xs = per_device(mesh, x)
    compiled, mod = _compile(mesh, lambda v: ring_reduce_scatter(v[0], axes)[None], xs)
    want = sharded(
        lambda v: jax.lax.psum_scatter(v[0], axes, scatter_dimension=0, tiled=True)[None],
        mesh,
        out_specs=P(AX),
    )(xs)
    np.testing.assert_allclose(np.asarray(compiled(xs)), np.asarray(want), rtol=1e-6, atol=1e-6)
    kinds = [c.kind for c in mod.collectives]
    assert kinds == ["collective-permute"] * (p - 1)  # (p-1)/p of x sent, no all-reduce


def test_ring_moves_to_next_rank_only(mesh):
    # 20 elements -> padded to 24, chunks of 3 elements: each step moves one chunk; the
    # all-gather collects one chunk from each of the 8 devices.
    xs = per_device(mesh, np.ones((8, 20), np.float32))
    _, mod = _compile(mesh, lambda v: ALGORITHMS["ring"](v[0], AX)[None], xs)
    for c in mod.collectives:
        if c.kind == "all-gather":
            assert c.result_elements == 24 and c.dtype == "f32"
            continue
        assert sorted(c.source_target_pairs) == [(i, (i + 1) % 8) for i in range(8)]
        assert c.result_elements == 3 and c.dtype == "f32"


def test_tree_reduces_whole_buffers_and_scatters_halves_along_binomial_edges(mesh):
    xs = per_device(mesh, np.ones((8, 20), np.float32))
    _, mod = _compile(mesh, lambda v: ALGORITHMS["tree"](v[0], AX)[None], xs)
    permutes = [c for c in mod.collectives if c.kind == "collective-permute"]
    got = sorted((tuple(sorted(c.source_target_pairs)), c.result_elements) for c in permutes)
    reduce = [((1, 0), (3, 2), (5, 4), (7, 6)), ((2, 0), (6, 4)), ((4, 0),)]
    scatter = [tuple(sorted((t, s) for s, t in step)) for step in reduce]
    # 20 elements -> chunks of 3: the reduce moves all 20, the scatter 3, 6, 12 (k chunks).
    want = [(r, 20) for r in reduce] + list(zip(scatter, [3, 6, 12], strict=True))
    assert got == sorted(want)
    (gather,) = [c for c in mod.collectives if c.kind == "all-gather"]
    assert gather.result_elements == 24


def test_halving_doubling_big_exchanges_stay_in_node(mesh):
    # Distance doubling: partners rank^1, rank^2 share a node ('intra'); only rank^4 crosses
    # ('inter'), with n/8 elements; then one all-gather of the 8 segments.
    xs = per_device(mesh, np.ones((8, 64), np.float32))
    _, mod = _compile(mesh, lambda v: ALGORITHMS["halving_doubling"](v[0], AX)[None], xs)
    permutes = [c for c in mod.collectives if c.kind == "collective-permute"]
    by_axes = sorted((c.axes, c.result_elements) for c in permutes)
    assert by_axes == sorted([(("intra",), 32), (("intra",), 16), (("inter",), 8)])
    assert [c.result_elements for c in mod.collectives if c.kind == "all-gather"] == [64]


@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling"])
def test_non_power_of_two_pytree_bf16(mesh6, algorithm):
    rng = np.random.default_rng(2)
    trees = [{"s": np.float32(rng.normal()), "v": rng.normal(size=(5, 3))} for _ in range(6)]
    trees = [jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), t) for t in trees]
    stacked = per_device(mesh6, jax.tree.map(lambda *xs: jnp.stack(xs), *trees))

    def f(t):
        local = jax.tree.map(lambda a: a[0], t)
        return jaxcomm.allreduce(local, algorithm=algorithm, op="mean")

    out = sharded(f, mesh6)(stacked)
    assert_replicas_equal(out)
    for key in ("s", "v"):
        ref = np.mean([np.asarray(t[key], np.float64) for t in trees], axis=0)
        assert out[key].dtype == jnp.bfloat16 and out[key].shape == ref.shape
        np.testing.assert_allclose(np.asarray(out[key], np.float64), ref, atol=0.05)


def test_auto_runs_what_the_cost_model_picks(line6):
    # One node of 6 devices (p not a power of two): a latency-optimal algorithm for a
    # scalar, the ring for 4 MB (halving-doubling pays two extra full-size steps).
    topo = T.cpu_local(1, 8)
    fitted = fit_to_mesh(topo, 1, 6)
    small, large = cost.choose(4, fitted), cost.choose(4 << 20, fitted)
    assert small in ("halving_doubling", "tree") and large in ("ring", "hierarchical")
    for n, name in ((1, small), (1 << 20, large)):
        xs = per_device(line6, np.ones((6, n), np.float32))
        compiled, mod = _compile(
            line6, lambda v: jaxcomm.allreduce(v[0], op="sum", algorithm="auto",
                                               topology=topo)[None], xs
        )  # fmt: skip
        if name == "hierarchical":
            assert {c.kind for c in mod.collectives} == {"reduce-scatter", "all-gather"}
        else:
            assert len(mod.collectives) == expected_permutes(name, 6) + 1
        np.testing.assert_allclose(np.asarray(compiled(xs)), 6.0)


def test_sync_gradients_auto_with_topology(mesh):
    tx = jaxcomm.sync_gradients(
        algorithm="auto", topology=T.fat_tree(2, 2, None, devices_per_node=4)
    )
    g = np.random.default_rng(3).normal(size=(8, 11)).astype(np.float32)
    gs = per_device(mesh, g)

    def step(v):
        upd, _ = tx.update({"w": v[0]}, tx.init(None))
        return upd["w"][None]

    out = sharded(step, mesh, out_specs=P(AX))(gs)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(g.mean(0), g.shape), atol=1e-6)


def test_bad_topology_argument():
    with pytest.raises(TypeError, match="jaxcomm.topology.Topology"):
        jaxcomm.sync_gradients(algorithm="auto", topology="dgx")
    with pytest.raises(TypeError, match="jaxcomm.topology.Topology"):
        jaxcomm.allreduce({"a": jnp.ones(2)}, algorithm="auto", topology={"levels": []})


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_data_parallel_step_matches_flat(mesh, algorithm):
    # The train step runs with check_vma=True: ppermute-built results must end invariant.
    rng = np.random.default_rng(4)
    params = {"w": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), "b": jnp.zeros(3)}
    batch = {"x": rng.normal(size=(16, 6)).astype(np.float32),
             "y": rng.normal(size=(16, 3)).astype(np.float32)}  # fmt: skip

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    out = {}
    for alg in ("flat", algorithm):
        tx = optax.chain(jaxcomm.sync_gradients(algorithm=alg), optax.sgd(0.1))
        dp = jaxcomm.data_parallel(loss, tx, mesh, check_replicas=1)
        state, _ = dp(dp.init(params), batch)
        assert_replicas_equal(state)
        out[alg] = state.params
    for k in params:
        np.testing.assert_allclose(out[algorithm][k], out["flat"][k], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out["flat"]["w"], params["w"])  # the step did update


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_invariant_all_gather_moves_no_more_bytes(mesh, algorithm):
    # Replacing the ppermute all-gather phase by one all-gather keeps the bandwidth-optimal
    # 2 (p-1)/p n bytes per device (wire_bytes: permutes at S, the all-gather at (p-1)/p S).
    n = 8 * 1024
    fn = sharded(lambda v: ALGORITHMS[algorithm](v[0], AX), mesh)
    wb = jaxcomm.wire_bytes(fn, abstract_per_device(mesh, (n,)))
    assert wb["total"] == pytest.approx(2 * 7 / 8 * n * 4)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling"])
def test_allreduce_runs_a_ppermute_algorithm_once_per_dtype(mesh, algorithm):
    # Compile time grows with the number of algorithm calls, so allreduce packs all leaves
    # of a dtype into one buffer for these algorithms: the collectives of one call per
    # dtype, whatever the leaf count, and no more bytes on the wire than one call per
    # leaf (less: one buffer's padding instead of one per leaf).
    shapes = [(5000,), (64, 70), (4097,), (9,), (3, 3)]
    tree = {f"f{i}": abstract_per_device(mesh, s) for i, s in enumerate(shapes)}
    tree["h"] = abstract_per_device(mesh, (4100,), jnp.bfloat16)

    def packed(t):
        return jaxcomm.allreduce(jax.tree.map(lambda v: v[0], t), algorithm=algorithm, op="sum")

    def per_leaf(t):  # one call per leaf (what allreduce did for large leaves before)
        return {k: ALGORITHMS[algorithm](v[0].reshape(-1), AX) for k, v in t.items()}

    got = jaxcomm.wire_bytes(sharded(packed, mesh), tree)
    before = jaxcomm.wire_bytes(sharded(per_leaf, mesh), tree)
    assert got["total"] <= before["total"]
    kinds = [c["kind"] for c in got["collectives"]]
    assert kinds.count("all-gather") == 2  # f32 and bf16
    assert kinds.count("collective-permute") == 2 * expected_permutes(algorithm, 8)
    # and the values: the sum over devices of every leaf
    rng = np.random.default_rng(5)
    xs = {k: per_device(mesh, rng.normal(size=v.shape).astype(v.dtype)) for k, v in tree.items()}
    out = sharded(packed, mesh)(xs)
    assert_replicas_equal(out)
    for k, x in xs.items():
        want = np.asarray(x, np.float64).sum(0)
        tol = 0.1 if x.dtype == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(np.asarray(out[k], np.float64), want, atol=tol)
