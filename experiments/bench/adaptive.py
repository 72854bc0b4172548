"""``python -m experiments.bench adaptive``: adaptive compression across a live link schedule.

Trains a wide MLP on digits (:mod:`experiments.bench.digits` data, ``--hidden`` layers, a few MB
of gradient) on an emulated cluster (:class:`jaxcomm.tools.testbed.Testbed`, 2 nodes x 2 devices by
default) whose link rate changes while it trains (``--link 10gbit --schedule
15s:25mbit,75s:10gbit``, the testbed's ``--link-schedule``). Once with
``compression.adaptive(...)`` driven by :meth:`jaxcomm.CommProfiler.drive` (the measured
exposed communication share in the loop), and once per fixed level (f32, bf16, int8, int4 with
error feedback, the rungs of the ladder), each in its own testbed with the same schedule,
seed, data order and step count.

Every run compiles first, then waits until ``--start-at`` seconds after the testbed's start
(``JAXCOMM_TESTBED_START``) and trains: the schedule's times count from the training start,
the same for every run. Recorded: per step the wall time since the start, the step time and
the loss; per window of the adaptive run the level and the measured share (every process's
sequence, which must agree); the link changes (``JAXCOMM_TESTBED_LINK_LOG``); the final test
accuracy; the time to finish the steps. After training, :func:`jaxcomm.check_replicas`
checks that every replicated leaf holds the same bits on every device of every process.

Reported: a table (time to finish, test accuracy, mean step time per link phase), the reaction
delay in windows after each link change (:func:`reaction_delays`), the level changes beyond
the needed ones (:func:`oscillations`), JSON (``--json``) and a plot (``--plot``: step time,
level and loss over time, the link changes marked).

Settings (the defaults; the figures they give are in docs/benchmarks.md): each fixed level
loses somewhere, so that a ladder can win honestly. On the fast phase (10 Gbit/s: the link
moves data as fast as the CPUs feed it) f32 beats int4, because int4's quantization kernels
cost more than the traffic they save; on the slow one (25 Mbit/s) int4 wins, sending about
an eighth of f32's bytes. A global batch of 240 (60 images per device) keeps the compute
per step small next to those kernels, so that they decide the fast phase. The ladder is
``f32,int4``: on a CPU the int8 and bf16 rungs cost about as much as int4 and would add a
window to every reaction. Windows of 2 steps. ``comm_low=0.8`` and ``comm_high=0.85`` lie
between the shares that int4 and f32 read on each link; int4's share on the fast link reads
below the predicted one, because the wire-fraction model scales the share by bytes while
the fast link's time is per-collective overhead, so a higher ``comm_low`` would hold int4
there after the recovery. ``error_high=0.4`` lies above int4's error of the mean on this
model. ``--start-at 75``: the compile and ``CommProfiler.drive``'s calibration (one timed
step per rung) must end before the first link change, or the calibration times int4 on the
slow link and takes its traffic for kernel time (``late_start_s`` in the JSON says when
training started late).

Example:
  sudo python -m experiments.bench adaptive --steps 300 --json adaptive.json --plot adaptive.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "link_changes",
    "main",
    "oscillations",
    "parse_runs",
    "reaction_delays",
    "summarize",
]

FIXED = ("f32", "bf16", "int8", "int4")


def parse_runs(text: str) -> list[str]:
    """``'adaptive,f32,int8'`` -> the runs, checked: ``adaptive`` or one of :data:`FIXED`.

    Raises:
      ValueError: an unknown or repeated name, or none (the message lists the choices).
    """
    runs = [r.strip() for r in text.split(",") if r.strip()]
    allowed = ["adaptive", *FIXED]
    bad = [r for r in runs if r not in allowed]
    if bad or not runs or len(set(runs)) != len(runs):
        raise ValueError(
            f"--runs {text!r}: give distinct names from {allowed}, e.g. 'adaptive,f32,int8'."
        )
    return runs


def link_changes(log: Sequence[dict], t0: float) -> list[dict]:
    """The link changes of a testbed's link log, in seconds since ``t0``.

    Args:
      log: the records of ``JAXCOMM_TESTBED_LINK_LOG`` (``time``, ``link``, ``link_bps``), the
        first being the rate at set-up.
      t0: unix time of the training start.

    Returns:
      ``[{"t", "link", "bps", "from_bps"}]`` for every record after the first.
    """
    out = []
    for prev, cur in zip(log, log[1:], strict=False):
        out.append(
            {"t": cur["time"] - t0, "link": cur["link"], "bps": cur["link_bps"],
             "from_bps": prev["link_bps"]}
        )  # fmt: skip
    return out


def _window_of(windows: Sequence[dict], t: float) -> int | None:
    """Index of the window during which ``t`` falls (the first that ends after it)."""
    return next((k for k, w in enumerate(windows) if w["t_end"] > t), None)


def reaction_delays(windows: Sequence[dict], changes: Sequence[dict]) -> list[dict]:
    """How many windows after each link change the level moved the right way.

    A slower link should raise the level (more compression), a faster one lower it. The
    window in which the link changed is window 0; the delay is the index of the first later
    window (before the next change) that runs a level moved in that direction from the one
    before it. A decision is taken at the first step of a window from the share measured
    over the previous one, so the smallest possible delay is 1.

    Args:
      windows: ``[{"t_end": seconds, "level": int}]`` in order (the level each window ran).
      changes: :func:`link_changes`.

    Returns:
      One ``{"t", "link", "direction" ('up' | 'down'), "delay_windows", "delay_s"}`` per
      change; the delays are ``None`` when the level never moved that way.
    """
    out = []
    for n, c in enumerate(changes):
        up = c["bps"] < c["from_bps"]
        k0 = _window_of(windows, c["t"])
        nxt = _window_of(windows, changes[n + 1]["t"]) if n + 1 < len(changes) else None
        end = len(windows) if nxt is None else nxt + 1
        delay = None
        if k0 is not None:
            for j in range(k0 + 1, end):
                move = windows[j]["level"] - windows[j - 1]["level"]
                if (move > 0) if up else (move < 0):
                    delay = j - k0
                    break
        t_moved = None if delay is None else windows[k0 + delay - 1]["t_end"]
        out.append(
            {"t": c["t"], "link": c["link"], "direction": "up" if up else "down",
             "delay_windows": delay, "delay_s": None if t_moved is None else t_moved - c["t"]}
        )  # fmt: skip
    return out


def oscillations(windows: Sequence[dict], changes: Sequence[dict]) -> list[int]:
    """Level changes beyond the needed ones, per link phase.

    Phase 0 runs until the first change, phase ``i`` from change ``i - 1`` to change ``i``.
    After a slower link only upward moves are needed, after a faster one only downward
    ones: every move the other way counts. Before any change (no direction known) every
    reversal of direction counts.

    Returns:
      The count per phase (``len(changes) + 1`` entries).
    """
    bounds = [_window_of(windows, c["t"]) for c in changes]
    bounds = [len(windows) if b is None else b for b in bounds]
    starts, ends = [0, *bounds], [*bounds, len(windows)]
    counts = []
    for phase, (a, b) in enumerate(zip(starts, ends, strict=True)):
        moves = [
            windows[j]["level"] - windows[j - 1]["level"]
            for j in range(max(a, 0) + 1, min(b + 1, len(windows)))
            if windows[j]["level"] != windows[j - 1]["level"]
        ]
        if phase == 0:
            counts.append(sum(1 for x, y in zip(moves, moves[1:], strict=False) if x * y < 0))
        else:
            up = changes[phase - 1]["bps"] < changes[phase - 1]["from_bps"]
            counts.append(sum(1 for m in moves if (m < 0 if up else m > 0)))
    return counts


def _phase_means(run: dict, changes: Sequence[dict]) -> list[float | None]:
    """Mean step time (s) of the run's steps in each link phase."""
    cuts = [-float("inf"), *(c["t"] for c in changes), float("inf")]
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        st = [s for t, s in zip(run["t"], run["step_time"], strict=True) if a <= t - s and t <= b]
        out.append(sum(st) / len(st) if st else None)
    return out


def summarize(runs: dict[str, dict], *, tolerance: float = 0.005) -> dict[str, Any]:
    """The reaction delays, oscillation and the 'Done when' checks from per-run results.

    Args:
      runs: run name -> ``{"seconds", "accuracy", "t", "step_time", "link_changes"}`` and, for
        ``'adaptive'``, ``"windows"`` (``t_end``, ``level``). ``'f32'`` is the reference.
      tolerance: the quality band around f32 (0.005 = 0.5 points of test accuracy).

    Returns:
      ``delays``, ``oscillations``, ``quality_ok`` (fixed levels within the band),
      ``faster_than_all_ok`` and ``adaptive_quality_ok``.
    """
    ad = runs.get("adaptive")
    ref = runs.get("f32")
    out: dict[str, Any] = {}
    if ad is not None:
        out["delays"] = reaction_delays(ad["windows"], ad["link_changes"])
        out["oscillations"] = oscillations(ad["windows"], ad["link_changes"])
    if ref is not None:
        ok = [n for n, r in runs.items() if n != "adaptive"
              and r["accuracy"] >= ref["accuracy"] - tolerance - 1e-9]  # fmt: skip
        out["quality_ok"] = ok
        if ad is not None:
            out["adaptive_quality_ok"] = ad["accuracy"] >= ref["accuracy"] - tolerance - 1e-9
            out["faster_than_all_ok"] = all(ad["seconds"] < runs[n]["seconds"] for n in ok)
    return out


# -- one run, on every node of the testbed ----------------------------------------------------
def _compressor(run: str, args: argparse.Namespace):
    import jaxcomm.compression as C

    if run == "adaptive":
        return C.adaptive(
            0.0, min_compression=0.0, max_compression=1.0, ladder=args.ladder,
            adjustment_step=args.window, comm_low=args.comm_low, comm_high=args.comm_high,
            cooldown=args.cooldown, error_low=args.error_low, error_high=args.error_high,
        )  # fmt: skip
    return {
        "f32": lambda: None,
        "bf16": C.bf16,
        "int8": lambda: C.int8(error_feedback=True),
        "int4": lambda: C.int4(error_feedback=True),
    }[run]()


def worker(args: argparse.Namespace) -> int:
    """Trains ``args.worker`` on this node; process 0 writes the run's JSON."""
    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import jaxcomm
    from experiments.bench.digits import (
        LEARNING_RATE,
        _init,
        _logits,
        _loss,
        data_order,
        load_split,
    )

    jaxcomm.init_distributed()
    pid = jax.process_index()
    mesh = jaxcomm.make_mesh()
    x_tr, y_tr, x_te, y_te = load_split()
    order = data_order(args.seed, args.steps, args.batch)

    def batch(i: int) -> dict:
        idx = order[i * args.batch : (i + 1) * args.batch]
        return {"x": x_tr[idx], "y": y_tr[idx]}

    tx = optax.chain(
        jaxcomm.sync_gradients(compression=_compressor(args.worker, args)),
        optax.adam(LEARNING_RATE),
    )
    dp = jaxcomm.data_parallel(_loss, tx, mesh)
    state = dp.init(_init(args.seed, tuple(args.hidden)))
    prof = None
    if args.worker == "adaptive":
        prof = jaxcomm.CommProfiler(log_file=os.devnull)
        prof.drive(dp, state, batch(0))
        step = dp
    else:
        compiled = dp.lower(state, batch(0)).compile()

        def step(s, b):
            return jax.block_until_ready(compiled(s, dp.shard_batch(b)))

    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(state.params))
    multihost_utils.sync_global_devices("adaptive bench: compiled")
    late = _wait_for_start(args, pid)
    t0_unix, t0 = time.time(), time.perf_counter()
    ends, losses = [], []
    for i in range(args.steps):
        state, metrics = step(state, batch(i))
        ends.append(time.perf_counter() - t0)
        losses.append(metrics["loss"])
    seconds = ends[-1]
    jaxcomm.check_replicas(state, mesh=mesh, what=f"{args.worker} state after {args.steps} steps")
    params = jax.device_get(state.params)
    acc = float(np.mean(np.asarray(jax.numpy.argmax(_logits(params, x_te), -1)) == y_te))
    windows = [] if prof is None else _windows(prof.windows, ends, args.ladder)
    # Every process's level sequence, to check that they decide alike.
    seq = np.asarray([w["level"] for w in windows] or [-1], np.int32)
    all_seq = np.asarray(multihost_utils.process_allgather(seq))
    if pid != 0:
        return 0
    res = {
        "run": args.worker,
        "steps": args.steps,
        "seconds": seconds,
        "accuracy": acc,
        "final_loss": float(np.mean(jax.device_get(losses[-10:]))),
        "t": ends,
        "step_time": [b - a for a, b in zip([0.0, *ends], ends, strict=False)],
        "loss": [float(v) for v in jax.device_get(losses)],
        "windows": windows,
        "level_changes": prof.level_changes if prof is not None else [],
        "compute_time": prof.compute_time if prof is not None else None,
        "kernel_times": prof.kernel_times if prof is not None else None,
        "processes_agree": bool((all_seq == all_seq[0]).all()),
        "process_level_sequences": all_seq.tolist(),
        "replicas_bit_equal": True,  # check_replicas above raises otherwise
        "link_changes": link_changes(_link_log(), t0_unix),
        "late_start_s": late,
        "gradient_bytes": grad_bytes,
        "load_avg_1m": os.getloadavg()[0],
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }
    with open(args.worker_out, "w") as f:
        json.dump(res, f)
    print(f"[adaptive bench] {args.worker}: {seconds:.1f} s, acc {acc:.4f}", flush=True)
    return 0


def _wait_for_start(args: argparse.Namespace, pid: int) -> float:
    """Sleeps until ``--start-at`` seconds after the testbed's start (the link schedule
    counts from there); returns how many seconds late training starts (0 if on time)."""
    start = os.environ.get("JAXCOMM_TESTBED_START")
    if not start:
        return 0.0
    wait = float(start) + args.start_at - time.time()
    late = max(-wait, 0.0)
    if late > 1.0 and pid == 0:  # the schedule no longer lines up with training
        print(f"[adaptive bench] {args.worker}: training starts {late:.1f} s late; "
              "raise --start-at", file=sys.stderr, flush=True)  # fmt: skip
    time.sleep(max(wait, 0.0))
    return late


def _windows(windows: Sequence[dict], ends: Sequence[float], ladder: Sequence[str]) -> list:
    """``CommProfiler.windows`` with each window's end time (from ``ends``, the seconds
    since the training start after each step) and the index of its level in ``ladder``."""
    return [
        {"step": w["step"], "t_end": ends[w["step"] - 1], "name": w["levels"][0],
         "level": list(ladder).index(w["levels"][0]),
         "comm_share": w["comm_share"], "step_time": w["step_time"]}
        for w in windows
    ]  # fmt: skip


def _link_log() -> list[dict]:
    """The records of the testbed's link log (``JAXCOMM_TESTBED_LINK_LOG``), if any."""
    path = os.environ.get("JAXCOMM_TESTBED_LINK_LOG")
    if not path:
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the whole benchmark ----------------------------------------------------------------------
def _table(runs: dict[str, dict], summary: dict) -> str:
    changes = next(iter(runs.values()))["link_changes"]
    phases = ["start", *(f"after {c['t']:.0f}s: {c['link']}" for c in changes)]
    lines = [
        "| run | time to finish (s) | test acc | final loss | "
        + " | ".join(f"ms/step ({p})" for p in phases) + " |",
        "|---|---|---|---|" + "---|" * len(phases),
    ]  # fmt: skip
    for name, r in runs.items():
        means = " | ".join("-" if m is None else f"{m * 1e3:.0f}" for m in _phase_means(r, changes))
        lines.append(
            f"| {name} | {r['seconds']:.1f} | {r['accuracy']:.4f} | {r['final_loss']:.4f} | "
            f"{means} |"
        )
    for d in summary.get("delays", []):
        lines.append(
            f"\nlink -> {d['link']} at {d['t']:.1f} s: level {d['direction']} after "
            f"{d['delay_windows']} window(s)"
            + ("" if d["delay_s"] is None else f" ({d['delay_s']:.1f} s)")
        )
    if "oscillations" in summary:
        lines.append(f"level changes beyond the needed ones, per phase: {summary['oscillations']}")
    return "\n".join(lines)


def plot(runs: dict[str, dict], ladder: Sequence[str], path: str) -> None:
    """Step time, the adaptive level and the loss over time, the link changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(
        3, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 1, 2]}
    )
    for name, r in runs.items():
        lw = 2.0 if name == "adaptive" else 1.0
        ax[0].plot(r["t"], [s * 1e3 for s in r["step_time"]], label=name, lw=lw)
        ax[2].plot(r["t"], r["loss"], label=name, lw=lw)
    ad = runs.get("adaptive")
    if ad is not None and ad["windows"]:
        ts = [0.0, *(w["t_end"] for w in ad["windows"])]
        lv = [ad["windows"][0]["level"], *(w["level"] for w in ad["windows"])]
        ax[1].step(ts, lv, where="pre", color="k", label="adaptive level (per window)")
        ax[1].set_yticks(range(len(ladder)), list(ladder))
    for a in ax:
        for c in next(iter(runs.values()))["link_changes"]:
            a.axvline(c["t"], color="r", ls="--", lw=1)
    for c in next(iter(runs.values()))["link_changes"]:
        ax[0].annotate(f"link {c['link']}", (c["t"], 1), xycoords=("data", "axes fraction"),
                       xytext=(3, -12), textcoords="offset points", color="r")  # fmt: skip
    ax[0].set_yscale("log")
    ax[0].set_ylabel("step time (ms)")
    ax[1].set_ylabel("level")
    ax[2].set_ylabel("training loss")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("seconds since the training start")
    ax[0].legend(loc="upper right", fontsize=8)
    ax[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench adaptive",
        description="Adaptive compression (driven by CommProfiler.drive) against every fixed "
        "level, training a wide digits MLP on the emulated cluster "
        "(python -m jaxcomm.tools.testbed, needs root) while its link rate changes on a "
        "schedule; one testbed per run.",
    )
    p.add_argument("--runs", default="adaptive," + ",".join(FIXED),
                   help="'adaptive' and fixed levels (any of f32, bf16, int8, int4)")  # fmt: skip
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--hidden", default="1024,1024", help="hidden layer widths")
    p.add_argument("--batch", type=int, default=240, help="global batch (images)")
    p.add_argument("--seed", type=int, default=0, help="model and data-order seed")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices-per-node", type=int, default=2)
    p.add_argument("--link", default="10gbit", help="link rate at the start")
    p.add_argument("--schedule", default="15s:25mbit,75s:10gbit",
                   help="link changes, seconds after the training start")  # fmt: skip
    p.add_argument("--start-at", type=float, default=75.0,
                   help="seconds from the testbed start to training (compile first)")  # fmt: skip
    p.add_argument("--ladder", default="f32,int4", help="rungs of the adaptive run")
    p.add_argument("--window", type=int, default=2, help="adjustment_step (steps per window)")
    p.add_argument("--comm-low", type=float, default=0.8, help="adaptive comm_low")
    p.add_argument("--comm-high", type=float, default=0.85, help="adaptive comm_high")
    p.add_argument("--cooldown", type=int, default=3, help="adaptive cooldown (windows)")
    p.add_argument("--error-low", type=float, default=0.05, help="adaptive error_low")
    p.add_argument("--error-high", type=float, default=0.4, help="adaptive error_high")
    p.add_argument("--json", default="runs/adaptive_bench.json", help="output JSON path")
    p.add_argument("--plot", default="runs/adaptive_bench.png", help="output PNG path")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, checked (a clear error for a bad value)."""
    from jaxcomm.compression import adaptive
    from jaxcomm.tools.testbed import parse_link_schedule, parse_rate

    p = _parser()
    args = p.parse_args(argv)
    args.ladder = tuple(r.strip() for r in args.ladder.split(",") if r.strip())
    try:
        unknown = sorted(set(args.ladder) - set(FIXED))
        if unknown:
            raise ValueError(f"--ladder: {unknown} not supported here; use rungs of {FIXED}")
        args.runs = parse_runs(args.runs)
        args.hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
        if not args.hidden or min(args.hidden) < 1:
            raise ValueError(f"--hidden {args.hidden}: positive widths, e.g. '1024,1024'")
        parse_rate(args.link)
        args.schedule = parse_link_schedule(args.schedule)
        for name, v, lo in (("--steps", args.steps, 1), ("--batch", args.batch, 1),
                            ("--start-at", args.start_at, 0)):  # fmt: skip
            if v < lo:
                raise ValueError(f"{name}={v}: must be >= {lo}")
        if args.batch % (args.nodes * args.devices_per_node):
            raise ValueError(
                f"--batch {args.batch} must divide by the {args.nodes * args.devices_per_node} "
                "devices"
            )
        adaptive(  # the controller's own checks, before any testbed is built
            0.0, min_compression=0.0, ladder=args.ladder, adjustment_step=args.window,
            comm_low=args.comm_low, comm_high=args.comm_high, cooldown=args.cooldown,
            error_low=args.error_low, error_high=args.error_high,
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    return args


def _forward(args: argparse.Namespace) -> list[str]:
    """The worker's flags (everything that shapes one run)."""
    return [
        "--steps", str(args.steps), "--hidden", ",".join(map(str, args.hidden)),
        "--batch", str(args.batch), "--seed", str(args.seed), "--start-at", str(args.start_at),
        "--ladder", ",".join(args.ladder), "--window", str(args.window),
        "--comm-low", str(args.comm_low), "--comm-high", str(args.comm_high),
        "--cooldown", str(args.cooldown), "--error-low", str(args.error_low),
        "--error-high", str(args.error_high),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from jaxcomm.tools import testbed

    args = parse_args(argv)
    if args.worker:
        return worker(args)
    why = testbed.available()[1]  # '' when it can run
    if why:
        print(f"bench adaptive: cannot run here: {why}", file=sys.stderr)
        return 2
    schedule = [(args.start_at + at, rate) for at, rate in args.schedule]
    runs: dict[str, dict] = {}
    t_start = time.time()
    for name in args.runs:
        with tempfile.TemporaryDirectory(prefix="jc-adaptive-") as tmp:
            out = os.path.join(tmp, "run.json")
            cmd = [sys.executable, "-m", "experiments.bench", "adaptive", "--worker", name,
                   "--worker-out", out, *_forward(args)]  # fmt: skip
            load = os.getloadavg()[0]
            with testbed.Testbed(
                nodes=args.nodes, devices_per_node=args.devices_per_node, link=args.link
            ) as tb:
                rc = tb.run(cmd, link_schedule=schedule)
            if rc != 0:
                print(f"bench adaptive: run {name} failed with {rc}", file=sys.stderr)
                return rc
            with open(out) as f:
                runs[name] = json.load(f)
            runs[name]["load_avg_1m_before"] = load
        summary = summarize(runs)
        res = {
            "runs": runs,
            "summary": summary,
            "settings": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
            "load_avg_1m_after": os.getloadavg()[0],
            "seconds": time.time() - t_start,
        }
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:  # after every run, so a long sweep shows progress
            json.dump(res, f, indent=1)
    print(_table(runs, summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "delays"}))
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plot(runs, args.ladder, args.plot)
    print(f"wrote {args.json} and {args.plot}; load average {os.getloadavg()[0]:.2f}")
    return 0
