"""``python -m experiments.bench overhead``: host time per step of each entry point against
the same step written by hand.

A model small enough that the host dominates (a 64 x 10 linear layer, 8 devices): each
jaxcomm entry and its hand-written twin take the same steps from the same state on the same
batch, already on the devices, in interleaved rounds:

- ``data_parallel`` vs ``jax.jit(jax.shard_map(step))`` with ``lax.pmean`` of the gradients;
- ``linen_data_parallel`` vs the same over a ``TrainState`` (``apply_gradients``);
- ``nnx_data_parallel`` vs ``jax.jit(jax.shard_map(...))`` over ``nnx.split`` state (split
  once, outside the loop, as a functional NNX loop keeps it);
- ``pmap_data_parallel`` (``in_axes=(None, 0), out_axes=(None, 0)``, and the older rows
  form) vs ``jax.pmap`` of the step with ``lax.pmean``;
- ``pmap_data_parallel`` in the optax form (``update(params, opt_state, batch)``, ``tx``
  closed over, the state in rows) vs ``jax.pmap`` of the same with ``lax.pmean``.

Every jaxcomm entry uses ``sync_gradients(algorithm='flat')`` (one all-reduce, as the twins'
``lax.pmean``). Per step it records the time until the result is ready (``step``; on a CPU
mesh a jaxcomm call waits for its result itself, see ``jaxcomm.backend``), the entry's own
compiled program run alone on its inputs (``program``: what the devices do, and the wait),
and the difference (``host``: the work the entry does around its program), and the main
thread's CPU time per step of the entry and of its twin (``time.thread_time``: the host's
own work, which other processes on a loaded machine do not stretch as they stretch the
wall clock). The table reports medians over rounds and each entry's step over its twin's
(goal: at most 1.1). The twins' losses are checked equal to the entries'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from experiments.bench.machine import describe

__all__ = ["main", "run"]

FEATURES, CLASSES, PER_DEVICE = 64, 10, 8
ENTRIES = (
    "data_parallel",
    "linen_data_parallel",
    "nnx_data_parallel",
    "pmap_data_parallel unreplicated",
    "pmap_data_parallel rows",
    "pmap_data_parallel optax",
)
COMPRESSIONS = ("none", "int8", "adaptive")  # of every entry's sync (the twins: lax.pmean)


def check_args(only: list[str] | None, compression: str) -> None:
    """Refuses entry names and compressions the bench does not have.

    Raises:
      ValueError: naming the value and the allowed set.
    """
    bad = sorted(set(only or ()) - set(ENTRIES))
    if bad:
        raise ValueError(f"only={bad} are not entries; choose from {list(ENTRIES)}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} must be one of {COMPRESSIONS}")


def _batch(n_dev: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n_dev * PER_DEVICE, FEATURES)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, CLASSES, n_dev * PER_DEVICE).astype(np.int32)}


def _pairs(mesh: Any, compression: str = "none") -> dict[str, tuple[Callable, Callable]]:
    """``name -> (make_entry, make_twin)``; each maker returns ``step() -> loss`` (a closure
    that advances its own state by one step on its batch, already on the devices)."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from flax import jax_utils, nnx
    from flax.training import train_state
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    axes = mesh.axis_names
    n = mesh.size
    auto = jax.sharding.Mesh(
        mesh.devices, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes)
    )
    rep, split = NamedSharding(auto, P()), NamedSharding(auto, P(axes))
    host = _batch(n)
    batch = jax.device_put(host, split)
    rows = {k: v.reshape(n, -1, *v.shape[1:]) for k, v in host.items()}
    pmap_rows = jax.pmap(lambda x: x)(rows)  # on the devices as jax.pmap lays them out
    lr = 0.1

    def xent(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params0 = {"w": jnp.zeros((FEATURES, CLASSES)), "b": jnp.zeros((CLASSES,))}

    def loss_fn(p, b):
        return xent(b["x"] @ p["w"] + p["b"], b["y"])

    codec = {"none": lambda: None, "int8": jaxcomm.compression.int8}
    codec["adaptive"] = jaxcomm.compression.adaptive

    def synced(tx):
        # The flat algorithm: one all-reduce, as the twins' lax.pmean, so that the programs
        # match and the difference is the host's (with compression: the entries' programs
        # differ from the twins', and compare with each other).
        sync = jaxcomm.sync_gradients(algorithm="flat", compression=codec[compression]())
        return optax.chain(sync, tx)

    def placed(tree, front_end):
        """The batch on the devices as the entry lays it out (it stays there)."""
        return jax.device_put(tree, front_end.batch_sharding)

    def alone(front_end, *args):
        """The entry's compiled program, run by itself on the entry's inputs."""
        compiled = front_end.compile(*args)
        inputs = front_end.drive_inputs(*args)
        return lambda: compiled(*inputs)

    def looped(step_fn: Callable, state: Any, *args: Any) -> Callable:
        box = [state]

        def one():
            box[0], loss = step_fn(box[0], *args)
            return loss

        return one

    # -- data_parallel --------------------------------------------------------------------
    def dp_entry():
        dp = jaxcomm.data_parallel(loss_fn, synced(optax.sgd(lr)), mesh)
        state, on_mesh = dp.init(params0), dp.shard_batch(host)
        step = looped(lambda s, b: (lambda r: (r[0], r[1]["loss"]))(dp(s, b)), state, on_mesh)
        return step, alone(dp, state, on_mesh)

    def dp_twin():
        tx = optax.sgd(lr)

        def body(p, o, b):
            loss, g = jax.value_and_grad(loss_fn)(lax.pcast(p, axes, to="varying"), b)
            u, o = tx.update(lax.pmean(g, axes), o, p)
            return optax.apply_updates(p, u), o, lax.pmean(loss, axes)

        f = jax.jit(jax.shard_map(body, mesh=auto, in_specs=(P(), P(), P(axes)), out_specs=P()))
        p = jax.device_put(params0, rep)
        o = jax.device_put(tx.init(params0), rep)

        def step(s, b):
            p, o, loss = f(*s, b)
            return (p, o), loss

        step = looped(step, (p, o), batch)
        return step, step

    # -- Linen ----------------------------------------------------------------------------
    class Linear(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(CLASSES)(x)

    model = Linear()
    variables = model.init(jax.random.key(0), jnp.ones((1, FEATURES)))

    def linen_step(state, b):
        def loss(p):
            return xent(state.apply_fn({"params": p}, b["x"]), b["y"])

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": lax.pmean(value, "batch")}

    def pmean_step(state, b):
        def loss(p):
            return xent(state.apply_fn({"params": p}, b["x"]), b["y"])

        value, grads = jax.value_and_grad(loss)(state.params)
        state = state.apply_gradients(grads=lax.pmean(grads, "batch"))
        return state, {"loss": lax.pmean(value, "batch")}

    def make_state(tx):
        return train_state.TrainState.create(
            apply_fn=model.apply, params=variables["params"], tx=tx
        )

    def first_loss(step_fn):
        return lambda s, b: (lambda r: (r[0], r[1]["loss"]))(step_fn(s, b))

    def linen_entry():
        step = jaxcomm.linen_data_parallel(mesh, axis_name="batch")(linen_step)
        state, on_mesh = make_state(synced(optax.sgd(lr))), placed(host, step)
        return looped(first_loss(step), state, on_mesh), alone(step, state, on_mesh)

    def linen_twin():
        def body(state, b):
            def loss(p):
                return xent(state.apply_fn({"params": p}, b["x"]), b["y"])

            params = lax.pcast(state.params, axes, to="varying")
            value, grads = jax.value_and_grad(loss)(params)
            return state.apply_gradients(grads=lax.pmean(grads, axes)), lax.pmean(value, axes)

        f = jax.jit(jax.shard_map(body, mesh=auto, in_specs=(P(), P(axes)), out_specs=P()))
        step = looped(f, jax.device_put(make_state(optax.sgd(lr)), rep), batch)
        return step, step

    # -- NNX ------------------------------------------------------------------------------
    def nnx_objects(tx):
        m = nnx.Linear(FEATURES, CLASSES, rngs=nnx.Rngs(0))
        return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

    def nnx_loss(m, b):
        return xent(m(b["x"]), b["y"])

    def nnx_entry():
        @jaxcomm.nnx_data_parallel(mesh)
        def step(m, opt, b):
            loss, grads = nnx.value_and_grad(nnx_loss)(m, b)
            opt.update(m, grads)
            return loss

        m, opt = nnx_objects(synced(optax.sgd(lr)))
        on_mesh = placed(host, step)
        return (lambda: step(m, opt, on_mesh)), alone(step, m, opt, on_mesh)

    def nnx_twin():
        m, opt = nnx_objects(optax.sgd(lr))
        graphdef, state = nnx.split((m, opt))

        def body(state, b):
            m, opt = nnx.merge(graphdef, state)
            model_def, params = nnx.split(m, nnx.Param)

            def loss(p):
                return nnx_loss(nnx.merge(model_def, p), b)

            value, grads = jax.value_and_grad(loss)(lax.pcast(params, axes, to="varying"))
            opt.update(m, lax.pmean(grads, axes))
            return nnx.split((m, opt))[1], lax.pmean(value, axes)

        f = jax.jit(jax.shard_map(body, mesh=auto, in_specs=(P(), P(axes)), out_specs=P()))
        step = looped(f, jax.device_put(state, rep), batch)
        return step, step

    # -- pmap -----------------------------------------------------------------------------
    current = {"in_axes": (None, 0), "out_axes": (None, 0), "axis_name": "batch"}

    def pmap_entry():
        step = jaxcomm.pmap_data_parallel(mesh)(linen_step, **current)
        state, on_mesh = make_state(synced(optax.sgd(lr))), placed(rows, step)
        return looped(first_loss(step), state, on_mesh), alone(step.engine, state, on_mesh)

    def pmap_twin():
        step = looped(
            first_loss(jax.pmap(pmean_step, **current)), make_state(optax.sgd(lr)), pmap_rows
        )
        return step, step

    def rows_entry():
        step = jaxcomm.pmap_data_parallel(mesh)(linen_step, axis_name="batch")
        state, on_mesh = make_state(synced(optax.sgd(lr))), placed(rows, step)
        program = alone(step.engine, state, on_mesh)  # the engine takes the state itself
        return looped(first_loss(step), jax_utils.replicate(state), on_mesh), program

    def rows_twin():
        state = jax_utils.replicate(make_state(optax.sgd(lr)))
        step = looped(first_loss(jax.pmap(pmean_step, axis_name="batch")), state, pmap_rows)
        return step, step

    def update_fn(tx, mean: bool):
        def update(p, o, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, o = tx.update(lax.pmean(g, "batch") if mean else g, o, p)
            return optax.apply_updates(p, u), o, lax.pmean(loss, "batch")

        return update

    def updated(step_fn: Callable, tx, b: Any) -> Callable:
        box = list(jax_utils.replicate((params0, tx.init(params0))))

        def one():
            box[0], box[1], loss = step_fn(*box, b)
            return loss

        return one

    def optax_entry():
        from jaxcomm.pmap import OptaxState  # the engine's state node for the optax form

        tx = synced(optax.sgd(lr))
        step = jaxcomm.pmap_data_parallel(mesh)(update_fn(tx, False), axis_name="batch")
        on_mesh = placed(rows, step)
        program: list = []

        def alone_later():
            # The entry finds the optax form's state at its first call; its program is
            # built from the node after that (run() calls this after the first steps).
            if not program:
                program.append(alone(step.engine, OptaxState(params0, tx.init(params0)), on_mesh))
            return program[0]()

        return updated(step, tx, on_mesh), alone_later

    def optax_twin():
        tx = optax.sgd(lr)
        step = updated(jax.pmap(update_fn(tx, True), axis_name="batch"), tx, pmap_rows)
        return step, step

    return {
        "data_parallel": (dp_entry, dp_twin),
        "linen_data_parallel": (linen_entry, linen_twin),
        "nnx_data_parallel": (nnx_entry, nnx_twin),
        "pmap_data_parallel unreplicated": (pmap_entry, pmap_twin),
        "pmap_data_parallel rows": (rows_entry, rows_twin),
        "pmap_data_parallel optax": (optax_entry, optax_twin),
    }


def _time(step: Callable, n: int) -> tuple[float, float, float, Any]:
    """Median seconds per step until the call returns and until its result is ready, and
    the main thread's CPU seconds per step (``time.thread_time``: the host's own work,
    which other processes on a loaded machine do not stretch)."""
    calls, steps, loss = [], [], None
    c0 = time.thread_time()
    for _ in range(n):
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        jax.block_until_ready(loss)
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        steps.append(t2 - t0)
    cpu = (time.thread_time() - c0) / n
    return statistics.median(calls), statistics.median(steps), cpu, loss


def run(
    *,
    rounds: int = 5,
    steps: int = 50,
    only: list[str] | None = None,
    compression: str = "none",
) -> dict[str, Any]:
    """Each pair's time per step, interleaved over ``rounds``; see the module docstring.

    Returns:
      ``{'rows': {name: row}}``; a row has the entry's ``call_ms`` and ``step_ms``, its
      compiled program's alone (``program_ms``), ``host_ms`` (step minus program: the work
      around the program), the twin's ``twin_step_ms``, ``ratio`` (the entry's step over
      the twin's) and its ``ratio_range`` over rounds, the main thread's CPU time per step
      of the entry and the twin (``cpu_ms``, ``twin_cpu_ms``, ``cpu_ratio``: the host's
      own work, robust to other processes' load), and ``loss_gap`` (the largest
      difference of their losses over the first steps). Times are medians over rounds of
      per-step medians (CPU: of per-round means).
    """
    import jaxcomm

    check_args(only, compression)
    mesh = jaxcomm.make_mesh(intra=min(4, jax.device_count()))
    pairs = _pairs(mesh, compression)
    names = [k for k in pairs if only is None or k in only]
    made = {k: (*pairs[k][0](), pairs[k][1]()[0]) for k in names}
    gaps = {}
    for k, (entry, program, twin) in made.items():  # compile; they compute the same
        a = [float(np.asarray(entry()).reshape(-1)[0]) for _ in range(3)]
        b = [float(np.asarray(twin()).reshape(-1)[0]) for _ in range(3)]
        gaps[k] = max(abs(x - y) for x, y in zip(a, b, strict=True))
        jax.block_until_ready(program())
    samples: dict[str, list] = {k: [] for k in names}
    for _ in range(rounds):
        for k in names:
            entry, program, twin = made[k]
            e_call, e_step, e_cpu, _ = _time(entry, steps)
            _, p_step, _, _ = _time(program, steps)
            _, t_step, t_cpu, _ = _time(twin, steps)
            samples[k].append((e_call, e_step, p_step, t_step, e_cpu, t_cpu))
    rows = {}
    for k, s in samples.items():
        call, step, prog, twin, cpu, twin_cpu = (
            statistics.median(x[i] for x in s) * 1e3 for i in range(6)
        )
        ratios = [x[1] / x[3] for x in s]
        rows[k] = {
            "call_ms": call,
            "step_ms": step,
            "program_ms": prog,
            "host_ms": step - prog,
            "twin_step_ms": twin,
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "cpu_ms": cpu,
            "twin_cpu_ms": twin_cpu,
            "cpu_ratio": statistics.median(x[4] / x[5] for x in s),
            "loss_gap": gaps[k],
        }
    return {"rows": rows, "rounds": rounds, "steps": steps, "compression": compression}


def _table(res: dict) -> str:
    lines = [
        "| entry | step ms | its program alone ms | host ms | twin step ms | step / twin (range) "
        "| main-thread CPU ms, entry / twin |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, r in res["rows"].items():
        lo, hi = r["ratio_range"]
        lines.append(
            f"| {k} | {r['step_ms']:.3f} | {r['program_ms']:.3f} | {r['host_ms']:.3f} | "
            f"{r['twin_step_ms']:.3f} | {r['ratio']:.2f} ({lo:.2f}-{hi:.2f}) | "
            f"{r['cpu_ms']:.3f} / {r['twin_cpu_ms']:.3f} ({r['cpu_ratio']:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench overhead",
        description="Host time per step of data_parallel, the NNX and Linen decorators and "
        "the pmap entry against the same step written by hand (jax.jit over jax.shard_map "
        "with lax.pmean; jax.pmap), a 64 x 10 model on 8 (fake) devices, interleaved.",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=50, help="steps per entry per round")
    p.add_argument(
        "--only", default="", help=f"comma-separated entries of {list(ENTRIES)} (default: all)"
    )
    p.add_argument(
        "--compression",
        default="none",
        choices=COMPRESSIONS,
        help="every entry's sync compression (default none: the same program as its twin)",
    )
    p.add_argument("--json", default="runs/overhead_bench.json", help="output JSON path")
    args = p.parse_args(argv)
    if jax.device_count() < 8:
        from experiments.bench.digits import reexec_with_fake_devices

        return reexec_with_fake_devices("overhead", argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()] or None
    try:
        check_args(only, args.compression)
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    res = run(rounds=args.rounds, steps=args.steps, only=only, compression=args.compression)
    res |= describe() | {"seconds": time.perf_counter() - t0}
    print(_table(res))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.json}; load average {res['load_avg_1m']:.2f}")
    return 0
