"""The ``jax.lax`` seam: only a step given ``axis_name=`` replaces ``jax.lax`` functions
while it traces; every other step leaves the module as JAX made it (checked inside the
user's code, while it traces), and an axis name bound nowhere still gets
``UnboundAxisError`` (the names in scope, the fix), raised from JAX's own error."""

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import lax

import jaxcomm
from jaxcomm.axis_names import UnboundAxisError

# jax.lax as JAX made it, read when this file is imported (before any step traces).
JAX_LAX = dict(vars(lax))


def changed_lax_attributes() -> list[str]:
    """The ``jax.lax`` attributes that differ from JAX's own now (added, removed, other)."""
    now = vars(lax)
    return sorted(k for k in JAX_LAX.keys() | now.keys() if JAX_LAX.get(k) is not now.get(k))


def sync_tx():
    return optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))


def xy(rows=32):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(rows, 5)).astype(np.float32),
        "y": rng.integers(0, 3, rows).astype(np.int32),
    }


class Net(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        if self.axis_name is not None:
            x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x)
        return nn.Dense(3)(x)


def linen_state(axis_name=None):
    model = Net(axis_name)
    variables = model.init(jax.random.key(0), jnp.ones((2, 5)))
    return train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=sync_tx()
    ), variables.get("batch_stats")


def linen_step(seen, mean_over):
    """A Linen step that records the changed ``jax.lax`` attributes while it traces."""

    def step(state, batch):
        seen.append(changed_lax_attributes())

        def loss_fn(p):
            out = state.apply_fn({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": lax.pmean(loss, mean_over)}

    return step


class NnxNet(nnx.Module):
    def __init__(self, rngs, axis_name=None):
        bn = nnx.BatchNorm(3, axis_name=axis_name, rngs=rngs)
        self.layers = nnx.Sequential(nnx.Linear(5, 3, rngs=rngs), bn)

    def __call__(self, x):
        return self.layers(x)


def nnx_step(seen):
    def step(model, optimizer, batch):
        seen.append(changed_lax_attributes())

        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    return step


def nnx_objects(axis_name=None):
    model = NnxNet(nnx.Rngs(0), axis_name=axis_name)
    return model, nnx.Optimizer(model, sync_tx(), wrt=nnx.Param)


# -- jax.lax untouched outside axis_name= steps ----------------------------------------


def test_a_data_parallel_step_leaves_jax_lax_as_jax_made_it(mesh):
    seen = []

    def loss_fn(params, batch):
        seen.append(changed_lax_attributes())
        return jnp.mean((batch["x"] @ params["w"]) ** 2)

    dp = jaxcomm.data_parallel(loss_fn, sync_tx(), mesh)
    state, _ = dp(dp.init({"w": jnp.ones((5, 3))}), xy())
    assert seen and seen == [[]] * len(seen), seen
    assert np.all(np.isfinite(np.asarray(state.params["w"])))


@pytest.mark.parametrize("axis_name", [None, "batch"], ids=["without", "with_axis_name"])
def test_a_linen_step_replaces_jax_lax_only_with_axis_name(mesh, axis_name):
    """Without ``axis_name=``: nothing replaced while the step traces. With it: the
    collectives and axis queries are the step's (the check above can fail), and JAX's own
    again after the step."""
    seen = []
    state, _ = linen_state()
    mean_over = ("inter", "intra") if axis_name is None else axis_name
    p = jaxcomm.linen_data_parallel(mesh, axis_name=axis_name)(linen_step(seen, mean_over))
    _, metrics = p(state, xy())
    assert np.isfinite(float(metrics["loss"]))
    assert seen
    if axis_name is None:
        assert seen == [[]] * len(seen), seen
    else:
        assert all({"pmean", "psum", "axis_index"} <= set(s) for s in seen), seen
    assert changed_lax_attributes() == []


def test_an_nnx_step_without_axis_name_leaves_jax_lax_as_jax_made_it(mesh):
    seen = []
    model, optimizer = nnx_objects()
    jaxcomm.nnx_data_parallel(mesh)(nnx_step(seen))(model, optimizer, xy())
    assert seen and seen == [[]] * len(seen), seen


# -- an unbound name: JAX's error, named at the step's boundary ---------------------


@pytest.mark.parametrize(
    "collective, jax_error",
    [
        (lambda v: lax.pmean(v, "batch"), AssertionError),  # shard_map's replication check
        (lambda v: lax.all_gather(v, "batch").sum(), NameError),
        (lambda v: v + lax.axis_index("batch"), NameError),
    ],
    ids=["pmean", "all_gather", "axis_index"],
)
def test_an_unbound_name_in_a_data_parallel_loss_is_named_with_the_fix(mesh, collective, jax_error):
    def loss_fn(params, batch):
        return collective(jnp.mean((batch["x"] @ params["w"]) ** 2))

    dp = jaxcomm.data_parallel(loss_fn, sync_tx(), mesh)
    with pytest.raises(UnboundAxisError) as e:
        dp(dp.init({"w": jnp.ones((5, 3))}), xy())
    message = str(e.value)
    assert "data_parallel: axis name 'batch' is not bound" in message
    assert "the names in scope are ['inter', 'intra']" in message
    assert "pmap_data_parallel(mesh, axis_name='batch')" in message  # the fix
    assert e.value.name == "batch"
    assert type(e.value.__cause__) is jax_error  # JAX's own error, chained


def test_an_unbound_name_in_an_nnx_layer_is_named_with_the_decorators_fix(mesh):
    """``nnx.BatchNorm(axis_name='batch')`` (Flax's own ``lax.pmean``) in a step without
    ``axis_name=``: JAX's bare AssertionError, named."""
    model, optimizer = nnx_objects(axis_name="batch")
    with pytest.raises(UnboundAxisError, match=r"nnx_data_parallel: axis name 'batch'") as e:
        jaxcomm.nnx_data_parallel(mesh)(nnx_step([]))(model, optimizer, xy())
    assert "jaxcomm.nnx_data_parallel(mesh, axis_name='batch')" in str(e.value)
    assert isinstance(e.value.__cause__, AssertionError)
    assert changed_lax_attributes() == []


def test_a_collective_imported_by_name_is_named_as_jaxs_own(mesh):
    """``from jax.lax import pmean`` before the step: JAX's function, which the step's
    ``axis_name=`` cannot see; the error says to call it through ``lax``."""
    from jax.lax import pmean

    state, _ = linen_state()
    p = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(
        lambda s, b: (s, {"n": pmean(jnp.mean(b["x"]), "batch")})
    )
    with pytest.raises(UnboundAxisError, match=r"imported by name.*call it as lax.pmean"):
        p(state, xy())


def test_another_error_of_the_users_code_is_not_renamed(mesh):
    def loss_fn(params, batch):
        assert batch["x"].shape[0] == 1, "the user's own check"
        return jnp.mean(params["w"])

    dp = jaxcomm.data_parallel(loss_fn, sync_tx(), mesh)
    with pytest.raises(AssertionError, match="the user's own check") as e:
        dp(dp.init({"w": jnp.ones((5, 3))}), xy())
    assert not isinstance(e.value, UnboundAxisError)


def test_no_module_of_jaxcomm_imports_jax_internals():
    root = Path(jaxcomm.__file__).parent
    found = [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if re.search(r"^\s*(from|import) jax\._src", path.read_text(), re.M)
    ]
    assert found == []
