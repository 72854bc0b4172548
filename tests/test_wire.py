"""``jaxcomm.wire_bytes``: nccl-tests bus factors, axes, conditional branches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.hlo import parse_collectives
from jaxcomm.tools.wire import summarize

AX = ("inter", "intra")


def _wire(mesh, body, n=1024, extra=(), taken=None):
    fn = jax.jit(
        jax.shard_map(
            lambda x, *e: body(x[0], *e)[None],
            mesh=mesh,
            in_specs=(P(AX), *[P()] * len(extra)),
            out_specs=P(AX),
            check_vma=False,
        )
    )
    arg = jax.ShapeDtypeStruct((8, n), jnp.float32, sharding=NamedSharding(mesh, P(AX)))
    return jaxcomm.wire_bytes(fn, arg, *extra, taken=taken)


S = 4 * 1024  # bytes of the f32[1024] buffer


@pytest.mark.parametrize(
    "name, body, kind, axis, expected",
    [
        ("psum_all", lambda x: lax.psum(x, AX), "all-reduce", "inter+intra", 2 * 7 / 8 * S),
        ("psum_inter", lambda x: lax.psum(x, "inter"), "all-reduce", "inter", 2 * 1 / 2 * S),
        (
            "reduce_scatter",
            lambda x: jnp.tile(lax.psum_scatter(x, "intra", tiled=True), 4),
            "reduce-scatter",
            "intra",
            3 / 4 * S,
        ),
        (
            "all_gather",
            lambda x: lax.all_gather(x[:256], "intra", tiled=True),
            "all-gather",
            "intra",
            3 / 4 * S,
        ),
        (
            "all_to_all",
            lambda x: lax.all_to_all(x.reshape(8, -1), AX, 0, 0, tiled=True).reshape(-1),
            "all-to-all",
            "inter+intra",
            7 / 8 * S,
        ),
        (
            "permute",
            lambda x: lax.ppermute(x, "intra", [(i, (i + 1) % 4) for i in range(4)]),
            "collective-permute",
            "intra",
            S,
        ),
    ],
)
def test_bus_factors(mesh, name, body, kind, axis, expected):
    wb = _wire(mesh, body)
    assert wb["total"] == pytest.approx(expected), name
    assert wb["by_kind"] == {kind: pytest.approx(expected)}
    assert wb["by_axis"] == {axis: pytest.approx(expected)}
    assert wb["unconditional"] == pytest.approx(expected) and wb["branches"] == {}
    (c,) = wb["collectives"]
    assert c["kind"] == kind and c["dtype"] == "f32" and c["branch"] == ()


def test_conditional_counts_the_largest_branch(mesh):
    def body(x, i):
        x = lax.psum(x, "intra")  # unconditional: 2 * 3/4 * S
        return lax.switch(
            i,
            [
                lambda x: lax.psum(x, AX),  # 2 * 7/8 * S
                lambda x: lax.psum(x[:256], "inter").sum() + x,  # 2 * 1/2 * S/4
                lambda x: x * 2.0,  # nothing
            ],
            x,
        )

    wb = _wire(mesh, body, extra=(jax.ShapeDtypeStruct((), jnp.int32),))
    uncond = 2 * 3 / 4 * S
    assert wb["unconditional"] == pytest.approx(uncond)
    (branches,) = wb["branches"].values()
    assert sorted(branches.values()) == pytest.approx([0.0, 2 * 1 / 2 * S / 4, 2 * 7 / 8 * S])
    assert wb["total"] == pytest.approx(uncond + 2 * 7 / 8 * S)
    assert wb["by_axis"] == {
        "intra": pytest.approx(uncond),
        "inter+intra": pytest.approx(2 * 7 / 8 * S),
    }
    # What leaves one slice of each axis per direction: the psum over all 8 is one group
    # crossing both boundaries; the intra psum is 2 groups (one per inter index) side by
    # side, each crossing the intra boundary.
    assert wb["crossing"] == {
        "inter": pytest.approx(2 * 7 / 8 * S),
        "intra": pytest.approx(2 * uncond + 2 * 7 / 8 * S),
    }
    # The calls that cross (what a transport's per-message framing scales with): the
    # psum over all 8 once per boundary, the intra psum's 2 groups at the intra boundary.
    assert wb["crossing_calls"] == {
        "inter": {"all-reduce/8": 1},
        "intra": {"all-reduce/4": 2, "all-reduce/8": 1},
    }
    in_branch = [c for c in wb["collectives"] if c["branch"]]
    assert len(in_branch) == 2
    # the counted collectives: the unconditional one and the largest branch's
    counted = [c for c in wb["collectives"] if c["counted"]]
    assert sorted(c["axes"] for c in counted) == sorted([("intra",), AX])
    assert wb["num_collectives"] == 2 and wb["conditionals"] == "largest_branch"
    assert wb["operand_bytes"] == pytest.approx(2 * S)
    assert wb["taken"] == {}

    # The branch a run took (an adaptive compressor's level), priced instead of the largest:
    # branch 1's psum of S/4 over 'inter' crosses the inter boundary once per group (4 groups).
    (cond,) = wb["branches"]
    cases = (
        (1, uncond + 2 * 1 / 2 * S / 4, 4 * 2 * 1 / 2 * S / 4),
        (2, uncond, 0.0),
        (0, wb["total"], wb["crossing"]["inter"]),
    )
    for index, total, inter in cases:
        got = _wire(mesh, body, extra=(jax.ShapeDtypeStruct((), jnp.int32),), taken={cond: index})
        assert got["total"] == pytest.approx(total) and got["taken"] == {cond: index}
        assert got["crossing"]["inter"] == pytest.approx(inter)
        calls = {1: {"all-reduce/2": 4}, 2: {}, 0: {"all-reduce/8": 1}}[index]
        assert got["crossing_calls"]["inter"] == calls
        assert got["branches"] == wb["branches"]
    with pytest.raises(ValueError, match="does not have"):
        _wire(mesh, body, extra=(jax.ShapeDtypeStruct((), jnp.int32),), taken={"nope": 0})
    with pytest.raises(ValueError, match=r"has branches \[0, 1, 2\]; give one of them"):
        _wire(mesh, body, extra=(jax.ShapeDtypeStruct((), jnp.int32),), taken={cond: 3})


_ASYNC_HLO = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%b0 (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
}

%b1 (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %sl = f32[256]{0} slice(%p), slice={[0:256]}
  %ags = (f32[256]{0}, f32[1024]{0}) all-gather-start(%sl), replica_groups={{0,1,2,3}}
  ROOT %agd = f32[1024]{0} all-gather-done(%ags)
}

ENTRY %main (x: f32[1024], i: s32[]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %i = s32[] parameter(1)
  %ars = f32[1024]{0} all-reduce-start(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  ROOT %c = f32[1024]{0} conditional(%i, %ard, %ard), branch_computations={%b0, %b1}
}
"""


def test_async_ops_and_branches_from_text():
    """GPU-style async start/done pairs and a conditional, parsed from HLO text."""
    wb = summarize(parse_collectives(_ASYNC_HLO))
    kinds = [(c["kind"], c["branch"]) for c in wb["collectives"]]
    assert kinds == [
        ("all-reduce", (("c", 0),)),
        ("all-gather", (("c", 1),)),
        ("all-reduce", ()),
    ]
    assert wb["unconditional"] == pytest.approx(2 * 1 / 2 * S)
    # branch 1 gathers an f32[1024] from 4 devices: 3/4 * S
    assert wb["branches"] == {"c": {0: pytest.approx(2 * 3 / 4 * S), 1: pytest.approx(3 / 4 * S)}}
    assert wb["total"] == pytest.approx(2 * 1 / 2 * S + 2 * 3 / 4 * S)
    assert np.isclose(sum(wb["by_kind"].values()), wb["total"])


@pytest.mark.parametrize(
    "name, body, inter, intra",
    [
        # one ring over all 8 crosses each boundary once per direction
        ("flat", lambda x: lax.psum(x, AX), 2 * 7 / 8 * S, 2 * 7 / 8 * S),
        # 4 rings over 'inter' side by side (one per intra index) share a node's link
        ("inter only", lambda x: lax.psum(x, "inter"), 4 * S, 0.0),
        # 2 rings over 'intra' (one per node) never leave a node
        ("intra only", lambda x: lax.psum(x, "intra"), 0.0, 2 * 2 * 3 / 4 * S),
        # pairs 0->1 and 4->5 leave the intra slice {0, 4}; none leaves a node
        ("permute", lambda x: lax.ppermute(x, "intra", [(i, (i + 1) % 4) for i in range(4)]),
         0.0, 2 * S),
        # an all-to-all sends 1/8 of S from each device to each other one: the 4 devices
        # of a node send 4 x 4 / 8 S across its link (a ring would carry 7/8 S); the intra
        # slice {0, 4} sends 2 x 6 / 8 S
        ("all-to-all", lambda x: lax.all_to_all(x, AX, 0, 0, tiled=True), 2 * S, 1.5 * S),
        # 4 groups over 'inter' side by side, each sending half of S across
        ("all-to-all inter", lambda x: lax.all_to_all(x, "inter", 0, 0, tiled=True),
         4 * S / 2, 0.0),
    ],
)  # fmt: skip
def test_crossing_bytes_per_slice(mesh, name, body, inter, intra):
    wb = _wire(mesh, body)
    assert wb["crossing"] == {"inter": pytest.approx(inter), "intra": pytest.approx(intra)}, name
