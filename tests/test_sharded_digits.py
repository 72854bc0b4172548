"""Quality guard of sharded optimizer state: the digits MLP (300 steps, 8 devices) with
compressed gradients and param gathers within 0.5 points of f32 data parallelism, in
the mean over three seeds (one seed's test set moves in steps of 0.28 points, one
example: a single seed's gap is noise at this bound)."""

import numpy as np
import pytest

import jaxcomm
from experiments.bench.digits import digits_accuracy

C = jaxcomm.compression
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def baseline(mesh):
    runs = [digits_accuracy(None, steps=300, seed=s, mesh=mesh) for s in SEEDS]
    assert min(r["accuracy"] for r in runs) > 0.95  # the task is learnt at all
    return float(np.mean([r["accuracy"] for r in runs]))


@pytest.mark.parametrize(
    "grads, params", [(C.int8, C.bf16), (C.int4, C.bf16)], ids=["int8-bf16", "int4-bf16"]
)
def test_accuracy_within_half_a_point(mesh, baseline, grads, params):
    runs = [
        digits_accuracy(
            {"compression": grads()},
            steps=300,
            seed=s,
            mesh=mesh,
            dp_kwargs={"shard_optimizer": True, "param_gather": params()},
        )
        for s in SEEDS
    ]
    accuracy = float(np.mean([r["accuracy"] for r in runs]))
    assert accuracy >= baseline - 0.005, (accuracy, baseline)
    assert max(r["final_loss"] for r in runs) < 0.1
