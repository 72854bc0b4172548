"""Collectives keep one order on every device: ``jaxcomm.ordering.after`` and
``jaxcomm.hlo.ordering_hazards`` (XLA:CPU chains collectives only by scheduling edges, so a
collective after a conditional holding collectives may overtake them; see
``jaxcomm/ordering.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, abstract_per_device, sharded
from jax import lax
from jax.sharding import AbstractDevice, NamedSharding

import jaxcomm
from jaxcomm.hlo import ordering_hazards
from jaxcomm.ordering import after

BITS = {
    "f32": np.array([-0.0, 0.0, np.nan, -np.inf, 1e-45, 3.5, -2.25], np.float32),
    "bf16": np.array([-0.0, 1.5, np.nan, -3.0], jnp.bfloat16),
    "f16": np.array([-0.0, 65504.0, np.inf], np.float16),
    "i8": np.array([-128, 0, 127], np.int8),
    "u32": np.array([0, 2**32 - 1, 7], np.uint32),
    "bool": np.array([True, False, True]),
}


@pytest.mark.parametrize("dtype", sorted(BITS))
def test_after_keeps_every_bit(mesh, dtype):
    x = BITS[dtype]
    deps = (jnp.float32(np.nan), jnp.arange(3, dtype=jnp.int8), jnp.array([True]))
    with jax.set_mesh(mesh):  # a CPU mesh: the dependency is added
        f = jax.jit(after)
        assert "sort" in f.trace(x, *deps).lower().as_text()
        got = np.asarray(f(x, *deps))
    assert got.dtype == x.dtype
    assert got.tobytes() == x.tobytes()


def test_after_adds_a_dependency_on_a_cpu_mesh_only(mesh):
    def body(x, d):
        return after(x, d)

    def lowered(m, platform):
        f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(jax.P(AX),) * 2, out_specs=jax.P(AX)))
        args = [jax.ShapeDtypeStruct((8 * k,), np.float32, sharding=NamedSharding(m, jax.P(AX)))
                for k in (4, 3)]  # fmt: skip
        return f.trace(*args).lower(lowering_platforms=(platform,)).as_text()

    gpu = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    cpu_text = lowered(mesh, "cpu")
    gpu_text = lowered(mesh.abstract_mesh.update(abstract_device=gpu), "cuda")
    assert "sort" in cpu_text  # the runtime zero read out of d
    assert "sort" not in gpu_text and "bitcast_convert" not in gpu_text  # the plain program
    assert "sort" not in jax.jit(body).trace(jnp.ones(4), jnp.zeros(3)).lower().as_text()  # no mesh


def _program(mesh, tie: bool):
    """A lax.switch whose branches all-reduce within the node, then an independent
    all-reduce within the node: the second may overtake the first without ``after``."""
    n = 1 << 12

    def body(x, y, k):
        def branch(i):
            def f(x):
                parts = [lax.psum(jnp.cos(x * (i + j + 1.0)), "intra") for j in range(6)]
                return jnp.concatenate([lax.psum(p[: n // 8], "inter") for p in parts])

            return f

        out = lax.switch(k[0] % 2, [branch(0), branch(1)], x[0])
        y = after(y[0], out) if tie else y[0]
        extra = sum(jnp.sin(x[0] * (j + 2.0))[:64].sum() for j in range(12))
        return out[None] + extra, lax.psum(y * 3.0, "intra")[None]

    f = sharded(body, mesh, in_specs=(jax.P(AX),) * 3, out_specs=(jax.P(AX), jax.P(AX)),
                check_vma=False)  # fmt: skip
    args = (abstract_per_device(mesh, (n,)), abstract_per_device(mesh, (n,)),
            abstract_per_device(mesh, (), np.int32))  # fmt: skip
    return f.lower(*args).compile().as_text()


def test_after_removes_the_hazard_of_a_real_program(mesh):
    text = _program(mesh, tie=True)
    assert "conditional" in text
    assert ordering_hazards(text) == []


# Scheduled HLO as XLA:CPU prints it, cut to what the detector reads.
_MODULE = """HloModule m, is_scheduled=true

%branch_a (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %ar.in = f32[8]{{0}} all-reduce(%p), replica_groups={{{{0,1}}}}, to_apply=%add
}}

%branch_b (q: f32[8]) -> f32[8] {{
  ROOT %q = f32[8]{{0}} parameter(0)
}}

ENTRY %main (x: f32[8], y: f32[8], i: s32[]) -> (f32[8], f32[8]) {{
  %x = f32[8]{{0}} parameter(0)
  %y = f32[8]{{0}} parameter(1)
  %i = s32[] parameter(2)
  %cond = f32[8]{{0}} conditional(%i, %x, %x), branch_computations={{%branch_a, %branch_b}}
  {later}
  ROOT %t = (f32[8]{{0}}, f32[8]{{0}}) tuple(%cond, %ar.out)
}}
"""


@pytest.mark.parametrize(
    "later, hazard",
    [
        ("%ar.out = f32[8]{0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%add", True),
        ("%ar.out = f32[8]{0} all-gather(%y), replica_groups={{0,1}}, dimensions={0}", True),
        ("%ar.out = f32[8]{0} all-reduce(%cond), replica_groups={{0,1}}, to_apply=%add", False),
        (
            "%dep = f32[8]{0} add(%cond, %y)\n  %ar.out = f32[8]{0} all-reduce(%dep), "
            "replica_groups={{0,1}}, to_apply=%add",
            False,
        ),
        ("%ar.out = f32[8]{0} add(%y, %y)", False),
    ],
    ids=["independent-all-reduce", "independent-all-gather", "on-result", "transitive", "none"],
)
def test_ordering_hazards_reads_dependencies(later, hazard):
    found = ordering_hazards(_MODULE.format(later=later))
    if hazard:
        assert [(h.control_flow, h.collective) for h in found] == [("cond", "ar.out")]
        assert found[0].computation == "main"
    else:
        assert found == []


def test_ordering_hazards_sees_collectives_nested_in_loops():
    text = _MODULE.format(
        later="%w = f32[8]{0} while(%y), condition=%branch_b, body=%branch_a\n"
        "  %ar.out = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add"
    )
    pairs = {(h.control_flow, h.collective) for h in ordering_hazards(text)}
    assert pairs == {("cond", "w"), ("cond", "ar.out"), ("w", "ar.out")}


@pytest.mark.parametrize(
    "compressor",
    [
        lambda: jaxcomm.compression.adaptive(0.5, adjustment_step=1),
        lambda: jaxcomm.compression.int8(block=32),
        lambda: jaxcomm.compression.powersgd(rank=2),
    ],
    ids=["adaptive", "int8", "powersgd"],
)
@pytest.mark.parametrize("algorithm", ["hierarchical", "ring"])
def test_compressed_sync_then_plain_leaves_keeps_one_order(mesh, compressor, algorithm):
    # The compressed path is a conditional (warm-up decided on the devices, adaptive's
    # rungs) and the plain leaves (biases) are all-reduced after it, tied to everything it
    # computed.
    import optax
    from mlp import mlp_init, mlp_loss

    sync = jaxcomm.sync_gradients(
        algorithm=algorithm, compression=compressor(), compress_stage="inter",
        warmup_steps=1, min_size=64,
    )  # fmt: skip
    dp = jaxcomm.data_parallel(mlp_loss, optax.chain(sync, optax.sgd(0.1)), mesh)
    state = dp.init(mlp_init(jax.random.key(0)))
    batch = {"x": np.zeros((16, 12), np.float32), "y": np.zeros(16, np.int32)}
    # The program whose sync decides the warm-up on the devices (a lax.cond), and the one
    # the step runs in each phase (decided on the host).
    on_device = dp.step_fn(state).lower(state, dp.shard_batch(batch))
    text = on_device.compile().as_text()
    assert "conditional" in text
    assert ordering_hazards(text) == []
    assert ordering_hazards(dp.compile(state, batch).as_text()) == []
