"""The steady-state step holds no conditional: the host decides the warm-up phase, local
SGD's branch and an adaptive compressor's rung from values every process shares
(``jaxcomm.phase_clock.PhaseClock``) and runs one program per phase, bit for bit as the
program that decides on the devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal

import jaxcomm
from jaxcomm import backend

C = jaxcomm.compression


def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] + p.get("b", 0.0) - b["y"]) ** 2)


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


def decisions(text: str) -> int:
    """``conditional`` s of compiled HLO text but the CPU row's materialising ones
    (``jaxcomm.hlo.is_materializing``: no decision, and no round trip)."""
    lines = [line for line in text.splitlines() if re.search(r"\bconditional\(", line)]
    return sum(not jaxcomm.hlo.is_materializing(line) for line in lines)


def bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def ladder(stage="all"):
    """An adaptive compressor that visits every rung within a few windows of 2 steps
    (its error band is narrow: int4 steps back down)."""
    c = C.adaptive(0.0, min_compression=0.0, max_compression=1.0, adjustment_step=2,
                   ladder=("f32", "bf16", "int8", "int4"), block=64, stochastic=False,
                   error_low=0.02, error_high=0.05, cooldown=1)  # fmt: skip
    return {"compression": c, "compress_stage": stage}


#: Every option of the sync and the step: (sync_gradients keyword arguments, or None for
#: local SGD; data_parallel's, or local_sgd's).
OPTIONS = {
    "flat": ({"algorithm": "flat"}, {}),
    "hierarchical": ({}, {}),
    "bf16": ({"compression": C.bf16()}, {}),
    "fp16": ({"compression": C.fp16()}, {}),
    "int8": ({"compression": C.int8()}, {}),
    "int4": ({"compression": C.int4()}, {}),
    "topk": ({"compression": C.topk(0.1)}, {}),
    "powersgd": ({"compression": C.powersgd(rank=2)}, {}),
    "adaptive": (ladder(), {}),
    "adaptive inter": (ladder("inter"), {}),
    "warm-up": ({"compression": C.int8(), "warmup_steps": 2}, {}),
    "buckets": ({"bucket_bytes": (512, 1024)}, {}),
    "microbatches": ({"compression": C.int8()}, {"microbatches": 2}),
    "sharded": ({"compression": C.int8()}, {"shard_optimizer": True}),
    "local_sgd": (None, {}),
    "local_sgd fragments": (None, {"fragments": 2}),
}


def build_option(mesh, name):
    sync, kw = OPTIONS[name]
    if sync is None:
        tx = jaxcomm.local_sgd(optax.sgd(0.1), sync_every=3, **kw)
        kw = {}
    else:
        size = {} if "shard_optimizer" in kw else {"min_size": 0}
        tx = optax.chain(jaxcomm.sync_gradients(**size, **sync), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(loss_fn, tx, mesh, **kw)
    return dp, dp.init({"w": jnp.ones((64, 10)) * 0.01, "b": jnp.zeros((10,))})


@pytest.mark.parametrize(
    "name", [n for n in OPTIONS if n not in ("adaptive inter", "local_sgd fragments")]
)
def test_steady_state_program_holds_no_decision(mesh, name):
    """After 3 steps (the warm-up's end, a local SGD period, an adaptive window) the
    program the step runs holds no conditional but the CPU row's buffers; traced under
    the GPU row (the program a GPU compiles), none at all."""
    dp, state = build_option(mesh, name)
    for i in range(3):
        state, _ = dp(state, batch(i))
    assert decisions(dp.lower(state, batch()).compile().as_text()) == 0
    with backend.use(backend.GPU):
        text = dp.lower(state, batch()).compile().as_text()
    assert len(re.findall(r"\bconditional\(", text)) == 0
    if name == "adaptive":
        # The program that decides on the devices has its conditionals: the test reads
        # the programs it means to.
        on_device = dp.step_fn(state).lower(state, dp.shard_batch(batch())).compile()
        assert decisions(on_device.as_text()) > 0


def test_host_phases_equal_the_devices_decision_bit_for_bit(mesh):
    """Four steps through the two programs equal four steps of the one program whose sync
    decides with a lax.cond; a state from before the warm-up's end, passed again, runs the
    warm-up program again (the clock reads the count)."""
    dp, s0 = build(mesh, C.int8(), warmup_steps=2)
    on_device = dp.step_fn(s0)
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


@pytest.mark.parametrize("name", ["adaptive", "adaptive inter", "local_sgd fragments"])
def test_host_choices_equal_the_devices_bit_for_bit(mesh, name):
    """Twelve steps through the programs the host picks (adaptive: every rung and a step
    back down; local SGD: both fragments' syncs and the steps between) equal twelve
    steps of the one program that decides on the devices: adaptive bit for bit; local
    SGD within f32 rounding (its outer optimizer, no longer a switch branch, fuses with
    its neighbours: XLA:CPU may contract a multiply-add differently). A state from the
    middle, passed again, resumes there (the clock reads the state)."""
    dp, s0 = build_option(mesh, name)
    on_device = dp.step_fn(s0)
    a = b = s0
    seen, states = [], []
    for i in range(12):
        a, _ = dp(a, batch(i))
        b, _ = on_device(b, dp.shard_batch(batch(i)))
        if name.startswith("adaptive"):
            assert bits(a) == bits(b), f"step {i}"
        else:
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-8, err_msg=f"step {i}")
        if name.startswith("adaptive"):
            seen.append(int(C.adaptive_states(a.opt_state)[0].level))
        else:  # params move on sync steps only
            seen.append(bits(a.params) != bits(states[-1].params if states else s0.params))
        states.append(a)
    assert assert_replicas_equal(a) > 0
    if name.startswith("adaptive"):
        assert set(seen) == {0, 1, 2, 3} and seen[-1] < max(seen), seen  # up, then down
    else:
        assert 0 < sum(seen) < len(seen), seen
    again, _ = dp(states[6], batch(7))
    assert bits(again) == bits(states[7])


@pytest.mark.parametrize("option", ["warm-up", "adaptive"])
@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_flax_front_ends_run_one_program_per_phase(mesh, front, option):
    """The Flax decorators decide on the host too: after the warm-up (int8 with
    ``warmup_steps=2``) or while adaptive climbs its ladder, the program they run holds
    no decision."""
    from flax import nnx
    from flax.training import train_state

    sync = OPTIONS[option][0]
    tx = optax.chain(jaxcomm.sync_gradients(min_size=0, **sync), optax.sgd(0.1))

    if front == "linen":

        def step(state, b):
            grads = jax.grad(loss_fn)(state.params, b)
            return state.apply_gradients(grads=grads), {}

        params = {"w": jnp.ones((64, 10)) * 0.01}
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        fn, args = jaxcomm.linen_data_parallel(mesh)(step), (state,)

        def run(args, b):
            state, _ = fn(*args, b)
            return (state,)

        def level(args):
            return int(C.adaptive_states(args[0].opt_state)[0].level)

    else:

        def step(model, optimizer, b):
            def loss(m):
                return jnp.mean((m(b["x"]) - b["y"]) ** 2)

            grads = nnx.grad(loss)(model)
            optimizer.update(model, grads)

        model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        fn, args = jaxcomm.nnx_data_parallel(mesh)(step), (model, opt)

        def run(args, b):
            fn(*args, b)
            return args

        def level(args):  # the rung's leaf in the optimizer's nnx state
            flat = jax.tree_util.tree_flatten_with_path(nnx.state(args[1]))[0]
            (x,) = [x for path, x in flat if "level" in jax.tree_util.keystr(path)]
            return int(x)

    for i in range(5):
        args = run(args, batch(i))
    assert decisions(fn.compile(*args, batch()).as_text()) == 0
    if option == "adaptive":  # it climbed: the host's choices changed on the way
        assert level(args) > 0


def test_a_phase_that_is_not_a_host_phase_is_refused(mesh):
    dp, state = build_option(mesh, "warm-up")
    with pytest.raises(TypeError, match=r"phase=False is not a jaxcomm.HostPhase.*HostPhase\(\)"):
        dp.compile(state, batch(), phase=False)
    with pytest.raises(TypeError, match=r"phase='warm' is not a jaxcomm.HostPhase"):
        dp.step_fn(state, phase="warm")
