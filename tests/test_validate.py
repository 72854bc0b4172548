"""One integer check for every public constructor: numpy integers in, bools and floats out,
one message shape ``NAME=VALUE must be an integer >= MIN (got TYPE)``."""

import re

import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm import compression as C
from jaxcomm import topology as T
from jaxcomm import xla
from jaxcomm.tools import testbed
from jaxcomm.validate import check_int


def _loss(p, batch):
    return (p["w"] * batch).sum()


def _dp(mesh, microbatches):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    return jaxcomm.data_parallel(_loss, tx, mesh, microbatches=microbatches)


# (id, make(value), the name in the message, a valid value, the minimum)
CASES = [
    ("warmup_steps", lambda v, m: jaxcomm.sync_gradients(warmup_steps=v), "warmup_steps", 5, 0),
    ("min_size", lambda v, m: jaxcomm.sync_gradients(min_size=v), "min_size", 1024, 0),
    ("seed", lambda v, m: jaxcomm.sync_gradients(seed=v), "seed", 3, 0),
    (
        "bucket_bytes",
        lambda v, m: jaxcomm.sync_gradients(bucket_bytes=(v, 1 << 30)),
        "bucket_bytes[0]",
        1 << 20,
        1,
    ),
    ("int8.block", lambda v, m: C.int8(block=v), "block", 256, 1),
    ("int4.block", lambda v, m: C.int4(block=v), "block", 256, 1),
    ("powersgd.rank", lambda v, m: C.powersgd(rank=v), "rank", 4, 1),
    ("adaptive.step", lambda v, m: C.adaptive(adjustment_step=v), "adjustment_step", 10, 1),
    ("adaptive.cooldown", lambda v, m: C.adaptive(cooldown=v), "cooldown", 3, 0),
    ("adaptive.block", lambda v, m: C.adaptive(block=v), "block", 256, 2),
    ("adaptive.sketch", lambda v, m: C.adaptive(sketch_size=v), "sketch_size", 1021, 16),
    ("make_mesh.intra", lambda v, m: jaxcomm.make_mesh(intra=v), "intra", 4, 1),
    ("microbatches", lambda v, m: _dp(m, v), "microbatches", 2, 1),
    ("fat_tree.nodes", lambda v, m: T.fat_tree(nodes=v), "nodes", 16, 1),
    ("fat_tree.npl", lambda v, m: T.fat_tree(16, nodes_per_leaf=v), "nodes_per_leaf", 4, 1),
    ("fat_tree.lpp", lambda v, m: T.fat_tree(16, leaves_per_pod=v), "leaves_per_pod", 2, 1),
    (
        "fat_tree.devices",
        lambda v, m: T.fat_tree(16, devices_per_node=v),
        "devices_per_node",
        8,
        1,
    ),
    ("dgx_h100.nodes", lambda v, m: T.dgx_h100(v), "nodes", 64, 1),
    ("cpu_local.nodes", lambda v, m: T.cpu_local(nodes=v), "nodes", 2, 1),
    ("with_nodes", lambda v, m: T.fat_tree(16).with_nodes(v), "nodes", 16, 1),
    ("Level.size", lambda v, m: T.Level("node", v, 1e9, 1e-6), "Level 'node': size", 8, 1),
    ("log_interval", lambda v, m: jaxcomm.CommProfiler(log_interval=v), "log_interval", 10, 1),
    ("combine", lambda v, m: xla.combine_options(all_reduce=v), "all_reduce", 1 << 20, 0),
    ("max_count", lambda v, m: xla.combine_options(max_count=v), "max_count", 8, 1),
    ("testbed.nodes", lambda v, m: testbed.Testbed(nodes=v), "nodes", 3, 2),
]
IDS = [c[0] for c in CASES]


def _message(name, value, minimum):
    allowed = rf"(>= {minimum}|in \[{minimum}, \d+\])"
    got = type(value).__name__
    return (
        rf"^{re.escape(name)}={re.escape(repr(value))} must be an integer {allowed} \(got {got}\)"
    )


@pytest.mark.parametrize("_, make, name, ok, minimum", CASES, ids=IDS)
def test_numpy_integers_accepted(mesh, _, make, name, ok, minimum):
    for v in (ok, np.int32(ok), np.int64(ok)):
        make(v, mesh)


@pytest.mark.parametrize("_, make, name, ok, minimum", CASES, ids=IDS)
@pytest.mark.parametrize("bad", [True, False, 2.0, "below"])
def test_bools_floats_and_small_values_refused(mesh, _, make, name, ok, minimum, bad):
    value = minimum - 1 if bad == "below" else bad
    with pytest.raises(ValueError, match=_message(name, value, minimum)):
        make(value, mesh)


def test_check_int_message_and_return():
    assert check_int("n", np.int16(7), minimum=0, maximum=9) == 7
    assert type(check_int("n", np.int64(7))) is int
    with pytest.raises(
        ValueError, match=r"^n=10 must be an integer in \[0, 9\] \(got int\); fix\.$"
    ):
        check_int("n", 10, minimum=0, maximum=9, fix="fix")
    with pytest.raises(ValueError, match=r"^n=np.True_ must be an integer \(got bool\)\.$"):
        check_int("n", np.bool_(True))
    with pytest.raises(ValueError, match=r"^n='3' must be an integer <= 5 \(got str\)\.$"):
        check_int("n", "3", maximum=5)


def test_check_choice_names_the_value_and_the_allowed_set():
    from jaxcomm.validate import check_choice

    assert check_choice("op", "sum", ("mean", "sum")) == "sum"
    with pytest.raises(ValueError, match=r"op='avg' must be one of \('mean', 'sum'\)"):
        check_choice("op", "avg", ("mean", "sum"))
    with pytest.raises(ValueError, match=r"must be one of"):
        check_choice("op", ["mean"], ("mean", "sum"))  # unhashable


def test_outputs_marker_refuses_an_unknown_op():
    from jaxcomm.outputs import OPS, Reduced

    with pytest.raises(ValueError, match=r"op='avg' must be one of \('mean', 'sum', 'max'"):
        Reduced(1.0, "avg")
    assert Reduced(1.0, "max").op in OPS
