"""The steady-state step holds no conditional for the warm-up: the host decides the phase
from the sync count (``jaxcomm.warmup.WarmupClock``) and runs one program per phase."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal

import jaxcomm

C = jaxcomm.compression
COMPRESSORS = {
    "int8": lambda: C.int8(),
    "int4": lambda: C.int4(),
    "topk": lambda: C.topk(0.1),
    "bf16": lambda: C.bf16(),
}


def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(32, 64)).astype(np.float32),
        "y": rng.normal(size=(32, 10)).astype(np.float32),
    }


def build(mesh, compression, warmup_steps=0):
    sync = jaxcomm.sync_gradients(compression=compression, min_size=0, warmup_steps=warmup_steps)
    dp = jaxcomm.data_parallel(loss_fn, optax.chain(sync, optax.sgd(0.1)), mesh)
    return dp, dp.init({"w": jnp.ones((64, 10)) * 0.01})


def conditionals(dp, state) -> int:
    """``conditional`` instructions in the program the step runs from ``state``."""
    return len(re.findall(r"\bconditional\(", dp.lower(state, batch()).compile().as_text()))


def bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_warmup_adds_no_conditional_to_either_phase(mesh, name):
    plain, plain_state = build(mesh, None)
    steady, steady_state = build(mesh, COMPRESSORS[name]())
    dp, state = build(mesh, COMPRESSORS[name](), warmup_steps=2)
    assert conditionals(dp, state) == conditionals(plain, plain_state)  # warm: uncompressed
    for _ in range(2):
        state, _ = dp(state, batch())
    assert conditionals(dp, state) == conditionals(steady, steady_state)  # as without warm-up


def test_host_phases_equal_the_devices_decision_bit_for_bit(mesh):
    """Four steps through the two programs equal four steps of the one program whose sync
    decides with a lax.cond; a state from before the warm-up's end, passed again, runs the
    warm-up program again (the clock reads the count)."""
    dp, s0 = build(mesh, C.int8(), warmup_steps=2)
    on_device = dp.step_fn(s0, warming_up=None)
    a = b = s0
    firsts = []
    for i in range(4):
        a, _ = dp(a, batch(i))
        b, _ = on_device(b, dp.shard_batch(batch(i)))
        assert bits(a) == bits(b), f"step {i}"
        assert assert_replicas_equal(a) > 0
        firsts.append(a)
    again, _ = dp(s0, batch(0))  # count 0 again: uncompressed
    assert bits(again) == bits(firsts[0])


@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_flax_front_ends_run_one_program_per_phase(mesh, front):
    """The Flax decorators decide the warm-up on the host too: after it, the program they
    run holds no more conditionals than the same sync's without warm-up."""
    from flax import nnx
    from flax.training import train_state

    def tx(warmup_steps):
        sync = jaxcomm.sync_gradients(compression=C.int8(), min_size=0, warmup_steps=warmup_steps)
        return optax.chain(sync, optax.sgd(0.1))

    if front == "linen":

        def step(state, b):
            grads = jax.grad(loss_fn)(state.params, b)
            return state.apply_gradients(grads=grads), {}

        def make(warmup_steps):
            params = {"w": jnp.ones((64, 10)) * 0.01}
            state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx(warmup_steps))
            return jaxcomm.linen_data_parallel(mesh)(step), (state,)

        def run(fn, args, b):
            state, _ = fn(*args, b)
            return (state,)

    else:

        def step(model, optimizer, b):
            def loss(m):
                return jnp.mean((m(b["x"]) - b["y"]) ** 2)

            grads = nnx.grad(loss)(model)
            optimizer.update(model, grads)

        def make(warmup_steps):
            model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
            opt = nnx.Optimizer(model, tx(warmup_steps), wrt=nnx.Param)
            return jaxcomm.nnx_data_parallel(mesh)(step), (model, opt)

        def run(fn, args, b):
            fn(*args, b)
            return args

    def count(fn, args):
        text = fn.compile(*args, batch()).as_text()
        return len(re.findall(r"\bconditional\(", text))

    steady_fn, steady_args = make(0)
    run(steady_fn, steady_args, batch())
    fn, args = make(2)
    for i in range(3):
        args = run(fn, args, batch(i))
    assert count(fn, args) == count(steady_fn, steady_args)
