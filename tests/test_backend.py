"""jaxcomm.backend: one row per platform; the XLA:CPU / gloo rewrites on a CPU mesh only.

Each program is lowered twice: inside ``shard_map`` over the CPU test mesh (the CPU row:
the rewrites are in the program) and over the same mesh typed as GPU devices, lowered for
``'cuda'`` (the GPU row: the plain program, which a GPU compiles). On the CPU, the GPU row
forced (``backend.use``) computes the same values: bit for bit, except bf16, whose plain
route (a bf16 all-reduce) is held to bf16's precision only (on the 8 test devices, a
power of two, it comes out bit for bit too: XLA:CPU sums the promoted all-reduce in f32,
and a division by 8 commutes with the rounding to bf16).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, per_device
from jax import lax
from jax.sharding import AbstractDevice, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import backend
from jaxcomm.compression import ReduceContext
from jaxcomm.compression.cast import bf16_mean
from jaxcomm.compression.keys import step_key, two_phase_seeds
from jaxcomm.compression.quantize import two_phase_mean
from jaxcomm.ordering import after
from jaxcomm.packing import plan_groups

C = jaxcomm.compression
GPU = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
N = 4096
LEAVES = [(30, 7), (5,), (30, 7), (11, 3)]  # a packed buffer of 4 leaves, 3 sizes


def _gpu_mesh(mesh):
    """The test mesh's axes, typed as GPU devices (an AbstractMesh: lowering only)."""
    return mesh.abstract_mesh.update(abstract_device=GPU)


def _lowered(fn, mesh, size: int, platform: str) -> str:
    """StableHLO of ``fn`` (one device's ``(1, size)`` f32 row -> ``(1, k)`` row) inside
    ``shard_map`` over ``mesh``, lowered for ``platform``."""
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
    n = int(np.prod(mesh.axis_sizes))
    x = jax.ShapeDtypeStruct((n, size), jnp.float32, sharding=NamedSharding(mesh, P(AX)))
    return f.trace(x).lower(lowering_platforms=(platform,)).as_text()


def _both(fn, mesh, size: int) -> tuple[str, str]:
    """``fn``'s StableHLO on the CPU mesh and on the GPU mesh (for 'cuda')."""
    return _lowered(fn, mesh, size, "cpu"), _lowered(fn, _gpu_mesh(mesh), size, "cuda")


def _ops(text: str) -> set[str]:
    return set(re.findall(r"\b(?:stablehlo|chlo)\.([a-z_]+)", text))


def _int8_mean(x):
    seeds = two_phase_seeds(jax.random.key(0), lax.axis_index(AX), 0)
    return two_phase_mean(x[0], AX, bits=8, block=256, seeds=seeds)[0][None]


def _bf16_mean(x):
    return bf16_mean(x[0], AX, "flat")[0][None]


def _unpack(x):
    leaves = [jnp.zeros(s) for s in LEAVES]
    plan = plan_groups(leaves, [range(len(leaves))])
    n = plan.buffers[0].elements
    out = plan.unpack([lax.psum(x[0, :n], AX)])  # the buffer, reduced
    return jnp.concatenate([leaf.reshape(-1) for leaf in out])[None]


def test_row_follows_the_mesh_platform(mesh):
    seen = {}

    def probe(key):
        def fn(x):
            seen[key] = backend.current()
            return x

        return fn

    assert backend.current() is backend.PLAIN  # no mesh in context: the plain program
    _lowered(probe("cpu"), mesh, 8, "cpu")
    _lowered(probe("gpu"), _gpu_mesh(mesh), 8, "cuda")
    with jax.set_mesh(mesh):
        seen["set_mesh"] = backend.current()
    assert seen == {"cpu": backend.CPU, "gpu": backend.GPU, "set_mesh": backend.CPU}


def test_table_rows_and_lookups(mesh):
    assert backend.ROWS == {"cpu": backend.CPU, "gpu": backend.GPU, "tpu": backend.TPU}
    assert backend.for_mesh(mesh) is backend.CPU  # a concrete mesh, on the host
    assert backend.for_mesh(mesh.abstract_mesh) is backend.CPU
    assert backend.for_mesh(_gpu_mesh(mesh)) is backend.GPU
    assert backend.for_platform("metal") is backend.PLAIN
    assert backend.for_platform(None) is backend.PLAIN
    # the CPU row takes every rewrite; the others none
    fields = [f.name for f in dataclasses.fields(backend.Backend) if f.name != "platform"]
    for f in fields:
        assert getattr(backend.CPU, f) not in (False, "allreduce", ()), f
        for row in (backend.GPU, backend.TPU, backend.PLAIN):
            assert getattr(row, f) in (False, "allreduce", ()), (row, f)
    assert backend.CPU.bf16_route == "all_to_all"


def test_use_installs_a_row_for_the_enclosed_traces_only(mesh):
    seen = []

    def fn(x):
        seen.append(backend.current())
        return x

    with backend.use(backend.GPU) as row:
        assert row is backend.GPU and backend.current() is backend.GPU
        _lowered(fn, mesh, 8, "cpu")  # a CPU mesh, traced under the GPU row
        with backend.use(backend.PLAIN):
            assert backend.current() is backend.PLAIN
        assert backend.current() is backend.GPU
    assert backend.current() is backend.PLAIN
    assert seen == [backend.GPU]
    with pytest.raises(TypeError, match=r"expected a jaxcomm.backend.Backend row"):
        with backend.use("cpu"):
            pass
    with pytest.raises(ValueError, match=r"bf16_route='nccl' is not known"):
        backend.Backend("x", bf16_route="nccl")


def test_int8_mean_hlo_of_both_paths(mesh):
    cpu, gpu = _both(_int8_mean, mesh, N)
    # CPU: offsets and 1/qmax through sorts, seeds and decoding through conditionals,
    # all-to-all operands cut at runtime offsets
    assert {"sort", "case", "dynamic_slice", "all_to_all", "all_gather"} <= _ops(cpu)
    # GPU: the plain two-phase program, the same two collectives
    assert {"all_to_all", "all_gather"} <= _ops(gpu)
    assert not {"sort", "case", "dynamic_slice"} & _ops(gpu), _ops(gpu)


def test_bf16_mean_hlo_of_both_paths(mesh):
    cpu, gpu = _both(_bf16_mean, mesh, N)
    # CPU: bf16 words through an all-to-all and an all-gather (XLA:CPU would sum a bf16
    # all-reduce in f32), the rows cut at runtime offsets
    assert {"all_to_all", "all_gather", "sort"} <= _ops(cpu)
    assert "all_reduce" not in _ops(cpu)
    # GPU: one all-reduce in bf16
    assert "all_reduce" in _ops(gpu) and not {"all_to_all", "sort"} & _ops(gpu)
    assert re.search(r"all_reduce.*\n?.*bf16", gpu)


def test_unpack_hlo_of_both_paths(mesh):
    cpu, gpu = _both(_unpack, mesh, 512)
    assert {"sort", "dynamic_slice"} <= _ops(cpu)  # pieces cut at runtime offsets
    assert "slice" in _ops(gpu) and not {"sort", "dynamic_slice"} & _ops(gpu)


COMPRESSORS = {
    "int8": (lambda: C.int8(), (N,)),
    "int4_ef": (lambda: C.int4(error_feedback=True), (N,)),
    "int8_nearest": (lambda: C.int8(64, stochastic=False), (N,)),
    "bf16": (lambda: C.bf16(), (N,)),
    "fp16": (lambda: C.fp16(), (N,)),
    "topk": (lambda: C.topk(0.1), (N,)),
    "random_k": (lambda: C.random_k(0.5), (N,)),
    "powersgd": (lambda: C.powersgd(rank=2), (64, 64)),
}


def _reduce_fn(name: str):
    """A fresh function (no trace cache shared between switch settings): one device's
    compressed mean of its row, from the compressor's initial state."""
    factory, shape = COMPRESSORS[name]
    comp = factory()

    def fn(x):
        ctx = ReduceContext(AX, "flat", jnp.int32(0), step_key(0, jnp.int32(0)))
        state = comp.init([jax.ShapeDtypeStruct(shape, jnp.float32)])
        out, _ = comp.reduce([x[0].reshape(shape)], state, ctx)
        return out[0].reshape(-1)[None]

    return fn, int(np.prod(shape))


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_gpu_program_holds_no_workaround(mesh, name):
    fn, size = _reduce_fn(name)
    gpu = _lowered(fn, _gpu_mesh(mesh), size, "cuda")
    assert not {"sort", "case"} & _ops(gpu), _ops(gpu)


def test_allreduce_and_after_gpu_programs_are_plain(mesh):
    def fn(x):
        leaves = [x[0, :210].reshape(30, 7), x[0, 210:215], x[0, 215:]]
        out = jaxcomm.allreduce(leaves, algorithm="hierarchical")
        return after(jnp.concatenate([o.reshape(-1) for o in out]), out[0])[None]

    cpu, gpu = _both(fn, mesh, 512)
    assert "sort" in _ops(cpu)  # unpacking offsets and the ordering tie
    assert not {"sort", "case", "dynamic_slice", "bitcast_convert"} & _ops(gpu), _ops(gpu)


def _run(fn, mesh, x):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
    return np.asarray(f(per_device(mesh, x)))


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_gpu_row_on_cpu_gives_the_same_values(mesh, name):
    """The plain program run on the CPU: the same bits, except bf16 (another route)."""
    size = _reduce_fn(name)[1]
    x = np.random.default_rng(0).normal(size=(8, size)).astype(np.float32)
    on = _run(_reduce_fn(name)[0], mesh, x)
    with backend.use(backend.GPU):
        off = _run(_reduce_fn(name)[0], mesh, x)
        plain = _ops(_lowered(_reduce_fn(name)[0], mesh, size, "cpu"))
    assert not {"sort", "case"} & plain, plain
    if name != "bf16":
        np.testing.assert_array_equal(off.view(np.uint32), on.view(np.uint32))
        return
    # Under the GPU row, bf16 is a bf16 all-reduce (which XLA:CPU sums in f32) ...
    assert "all_reduce" in plain
    # ... within bf16's precision of the two-phase mean: the inputs and the result are
    # each rounded to bf16 once (relative error 2**-8 each).
    bound = 2.0**-8 * (np.abs(x).mean(0) + np.abs(x.mean(0))) * 2
    for got in (on, off):
        assert np.all(np.abs(got[0] - x.mean(0)) <= bound)


@pytest.mark.parametrize("fn", [_int8_mean, _unpack], ids=["int8_mean", "unpack"])
def test_gpu_row_on_cpu_helpers_bit_for_bit(mesh, fn):
    x = np.random.default_rng(1).normal(size=(8, N)).astype(np.float32)
    on = _run(fn, mesh, x)
    with backend.use(backend.GPU):
        off = _run(lambda v: fn(v), mesh, x)  # a new function: no shared trace
        assert "sort" not in _ops(_lowered(lambda v: fn(v), mesh, N, "cpu"))  # really plain
    np.testing.assert_array_equal(off.view(np.uint32), on.view(np.uint32))


def test_adaptive_rungs_are_not_materialized_inside_the_switch(mesh):
    """A ``lax.switch`` branch's outputs are buffers already: the int rungs of adaptive
    trace under the row without ``materialize`` (no conditional of their own), a lone
    rung (no switch) under the mesh's row."""

    def lowered(comp):
        def fn(x):
            ctx = ReduceContext(AX, "flat", jnp.int32(0), step_key(0, jnp.int32(0)))
            state = comp.init([jax.ShapeDtypeStruct((N,), jnp.float32)])
            return comp.reduce([x[0]], state, ctx)[0][0][None]

        return _lowered(fn, mesh, N, "cpu")

    def conds(text):
        return len(re.findall(r"stablehlo\.case", text))

    ladder = C.adaptive(0.75, ladder=("int8", "int4"), min_compression=0.7)
    lone = C.adaptive(0.75, ladder=("int8",), min_compression=0.7, max_compression=0.8)
    # the switch, the f32 rung's lax.cond absent, the int8 mean's two materializations
    # (seeds, decode) only without the switch
    assert conds(lowered(ladder)) == 1
    assert conds(lowered(lone)) == 2


def test_gloo_reduce_scatter_check_follows_the_mesh(mesh, monkeypatch):
    """Several processes on a CPU mesh: the reduce-scatter of 'hierarchical' is a ring of
    ppermutes (gloo's own is faulty); on a GPU mesh it stays a reduce-scatter."""
    monkeypatch.setattr(jax, "process_count", lambda *a: 2)

    def fn(x):
        return jaxcomm.collectives.hierarchical_allreduce(x[0], AX)[None]

    cpu, gpu = _both(fn, mesh, 64)
    assert "collective_permute" in _ops(cpu) and "reduce_scatter" not in _ops(cpu)
    assert "reduce_scatter" in _ops(gpu) and "collective_permute" not in _ops(gpu)


def test_runtime_ints_values_and_range():
    got = jax.jit(lambda: backend.runtime_ints([5, 0, 5, 2**31 - 1] + list(range(70))))()
    assert [int(x) for x in got] == [5, 0, 5, 2**31 - 1] + list(range(70))
    assert all(x.dtype == jnp.int32 and x.shape == () for x in got)
    assert backend.runtime_ints([]) == []
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        backend.runtime_ints([-1, 3])


def test_runtime_f32_keeps_the_bits():
    v = np.float32(1) / np.float32(7)
    got = jax.jit(lambda: backend.runtime_f32(v))()
    assert np.asarray(got).view(np.uint32) == v.view(np.uint32)


def test_slices_past_int32_offsets_are_static():
    """No limit below the plain program's: a piece starting past 2**31 is a static slice
    (traced only: the buffer is never allocated)."""
    buf = jax.ShapeDtypeStruct((2**31 + 64,), jnp.int8)
    cuts = [(0, 16), (16, 40), (2**31, 2**31 + 64)]
    jaxpr = jax.make_jaxpr(
        lambda b: backend.slices_at_runtime_offsets([(b, s, e) for s, e in cuts])
    )(buf)
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("dynamic_slice") == 2
    last = [e for e in jaxpr.eqns if e.primitive.name == "slice"][-1]
    assert last.params["start_indices"] == (2**31,)
    assert [v.aval.shape for v in jaxpr.jaxpr.outvars] == [(16,), (24,), (64,)]
