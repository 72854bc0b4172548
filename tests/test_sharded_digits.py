"""Quality guard of sharded optimizer state: the digits MLP (300 steps, 8 devices) with
compressed gradients and param gathers within 0.5 points of f32 data parallelism."""

import pytest

import jaxcomm
from experiments.bench.digits import digits_accuracy

C = jaxcomm.compression


@pytest.fixture(scope="module")
def baseline(mesh):
    r = digits_accuracy(None, steps=300, seed=0, mesh=mesh)
    assert r["accuracy"] > 0.95  # the task is learnt at all
    return r


@pytest.mark.parametrize(
    "grads, params", [(C.int8, C.bf16), (C.int4, C.bf16)], ids=["int8-bf16", "int4-bf16"]
)
def test_accuracy_within_half_a_point(mesh, baseline, grads, params):
    dp_kwargs = {"shard_optimizer": True, "param_gather": params()}
    r = digits_accuracy({"compression": grads()}, steps=300, seed=0, mesh=mesh, dp_kwargs=dp_kwargs)
    assert r["accuracy"] >= baseline["accuracy"] - 0.005, (r["accuracy"], baseline["accuracy"])
    assert r["final_loss"] < 0.1
