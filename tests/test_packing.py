"""jaxcomm.packing: the one leaves <-> flat buffers plan (allreduce, compression policy,
buckets): exact round trips, layouts, replication types, and no per-leaf work it can avoid."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, per_device, replicated, shard
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives.base import allreduce_plan
from jaxcomm.packing import plan_groups, plan_streams
from jaxcomm.state import varying_axes


def _leaves(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [((30, 100), jnp.float32), ((10,), jnp.float32), ((7, 100), jnp.bfloat16),
              ((0, 3), jnp.float32), ((), jnp.float32), ((5,), jnp.bfloat16)]  # fmt: skip
    return [jnp.asarray(rng.normal(size=s), d) for s, d in shapes]


def _assert_same_bits(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        bits = [np.asarray(x).reshape(-1).view(np.uint8) for x in (a, b)]
        np.testing.assert_array_equal(*bits)


def test_plan_groups_roundtrip_and_layout():
    leaves = _leaves()
    plan = plan_groups(leaves, [[0], [1, 3, 4], [2, 5]])
    bufs = plan.pack(leaves)
    assert [b.shape for b in bufs] == [(3000,), (11,), (705,)]
    assert [b.dtype for b in bufs] == [jnp.float32, jnp.float32, jnp.bfloat16]
    assert plan.buffers[1].pieces == ((1, 0, 10), (3, 0, 0), (4, 0, 1))
    assert [b.nbytes for b in plan.buffers] == [12000, 44, 1410]
    np.testing.assert_array_equal(bufs[1], jnp.concatenate([leaves[1], leaves[4][None]]))
    _assert_same_bits(plan.unpack(bufs), leaves)


def test_plan_groups_refuses_mixed_dtypes_and_shared_leaves():
    with pytest.raises(ValueError, match="dtypes"):
        plan_groups(_leaves(), [[0, 2]])
    with pytest.raises(ValueError, match="more than one"):
        plan_groups(_leaves(), [[0, 1], [1]])


def test_plan_streams_without_cut_is_one_buffer_per_dtype_and_unpacks_into_a_subset():
    leaves = _leaves()
    plan = plan_streams(leaves, [5, 0, 2, 3, 4])  # leaf 1 left out; 3 is empty
    assert [b.dtype for b in plan.buffers] == [jnp.bfloat16, jnp.float32]
    assert plan.buffers[0].pieces == ((5, 0, 5), (2, 0, 700))
    assert plan.buffers[1].pieces == ((0, 0, 3000), (4, 0, 1))
    assert plan.leaves() == [0, 2, 4, 5]
    out = ["untouched"] * len(leaves)
    plan.unpack_into(plan.pack(leaves), out)
    assert out[1] == out[3] == "untouched"
    _assert_same_bits([out[i] for i in plan.leaves()], [leaves[i] for i in plan.leaves()])
    assert [s.shape for s in plan.specs(4)] == [(-(-705 // 4),), (-(-3001 // 4),)]
    with pytest.raises(ValueError, match="max_bytes"):
        plan_streams(leaves, [0], first_bytes=100)


def test_unpack_of_rows_gives_leaves_with_those_rows():
    """Buffers with a leading axis (each device's buffer a row, as lax.all_gather returns
    them) unpack into leaves with that axis, row by row the 1-D unpack's, also for leaves
    cut across buffers."""
    rows = [_leaves(seed) for seed in range(3)]
    plan = plan_streams(rows[0], [0, 1, 2, 4, 5], max_bytes=4000)  # leaf 0 cut in three
    assert sum(1 for b in plan.buffers for i, _, _ in b.pieces if i == 0) == 3
    stacked = [jnp.stack(bufs) for bufs in zip(*(plan.pack(r) for r in rows), strict=True)]
    got = plan.unpack(stacked)
    each = [plan.unpack(plan.pack(r)) for r in rows]
    want = [jnp.stack(leaves) for leaves in zip(*each, strict=True)]
    _assert_same_bits(got, want)
    assert got[3].shape == (3, 0, 3)  # in no buffer: zeros with the rows' axis


def test_unpack_checks_the_buffer_count():
    leaves = _leaves()
    plan = plan_groups(leaves, [[0], [1]])
    with pytest.raises(ValueError, match="expected 2 buffers, got 1"):
        plan.unpack(plan.pack(leaves)[:1])


def test_allreduce_plan_large_alone_small_per_dtype():
    leaves = _leaves()
    plan, names = allreduce_plan(leaves, small_elements=1000)
    assert [[i for i, _, _ in b.pieces] for b in plan.buffers] == [[0], [1, 3, 4], [2, 5]]
    assert names == ["flat"] * 3


def test_allreduce_plan_packed_algorithms_get_one_buffer_per_dtype():
    leaves = _leaves()
    plan, names = allreduce_plan(leaves, small_elements=1000, algorithm=lambda _: "ring")
    assert [[i for i, _, _ in b.pieces] for b in plan.buffers] == [[0, 1, 3, 4], [2, 5]]
    assert names == ["ring", "ring"]
    _assert_same_bits(plan.unpack(plan.pack(leaves)), leaves)
    # Per buffer of the leaf plan (as 'auto' picks): only the buffers of a packed
    # algorithm merge, per (algorithm, dtype); the others stay as they were.
    by_size = {3000 * 4: "tree", 11 * 4: "tree", 705 * 2: "hierarchical"}
    plan, names = allreduce_plan(leaves, small_elements=1000, algorithm=by_size.__getitem__)
    assert [[i for i, _, _ in b.pieces] for b in plan.buffers] == [[0, 1, 3, 4], [2, 5]]
    assert names == ["tree", "hierarchical"]


def test_packing_keeps_replication_types(mesh):
    """Under check_vma: a buffer with a varying leaf varies, one of invariant leaves does
    not, and unpacked leaves have the type of their buffer."""
    seen = {}
    n = len(mesh.devices.flat)

    def step(g, w, b):
        plan = plan_groups([g, w, b], [[0, 1], [2]])
        bufs = plan.pack([g, w, b])
        seen["bufs"] = [varying_axes(x) for x in bufs]
        out = plan.unpack(bufs)
        seen["out"] = [varying_axes(x) for x in out]
        reduced = plan.unpack([jax.lax.psum(bufs[0], AX), bufs[1]])
        seen["reduced"] = [varying_axes(x) for x in reduced]
        return tuple(reduced)

    rng = np.random.default_rng(1)
    g = per_device(mesh, rng.normal(size=(n, 6)).astype(np.float32))
    w, b = replicated(mesh, jnp.arange(4.0)), replicated(mesh, jnp.ones(3))
    fn = shard(step, mesh, in_specs=(P(AX), P(), P()), out_specs=(P(), P(), P()))
    got = jax.jit(fn)(g, w, b)
    assert seen["bufs"] == [frozenset(AX), frozenset()]
    # w shared a buffer with the varying g: it comes back typed varying, as it travelled.
    assert seen["out"] == [frozenset(AX), frozenset(AX), frozenset()]
    assert seen["reduced"] == [frozenset(), frozenset(), frozenset()]
    np.testing.assert_allclose(got[0][0], np.asarray(g).sum(0), rtol=1e-6)
    np.testing.assert_array_equal(got[2], np.ones(3))


def test_pack_and_unpack_add_no_per_leaf_ops(mesh):
    """One concatenate per multi-leaf buffer, no slice of a leaf kept whole, one ravel per
    leaf even when buckets cut it (compile time grows with traced ops). Unpacking cuts
    by static slices, on a CPU mesh at runtime offsets (jaxcomm.backend)."""
    leaves = _leaves()

    def prims(plan):
        jaxpr = jax.make_jaxpr(lambda ls: plan.unpack(plan.pack(ls)))(leaves)
        names = [e.primitive.name for e in jaxpr.eqns]
        return {k: names.count(k) for k in ("concatenate", "slice", "dynamic_slice", "reshape")}

    whole = plan_groups(leaves, [[0], [1, 3, 4], [2, 5]])
    # 2 concatenates (packing the two multi-leaf buffers); 5 slices unpacking them; the
    # single-leaf buffer neither.
    got = prims(whole)
    assert got["concatenate"] == 2 and got["slice"] == 5 and got["dynamic_slice"] == 0, got
    with jax.set_mesh(mesh):  # a CPU mesh: the 5 pieces at runtime offsets, one static
        got = prims(whole)  # slice per distinct offset takes it out of runtime_ints' sort
    offsets = {0, leaves[1].size, leaves[1].size + leaves[3].size, leaves[2].size}
    assert got["concatenate"] == 2 and got["dynamic_slice"] == 5, got
    assert got["slice"] == len(offsets), got
    cut = plan_streams(leaves, [0], first_bytes=4000, max_bytes=4000)  # 3 buckets of leaf 0
    got = prims(cut)
    # 3 slices cut leaf 0 into its buckets; each bucket is one piece: no unpacking slice
    assert got["slice"] == 3 and got["dynamic_slice"] == 0 and got["concatenate"] == 1, got
    assert got["reshape"] <= 2, got  # one ravel of leaf 0, one reshape back


def _kernel_bodies(text: str, op: str) -> set[str]:
    """The distinct bodies of the non-entry computations of ``text`` that hold ``op``."""
    bodies = set()
    for block in text.split("\n\n"):
        if f"{op}(" in block and not block.lstrip().startswith("ENTRY"):
            body = re.sub(r"%[\w.\-]+", "%", block.split("\n", 1)[1])
            bodies.add(re.sub(r", metadata=\{[^}]*\}", "", body))
    return bodies


def test_unpack_cuts_leaves_of_one_size_with_one_kernel(mesh):
    """On a CPU mesh unpacking slices at runtime offsets (jaxcomm.backend): the 12 leaves
    of one size share one compiled kernel (at constant offsets each would be a kernel of
    its own). The same values either way."""
    leaves = [jnp.full((3, 5), float(i)) for i in range(12)] + [jnp.arange(7.0)]
    plan = plan_groups(leaves, [list(range(13))])
    buf = plan.pack(leaves)[0]
    plain = jax.jit(lambda b: plan.unpack([b]))
    _assert_same_bits(plain(buf), leaves)
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda b: plan.unpack([b]))
        _assert_same_bits(fn(buf), leaves)
        text = fn.lower(buf).compile().as_text()
    assert len(_kernel_bodies(text, "dynamic-slice")) == 2  # one per leaf size (15 and 7)
