"""Gradient buckets: boundaries, order, dtypes, and equality with the unbucketed path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import per_device, sharded

import jaxcomm
from jaxcomm.buckets import AutoBuckets, exposed_seconds, plan_buckets
from jaxcomm.collectives import ALGORITHMS

AXES = ("inter", "intra")


def _shapes():
    # parameter order: w0 (f32, 3000), b0 (f32, 10), w1 (bf16, 700), w2 (f32, 2500), s (f32, ())
    return [
        jax.ShapeDtypeStruct((30, 100), jnp.float32),
        jax.ShapeDtypeStruct((10,), jnp.float32),
        jax.ShapeDtypeStruct((7, 100), jnp.bfloat16),
        jax.ShapeDtypeStruct((2500,), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32),
    ]


def test_boundaries_order_and_dtypes():
    plan = plan_buckets(_shapes(), min_bytes=1000, max_bytes=4000)
    f32 = [b for b in plan.buckets if b.dtype == jnp.float32]
    bf16 = [b for b in plan.buckets if b.dtype == jnp.bfloat16]
    # f32 stream in reverse order: s (1), w2 (2500), b0 (10), w0 (3000) = 5511 elements.
    assert [b.elements for b in f32] == [250, 1000, 1000, 1000, 1000, 1000, 261]
    assert f32[0].pieces == ((4, 0, 1), (3, 0, 249))  # first bucket: min_bytes, last leaf first
    assert f32[2].pieces == ((3, 1249, 2249),)
    assert f32[3].pieces == ((3, 2249, 2500), (1, 0, 10), (0, 0, 739))
    assert f32[-1].pieces == ((0, 2739, 3000),)
    assert all(b.nbytes <= 4000 for b in plan.buckets)
    assert [b.nbytes for b in bf16] == [1000, 400]  # 500 + 200 bf16 elements
    # issue order: the f32 stream (whose last leaf comes first) before bf16
    assert plan.buckets[0].dtype == jnp.float32


def test_pack_unpack_roundtrip():
    rng = np.random.default_rng(0)
    shapes = [*_shapes(), jax.ShapeDtypeStruct((0, 3), jnp.float32)]  # and an empty leaf
    leaves = [jnp.asarray(rng.normal(size=s.shape), s.dtype) for s in shapes]
    plan = plan_buckets(leaves, min_bytes=1000, max_bytes=4000)
    bufs = plan.pack(leaves)
    assert all(b.ndim == 1 for b in bufs)
    assert [int(b.size) for b in bufs] == [b.elements for b in plan.buckets]
    for a, b in zip(plan.unpack(bufs), leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bad", [(0, 10), (10, 5), (1.5, 10), "big", (True, 10), 7, (1, 2, 3)])
def test_bad_bucket_bytes(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        jaxcomm.sync_gradients(bucket_bytes=bad)


def _sync_fn(mesh, tx, combine=False):
    # XLA:CPU merges all-reduces itself; turn that off so each bucket stays one all-reduce.
    options = None if combine else jaxcomm.xla.disable_passes("cpu-all-reduce-combiner")

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(g))[0]

    return sharded(local, mesh, compiler_options=options)


@pytest.fixture(scope="module")
def grads(mesh):
    rng = np.random.default_rng(1)
    tree = {
        "w0": rng.normal(size=(8, 30, 100)).astype(np.float32),
        "b0": rng.normal(size=(8, 10)).astype(np.float32),
        "w1": rng.normal(size=(8, 7, 100)).astype(jnp.bfloat16),
        "w2": rng.normal(size=(8, 2500)).astype(np.float32),
    }
    return per_device(mesh, tree)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_bucketed_equals_unbucketed(mesh, grads, algorithm):
    plain = _sync_fn(mesh, jaxcomm.sync_gradients(algorithm=algorithm))(grads)
    bucketed = _sync_fn(
        mesh, jaxcomm.sync_gradients(algorithm=algorithm, bucket_bytes=(4000, 8000))
    )(grads)  # f32: 4000, 8000, 8000, 2040 bytes (leaves split across buckets); bf16: 1400
    for k in grads:
        ref = np.asarray(grads[k], np.float64).mean(0)
        tol = 1e-2 if grads[k].dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(bucketed[k], np.float64), ref, rtol=tol, atol=tol)
        np.testing.assert_allclose(
            np.asarray(bucketed[k], np.float64), np.asarray(plain[k], np.float64),
            rtol=tol, atol=tol,
        )  # fmt: skip


def test_one_allreduce_per_bucket_in_hlo(mesh, grads):
    tx = jaxcomm.sync_gradients(algorithm="flat", bucket_bytes=(1000, 4000))
    leaves = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in jax.tree.leaves(grads)]
    plan = plan_buckets(leaves, min_bytes=1000, max_bytes=4000)
    mod = jaxcomm.hlo.collectives(_sync_fn(mesh, tx), grads, mesh=mesh)
    ars = [c for c in mod.collectives if c.kind == "all-reduce"]
    assert len(ars) == len(plan.buckets) == 9
    assert all(c.axes == AXES and c.num_buffers == 1 for c in ars)
    assert sorted(c.operand_elements for c in ars) == sorted(b.elements for b in plan.buckets)
    # XLA:CPU widens bf16 all-reduces to f32 (so the bf16 buckets cost f32 bytes on CPU).
    assert {c.dtype for c in ars} == {"f32"}
    # With XLA:CPU's combiner on, the same program has fewer all-reduces: the flag matters.
    combined = jaxcomm.hlo.collectives(_sync_fn(mesh, tx, combine=True), grads, mesh=mesh)
    assert len([c for c in combined.collectives if c.kind == "all-reduce"]) < len(ars)


def test_auto_picks_the_least_exposed_candidate():
    leaves = [jax.ShapeDtypeStruct((1 << 20,), jnp.float32) for _ in range(16)]  # 64 MiB

    def comm(n):  # 1 ms start-up, 1 GB/s
        return 1e-3 + n / 1e9

    chosen = {}
    for backward in (1e-3, 1.0):
        auto = AutoBuckets(comm_seconds=comm, backward_seconds=backward)
        lo, hi = auto.choose(leaves)
        costs = {
            cap: exposed_seconds(
                plan_buckets(leaves, min_bytes=min(1 << 20, cap), max_bytes=cap), comm, backward
            )
            for cap in auto.candidates
        }
        assert costs[hi] == pytest.approx(min(costs.values()))
        chosen[backward] = hi
    # A short backward pass hides nothing: one big bucket (fewest start-ups) wins; a long one
    # hides all but the last bucket, so smaller buckets win.
    assert chosen[1e-3] == max(AutoBuckets().candidates)
    assert chosen[1.0] < chosen[1e-3]


def test_exposed_seconds_model():
    leaves = [jax.ShapeDtypeStruct((250,), jnp.float32) for _ in range(4)]  # 4 x 1000 B
    plan = plan_buckets(leaves, min_bytes=1000, max_bytes=1000)
    # buckets ready at 1,2,3,4 s; each takes 0.5 s: only the last is exposed.
    assert exposed_seconds(plan, lambda n: 0.5, 4.0) == pytest.approx(0.5)
    # each takes 2 s: a queue forms; ends at 1 + 4*2 = 9 s.
    assert exposed_seconds(plan, lambda n: 2.0, 4.0) == pytest.approx(5.0)


def test_auto_in_sync_gradients(mesh, grads):
    tx = jaxcomm.sync_gradients(algorithm="flat", bucket_bytes="auto")
    out = _sync_fn(mesh, tx)(grads)
    np.testing.assert_allclose(
        np.asarray(out["w0"]), np.asarray(grads["w0"]).mean(0), rtol=1e-5, atol=1e-5
    )


def test_auto_uses_the_cost_model_of_its_topology(mesh, grads):
    from jaxcomm import backend, cost, topology

    topo = topology.dgx_h100(2, nodes_per_leaf=2)  # 2 nodes x 8 GPUs; fitted to 2 x 4
    fitted = jaxcomm.collectives.auto.fit_to_mesh(topo, 2, 4)
    leaves = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in jax.tree.leaves(grads)]
    auto = AutoBuckets(backward_seconds=1e-4, min_bytes=1024, candidates=(2048, 8192, 32768))
    chosen = auto.choose(leaves, lambda n: cost.predict("flat", n, fitted))
    assert chosen != (32768, 32768)  # the model cuts this gradient for overlap
    tx = jaxcomm.sync_gradients(algorithm="flat", topology=topo, bucket_bytes=auto)
    # Traced as for a GPU, whose collectives overlap compute: the cost model's buckets.
    # On XLA:CPU, which runs collectives synchronously, the fewest: the largest candidate.
    for row, (lo, hi) in ((backend.GPU, chosen), (backend.CPU, (32768, 32768))):
        expected = plan_buckets(leaves, min_bytes=lo, max_bytes=hi)
        with backend.use(row):
            mod = jaxcomm.hlo.collectives(_sync_fn(mesh, tx), grads, mesh=mesh)
        sizes = sorted(c.operand_elements for c in mod.collectives if c.kind == "all-reduce")
        assert sizes == sorted(b.elements for b in expected.buckets), row.platform


@pytest.mark.parametrize(
    "make,tol",
    [(lambda: jaxcomm.compression.bf16(), 2e-2), (lambda: jaxcomm.compression.int8(), 5e-2)],
)
def test_buckets_feed_elementwise_compressors(mesh, grads, make, tol):
    """leaves -> buckets -> compressor: the mean is right and the compressed collectives
    run once per bucket (read from the HLO)."""
    f32 = {k: v for k, v in grads.items() if v.dtype == jnp.float32}
    tx = jaxcomm.sync_gradients(compression=make(), min_size=1000, bucket_bytes=(4000, 8000))
    out = _sync_fn(mesh, tx)(f32)
    for k in f32:
        ref = np.asarray(f32[k], np.float64).mean(0)
        np.testing.assert_allclose(np.asarray(out[k], np.float64), ref, atol=tol * 4, rtol=0)
    leaves = [jax.ShapeDtypeStruct(f32[k].shape[1:], f32[k].dtype) for k in ("w0", "w2")]
    n_buckets = len(plan_buckets(leaves, min_bytes=4000, max_bytes=8000).buckets)
    unbucketed = jaxcomm.hlo.collectives(
        _sync_fn(mesh, jaxcomm.sync_gradients(compression=make(), min_size=1000)),
        f32,
        mesh=mesh,
    )
    bucketed = jaxcomm.hlo.collectives(_sync_fn(mesh, tx), f32, mesh=mesh)
    # one buffer of compressed leaves without buckets, n_buckets with them
    extra = len(bucketed.collectives) - len(unbucketed.collectives)
    per_buffer = (len(bucketed.collectives) - 1) // n_buckets  # b0 (10 entries) is plain
    assert n_buckets == 4 and extra == per_buffer * (n_buckets - 1)
