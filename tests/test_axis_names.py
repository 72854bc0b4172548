"""``jaxcomm.axis_names``: a step's ``axis_name=`` is the tracing thread's own, and a name
that a transformation inside the step binds is JAX's (shadowing)."""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax import lax

import jaxcomm

# How long a thread waits for the other; the wait that must not time out returns at once
# when the code is right (the other thread only runs a small pmap).
WAIT_S = 60


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def make_state():
    model = Net()
    params = model.init(jax.random.key(0), jnp.ones((2, 5)))["params"]
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def batch():
    return {"x": np.ones((32, 5), np.float32), "y": np.zeros((32,), np.int32)}


def linen_step(extra):
    """A pmap-style Linen step whose metrics add ``extra()`` (traced inside the step)."""

    def step(state, batch):
        def loss_fn(p):
            out = state.apply_fn({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": lax.pmean(loss, "batch"), **extra()}

    return step


def test_a_vmap_inside_the_step_shadows_the_steps_axis_name(mesh):
    """``jax.vmap(..., axis_name='batch')`` inside a step bound to ``'batch'``: the vmap's
    ``'batch'`` is its own 3 entries, as it would be under ``jax.pmap``."""

    def inner():
        per = jax.vmap(
            lambda v: (lax.psum(1, "batch"), lax.axis_index("batch"), lax.axis_size("batch")),
            axis_name="batch",
        )
        total, index, size = per(jnp.ones(3))
        # and the step's own 'batch' outside the vmap: the 8 devices
        return {"total": total, "index": index, "size": size, "devices": lax.psum(1, "batch")}

    p = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(linen_step(inner))
    _, metrics = p(make_state(), batch())
    np.testing.assert_array_equal(np.asarray(metrics["total"]), [3, 3, 3])
    np.testing.assert_array_equal(np.asarray(metrics["index"]), [0, 1, 2])
    np.testing.assert_array_equal(np.asarray(metrics["size"]), [3, 3, 3])
    assert int(metrics["devices"]) == 8


def test_a_collective_over_a_vmap_axis_inside_the_step_is_refused_by_name(mesh):
    """JAX 0.10.2 cannot reduce a value over a vmap axis inside shard_map(check_vma=True)
    (a bare AssertionError): the shadowed ``'batch'`` is named with the fix, and never
    summed over the devices instead."""

    def inner():
        return {"total": jax.vmap(lambda v: lax.psum(v, "batch"), axis_name="batch")(jnp.ones(3))}

    p = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(linen_step(inner))
    with pytest.raises(NotImplementedError, match=r"lax.psum over 'batch'.*outside the") as e:
        p(make_state(), batch())
    assert isinstance(e.value.__cause__, AssertionError)


def test_another_threads_collectives_are_jaxs_while_a_step_traces(mesh):
    """While a step bound to ``'batch'`` traces in one thread (held open inside the step),
    another thread's own ``jax.pmap(..., axis_name='batch')`` sums over its own devices,
    its shard_map over the mesh gets JAX's own error for ``'batch'`` (the step's alias
    does not leak to it), and its own jaxcomm step traces meanwhile with its own names."""
    tracing, other_done = threading.Event(), threading.Event()
    seen: dict = {}

    def hold():
        tracing.set()
        seen["released"] = other_done.wait(WAIT_S)
        return {}

    def run_step():
        try:
            p = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(linen_step(hold))
            seen["loss"] = float(p(make_state(), batch())[1]["loss"])
        except BaseException as e:  # reported by the main thread
            seen["step_error"] = e
            tracing.set()

    t = threading.Thread(target=run_step)
    t.start()
    try:
        assert tracing.wait(WAIT_S) and "step_error" not in seen, seen
        # A plain pmap of the other thread's own: 'batch' is pmap's, over 4 devices.
        out = jax.pmap(lambda x: lax.psum(x, "batch"), axis_name="batch")(jnp.ones(4))
        np.testing.assert_array_equal(np.asarray(out), [4.0, 4.0, 4.0, 4.0])
        # 'batch' bound nowhere in this thread: JAX's own error, not the step's mapping.
        psum_batch = jax.jit(
            jax.shard_map(
                lambda x: lax.psum(x, "batch"),
                mesh=mesh,
                in_specs=jax.P(),
                out_specs=jax.P(),
            )
        )
        with pytest.raises((NameError, AssertionError)) as e:
            psum_batch(jnp.ones(8))
        assert not isinstance(e.value, jaxcomm.axis_names.UnboundAxisError), e.value

        # This thread's own jaxcomm step, without axis_name=: 'batch' is unbound in it.
        def loss_fn(params, b):
            return lax.pmean(jnp.mean((b["x"] @ params["w"]) ** 2), "batch")

        tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
        dp = jaxcomm.data_parallel(loss_fn, tx, mesh)
        with pytest.raises(jaxcomm.axis_names.UnboundAxisError, match="'batch' is not bound"):
            dp(dp.init({"w": jnp.ones((5, 3))}), {"x": np.ones((32, 5), np.float32)})
    finally:
        other_done.set()
        t.join(WAIT_S)
    assert not t.is_alive()
    assert "step_error" not in seen, seen["step_error"]
    assert seen["released"], "the step's trace was not held while the other thread ran"
    assert np.isfinite(seen["loss"])
    assert not jaxcomm.axis_names.active()
    # no step traces any more: jax.lax holds JAX's own functions again
    assert not any(hasattr(getattr(lax, f), "__wrapped__") for f in ("psum", "axis_index"))
