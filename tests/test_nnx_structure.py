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
    adapter = NnxAdapter()
    a, leaves, _, kinds, _ = adapter.split(first)
    assert adapter.split(first).graphdef is a  # the same structure: one object, read once
    # Other objects (their own optimizer transform, static in the graph): another one.
    assert adapter.split(objects(nnx.metrics.Average("loss"))).graphdef is not a
    assert len(kinds) == len(leaves) == len(jax.tree.leaves(nnx.state(first)))
    assert kinds.count(PARAM) == 2 and METRIC in kinds  # kernel, bias; the metric's sums
    train = jaxcomm.nnx_data_parallel(mesh)(step)
    train(*first, batch)
    train(*first, batch)
    assert int(first[2].loss.count[...]) == 2 * 8  # a loss per device per step, summed
    # The same decorator, another structure (a metric that is not a sum and a count).
    with pytest.raises(NotImplementedError, match="Welford"):
        train(*objects(nnx.metrics.Welford("loss")), batch)


class _Three(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
        self.c = nnx.Linear(4, 4, rngs=nnx.Rngs(2))
        self.b = nnx.Linear(4, 3, rngs=nnx.Rngs(3))

    def __call__(self, x):
        return self.b(self.c(self.a(x)))


def _three_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: xent(m(batch["x"]), batch["y"]))(model)
    optimizer.update(model, grads)
    return loss


def _bits(objs):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(objs))]


@pytest.mark.parametrize("change", ["replaced", "shared", "metadata", "type"])
def test_a_warm_step_trains_the_objects_as_they_are_now(mesh, change):
    """Once warm, a call reads the objects' state from their Variables without Flax's
    split (the structure recognised from their pytree flatten). A change between calls is
    seen: a Variable replaced by a new one, a Variable now shared by two layers, a
    Variable's metadata, a Variable's type (a Param made a BatchStat). The step trains the
    objects as they are, bit for bit as a copy of them (nnx.clone: the same sharing)."""
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(16, 4)).astype(np.float32),
        "y": rng.integers(0, 3, 16).astype(np.int32),
    }
    model = _Three()
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train = jaxcomm.nnx_data_parallel(mesh)(_three_step)
    for _ in range(2):
        train(model, optimizer, batch)
    warm = train.engine.adapter.split((model, optimizer))
    assert warm.targets is not None  # read from the Variables, no nnx.split
    old = model.a.kernel
    before = np.asarray(old[...])
    if change == "replaced":
        model.a.kernel = nnx.Param(old[...] + 1.0)
    elif change == "shared":
        model.c.kernel = model.a.kernel  # one Variable in two layers: one param
    elif change == "metadata":
        old.set_metadata("note", "changed")
    else:
        model.b.bias = nnx.BatchStat(model.b.bias[...])  # no longer trained
    twin = nnx.clone((model, optimizer))
    train(model, optimizer, batch)
    train(*twin, batch)
    assert _bits((model, optimizer)) == _bits(twin)
    if change == "replaced":  # the new Variable trained, the old one untouched
        assert np.array_equal(np.asarray(old[...]), before)
        assert not np.array_equal(np.asarray(model.a.kernel[...]), before + 1.0)
    else:  # another structure, as nnx.split's GraphDef says
        assert train.engine.adapter.split((model, optimizer)).graphdef is not warm.graphdef
