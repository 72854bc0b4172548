"""Invariants every compressor must satisfy, parametrized over all of them.

Each compressor is run through ``compressor.reduce`` inside ``jax.shard_map`` on the 8 fake
devices and compared with the exact mean (numpy). One compiled function per compressor is
shared by all tests of this module.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, assert_rows_equal, per_device, sharded, state_specs
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import backend
from jaxcomm.compression import ReduceContext
from jaxcomm.state import stack_local, unstack_local

C = jaxcomm.compression


def _on_route(comp, route: str):
    """``comp`` whose ``reduce`` traces under the mesh's backend row with ``bf16_route``
    replaced: the other platforms' bf16 all-reduce, run on the CPU mesh."""

    def reduce(xs, state, ctx):
        with backend.use(dataclasses.replace(backend.current(), bf16_route=route)):
            return comp.reduce(xs, state, ctx)

    return comp._replace(reduce=reduce)


N = 4096
MAT = (64, 64)

# name -> (factory, input kind, bound on ||out - mean|| / ||mean|| after one step)
# The bound comes from what goes over the wire: bf16 has 8 mantissa bits, fp16 11, int8
# 127 levels per block, int4 7 levels per block (stochastic rounding, gaussian data);
# top-k and PowerSGD get inputs they represent exactly (a shared sparse / low-rank mean);
# random-k with ratio 1/2 sends half of the entries.
COMPRESSORS = {
    "bf16": (lambda: C.bf16(), "gauss", 1e-2),
    "bf16_allreduce": (lambda: _on_route(C.bf16(), "allreduce"), "gauss", 1e-2),
    "fp16": (lambda: C.fp16(), "gauss", 2e-3),
    "int8": (lambda: C.int8(), "gauss", 3e-2),
    "int8_nearest_ef": (lambda: C.int8(64, stochastic=False, error_feedback=True), "gauss", 2e-2),
    "int4": (lambda: C.int4(), "gauss", 0.35),
    "topk_exact": (lambda: C.topk(0.1, method="exact"), "sparse", 1e-6),
    "topk_sampled": (lambda: C.topk(0.1, method="sampled", sample_ratio=0.25), "sparse", 1e-6),
    "random_k": (lambda: C.random_k(0.5), "gauss", 0.8),
    "random_k_unbiased": (lambda: C.random_k(0.5, error_feedback=False), "gauss", 1.5),
    "powersgd": (lambda: C.powersgd(rank=4), "lowrank", 1e-4),
    "powersgd_cold": (lambda: C.powersgd(rank=4, warm_start=False), "lowrank", 1e-4),
    "adaptive": (lambda: C.adaptive(0.5, adjustment_step=1), "gauss", 1e-2),
    "adaptive_nearest": (
        lambda: C.adaptive(0.5, adjustment_step=1, block=64, stochastic=False),
        "gauss",
        1e-2,
    ),
}
NAMES = sorted(COMPRESSORS)


def _inputs(kind: str, seed: int = 0) -> np.ndarray:
    """Per-device inputs (8, ...) whose mean is known."""
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        return rng.normal(size=(8, N)).astype(np.float32)
    if kind == "sparse":  # the same 5%-sparse vector, scaled differently per device
        s = np.zeros(N, np.float32)
        idx = rng.choice(N, N // 20, replace=False)
        s[idx] = rng.normal(size=idx.size) + np.sign(rng.normal(size=idx.size))
        scale = 1 + 0.1 * (np.arange(8) - 3.5)
        return (scale[:, None] * s[None]).astype(np.float32)
    # low-rank mean (rank 2) plus per-device noise that sums to zero over devices
    mean = rng.normal(size=(MAT[0], 2)) @ rng.normal(size=(2, MAT[1]))
    noise = rng.normal(size=(8, *MAT))
    noise -= noise.mean(0, keepdims=True)
    return (mean[None] + noise).reshape(8, -1).astype(np.float32)


def _shape(kind: str) -> tuple[int, ...]:
    return MAT if kind == "lowrank" else (N,)


@functools.cache
def _step_fn(name: str, mesh_id: int):
    """jit(shard_map) of: init (when state is None) + one reduce; returns (out, state)."""
    factory, kind, _ = COMPRESSORS[name]
    comp = factory()
    shape = _shape(kind)
    mesh = _MESHES[mesh_id]
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)

    def local_init():
        return stack_local(comp.init([spec]))

    sspecs = state_specs(lambda: comp.init([spec]), mesh)
    init = sharded(local_init, mesh, in_specs=(), out_specs=sspecs)

    def local(x, state, step, seed):
        ctx = ReduceContext(
            AX, "hierarchical", step, jax.random.fold_in(jax.random.key(seed), step)
        )
        out, new = comp.reduce([x[0].reshape(shape)], unstack_local(state), ctx)
        return out[0].reshape(-1)[None], stack_local(new)

    # check_vma=True: a compressor's mean must be typed invariant (the row stacking of
    # out_specs P(AX) accepts it either way; test_mean_... compares the rows bitwise).
    step = sharded(local, mesh, in_specs=(P(AX), sspecs, P(), P()), out_specs=(P(AX), sspecs))
    return comp, init, step


_MESHES: dict[int, object] = {}


@pytest.fixture(scope="module")
def run(mesh):
    _MESHES[id(mesh)] = mesh

    def go(name, x, *, state=None, step=0, seed=0):
        comp, init, fn = _step_fn(name, id(mesh))
        if state is None:
            state = init()
        xs = per_device(mesh, np.asarray(x))
        out, state = fn(xs, state, jnp.int32(step), jnp.int32(seed))
        return np.asarray(out), state

    return go


@pytest.mark.parametrize("name", NAMES)
def test_mean_shape_dtype_and_replication(run, name):
    _, kind, bound = COMPRESSORS[name]
    x = _inputs(kind)
    out, _ = run(name, x)
    assert out.shape == x.shape and out.dtype == np.float32
    assert_rows_equal(out)  # every device holds the same bits
    ref = x.mean(0)
    rel = np.linalg.norm(out[0] - ref) / np.linalg.norm(ref)
    assert rel <= bound, f"{name}: relative error {rel:.3g} > {bound}"


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trips_through_jit(run, name):
    """Two steps with the state leaving and re-entering jit equal a re-run from scratch."""
    _, kind, _ = COMPRESSORS[name]
    x0, x1 = _inputs(kind, 1), _inputs(kind, 2)
    _, s1 = run(name, x0, step=0)
    out_a, s2a = run(name, x1, state=s1, step=1)
    _, s1b = run(name, x0, step=0)
    s1b = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), s1b)  # host round trip
    s1b = jax.tree.map(lambda a, ref: jax.device_put(a, ref.sharding), s1b, s1)
    out_b, s2b = run(name, x1, state=s1b, step=1)
    np.testing.assert_array_equal(out_a, out_b)
    assert jax.tree.structure(s2a) == jax.tree.structure(s2b)
    for a, b in zip(jax.tree.leaves(s2a), jax.tree.leaves(s2b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", NAMES)
def test_no_nan_on_zeros_and_huge_values(run, name):
    _, kind, _ = COMPRESSORS[name]
    shape = (8, int(np.prod(_shape(kind))))
    out, state = run(name, np.zeros(shape, np.float32))
    np.testing.assert_array_equal(out, 0.0)
    for leaf in jax.tree.leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    huge = _inputs(kind) * np.float32(1e30)
    out, state = run(name, huge)
    assert np.all(np.isfinite(out)), name
    if name == "fp16":  # 1e30 overflows fp16: the step is skipped and counted, not inf
        np.testing.assert_array_equal(out, 0.0)
        assert int(state.overflow_steps) == 1 and not bool(state.finite)
    else:
        ref = huge.astype(np.float64).mean(0)
        rel = np.linalg.norm(out[0] - ref) / np.linalg.norm(ref)
        assert rel <= COMPRESSORS[name][2]


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_given_key(run, name):
    _, kind, _ = COMPRESSORS[name]
    x = _inputs(kind)
    a, _ = run(name, x, step=3, seed=7)
    b, _ = run(name, x, step=3, seed=7)
    np.testing.assert_array_equal(a, b)
    if name in ("int8", "int4", "random_k"):  # randomized: another key, another result
        c, _ = run(name, x, step=3, seed=8)
        assert not np.array_equal(a, c)


def test_random_k_without_error_feedback_is_unbiased(run):
    """The mean over many steps (fresh shared indices each) converges to the true mean.

    Per entry the estimate is ``seg * x`` with probability ``1/seg`` (``seg = 2`` here), so
    its standard deviation is ``|x|`` and the relative error of a ``T``-step average is
    about ``1/sqrt(T)``: 0.09 at ``T = 128``. The bound 0.2 fails a compressor that returns
    zeros (error 1), halves its output (0.5) or drops the ``seg`` scaling (0.5).
    """
    x = _inputs("gauss")
    steps = 128
    total = sum(run("random_k_unbiased", x, step=t)[0][0].astype(np.float64) for t in range(steps))
    ref = x.mean(0)
    rel = np.linalg.norm(total / steps - ref) / np.linalg.norm(ref)
    assert rel < 0.2, rel


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("k", [1, 37, 4096])
def test_first_true_is_nonzero_with_fill(density, k):
    """The sampled top-k's index selection equals numpy's first ``k`` true indices, padded
    with ``len(mask)``: fewer true entries than ``k`` (the fill), more (the cut), none and
    all."""
    from jaxcomm.compression.sparse import first_true

    n = 4096
    mask = np.random.default_rng(int(density * 100) + k).random(n) < density
    ref = np.full(k, n, np.int32)
    hits = np.nonzero(mask)[0][:k]
    ref[: len(hits)] = hits
    got = np.asarray(jax.jit(first_true, static_argnums=1)(jnp.asarray(mask), k))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    "mask, k, match",
    [
        (np.array([0, 2, 0, 3]), 2, "1-D bool"),  # counts are not a mask
        (np.ones((2, 3), bool), 2, "1-D bool"),
        (np.ones(4, bool), 0, "k=0"),
    ],
)
def test_first_true_rejects_bad_input(mask, k, match):
    from jaxcomm.compression.sparse import first_true

    with pytest.raises(ValueError, match=match):
        first_true(jnp.asarray(mask), k)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: C.topk(0.0), r"ratio=0.0 is out of range; allowed \(0.0, 1.0\]"),
        (lambda: C.topk(1.5), r"ratio=1.5 is out of range"),
        (lambda: C.topk(-0.1), r"ratio=-0.1"),
        (lambda: C.topk(0.1, method="approx"), r"method='approx' is not known"),
        (lambda: C.random_k(0), r"ratio=0 is out of range"),
        (lambda: C.random_k(2), r"ratio=2 is out of range"),
        (lambda: C.quantized(bits=3), r"bits=3 is not supported; allowed: \[4, 8\]"),
        (lambda: C.int8(block=0), r"block=0 must be an integer >= 1"),
        (lambda: C.int4(block=-4), r"block=-4 must be an integer >= 1"),
        (lambda: C.int4(block=3), r"block=3 must be even"),
        (lambda: C.powersgd(rank=0), r"rank=0 must be an integer >= 1 \(got int\); e.g. 4"),
        (lambda: C.powersgd(min_compression_rate=0.5), r"min_compression_rate=0.5"),
        (
            lambda: C.adaptive(0.5, min_compression=0.8, max_compression=0.2),
            r"min_compression=0.8 > max",
        ),
        (lambda: C.adaptive(0.95), r"initial_compression_ratio=0.95 is out of range"),
        (lambda: C.adaptive(0.5, max_compression=1.5), r"max_compression=1.5 is out of range"),
        (
            lambda: C.adaptive(0.6, min_compression=0.6, max_compression=0.7),
            r"no compression level",
        ),
        (lambda: C.adaptive(adjustment_step=0), r"adjustment_step=0 must be an integer >= 1"),
        (lambda: C.adaptive(ladder=("bf16", "fp8")), r"rung 'fp8' is not known; use \['f32'"),
        (lambda: C.adaptive(ladder=("int8", "bf16")), r"rung 'bf16' .* least compression first"),
        (lambda: C.adaptive(ladder=("bf16", "topk")), r"write topk:R with R the fraction sent"),
        (lambda: C.adaptive(ladder=("bf16", "topk:2")), r"'topk:2': ratio=2.0 is out of range"),
        (lambda: C.adaptive(ladder="int8"), r"ladder='int8' must be a non-empty sequence"),
        (lambda: C.adaptive(comm_low=0.5, comm_high=0.2), r"comm_high=0.2 is out of range"),
        (lambda: C.adaptive(topk_method="approx"), r"topk_method='approx' is not known"),
        (lambda: C.int_codec(5, 256, stochastic=True), r"bits=5 is not supported; allowed"),
        (lambda: C.int_codec(4, 255, stochastic=True), r"block=255 must be even for int4"),
        (lambda: C.int_codec(8, 0, stochastic=True), r"block=0 must be an integer >= 1"),
        (lambda: C.topk_codec(0.0), r"ratio=0.0 is out of range; allowed \(0.0, 1.0\]"),
        (lambda: C.topk_codec(0.1, method="approx"), r"method='approx' is not known"),
        (lambda: C.random_k_codec(1.5), r"ratio=1.5 is out of range; allowed \(0.0, 1.0\]"),
        (lambda: jaxcomm.sync_gradients(warmup_steps=-1), r"warmup_steps=-1 must be an integer"),
        (lambda: jaxcomm.sync_gradients(min_size=-5), r"min_size=-5"),
        (lambda: jaxcomm.sync_gradients(compress_stage="intra"), r"compress_stage='intra'"),
        (
            lambda: jaxcomm.sync_gradients(axes=("inter",), compress_stage="inter"),
            r"needs an inner",
        ),
    ],
)
def test_bad_input_raises_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_from_codec_takes_a_codec():
    with pytest.raises(TypeError, match=r"from_codec\(codec=.*expected a BufferCodec"):
        C.from_codec(C.int8())


def test_compression_must_be_a_compressor():
    with pytest.raises(TypeError, match="not a jaxcomm.compression.Compressor"):
        jaxcomm.sync_gradients(compression="int8")
