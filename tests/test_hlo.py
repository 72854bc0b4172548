"""The compiled HLO holds the collectives each algorithm promises."""

from helpers import abstract_per_device, sharded

import jaxcomm
from jaxcomm.hlo import parse_replica_groups

AXES = ("inter", "intra")


def _module(mesh, algorithm, n=1000):
    f = sharded(lambda x: jaxcomm.allreduce(x[0], algorithm=algorithm, op="sum"), mesh)
    return jaxcomm.hlo.collectives(f, abstract_per_device(mesh, (n,)), mesh=mesh)


def test_hierarchical_hlo_stages(mesh):
    mod = _module(mesh, "hierarchical", n=100_003)
    kinds = [(c.kind, c.axes) for c in mod.collectives]
    assert kinds == [
        ("reduce-scatter", ("intra",)),
        ("all-reduce", ("inter",)),
        ("all-gather", ("intra",)),
    ]
    rs, ar, ag = mod.collectives
    assert rs.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert set(ar.replica_groups) == {(0, 4), (1, 5), (2, 6), (3, 7)}
    padded = 100_004  # next multiple of 4
    assert rs.operand_elements == padded and rs.result_elements == padded // 4
    assert ar.operand_elements == padded // 4  # the inter stage moves 1/intra of the data
    assert ag.result_elements == padded and ag.dtype == "f32"


def test_flat_hlo_is_one_allreduce_over_both_axes(mesh):
    mod = _module(mesh, "flat")
    assert [(c.kind, c.axes, c.operand_elements) for c in mod.collectives] == [
        ("all-reduce", ("inter", "intra"), 1000)
    ]


def test_replica_group_formats():
    assert parse_replica_groups("{{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert parse_replica_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert parse_replica_groups("{}", 4) == ((0, 1, 2, 3),)
