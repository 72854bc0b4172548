"""``python -m experiments.bench zero``: sharded optimizer state (ZeRO-1/2, ZeRO++ codecs)
beside data parallelism on 8 (fake) devices, a 2 x 4 ('inter', 'intra') mesh.

For each row, on a ResNet's gradient tree (``--model``, built from its shapes with a
synthetic loss whose gradient is ``2 p mean(x)``: the bytes depend on the shapes only):

- bytes per device per step from the compiled HLO (``jaxcomm.wire_bytes``) and their
  ratio to f32 data parallelism, and the bytes that cross a node's link (``'inter'``);
- the optimizer state one device holds (Adam), read from the arrays' shardings;
- the step time on this machine (median of ``--steps`` after ``--warmup`` steps).

Then the memory of Adam's state per device on ``--memory-model`` (ResNet-152 by default)
from abstract shapes (nothing allocated), replicated and sharded; with ``--digits``, every
row's test accuracy on the digits MLP (300 steps, seed 0; the quality guard). Table and
JSON.

Under ``python -m jaxcomm.tools.testbed`` (one process per node, ``JAXCOMM_COORDINATOR`` set) it
runs on the emulated network instead: the processes on ``'inter'``, their devices on
``'intra'``, the same synthetic loss over ``--model``'s gradient shapes, and per row the
step time (median of ``--steps`` timed steps after ``--warmup``, one host sync per step),
the bytes that cross a node's link per step (``wire_bytes(..)['crossing']['inter']``),
their line-rate time (the link bound: bytes * 8 / the link's bit/s), and the efficiency
bound / exposed, where exposed is the step time minus the compute-only twin's (the same
gradient and Adam update of the whole tree on one device, no collective). Every process
compiles and runs every row in the same order; after the timed steps the replicated
params are compared across all devices (``jaxcomm.check_replicas``).

Example:
  python -m jaxcomm.tools.testbed --nodes 2 --devices-per-node 2 --link 250mbit -- \
    python -m experiments.bench zero --rows dp-f32,zero-f32 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench.machine import describe

# name: (shard_optimizer, gradient codec, param gather codec, sync algorithm)
ROWS = {
    "dp-f32": (False, None, None),
    "dp-int8": (False, "int8", None),
    "zero-f32": (True, None, None),
    "zero-bf16": (True, "bf16", "bf16"),
    "zero-int8-bf16": (True, "int8", "bf16"),
    "zero-int8-int8": (True, "int8", "int8"),
    "zero-int4-bf16": (True, "int4", "bf16"),
}


def _codec(name):
    from jaxcomm import compression

    return None if name is None else getattr(compression, name)()


def _loss(params, batch):
    scale = jnp.mean(batch["x"])
    return scale * sum(jnp.vdot(p, p) for p in jax.tree.leaves(params))


def _built(mesh, params, batch, shard, grad, gather):
    """A row's step (data parallelism or sharded, the gradient codec and the param gather),
    its initial state, the batch on the mesh and the step's HLO bytes."""
    import jaxcomm

    tx = optax.chain(jaxcomm.sync_gradients(compression=_codec(grad)), optax.adam(1e-3))
    kw = {"shard_optimizer": True, "param_gather": _codec(gather)} if shard else {}
    dp = jaxcomm.data_parallel(_loss, tx, mesh, **kw)
    state = dp.init(params)
    batch = dp.shard_batch(batch)
    return dp, state, batch, jaxcomm.wire_bytes(dp.step_fn(state), state, batch)


def _timed(step, carry, runs: int) -> tuple[Any, list[float]]:
    """``carry = step(carry)`` ``runs`` times, each waited for; the carry and each time."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - t)
    return carry, times


def _row(mesh, params, batch, shard, grad, gather, warmup, steps):
    from jaxcomm.sharded import per_device_bytes

    dp, state, batch, wire = _built(mesh, params, batch, shard, grad, gather)
    (state, metrics), times = _timed(lambda c: dp(c[0], batch), (state, None), warmup + steps)
    return {
        "bytes": wire["total"],
        "by_kind": wire["by_kind"],
        "crossing_inter": wire["crossing"].get("inter", 0.0),
        "opt_state_bytes_per_device": per_device_bytes(state.opt_state),
        "step_ms": 1e3 * float(np.median(times[warmup:])),
        "loss": float(metrics["loss"]),
    }


TESTBED_ROWS = ("dp-f32", "dp-int8", "zero-f32", "zero-bf16", "zero-int8-bf16")


def _compute_only(params, batch, warmup: int, steps: int) -> float:
    """Median seconds of the step's compute alone: gradient and Adam update of the whole
    tree on one local device, no collective (data parallelism's per-device compute; the
    sharded rows run Adam on a 1/N slice, so for them it is an upper bound)."""
    tx = optax.adam(1e-3)
    dev = jax.local_devices()[0]
    params, batch = jax.device_put((params, batch), dev)
    opt = jax.device_put(tx.init(params), dev)  # committed, as the step's outputs are

    @jax.jit
    def step(params, opt, batch):
        grads = jax.grad(_loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    runs = max(warmup, 1) + steps
    _, times = _timed(lambda c: step(*c, batch), (params, opt), runs)
    return float(np.median(times[max(warmup, 1) :]))


def _testbed_row(mesh, params, batch, shard, grad, gather, warmup, steps):
    import jaxcomm

    dp, state, local, wire = _built(mesh, params, batch, shard, grad, gather)
    (state, metrics), times = _timed(lambda c: dp(c[0], local), (state, None), warmup + steps)
    jaxcomm.check_replicas(state.params, mesh=mesh, what="params")
    return {
        "bytes": wire["total"],
        "crossing_inter": wire["crossing"].get("inter", 0.0),
        "step_s": float(np.median(times[warmup:])),
        "step_times_s": times,
        "loss": float(metrics["loss"]),
    }


def bookkeep(rows: dict, link_bps: float, compute_s: float | None) -> dict:
    """Adds each row's link bound and efficiency, in place.

    Args:
      rows: ``{name: row}``, each with ``crossing_inter`` (bytes across a node's link per
        step, one direction) and ``step_s``.
      link_bps: the link's rate in bit/s (0: unknown, no bound).
      compute_s: the compute-only step time, or None where there is none.

    Returns:
      ``rows``, each with ``link_bound_s`` (``crossing_inter * 8 / link_bps``), ``exposed_s``
      (``step_s - compute_s``) and ``efficiency`` (bound / exposed; None where either is
      unknown or exposed is not positive).
    """
    for r in rows.values():
        bound = r["crossing_inter"] * 8 / link_bps if link_bps else None
        exposed = None if compute_s is None else r["step_s"] - compute_s
        r["link_bound_s"] = bound
        r["exposed_s"] = exposed
        r["efficiency"] = bound / exposed if bound is not None and exposed and exposed > 0 else None
    return rows


def run_testbed(model: str, rows: list[str], warmup: int, steps: int) -> dict:
    """The rows on the emulated network (one process per node); see the module docstring."""
    import jaxcomm
    from jaxcomm.models import gradient_shapes

    mesh = jaxcomm.make_mesh()  # the processes on 'inter', their devices on 'intra'
    shapes = gradient_shapes(model)
    rng = np.random.default_rng(0)  # the same params on every process
    params = jax.tree.map(lambda s: (0.01 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    # each process passes its own part of the global batch (2 rows per device)
    local = {"x": rng.normal(size=(2 * jax.local_device_count(), 4)).astype(np.float32)}
    compute_s = _compute_only(params, {"x": local["x"][:2]}, warmup, steps)
    out = {}
    for name in rows:
        out[name] = _described(name, _testbed_row(mesh, params, local, *ROWS[name], warmup, steps))
        if jax.process_index() == 0:
            print(f"done: {name} {out[name]['step_s']:.3f} s", flush=True)
    link_bps = float(os.environ.get("JAXCOMM_TESTBED_LINK_BPS", 0))
    bookkeep(out, link_bps, compute_s)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    return {
        "model": model,
        "params": n,
        "loss": "synthetic: scale * sum |p|^2 over the model's gradient shapes",
        "mesh": dict(mesh.shape),
        "link": os.environ.get("JAXCOMM_TESTBED_LINK"),
        "link_bps": link_bps,
        "compute_only_s": compute_s,
        "warmup": warmup,
        "rows": out,
    }


def _testbed_table(res: dict) -> str:
    m = res["mesh"]
    lines = [
        f"{res['model']} ({res['params'] / 1e6:.2f}M params, synthetic loss), "
        f"{m['inter']} nodes x {m['intra']} devices, link {res['link']}, Adam; "
        f"compute-only step {1e3 * res['compute_only_s']:.0f} ms",
        f"{'row':16} {'grads':>6} {'params':>6} {'link MB':>8} {'bound s':>8} "
        f"{'step s':>8} {'exposed s':>9} {'bound/exp':>9}",
    ]
    for name, r in res["rows"].items():
        bound = "-" if r["link_bound_s"] is None else f"{r['link_bound_s']:.3f}"
        exposed = "-" if r["exposed_s"] is None else f"{r['exposed_s']:.3f}"
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(
            f"{name:16} {r['gradients']:>6} {r['param_gather']:>6} "
            f"{r['crossing_inter'] / 1e6:8.2f} {bound:>8} {r['step_s']:8.3f} {exposed:>9} "
            f"{eff:>9}"
        )
    return "\n".join(lines)


def memory(mesh, model: str) -> dict:
    """Adam's state per device on ``model``'s shapes, replicated and sharded (abstract)."""
    import jaxcomm
    from jaxcomm.models import gradient_shapes
    from jaxcomm.sharded import per_device_bytes

    shapes = gradient_shapes(model)
    tx = optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-3))
    zp = jaxcomm.data_parallel(_loss, tx, mesh, shard_optimizer=True)
    replicated = per_device_bytes(jax.eval_shape(optax.adam(1e-3).init, shapes))
    sharded = per_device_bytes(zp.abstract_state(shapes).opt_state)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    return {
        "model": model,
        "params": params,
        "replicated_bytes": replicated,
        "sharded_bytes": sharded,
        "ratio": sharded / replicated,
    }


def _mlp_params(keys, width: int) -> list:
    return [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys]


def _mlp_loss(params, batch):
    h = batch["x"]
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - batch["y"]) ** 2)


def _predicted(dp, shapes, batch) -> dict:
    """What a step needs before anything is allocated: the state one device holds (its
    shardings) and XLA's buffer assignment of the compiled step (arguments + outputs +
    temporaries, less the donated outputs that reuse an argument), per device."""
    from jaxcomm.sharded import per_device_bytes

    state = dp.abstract_state(shapes)
    m = dp.compile(state, batch).memory_analysis()
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return {
        "params_bytes_per_device": per_device_bytes(state.params),
        "opt_state_bytes_per_device": per_device_bytes(state.opt_state),
        "step_peak_bytes_per_device": peak,
        "step_temp_bytes_per_device": m.temp_size_in_bytes,
    }


def fit(
    width: int,
    depth: int,
    steps: int,
    limit_bytes: int | None = None,
    bucket_bytes: int | None = None,
    check_replicas: int | None = None,
) -> dict:
    """Trains an MLP (``depth`` layers of ``width x width``, f32, Adam, batch 64) whose
    replicated Adam state does not fit the machine, sharded.

    For data parallelism and ``shard_optimizer=True`` (with its default buckets and with
    one bucket per dtype; all with donated state): the
    bytes per device of the params and the optimizer state (their shardings) and the
    step's peak (XLA's buffer assignment), all from abstract shapes; times the devices,
    against ``limit_bytes`` (default: this machine's physical memory). Each that fits is
    then built and trained ``steps`` steps: its losses, step times and this process's
    peak resident memory after it (``ru_maxrss``; the runs go sharded first, so the
    sharded figure is its own). One that does not fit is not run. ``bucket_bytes``: the
    sharded row's ``shard_bucket_bytes`` (None: the library's default);
    ``check_replicas``: the steps' ``data_parallel(check_replicas=)`` (the tests' 1).
    """
    import resource

    import jaxcomm

    mesh = jaxcomm.make_mesh(intra=4)
    n = mesh.size
    limit = limit_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shapes = [jax.ShapeDtypeStruct((width, width), jnp.float32) for _ in range(depth)]
    batch_shapes = {k: jax.ShapeDtypeStruct((64, width), jnp.float32) for k in ("x", "y")}
    out: dict[str, Any] = {
        "width": width,
        "depth": depth,
        "params": width * width * depth,
        "devices": n,
        "limit_bytes": limit,
        "rows": {},
    }
    # (shard_optimizer, shard_bucket_bytes): the default buckets, and one per dtype
    rows = {
        "zero-f32": (True, bucket_bytes),
        "zero-f32-one-bucket": (True, 2**62),
        "dp-f32": (False, None),
    }
    for name, (shard, bucket) in rows.items():
        tx = optax.chain(jaxcomm.sync_gradients(), optax.adam(1e-4))
        kw = {"shard_optimizer": True, "shard_bucket_bytes": bucket} if shard else {}
        dp = jaxcomm.data_parallel(
            _mlp_loss, tx, mesh, donate=True, check_replicas=check_replicas, **kw
        )
        row = _predicted(dp, shapes, batch_shapes)
        row["total_state_bytes"] = n * (
            row["params_bytes_per_device"] + row["opt_state_bytes_per_device"]
        )
        row["total_peak_bytes"] = n * row["step_peak_bytes_per_device"]
        row["fits"] = row["total_peak_bytes"] < limit
        out["rows"][name] = row
        if not row["fits"]:
            continue
        keys = jax.random.split(jax.random.key(0), depth + 2)
        make = jax.jit(functools.partial(_mlp_params, width=width), out_shardings=dp.replicated)
        state = dp.init(make(keys[:depth]))
        batch = dp.shard_batch(
            {
                "x": jax.random.normal(keys[-2], (64, width)),
                "y": 0.5 * jax.random.normal(keys[-1], (64, width)),
            }
        )
        losses, times = [], []
        for _ in range(steps):
            t = time.perf_counter()
            state, metrics = dp(state, batch)
            losses.append(float(metrics["loss"]))
            times.append(time.perf_counter() - t)
        row |= {
            "losses": losses,
            "step_s": times,
            "peak_rss_bytes": 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        }
        del state, batch
    return out


def _fit_table(res: dict) -> str:
    gib = 2**30
    lines = [
        f"MLP {res['depth']} x ({res['width']} x {res['width']}), "
        f"{res['params'] / 1e6:.0f}M params, Adam, {res['devices']} devices, limit "
        f"{res['limit_bytes'] / gib:.1f} GiB (this machine's memory)",
        f"{'row':19} {'params/dev':>10} {'Adam/dev':>9} {'peak/dev':>9} {'x devices':>9} "
        f"{'fits':>5} {'loss first -> last':>20} {'peak RSS':>9}",
    ]
    for name, r in res["rows"].items():
        run = (
            f"{r['losses'][0]:9.4f} -> {r['losses'][-1]:.4f} {r['peak_rss_bytes'] / gib:8.2f}G"
            if "losses" in r
            else f"{'not run':>20} {'-':>9}"
        )
        lines.append(
            f"{name:19} {r['params_bytes_per_device'] / gib:9.2f}G "
            f"{r['opt_state_bytes_per_device'] / gib:8.2f}G "
            f"{r['step_peak_bytes_per_device'] / gib:8.2f}G "
            f"{r['total_peak_bytes'] / gib:8.2f}G {'yes' if r['fits'] else 'no':>5} {run}"
        )
    return "\n".join(lines)


def digits(rows: list[str]) -> dict:
    """Test accuracy of each row on the digits MLP (300 steps, seed 0, Adam)."""
    from experiments.bench.digits import digits_accuracy

    out = {}
    for name in rows:
        shard, grad, gather = ROWS[name]
        dp_kwargs = {"shard_optimizer": True, "param_gather": _codec(gather)} if shard else {}
        r = digits_accuracy({"compression": _codec(grad)}, steps=300, seed=0, dp_kwargs=dp_kwargs)
        out[name] = r["accuracy"]
    return out


def run(model: str, memory_model: str, rows: list[str], steps: int, warmup: int = 1) -> dict:
    """The rows on ``model``'s gradient tree and the memory of ``memory_model``."""
    import jaxcomm
    from jaxcomm.models import gradient_shapes

    mesh = jaxcomm.make_mesh(intra=4)
    shapes = gradient_shapes(model)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.01 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32)}
    out = {}
    for name in rows:
        out[name] = _described(name, _row(mesh, params, batch, *ROWS[name], warmup, steps))
    base = out.get("dp-f32", next(iter(out.values())))
    for r in out.values():
        r["bytes_ratio"] = r["bytes"] / base["bytes"]
        r["state_ratio"] = r["opt_state_bytes_per_device"] / base["opt_state_bytes_per_device"]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    return {"model": model, "params": n, "rows": out, "memory": memory(mesh, memory_model)}


def _table(res: dict) -> str:
    lines = [
        f"{res['model']} ({res['params'] / 1e6:.2f}M params), 2 x 4 mesh, Adam",
        f"{'row':16} {'grads':>6} {'params':>6} {'MB/step':>8} {'vs dp':>6} "
        f"{'inter MB':>8} {'state MB':>9} {'vs dp':>6} {'ms/step':>8}",
    ]
    for name, r in res["rows"].items():
        lines.append(
            f"{name:16} {r['gradients']:>6} {r['param_gather']:>6} {r['bytes'] / 1e6:8.2f} "
            f"{r['bytes_ratio']:6.3f} {r['crossing_inter'] / 1e6:8.2f} "
            f"{r['opt_state_bytes_per_device'] / 1e6:9.2f} {r['state_ratio']:6.3f} "
            f"{r['step_ms']:8.0f}"
        )
    if "digits" in res:
        lines.append(
            "digits test accuracy (300 steps, seed 0): "
            + ", ".join(f"{k} {v:.4f}" for k, v in res["digits"].items())
        )
    m = res["memory"]
    lines.append(
        f"Adam state per device, {m['model']} ({m['params'] / 1e6:.1f}M params, shapes only): "
        f"replicated {m['replicated_bytes'] / 2**20:.1f} MiB, sharded "
        f"{m['sharded_bytes'] / 2**20:.1f} MiB ({m['ratio']:.4f}x)"
    )
    return "\n".join(lines)


def _described(name: str, result: dict) -> dict:
    """A row's measurements with what it ran: sharding, gradient codec, param gather."""
    shard, grad, gather = ROWS[name]
    return result | {
        "shard_optimizer": shard,
        "gradients": grad or "f32",
        "param_gather": gather or ("f32" if shard else "-"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench zero",
        description="Sharded optimizer state (data_parallel(shard_optimizer=True)) beside "
        "data parallelism on 8 (fake) devices: bytes per step from the compiled HLO, Adam "
        "state per device from the arrays' shardings, step time; Adam state of "
        "--memory-model from its shapes. Under python -m jaxcomm.tools.testbed (one process per "
        "node) it runs the rows on the emulated network instead: step time, the bytes "
        "crossing a node's link, their line-rate time (link bound) and bound / exposed.",
    )
    p.add_argument("--model", default="resnet18", help="gradient tree of the rows")
    p.add_argument("--memory-model", default="resnet152", help="model of the memory line")
    p.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated, of {list(ROWS)} (default: all; under the testbed "
        f"{','.join(TESTBED_ROWS)})",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per row")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps per row before the timed ones"
    )
    p.add_argument("--digits", action="store_true", help="also each row's digits accuracy")
    p.add_argument(
        "--fit",
        default=None,
        metavar="WIDTHxDEPTH",
        help="instead of the rows: an MLP of DEPTH WIDTH x WIDTH layers whose replicated "
        "Adam state does not fit this machine, trained sharded (e.g. 4096x16: 1 GiB of "
        "params; its memory predicted from the compiled steps, then measured)",
    )
    p.add_argument("--json", default="runs/zero_bench.json", help="output JSON path")
    args = p.parse_args(argv)
    testbed = bool(os.environ.get("JAXCOMM_COORDINATOR"))  # under jaxcomm.tools.testbed / launch
    rows = args.rows or ",".join(TESTBED_ROWS if testbed else ROWS)
    rows = [r.strip() for r in rows.split(",") if r.strip()]
    bad = sorted(set(rows) - set(ROWS))
    if bad:
        p.error(f"--rows: unknown {bad}; choose from {list(ROWS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if testbed and (args.digits or args.fit):
        p.error("--digits and --fit run on fake devices in one process, not under the testbed")
    if args.fit:
        try:
            width, depth = (int(v) for v in args.fit.lower().split("x"))
        except ValueError:
            p.error(f"--fit {args.fit!r}: expected WIDTHxDEPTH, e.g. 4096x16")
    t0 = time.perf_counter()
    if args.fit:
        if jax.device_count() < 8:
            from experiments.bench.digits import reexec_with_fake_devices

            return reexec_with_fake_devices("zero", argv)
        res = fit(width, depth, args.steps)
    elif testbed:
        import jaxcomm

        jaxcomm.init_distributed(collective_timeout_s=300)
        res = run_testbed(args.model, rows, args.warmup, args.steps)
    else:
        if jax.device_count() < 8:
            from experiments.bench.digits import reexec_with_fake_devices

            return reexec_with_fake_devices("zero", argv)
        res = run(args.model, args.memory_model, rows, args.steps, args.warmup)
        if args.digits:
            res["digits"] = digits(rows)
    res |= {"steps": args.steps, **describe(), "seconds": time.perf_counter() - t0}
    if jax.process_index() != 0:
        return 0
    print(_fit_table(res) if args.fit else _testbed_table(res) if testbed else _table(res))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2, default=float)
    print(f"wrote {args.json}; load average {res['load_avg_1m']:.2f}")
    return 0
