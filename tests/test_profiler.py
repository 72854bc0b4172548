"""CommProfiler on known programs: bytes from the HLO census, bandwidth = bus bytes / time."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tensorboard.backend.event_processing import event_accumulator

import jaxcomm
from jaxcomm.tools import profiler as prof_mod

N = 4096
AXES = ("inter", "intra")


@pytest.fixture(scope="module")
def psum_program(mesh):
    def body(x, with_comm):
        y = jnp.tanh(x) * 2.0
        return lax.psum(y, AXES) if with_comm else y

    def make(with_comm):
        return jax.jit(
            jax.shard_map(
                lambda x: body(x, with_comm), mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)
            )
        )

    x = jax.device_put(
        np.random.default_rng(0).standard_normal((8, N), dtype=np.float32),
        NamedSharding(mesh, P(AXES)),
    )
    return make(True), make(False), x


def test_stats_on_known_program(mesh, psum_program, tmp_path):
    step, twin, x = psum_program
    log = tmp_path / "comm.jsonl"
    p = jaxcomm.CommProfiler(log_interval=2, log_file=str(log))
    p.attach(step, x, mesh=mesh, compute_only=twin)
    census = jaxcomm.hlo.collectives(step, x, mesh=mesh).collectives
    assert [c.kind for c in census] == ["all-reduce"]
    for _ in range(4):
        with p.record_step() as s:
            s.outputs_are(step(x))
    st = p.get_stats()
    # Bytes from the compiled HLO: one all-reduce of the local f32[1, N] over 8 devices.
    assert st["comm_bytes"] == sum(c.operand_bytes for c in census) == 4 * N
    assert st["bus_bytes"] == pytest.approx(4 * N * 2 * 7 / 8)
    assert st["num_collectives"] == 1 and st["steps"] == 4
    # Timings are checked against a known split in test_timing_stats_on_a_known_split.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["steps"] for r in lines] == [2, 4]
    assert lines[-1]["comm_bytes"] == 4 * N
    assert lines[-1]["conditionals"] == "largest_branch"


def _sleeper(seconds):
    def fn(x):
        time.sleep(seconds)
        return x

    return fn


@pytest.mark.parametrize(
    ("step_s", "compute_s", "fraction"),
    [(0.10, 0.025, 0.75), (0.03, 0.06, 0.0)],
    ids=["three-quarters-comm", "twin-slower-no-comm"],
)
def test_timing_stats_on_a_known_split(mesh, psum_program, step_s, compute_s, fraction):
    """Issue 29: a step and a twin of known durations (sleeps), so the exposed share, the
    communication time and the bandwidth are known by construction, not re-derived from
    the profiler's own formula. A sleep may overrun by a few ms (loaded CI cores), hence
    the tolerances; a wrong formula (comm / compute, compute / step, no clamp) misses
    them by far more."""
    step, _, x = psum_program
    p = jaxcomm.CommProfiler(log_interval=1000)
    p.attach(step, x, mesh=mesh, compute_only=_sleeper(compute_s), twin_reps=3)
    sleep_step = _sleeper(step_s)
    for _ in range(5):
        with p.record_step() as s:
            s.outputs_are(sleep_step(x))
    st = p.get_stats()
    comm_s = max(step_s - compute_s, 0.0)
    assert st["step_time"] == pytest.approx(step_s, abs=0.012)
    assert st["compute_time"] == pytest.approx(compute_s, abs=0.012)
    assert st["exposed_comm_fraction"] == pytest.approx(fraction, abs=0.1)
    assert st["comm_time"] == pytest.approx(comm_s, abs=0.02)
    bus = 4 * N * 2 * 7 / 8  # one f32[1, N] all-reduce over 8 devices, ring bus bytes
    if comm_s:
        assert st["bandwidth"] == pytest.approx(bus / comm_s / 1e9, rel=0.3)
        assert st["exposed_ms_per_collective"] == pytest.approx(comm_s * 1e3, abs=20)
    else:
        assert st["comm_time"] == 0.0 and st["bandwidth"] is None


def test_without_twin_comm_is_the_whole_step(mesh, psum_program):
    step, _, x = psum_program
    p = jaxcomm.CommProfiler(track_per_collective=False, log_interval=1000)
    p.attach(step, x, mesh=mesh)
    with p.record_step():  # no outputs given: waits for every live array
        step(x)
    st = p.get_stats()
    assert st["exposed_comm_fraction"] is None and "exposed_ms_per_collective" not in st
    assert st["comm_time"] == st["step_time"]
    assert st["bandwidth"] == pytest.approx(st["bus_bytes"] / st["step_time"] / 1e9)


@pytest.mark.parametrize("compression", [None, "int8"])
def test_data_parallel_twin_drops_gradient_collectives(mesh, compression):
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    comp = getattr(jaxcomm.compression, compression)() if compression else None

    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    sync = jaxcomm.sync_gradients(algorithm="hierarchical", compression=comp)
    dp = jaxcomm.data_parallel(loss_fn, optax.chain(sync, optax.sgd(0.1)), mesh, check_replicas=1)
    state = dp.init(params)
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.standard_normal((16, 64), dtype=np.float32),
        "y": rng.standard_normal((16, 32), dtype=np.float32),
    }
    p = jaxcomm.CommProfiler(log_interval=1000)
    p.attach_data_parallel(dp, state, batch, twin_reps=1)
    kinds = {c.kind for c in p.module.collectives}
    # the gradient sync: hierarchical, or int8's all-to-all + all-gather of packed bytes
    assert ({"all-to-all"} if compression else {"reduce-scatter"}) | {"all-gather"} <= kinds
    twin = prof_mod.compute_only_step(dp, state, batch)
    twin_mod = jaxcomm.hlo.parse_collectives(twin.as_text(), mesh)
    assert {c.kind for c in twin_mod.collectives} <= {"all-reduce"}  # only the loss pmean
    assert sum(c.operand_bytes for c in twin_mod.collectives) < 64  # scalars
    for _ in range(2):
        with p.record_step() as s:
            state, _ = s.outputs_are(dp(state, batch))
    st = p.get_stats()
    assert st["comm_bytes"] >= 4 * (64 * 32 + 32) / 4  # the intra reduce-scatter at least
    assert st["compute_time"] > 0 and 0.0 <= st["exposed_comm_fraction"] <= 1.0


def test_conditional_counts_its_largest_branch_by_hand(mesh):
    """A psum in a lax.cond is counted once, at the larger branch (bus bytes 2(p-1)/p * S)."""
    s_bytes = 4 * N  # the local f32[N] buffer

    def body(x, i):
        x = lax.psum(x, "intra")  # unconditional, p = 4
        return lax.cond(
            i > 0,
            lambda x: lax.psum(x, AXES),  # p = 8: the larger branch
            lambda x: x + lax.psum(x[:, : N // 4], "inter").sum(),  # p = 2 on S/4
            x,
        )

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(AXES), check_vma=False)
    )
    x = jax.device_put(np.ones((8, N), np.float32), NamedSharding(mesh, P(AXES)))
    i = jnp.int32(1)
    p = jaxcomm.CommProfiler(log_interval=1000)
    p.attach(step, x, i, mesh=mesh, compute_only=lambda x, i: x * 2.0, twin_reps=1)
    assert len(p.module.collectives) == 3  # all three are in the program
    with p.record_step() as s:
        s.outputs_are(step(x, i))
    st = p.get_stats()
    expected = 2 * 3 / 4 * s_bytes + 2 * 7 / 8 * s_bytes
    assert st["bus_bytes"] == pytest.approx(expected)
    assert st["comm_bytes"] == pytest.approx(2 * s_bytes)
    assert st["num_collectives"] == 2 and st["conditionals"] == "largest_branch"
    assert st["bus_bytes"] == pytest.approx(jaxcomm.wire_bytes(step, x, i)["total"])
    if st["comm_time"]:
        assert st["exposed_ms_per_collective"] == pytest.approx(st["comm_time"] / 2 * 1e3)


def test_warmup_bytes_match_wire_bytes(mesh):
    """int8 with warmup_steps: the warm-up lax.cond is counted as wire_bytes counts it."""
    params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((64,))}

    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    sync = jaxcomm.sync_gradients(compression=jaxcomm.compression.int8(), warmup_steps=5)
    dp = jaxcomm.data_parallel(loss_fn, optax.chain(sync, optax.sgd(0.1)), mesh, check_replicas=1)
    state = dp.init(params)
    rng = np.random.default_rng(2)
    batch = dp.shard_batch(
        {
            "x": rng.standard_normal((16, 256), dtype=np.float32),
            "y": rng.standard_normal((16, 64), dtype=np.float32),
        }
    )
    p = jaxcomm.CommProfiler(log_interval=1000)
    p.attach(dp.step_fn(state), state, batch, mesh=mesh)
    wb = jaxcomm.wire_bytes(dp.step_fn(state), state, batch)
    assert wb["branches"], "the warm-up conditional is in the program"
    every = sum(jaxcomm.tools.wire.bus_bytes(c) for c in p.module.collectives)
    with p.record_step() as s:
        state, _ = s.outputs_are(dp(state, batch))
    st = p.get_stats()
    assert st["bus_bytes"] == pytest.approx(wb["total"]) and st["bus_bytes"] < every
    counted = [c for c in wb["collectives"] if c["counted"]]
    assert st["num_collectives"] == len(counted) < len(p.module.collectives)
    assert st["comm_bytes"] == pytest.approx(sum(c["operand_bytes"] for c in counted))


def _read_scalars(logdir):
    """{tag: {step: value}} of the event files in ``logdir``, read by TensorBoard's reader."""
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_trace(mesh, psum_program, tmp_path):
    step, twin, x = psum_program
    p = jaxcomm.CommProfiler(
        log_interval=1,
        log_file=str(tmp_path / "log.jsonl"),
        tensorboard_dir=str(tmp_path / "tb"),
        trace_dir=str(tmp_path / "trace"),
        trace_steps=(0, 0),
    )
    p.attach(step, x, mesh=mesh, compute_only=twin, twin_reps=1)
    for _ in range(2):
        with p.record_step() as s:
            s.outputs_are(step(x))
    p.close()
    (ev,) = os.listdir(tmp_path / "tb")
    assert ev.startswith("events.out.tfevents.")
    scalars = _read_scalars(tmp_path / "tb")
    assert sorted(scalars["comm/step_time"]) == [1, 2]
    # every number of a JSON line is a scalar at its step: bandwidth too, where it is known
    # (on a loaded machine the twin can take as long as the step: comm_time 0, bandwidth None)
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["steps"] for r in lines] == [1, 2]
    for line in lines:
        step_no = line["steps"]
        for key, value in line.items():
            if key != "time" and isinstance(value, int | float):
                assert scalars[f"comm/{key}"][step_no] == pytest.approx(value, rel=1e-6), key
        known = step_no in scalars.get("comm/bandwidth", {})
        assert known == (line["bandwidth"] is not None)
    traced = [f for _, _, fs in os.walk(tmp_path / "trace") for f in fs]
    assert traced, "jax.profiler wrote no trace"


def test_bad_arguments():
    with pytest.raises(ValueError, match="log_interval"):
        jaxcomm.CommProfiler(log_interval=0)
    with pytest.raises(ValueError, match="trace_steps"):
        jaxcomm.CommProfiler(trace_steps=(3, 1))


def test_the_log_folder_is_made_at_construction(tmp_path):
    log = tmp_path / "runs" / "a" / "adapt.jsonl"
    jaxcomm.CommProfiler(log_file=str(log))
    assert log.parent.is_dir() and not log.exists()
