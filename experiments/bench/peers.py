"""``python -m experiments.bench peers``: PyTorch DDP and its hooks beside jaxcomm, end to end.

One run on the emulated network (:class:`jaxcomm.tools.testbed.Testbed`, 2 nodes x 2
devices, one JAX process per node with 2 CPU devices, one PyTorch rank per node with 2
threads: ``--torch-ranks-per-node``) trains ResNet-18
(torchvision's ``resnet18`` and the project's Flax ``jaxcomm.models.resnet('resnet18')``:
the same layers, parameter count and f32 gradient bytes, both stated in the output) on the
digits task at ``--px`` pixels (scikit-learn's 8x8 digits, repeated to 3 channels and
scaled up by nearest neighbour), with the same global batch, data order, optimizer (Adam)
and number of steps in every row.

Rows (:data:`JAX_ROWS`, :data:`experiments.bench.peers_torch.ROWS`): each framework's
compute-only twin and f32 baseline, PyTorch's DDP knobs and communication hooks, and
jaxcomm's stacked row (the ablation's ``+batching`` row, ``experiments.rows``), PowerSGD at
the same rank as PyTorch's, the sharded optimizer with int8 gradients and bf16 params, and
local steps.

Schedule: every row runs ``--warmup`` untimed steps (compilation, PowerSGD's start
iteration, the bucket tuning before them), then ``--rounds`` rounds in which every row runs
``--steps`` steps, the rows of both frameworks interleaved, so both share the machine's
load. Per row, over the rounds:

* ``step_time_s``: median seconds per step (``step_range_s``: min and max),
* ``compute_s``: its framework's compute-only twin in the same rounds (median),
* ``exposed_comm_s``: median over rounds of (row - twin of the same round),
* ``speedup``: median over rounds of (own f32 baseline / row) of the same round,
* ``link_bytes_per_step``: TCP payload node 0 sent into its link per step while the row
  ran, from the kernel's ``tc`` counters (``jaxcomm.tools.testbed.node_link_sent``),
* ``accuracy``: test accuracy on the digits split after all ``warmup + rounds x steps``
  steps (batch norm in eval mode; not for the compute-only twins, whose devices train
  apart).

Example:
  sudo python -m experiments.bench peers --link 250mbit --json docs/results/peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["JAX_ROWS", "build_table", "main", "plot", "summarize"]

JAX_ROWS: dict[str, str] = {  # key (--rows) -> name in the table
    "jax-compute": "jaxcomm compute only (no sync)",
    "jax-f32": "jaxcomm f32 flat psum",
    "jax-stacked": "jaxcomm stacked (ablation's +batching row)",
    "jax-powersgd": "jaxcomm PowerSGD",
    "jax-sharded": "jaxcomm sharded, int8 grads + bf16 params",
    "jax-local": "jaxcomm local steps, int8 outer sync",
}
# Rows left out of the default --rows, with the reason (they run when named in --rows).
LEFT_OUT: dict[str, str] = {}
BASELINES = {"jaxcomm": "jax-f32", "torch": "torch-f32"}
TWINS = {"jaxcomm": "jax-compute", "torch": "torch-compute"}
TORCH_PORT = 23457


def framework(row: str) -> str:
    """``'torch'`` or ``'jaxcomm'``: which framework a row's key belongs to."""
    return "torch" if row.startswith("torch") else "jaxcomm"


def labels() -> dict[str, str]:
    """Every row's key -> its name in the table."""
    from experiments.bench import peers_torch

    return JAX_ROWS | {r.name: r.label for r in peers_torch.ROWS}


# -- data --------------------------------------------------------------------------------
def digits_images(px: int) -> tuple[Any, Any, Any, Any]:
    """The digits split of :func:`experiments.bench.digits.load_split` as images.

    Returns:
      ``(x_train, y_train, x_test, y_test)``; images ``(N, px, px, 3)`` f32 in [0, 1],
      each 8x8 digit scaled up by nearest neighbour (``px`` a multiple of 8).
    """
    import numpy as np

    from experiments.bench.digits import load_split

    if px % 8:
        raise ValueError(f"--px {px}: a multiple of 8 (the digits are 8x8)")
    x_tr, y_tr, x_te, y_te = load_split()

    def images(x):
        img = x.reshape(-1, 8, 8).repeat(px // 8, 1).repeat(px // 8, 2)
        return np.ascontiguousarray(np.repeat(img[..., None], 3, -1), dtype=np.float32)

    return images(x_tr), y_tr, images(x_te), y_te


# -- the JAX rows ------------------------------------------------------------------------
class _JaxRow:
    """A jaxcomm row: its data-parallel step, state and step counter."""

    def __init__(self, name: str, args: argparse.Namespace, parts: Any, mesh: Any):
        import optax

        import jaxcomm

        adam = optax.adam(args.lr)
        dp_kwargs: dict[str, Any] = {}
        self.name, self.steps, self.settings = name, 0, {}
        if name == "jax-compute":
            tx, dp_kwargs["require_sync"] = optax.chain(adam), False
        elif name == "jax-f32":
            tx = optax.chain(jaxcomm.sync_gradients(algorithm="flat"), adam)
        elif name == "jax-stacked":
            from experiments import rows

            (row,) = [r for r in rows.resolve_rows() if r.row.config == "+batching"]
            sync, options, mesh_kwargs = row.build()
            sync = rows.pin_adaptive(sync, args.stacked_rung)
            mesh = jaxcomm.make_mesh(**mesh_kwargs)
            tx = optax.chain(jaxcomm.sync_gradients(**sync), adam)
            dp_kwargs["compiler_options"] = options
            self.settings = row.describe() | {"adaptive pinned at": args.stacked_rung}
        elif name == "jax-powersgd":
            comp = jaxcomm.compression.powersgd(rank=args.rank)
            tx = optax.chain(jaxcomm.sync_gradients(compression=comp, algorithm="flat"), adam)
        elif name == "jax-sharded":
            tx = optax.chain(jaxcomm.sync_gradients(compression=jaxcomm.compression.int8()), adam)
            dp_kwargs |= {"shard_optimizer": True, "param_gather": jaxcomm.compression.bf16()}
        elif name == "jax-local":
            tx = jaxcomm.local_sgd(
                adam,
                sync_every=args.sync_every,
                compression=jaxcomm.compression.int8(block=64),
                outer=optax.sgd(1.0, momentum=0.5, nesterov=True),
            )
            self.settings = {"sync_every": args.sync_every, "outer": "sgd(1.0, m=0.5, nesterov)"}
        else:
            raise ValueError(f"unknown jaxcomm row {name!r}; choose from {list(JAX_ROWS)}")
        self.mesh = mesh
        self.dp = jaxcomm.data_parallel(
            _loss_fn(parts[0]), tx, mesh, with_model_state=True, **dp_kwargs
        )
        self.state = self.dp.init(*parts[1:])

    def run(self, n: int, data: dict[str, Any]) -> float:
        """``n`` steps; returns seconds per step (each step waited for, as on CPU)."""
        import jax

        t0 = time.perf_counter()
        for _ in range(n):
            self.state, _ = self.dp(self.state, self.dp.shard_batch(_batch(data, self.steps)))
            jax.block_until_ready(self.state)
            self.steps += 1
        return (time.perf_counter() - t0) / n

    def accuracy(self, graphdef: Any, data: dict[str, Any]) -> float:
        """Test accuracy of the params (batch norm in eval mode)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx

        def host(tree):
            return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), tree)

        @jax.jit
        def predict(params, stats, x):
            model = nnx.merge(graphdef, params, stats)
            model.eval()
            return jnp.argmax(model(x), -1)

        params, stats = host(self.state.params), host(self.state.model_state)
        pred = np.asarray(predict(params, stats, data["x_test"]))
        return float(np.mean(pred == data["y_test"]))


def _loss_fn(graphdef: Any):
    import optax
    from flax import nnx

    def loss_fn(params, batch_stats, batch):
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        _, _, new_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        return loss, (new_stats, {})

    return loss_fn


def _batch(data: dict[str, Any], step: int) -> dict[str, Any]:
    """This process's part of global batch ``step``."""
    import jax

    b, p = data["batch"], jax.process_count()
    lo = step * b + jax.process_index() * (b // p)
    idx = data["order"][lo : lo + b // p]
    return {"x": data["x_train"][idx], "y": data["y_train"][idx]}


# -- the worker (one per node, inside the testbed) ---------------------------------------
class _Torch:
    """This node's PyTorch ranks, driven through queues."""

    def __init__(self, cfg: dict[str, Any]):
        import multiprocessing as mp

        from experiments.bench import peers_torch

        node = int(os.environ["JAXCOMM_PROCESS_ID"])
        nodes = int(os.environ["JAXCOMM_NUM_PROCESSES"])
        dpn = cfg["ranks_per_node"]
        addr = os.environ["JAXCOMM_COORDINATOR"].split(":")[0]
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(dpn)]
        self.ranks = [node * dpn + i for i in range(dpn)]
        self.procs = [
            ctx.Process(
                target=peers_torch.rank_main,
                args=(r, nodes * dpn, addr, TORCH_PORT, cfg, q, self.results),
                daemon=True,
            )
            for r, q in zip(self.ranks, self.cmds, strict=True)
        ]
        for p in self.procs:
            p.start()

    def ask(self, *cmd: Any, timeout: float = 1800) -> dict[int, dict[str, Any]]:
        """Sends ``cmd`` to every local rank; returns their answers by rank."""
        for q in self.cmds:
            q.put(cmd)
        import queue

        out: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(self.cmds):
            try:
                rank, ans = self.results.get(timeout=5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in zip(self.ranks, self.procs, strict=True)
                        if not p.is_alive()]  # fmt: skip
                if dead:
                    raise RuntimeError(
                        f"torch ranks {dead} (rank, exit code) died on {cmd[:2]}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"torch ranks gave no answer to {cmd[:2]} in {timeout} s"
                    ) from None
                continue
            if "fatal" in ans:
                raise RuntimeError(f"torch rank {rank} failed on {cmd[0]}:\n{ans['fatal']}")
            out[rank] = ans
        return out

    def close(self) -> None:
        for q in self.cmds:
            q.put(("stop",))
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _sent() -> tuple[int, int]:
    from jaxcomm.tools.testbed import node_link_sent

    sent = node_link_sent()
    return sent if sent is not None else (0, 0)


def worker(args: argparse.Namespace) -> int:
    """One node's process: builds both frameworks' rows, runs the schedule, writes JSON."""
    import jaxcomm

    jaxcomm.init_distributed(collective_timeout_s=900, heartbeat_timeout_s=120)
    import jax
    import numpy as np
    from flax import nnx

    from experiments.bench.digits import data_order
    from jaxcomm.models import resnet
    from jaxcomm.tools.testbed import payload_bytes

    me = jax.process_index()
    x_tr, y_tr, x_te, y_te = digits_images(args.px)
    total = args.warmup + args.rounds * args.steps
    order = data_order(args.seed, total, args.batch)
    data = {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te,
            "order": order, "batch": args.batch}  # fmt: skip
    rows = [r for r in args.rows if r]
    torch_rows = [r for r in rows if framework(r) == "torch"]
    torch_side = None
    if torch_rows:
        cfg = {  # NCHW for torch
            "x_train": np.ascontiguousarray(x_tr.transpose(0, 3, 1, 2)), "y_train": y_tr,
            "x_test": np.ascontiguousarray(x_te.transpose(0, 3, 1, 2)), "y_test": y_te,
            "order": order, "batch": args.batch, "lr": args.lr, "seed": args.seed,
            "powersgd_rank": args.rank, "powersgd_start": args.powersgd_start,
            "ranks_per_node": args.torch_ranks_per_node,
            "threads": max(1, jax.local_device_count() // args.torch_ranks_per_node),
        }  # fmt: skip
        torch_side = _Torch(cfg)

    def create():
        return nnx.split(resnet("resnet18", 10, seed=args.seed), nnx.Param, nnx.BatchStat)

    # one compiled initialiser (the values of eager construction), kept on the host
    graphdef = nnx.eval_shape(create)[0]
    params, stats = jax.tree.map(np.asarray, jax.jit(create)()[1:])
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    info: dict[str, Any] = {"jaxcomm": {"params": n_params, "grad_bytes": 4 * n_params}}
    mesh = jaxcomm.make_mesh()
    jrows: dict[str, _JaxRow] = {}
    results: dict[str, dict[str, Any]] = {r: {"times_s": [], "bytes": [], "raw_bytes": []}
                                          for r in rows}  # fmt: skip
    log = (lambda *a: print(*a, flush=True)) if me == 0 else (lambda *a: None)

    def run(name: str, n: int, timed: bool) -> None:
        res = results[name]
        if res.get("error"):
            return
        before = _sent()
        if framework(name) == "torch":
            ans = torch_side.ask("run", name, n)
            errors = {r: a["error"] for r, a in ans.items() if "error" in a}
            if errors:
                res["error"] = next(iter(errors.values()))
                res["trace"] = next(a["trace"] for a in ans.values() if "trace" in a)
                log(f"  {name}: failed: {res['error']}")
                return
            a = ans[min(ans)]
            t = a["time_s"]
            for key in ("fix", "bucket_mb", "stock_error"):
                if a.get(key) is not None:
                    res[key] = a[key]
        else:
            if name not in jrows:
                jrows[name] = _JaxRow(name, args, (graphdef, params, stats), mesh)
                res["settings"] = jrows[name].settings
            t = jrows[name].run(n, data)
        after = _sent()
        if timed:
            delta = (after[0] - before[0], after[1] - before[1])
            res["times_s"].append(t)
            res["bytes"].append(payload_bytes(delta) / n)
            res["raw_bytes"].append(delta[0] / n)
        log(f"  {name}: {t:.3f} s/step" + ("" if timed else " (warm-up)"))

    t_start = time.perf_counter()
    tune: dict[str, Any] | None = None
    if torch_side is not None:
        info["torch"] = torch_side.ask("info")[min(torch_side.ranks)]
        if "torch-f32-tuned" in torch_rows:
            cands = [float(c) for c in args.tune_buckets.split(",")]
            tune = torch_side.ask("tune", cands, args.tune_steps)[min(torch_side.ranks)]
            log(f"bucket tuning (s/step by bucket_cap_mb): {tune}")
    log(f"warm-up: {args.warmup} steps per row")
    for name in rows:
        run(name, args.warmup, timed=False)
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for name in rows:
            run(name, args.steps, timed=True)
    for name in rows:
        if results[name].get("error") or name in TWINS.values():
            continue
        if framework(name) == "torch":
            acc = torch_side.ask("eval", name)[min(torch_side.ranks)].get("accuracy")
        else:
            acc = jrows[name].accuracy(graphdef, data) if me == 0 else None
        results[name]["accuracy"] = acc
    if torch_side is not None:
        torch_side.close()
    if me == 0:
        out = {
            "link_bps": int(os.environ.get("JAXCOMM_TESTBED_LINK_BPS", 0)),
            "nodes": jax.process_count(),
            "devices_per_node": jax.local_device_count(),
            "model": info,
            "bucket_tuning": tune,
            "rows": results,
            "seconds": time.perf_counter() - t_start,
        }
        with open(args.worker_out, "w") as f:
            json.dump(out, f)
    return 0


# -- summary, table, plot ------------------------------------------------------------------
def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-row figures from the worker's per-round measurements.

    Args:
      run: the worker's JSON: ``rows`` maps a row name to ``times_s`` and ``bytes`` (one
        entry per round) and optionally ``accuracy``, ``error``, ``fix``.

    Returns:
      Row name -> ``step_time_s``, ``step_range_s``, ``compute_s``, ``exposed_comm_s``,
      ``speedup``, ``speedup_range``, ``link_bytes_per_step``, ``accuracy``, ``error``,
      ``fix``; figures that cannot be computed (a failed row, a missing twin) are None.
    """
    rows = run["rows"]
    out: dict[str, dict[str, Any]] = {}
    for name, r in rows.items():
        fw = framework(name)
        times = r.get("times_s") or []
        twin = rows.get(TWINS[fw], {}).get("times_s") or []
        base = rows.get(BASELINES[fw], {}).get("times_s") or []
        paired = len(twin) == len(times)
        exposed = [t - c for t, c in zip(times, twin, strict=False)] if paired else []
        speed = (
            [b / t for b, t in zip(base, times, strict=False)] if len(base) == len(times) else []
        )
        out[name] = {
            "label": labels().get(name, name),
            "framework": fw,
            "step_time_s": _median(times),
            "step_range_s": [min(times), max(times)] if times else None,
            "compute_s": _median(twin),
            "exposed_comm_s": None if name == TWINS[fw] else _median(exposed),
            "speedup": _median(speed) if name != TWINS[fw] else None,
            "speedup_range": [min(speed), max(speed)] if speed and name != TWINS[fw] else None,
            "link_bytes_per_step": _median(r.get("bytes") or []),
            "accuracy": r.get("accuracy"),
            "error": r.get("error"),
            "fix": r.get("fix"),
            "stock_error": r.get("stock_error"),
            "rounds": len(times),
        }
    return out


def build_table(summary: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarize`'s rows (failed rows with their error)."""

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| row | step s (range) | compute-only s | exposed comm s | link MB/step "
        "| test acc | vs own f32 (range) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        label = s["label"] + (f" [{s['fix']}]" if s.get("fix") else "")
        if s.get("error"):
            lines.append(f"| {label} | failed: {s['error'][:160]} | | | | | |")
            continue
        rng = s["step_range_s"]
        step = f"{f(s['step_time_s'], '.3f')} ({rng[0]:.3f}-{rng[1]:.3f})" if rng else "-"
        sp = f"{f(s['speedup'], '.2f')}x" if s["speedup"] is not None else "-"
        if s.get("speedup_range"):
            sp += f" ({s['speedup_range'][0]:.2f}-{s['speedup_range'][1]:.2f})"
        mb = None if s["link_bytes_per_step"] is None else s["link_bytes_per_step"] / 1e6
        lines.append(
            f"| {label} | {step} | {f(s['compute_s'], '.3f')} | "
            f"{f(s['exposed_comm_s'], '.3f')} | {f(mb, '.1f')} | {f(s['accuracy'], '.3f')} "
            f"| {sp} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """Bars per row: compute-only time and exposed communication, test accuracy beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, s in summary.items() if s["step_time_s"] is not None
             and s["exposed_comm_s"] is not None]  # fmt: skip
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 2.0))
    ys = range(len(names))
    comp = [summary[n]["compute_s"] for n in names]
    exp = [max(summary[n]["exposed_comm_s"], 0.0) for n in names]
    colors = ["tab:orange" if summary[n]["framework"] == "torch" else "tab:blue" for n in names]
    ax.barh(ys, comp, color="lightgray")
    ax.barh(ys, exp, left=comp, color=colors)
    for y, n in zip(ys, names, strict=True):
        s = summary[n]
        acc = "" if s["accuracy"] is None else f"  acc {s['accuracy']:.3f}"
        sp = "" if s["speedup"] is None else f"  {s['speedup']:.2f}x own f32"
        ax.text(s["step_time_s"], y, f" {s['step_time_s']:.2f} s{sp}{acc}", va="center",
                fontsize=8)  # fmt: skip
    ax.set_yticks(list(ys), [summary[n]["label"] for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per training step (median over paired rounds)")
    ax.set_xlim(0, max(summary[n]["step_time_s"] for n in names) * 1.6)
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    legend = {"lightgray": "compute-only (own framework)",
              "tab:blue": "exposed communication, jaxcomm",
              "tab:orange": "exposed communication, PyTorch"}  # fmt: skip
    handles = [Patch(color=c, label=t) for c, t in legend.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3,
              fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command -------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from experiments.bench import peers_torch

    torch_names = [r.name for r in peers_torch.ROWS]
    keys = ", ".join(labels())
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench peers",
        description="PyTorch DDP (gloo) with its communication hooks beside jaxcomm's rows, "
        "ResNet-18 on digits, one run on the emulated network (needs root and iproute2).",
    )
    p.add_argument("--link", default="250mbit", help="tc rate of the link between the nodes")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices-per-node", type=int, default=2)
    p.add_argument(
        "--torch-ranks-per-node",
        type=int,
        default=1,
        help="PyTorch ranks per node (default 1, one process per node as JAX's, with "
        "devices-per-node threads; devices-per-node: one rank per device, 1 thread each)",
    )
    p.add_argument("--px", type=int, default=32, help="image side (a multiple of 8)")
    p.add_argument("--batch", type=int, default=32, help="global batch (every row)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (every row)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps of every row")
    p.add_argument("--rounds", type=int, default=4, help="paired rounds")
    p.add_argument("--steps", type=int, default=8, help="steps of every row in a round")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (both frameworks)")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="torch's start_powerSGD_iter (f32 all-reduce before it)")  # fmt: skip
    p.add_argument("--sync-every", type=int, default=8, help="local steps: H")
    p.add_argument("--stacked-rung", default="int4",
                   help="the rung the stacked row's adaptive compressor is held on")  # fmt: skip
    p.add_argument("--tune-buckets", default="1,5,25,100",
                   help="bucket_cap_mb candidates for the tuned DDP row")  # fmt: skip
    p.add_argument("--tune-steps", type=int, default=2, help="timed steps per candidate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rows",
        default=",".join(_interleave([r for r in JAX_ROWS if r not in LEFT_OUT], torch_names)),
        help=f"comma-separated row keys, in the order each round runs them: {keys} "
        "(default: all but those in LEFT_OUT)",
    )
    p.add_argument("--json", default="runs/peers.json", help="output JSON path")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def _interleave(a: list[str], b: list[str]) -> list[str]:
    out = []
    for i in range(max(len(a), len(b))):
        out += a[i : i + 1] + b[i : i + 1]
    return out


def validate(args: argparse.Namespace, torch_names: Sequence[str]) -> str | None:
    """Why these arguments cannot run, or None."""
    rows = [r for r in args.rows.split(",") if r]
    known = set(JAX_ROWS) | set(torch_names)
    bad = [r for r in rows if r not in known]
    if bad:
        return f"--rows: unknown {bad}; choose from {sorted(known)}"
    devices = args.nodes * args.devices_per_node
    if args.batch % devices:
        return f"--batch {args.batch}: a multiple of the {devices} devices"
    if args.torch_ranks_per_node < 1 or args.devices_per_node % args.torch_ranks_per_node:
        return (
            f"--torch-ranks-per-node {args.torch_ranks_per_node}: a divisor of --devices-per-node"
        )
    if args.px % 8 or args.px < 8:
        return f"--px {args.px}: a multiple of 8"
    if min(args.warmup, args.rounds, args.steps) < 1:
        return "--warmup, --rounds and --steps: at least 1"
    if "jax-local" in rows and (args.steps % args.sync_every or args.warmup % args.sync_every):
        return (
            f"--steps {args.steps} and --warmup {args.warmup}: multiples of --sync-every "
            f"{args.sync_every}, so every timed window holds one sync and the run ends on one"
        )
    if any(r.startswith("torch") and "powersgd" in r for r in rows) and args.powersgd_start < 2:
        return "--powersgd-start: at least 2 (PyTorch's PowerSGDState with error feedback)"
    if args.warmup <= args.powersgd_start:
        return f"--warmup {args.warmup}: more than --powersgd-start {args.powersgd_start}"
    for name in BASELINES.values():
        fw = framework(name)
        if any(framework(r) == fw for r in rows) and (name not in rows or TWINS[fw] not in rows):
            return f"--rows: {fw} rows need {name!r} and {TWINS[fw]!r} (speedup, exposed comm)"
    return None


def main(argv: list[str] | None = None) -> int:
    from experiments.bench import peers_torch

    parser = _parser()
    args = parser.parse_args(argv)
    why = validate(args, [r.name for r in peers_torch.ROWS])
    if why:
        parser.error(why)
    args.rows = [r for r in args.rows.split(",") if r]
    if args.worker:
        return worker(args)
    if any(framework(r) == "torch" for r in args.rows):
        try:
            import torch  # noqa: F401
            import torchvision  # noqa: F401
        except ImportError as e:
            print(f"bench peers: {e}; pip install -e '.[bench]'", file=sys.stderr)
            return 2
    from experiments.bench.testbed import run_worker
    from jaxcomm.tools import testbed

    ok, why = testbed.available()
    if not ok:
        print(f"bench peers: cannot run here: {why}", file=sys.stderr)
        return 2
    # glibc's per-thread malloc arenas hold freed memory: ten models in a process add up
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    load_before = os.getloadavg()
    worker_args = [a for a in (argv if argv is not None else sys.argv[1:])]
    worker_args = _strip(worker_args, ("--json", "--plot"))
    rc, run = run_worker("peers", worker_args, nodes=args.nodes,
                         devices_per_node=args.devices_per_node, link=args.link)  # fmt: skip
    if rc != 0:
        print(f"bench peers: the run failed with {rc}", file=sys.stderr)
        return rc
    summary = summarize(run)
    load_after = os.getloadavg()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    run |= {
        "summary": summary,
        "left_out": {k: why for k, why in LEFT_OUT.items() if k not in args.rows},
        "link": args.link,
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")},
        "command": "python -m experiments.bench peers " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "uptime_after": uptime,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    m = run["model"]
    print(
        f"\nResNet-18 on digits at {args.px} px, global batch {args.batch}, "
        f"{args.warmup} + {args.rounds} x {args.steps} steps, link {args.link}, "
        f"{args.nodes} nodes x {args.devices_per_node} devices (JAX: one process per node; "
        f"PyTorch: {args.torch_ranks_per_node} rank(s) per node)"
    )
    for fw, mi in m.items():
        print(f"  {fw}: {mi['params']:,} params, {mi['grad_bytes'] / 1e6:.1f} MB f32 gradient")
    if run.get("bucket_tuning"):
        print(f"  torch bucket tuning: {run['bucket_tuning']}")
    print(build_table(summary))
    print(f"load: before {load_before[0]:.2f}; {uptime}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(run, f, indent=1)
    print(f"wrote {args.json}")
    if args.plot:
        title = (
            f"ResNet-18, digits at {args.px} px, batch {args.batch}, {args.link} link, "
            f"{args.nodes}x{args.devices_per_node}, {args.rounds} rounds\n{uptime}"
        )
        plot(summary, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


def _strip(argv: list[str], flags: Sequence[str]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
