"""The NNX decorator reads what depends on the objects' structure (each state leaf's kind,
the metric check) once per structure: a new structure is read and checked again."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcomm
from jaxcomm.flax_step import METRIC, PARAM
from jaxcomm.nnx import NnxAdapter


def objects(metric):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.MultiMetric(loss=metric)


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def step(model, optimizer, metrics, batch):
    loss, grads = nnx.value_and_grad(lambda m: xent(m(batch["x"]), batch["y"]))(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)


def test_a_structure_is_read_once_and_a_new_one_is_checked(mesh):
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(16, 4)).astype(np.float32),
        "y": rng.integers(0, 3, 16).astype(np.int32),
    }
    first = objects(nnx.metrics.Average("loss"))
    a, state, kinds = NnxAdapter.split(first)
    assert NnxAdapter.split(first)[0] is a  # the same structure: one object, read once
    # Other objects (their own optimizer transform, static in the graph): another one.
    assert NnxAdapter.split(objects(nnx.metrics.Average("loss")))[0] is not a
    assert len(kinds) == len(jax.tree.leaves(state))
    assert kinds.count(PARAM) == 2 and METRIC in kinds  # kernel, bias; the metric's sums
    train = jaxcomm.nnx_data_parallel(mesh)(step)
    train(*first, batch)
    train(*first, batch)
    assert int(first[2].loss.count[...]) == 2 * 8  # a loss per device per step, summed
    # The same decorator, another structure (a metric that is not a sum and a count).
    with pytest.raises(NotImplementedError, match="Welford"):
        train(*objects(nnx.metrics.Welford("loss")), batch)
