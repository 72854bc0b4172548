"""``python -m experiments.bench localsgd``: local SGD (DiLoCo) against per-step sync on digits.

For every ``sync_every`` H and outer-gradient dtype (f32, int8), the digits MLP
(:mod:`experiments.bench.digits`, 8 devices, the same seed, data order and step count) is
trained with ``jaxcomm.local_sgd(adam, sync_every=H, compression=...)`` and compared with
the per-step baseline ``chain(sync_gradients(), adam)``: test accuracy at the same number
of steps, and bytes per device from the compiled step's HLO (``jaxcomm.wire_bytes``). A
step's ``wire_bytes`` total counts the sync branch (the largest branch of the step's
``lax.switch``), i.e. the bytes of a sync step; averaged over the H-step period the bytes
per step are :func:`jaxcomm.diloco.amortized_bytes`. Both are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import jax

__all__ = ["main", "run"]


def _parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def run(
    sync_every: list[int],
    dtypes: list[str],
    *,
    steps: int,
    fragments: int = 1,
    seed: int = 0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    error_feedback: bool = False,
    hidden: int = 256,
    inner_lr: float | None = None,
    batch: int = 120,
) -> dict[str, Any]:
    """The baseline and one row per (H, dtype); see the module docstring.

    Returns:
      ``{'baseline': row, 'rows': {name: row}}``; a row has ``accuracy``, ``final_loss``,
      ``sync_step_bytes`` (wire_bytes total), ``step_bytes`` (averaged per step),
      ``bytes_reduction`` (baseline step bytes / step_bytes), ``seconds``, ``step_ms``
      (wall time per step once set up: the baseline's steps 2..N, a row's steps after its
      first sync, whose first run also sets up the sync's collectives; with ``steps`` a
      multiple of H that is whole periods of H - 1 local steps and one sync) and
      ``timed_steps``. The outer
      optimizer is ``optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)``
      (momentum 0: plain SGD; lr 1, momentum 0: plain averaging of the local params);
      int8/int4 with stochastic rounding, and error feedback if ``error_feedback``.
      ``hidden`` is the MLP's width (the gradient is about ``300 * hidden`` bytes);
      ``inner_lr`` the Adam learning rate of the baseline and of every row's inner
      optimizer (default ``experiments.bench.digits.LEARNING_RATE``, 3e-3); ``batch`` the
      global batch (a smaller one shrinks each step's compute, not its bytes).
    """
    import optax

    import jaxcomm
    from experiments.bench.digits import LEARNING_RATE, digits_accuracy
    from jaxcomm.diloco import amortized_bytes

    inner_lr = LEARNING_RATE if inner_lr is None else inner_lr

    def row(r: dict, step_bytes: float) -> dict:
        return {
            "accuracy": r["accuracy"],
            "final_loss": r["final_loss"],
            "sync_step_bytes": r["wire"]["total"],
            "unconditional_bytes": r["wire"]["unconditional"],
            "step_bytes": step_bytes,
            "seconds": r["seconds"],
            "step_ms": r["step_seconds"] * 1e3,
            "timed_steps": r["timed_steps"],
        }

    # One process: the 8 fake devices as 2 x 4. Several processes (e.g. under
    # python -m jaxcomm.tools.testbed): the processes on 'inter', their devices on 'intra'.
    mesh = jaxcomm.make_mesh() if jax.process_count() > 1 else None
    common = {"steps": steps, "seed": seed, "wire": True, "mesh": mesh, "hidden": hidden}
    common["batch_size"] = batch
    base = digits_accuracy(**common, optimizer=optax.adam(inner_lr))
    out: dict[str, Any] = {"baseline": row(base, base["wire"]["total"]), "rows": {}}
    ref = out["baseline"]["step_bytes"]
    out["baseline"]["bytes_reduction"] = 1.0
    comps = {"f32": None, "int8": jaxcomm.compression.int8, "int4": jaxcomm.compression.int4}
    for h in sync_every:
        for dt in dtypes:
            comp = comps[dt]
            tx = jaxcomm.local_sgd(
                optax.adam(inner_lr),
                sync_every=h,
                outer=optax.sgd(outer_lr, momentum=outer_momentum or None, nesterov=True),
                fragments=min(fragments, h),
                compression=None if comp is None else comp(error_feedback=error_feedback),
            )
            r = digits_accuracy(**common, transform=tx, time_from=h if h < steps else 1)
            rr = row(r, amortized_bytes(r["wire"], h, min(fragments, h)))
            rr["bytes_reduction"] = ref / rr["step_bytes"]
            name = f"H={h} {dt}" + (f" F={min(fragments, h)}" if fragments > 1 else "")
            out["rows"][name] = rr
            if jax.process_index() == 0:
                print(f"done: {name}", flush=True)
    return out


def _table(res: dict) -> str:
    head = (
        "| run | test acc | final loss | bytes on a sync step | bytes per step (avg) "
        "| x fewer than per-step f32 | ms per step | x faster |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    rows = {"per-step f32 sync (adam)": res["baseline"], **res["rows"]}
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['accuracy']:.4f} | {r['final_loss']:.4f} | "
            f"{r['sync_step_bytes']:.0f} | {r['step_bytes']:.1f} | {r['bytes_reduction']:.1f} | "
            f"{r['step_ms']:.2f} | {res['baseline']['step_ms'] / r['step_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench localsgd",
        description="Local SGD (jaxcomm.local_sgd, inner Adam, outer Nesterov SGD, by default "
        "DiLoCo's lr 0.7 / momentum 0.9) vs per-step sync on the digits MLP, 8 (fake) "
        "devices: test accuracy at the same step count, bytes per step from the compiled HLO "
        "and wall time per step. For short runs with few syncs, --outer-lr 1.0 "
        "--outer-momentum 0.5 did better (docs/benchmarks.md). Under python -m "
        "jaxcomm.tools.testbed (one process per node) it runs on the emulated network.",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--sync-every", default="1,10,50", help="comma-separated H values")
    p.add_argument("--dtypes", default="f32,int8", help="outer gradient: f32, int8, int4")
    p.add_argument("--fragments", type=int, default=1, help="streaming fragments (<= H)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD lr")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="0: plain SGD")
    p.add_argument(
        "--inner-lr",
        type=float,
        default=3e-3,
        help="Adam lr of the baseline and of the inner optimizer (default 3e-3)",
    )
    p.add_argument("--error-feedback", action="store_true", help="int8/int4 with error feedback")
    p.add_argument("--seed", type=int, default=0, help="model and data-order seed")
    p.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="MLP hidden width (default 256: 78 KB of f32 gradient; about 300 B per unit, "
        "e.g. 16384: 4.9 MB)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=120,
        help="global batch, a multiple of the devices (default 120); smaller: less compute "
        "per step, the same bytes",
    )
    p.add_argument("--json", default="runs/localsgd_bench.json", help="output JSON path")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = sorted(set(dtypes) - {"f32", "int8", "int4"})
    if bad:
        p.error(f"--dtypes: unknown {bad}; choose from f32, int8, int4")
    import jaxcomm

    if os.environ.get("JAXCOMM_COORDINATOR"):  # under jaxcomm.tools.launch or the testbed
        jaxcomm.init_distributed()
    elif jax.device_count() < 8:
        from experiments.bench.digits import reexec_with_fake_devices

        return reexec_with_fake_devices("localsgd", argv)
    t0 = time.perf_counter()
    res = run(
        _parse_ints(args.sync_every),
        dtypes,
        steps=args.steps,
        fragments=args.fragments,
        seed=args.seed,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        error_feedback=args.error_feedback,
        hidden=args.hidden,
        inner_lr=args.inner_lr,
        batch=args.batch,
    )
    res |= {
        "steps": args.steps,
        "fragments": args.fragments,
        "seed": args.seed,
        "hidden": args.hidden,
        "inner_lr": args.inner_lr,
        "batch": args.batch,
        "error_feedback": args.error_feedback,
        "outer": {"lr": args.outer_lr, "momentum": args.outer_momentum, "nesterov": True},
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "load_avg_1m": os.getloadavg()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "link": os.environ.get("JAXCOMM_TESTBED_LINK"),
        "seconds": time.perf_counter() - t0,
    }
    if jax.process_index() != 0:
        return 0
    print(_table(res))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.json}; load average {res['load_avg_1m']:.2f}")
    return 0
