"""``python -m experiments.bench peers --workload gpt``: PyTorch FSDP2 beside jaxcomm's
hybrid sharding, end to end, on the byte-level GPT.

One run on the emulated network (:class:`jaxcomm.tools.testbed.Testbed`, 2 nodes x 2
devices; JAX: one process per node with 2 CPU devices, mesh ``('inter', 'intra')``;
PyTorch: one gloo rank per device, 1 thread each, a 2-D ``DeviceMesh`` ``('replicate',
'shard')``) trains ``jaxcomm.models.gpt(--model)`` and its PyTorch copy
(:class:`experiments.bench.peers_fsdp.TorchGPT`, loaded with the JAX model's initial
values) on the Python standard library's bytes (``experiments.text``: the same windows,
batch ``position`` for position, in both frameworks), global batch ``--batch``, AdamW
(``experiments.lm_step``'s betas and weight decay, constant ``--lr``), the same number of
steps in every row.

Rows (:data:`JAX_ROWS`, :data:`experiments.bench.peers_fsdp.ROWS`): each framework's
compute-only twin (the model unsharded on every device, no collective), jaxcomm's
``data_parallel(..., shard_params=True)`` (params, gradients and AdamW state split over
``'intra'``) with an f32, bf16, int8 (error feedback) and PowerSGD sync over ``'inter'``,
and FSDP2: HSDP over the 2-D mesh in f32 and with ``reduce_dtype=bf16``, and FSDP2 over
the node with an int8 all-reduce hook across nodes.

Schedule and figures are :mod:`experiments.bench.peers`' (``--warmup`` untimed steps, then
``--rounds`` rounds of ``--steps`` steps per row, rows of both frameworks interleaved;
per row the median step time, its framework's twin of the same rounds, exposed
communication = median of (row - twin) per round, node 0's TCP payload into its link
per step from the ``tc`` counters), plus:

* ``sync_bytes_per_step``: what the cross-node sync puts on node 0's link per step, from
  the program: jaxcomm from the compiled step's HLO (``jaxcomm.wire_bytes(...)
  ['crossing']['inter']``); PyTorch from the all-reduce hook of every FSDP module (HSDP:
  the size and dtype of the all-reduced tensor, times a ring all-reduce's 2 (r - 1) / r;
  the int8 hook: the codes and scales it all-gathers, times r - 1; summed over node 0's
  ranks), r the number of nodes;
* ``line_rate_s``: the ``tc``-counted bytes at the link's rate, the least time the link
  itself needs; exposed - line rate is what the step spends on the codec, the in-node
  gathers and reduce-scatters and the collectives' calls;
* ``held_out_bpb``: held-out loss (bits per byte) after all ``warmup + rounds x steps``
  steps, on ``--eval-windows`` fixed held-out windows, per seed of ``--seeds`` (the timed
  rounds run the first seed; every other seed trains each row again, untimed, from its
  own initialisation and data order);
* the f32 band: ``[min, max]`` over every seed of the two f32 rows' held-out losses; a
  row whose mean is inside it (or under it) trains as well as f32.

Example:
  sudo python -m experiments.bench peers --workload gpt --model gpt-mini --context 64 \\
      --link 50mbit --seeds 0,1,2 --json docs/results/peers_gpt_testbed_50mbit.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

__all__ = ["JAX_ROWS", "build_table", "f32_band", "main", "torch_state"]

JAX_ROWS: dict[str, str] = {
    "jax-compute": "jaxcomm compute only (replicated, no sync)",
    "jax-hsdp-f32": "jaxcomm shard_params, f32 sync",
    "jax-hsdp-bf16": "jaxcomm shard_params, bf16 sync",
    "jax-hsdp-int8": "jaxcomm shard_params, int8 sync + error feedback",
    "jax-hsdp-powersgd": "jaxcomm shard_params, PowerSGD sync",
}
TWINS = {"jaxcomm": "jax-compute", "torch": "torch-compute"}
BASELINES = {"jaxcomm": "jax-hsdp-f32", "torch": "torch-hsdp-f32"}
TORCH_PORT = 23459
EVAL_SEED = 1_000_003  # the held-out windows: the same for every row, seed and run


def labels() -> dict[str, str]:
    from experiments.bench import peers_fsdp

    return JAX_ROWS | {r.name: r.label for r in peers_fsdp.ROWS}


def torch_state(params: Any) -> dict[str, Any]:
    """The GPT's params (``nnx.State`` or its pure dict, host arrays) as the state dict of
    :class:`experiments.bench.peers_fsdp.TorchGPT` (``Linear`` kernels transposed)."""
    import numpy as np

    p = params
    if not isinstance(p, dict):
        from flax import nnx

        p = nnx.to_pure_dict(p)
    out = {"wte.weight": p["wte"]["embedding"], "wpe.weight": p["wpe"]["embedding"],
           "ln_f.weight": p["ln_f"]["scale"], "ln_f.bias": p["ln_f"]["bias"]}  # fmt: skip
    for i in sorted(p["blocks"]):
        b, pre = p["blocks"][i], f"blocks.{i}."
        for name, lin in (("qkv", b["attn"]["qkv"]), ("proj", b["attn"]["proj"]),
                          ("fc", b["fc"]), ("out", b["out"])):  # fmt: skip
            out[pre + name + ".weight"] = np.asarray(lin["kernel"]).T
            out[pre + name + ".bias"] = lin["bias"]
        for name in ("ln1", "ln2"):
            out[pre + name + ".weight"] = b[name]["scale"]
            out[pre + name + ".bias"] = b[name]["bias"]
    return {k: np.ascontiguousarray(np.asarray(v), dtype=np.float32) for k, v in out.items()}


# -- the JAX rows ------------------------------------------------------------------------
class _JaxRow:
    """A jaxcomm row on the GPT: its data-parallel step, state and step counter."""

    def __init__(self, name: str, args: argparse.Namespace, graphdef: Any, params: Any,
                 model_state: Any, mesh: Any):  # fmt: skip
        import optax

        import jaxcomm
        from experiments.lm_step import BETAS, WEIGHT_DECAY, next_byte_loss

        adamw = optax.adamw(args.lr, b1=BETAS[0], b2=BETAS[1], eps=1e-8,
                            weight_decay=WEIGHT_DECAY)  # fmt: skip
        comp = jaxcomm.compression
        syncs = {
            "jax-hsdp-f32": {},
            "jax-hsdp-bf16": {"compression": comp.bf16()},
            "jax-hsdp-int8": {"compression": comp.int8(error_feedback=True)},
            # no f32 warm-up steps: sync_gradients(warmup_steps=...) with a PowerSGD
            # compressor under shard_params=True fails to trace (its branches' Q differ in
            # their varying axes), so this row compresses from its first step
            "jax-hsdp-powersgd": {"compression": comp.powersgd(rank=args.rank)},
        }  # fmt: skip
        if name == "jax-compute":
            tx, kwargs = adamw, {"require_sync": False}
        elif name in syncs:
            tx = optax.chain(jaxcomm.sync_gradients(**syncs[name]), adamw)
            kwargs = {"shard_params": True}
        else:
            raise ValueError(f"unknown jaxcomm row {name!r}; choose from {list(JAX_ROWS)}")

        def loss_fn(p, batch):
            return next_byte_loss(graphdef, p, model_state, batch["tokens"])

        self.name, self.steps, self.mesh = name, 0, mesh
        self.dp = jaxcomm.data_parallel(loss_fn, tx, mesh, **kwargs)
        self.state = self.dp.init(params)

    def reset(self, params: Any) -> None:
        """Starts again from ``params`` (fresh optimizer and compressor state, step 0),
        the compiled step kept."""
        self.state = self.dp.init(params)
        self.steps = 0

    def run(self, n: int, windows: Any) -> float:
        """``n`` steps; seconds per step (each step waited for)."""
        import jax

        t0 = time.perf_counter()
        for _ in range(n):
            self.state, _ = self.dp(self.state, _local(windows, self.steps))
            jax.block_until_ready(self.state)
            self.steps += 1
        return (time.perf_counter() - t0) / n

    def sync_bytes(self, windows: Any) -> float:
        """Bytes across a node's link per step of the program the next step runs, from its
        compiled HLO (every process compiles it)."""
        import jaxcomm

        compiled = self.dp.compile(self.state, _local(windows, self.steps))
        return float(jaxcomm.wire_bytes(compiled, mesh=self.mesh)["crossing"].get("inter", 0.0))

    def full_params(self) -> Any:
        """The params on the host, whole: each leaf assembled from this process's shards
        (a node's devices hold every block)."""
        import jax
        import numpy as np

        def whole(a):
            out = np.empty(a.shape, a.dtype)
            for s in a.addressable_shards:
                out[s.index] = np.asarray(s.data)
            return out

        return jax.tree.map(whole, self.state.params)


def _local(windows: Any, position: int) -> dict[str, Any]:
    """This process's rows of global batch ``position`` (processes in order, as the
    PyTorch ranks take theirs)."""
    import jax

    tokens = windows.host_batch(position)["tokens"]
    per = tokens.shape[0] // jax.process_count()
    return {"tokens": tokens[jax.process_index() * per : (jax.process_index() + 1) * per]}


def _held_out(graphdef: Any, model_state: Any, tokens: Any) -> Any:
    """``loss(params)``: the mean next-byte loss (nats) of host ``params`` on ``tokens``
    (held-out windows, 8 at a time), on this process's first device (compiled once)."""
    import jax
    import numpy as np

    from experiments.lm_step import next_byte_loss

    dev = jax.local_devices()[0]
    f = jax.jit(lambda p, t: next_byte_loss(graphdef, p, model_state, t))
    chunks = [jax.device_put(tokens[i : i + 8], dev) for i in range(0, len(tokens), 8)]

    def loss(params: Any) -> float:
        p = jax.device_put(params, dev)
        return float(np.mean([float(f(p, c)) for c in chunks]))

    return loss


# -- the worker (one per node, inside the testbed) ---------------------------------------
def worker(args: argparse.Namespace) -> int:
    """One node's process: builds both frameworks' rows, runs the schedule, writes JSON."""
    import jaxcomm

    jaxcomm.init_distributed(collective_timeout_s=900, heartbeat_timeout_s=120)
    import jax
    import numpy as np

    from experiments.bench.peers import (
        _Torch,
        framework,
        measured_run,
        rounds,
        torch_run,
        write_worker_out,
    )
    from experiments.lm_step import make_model
    from experiments.text import TextWindows, load_corpus
    from jaxcomm.models import gpt_config

    me = jax.process_index()
    log = (lambda *a: print(*a, flush=True)) if me == 0 else (lambda *a: None)
    corpus = load_corpus()
    seeds = list(args.seeds)

    def windows_of(seed: int) -> Any:
        return TextWindows(corpus.train, None, global_batch=args.batch, context=args.context,
                           seed=seed)  # fmt: skip

    def params_of(seed: int) -> Any:
        parts = make_model(args.model, context=args.context, seed=seed)
        return parts.graphdef, parts.batch_stats, jax.tree.map(np.asarray, parts.params)

    windows = windows_of(seeds[0])
    held_out = TextWindows(corpus.held_out, None, global_batch=args.eval_windows,
                           context=args.context, seed=EVAL_SEED)  # fmt: skip
    eval_tokens = held_out.host_batch(0)["tokens"]
    graphdef, model_state, params = params_of(seeds[0])
    held_out_loss = _held_out(graphdef, model_state, eval_tokens) if me == 0 else None
    config = gpt_config(args.model, context=args.context)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    info: dict[str, Any] = {"jaxcomm": {"params": n_params, "grad_bytes": 4 * n_params},
                            "corpus": corpus.describe()}  # fmt: skip
    rows = list(args.rows)
    torch_side = None
    node, nodes = int(os.environ["JAXCOMM_PROCESS_ID"]), int(os.environ["JAXCOMM_NUM_PROCESSES"])
    dpn = jax.local_device_count()
    if any(framework(r) == "torch" for r in rows):
        from experiments.bench import peers_fsdp

        cfg = {"gpt": {"layers": config.layers, "d_model": config.d_model,
                       "heads": config.heads, "context": config.context,
                       "vocab": config.vocab, "mlp_ratio": config.mlp_ratio},
               "inits": {s: torch_state(params_of(s)[2]) for s in seeds},
               "batch": args.batch, "context": args.context,
               "lr": args.lr, "betas": list(_betas()), "weight_decay": _weight_decay(),
               "seed": seeds[0], "ranks_per_node": dpn, "threads": 1,
               "eval": eval_tokens}  # fmt: skip
        torch_side = _Torch(cfg, node=node, nodes=nodes,
                            addr=os.environ["JAXCOMM_COORDINATOR"].split(":")[0],
                            port=TORCH_PORT, target=peers_fsdp.rank_main)  # fmt: skip
        info["torch"] = torch_side.ask("info")[min(torch_side.ranks)]
    mesh = jaxcomm.make_mesh()
    jrows: dict[str, _JaxRow] = {}
    results: dict[str, dict[str, Any]] = {
        r: {"times_s": [], "bytes": [], "raw_bytes": [], "sync_bytes": [], "held_out_loss": []}
        for r in rows
    }

    def steps(name: str, n: int) -> float | None:
        res = results[name]
        if framework(name) == "torch":
            ans = torch_run(torch_side, name, n, res, log)
            if ans is None:
                return None
            hook = sum(a["hook_bytes"] for a in ans.values())  # node 0's ranks
            r = nodes  # ranks in a 'replicate' group: a ring all-reduce, or an all-gather
            res["last_sync_bytes"] = hook * (
                (r - 1) if name == "torch-fsdp-int8" else 2 * (r - 1) / r
            )
            return ans[min(ans)]["time_s"]
        if name not in jrows:
            try:  # a refusal at build time is the same on every process
                jrows[name] = _JaxRow(name, args, graphdef, params, model_state, mesh)
            except Exception as e:  # noqa: BLE001 - reported in the row
                res["error"] = f"{type(e).__name__}: {e}".strip().splitlines()[0]
                log(f"  {name}: failed: {res['error']}")
                return None
        return jrows[name].run(n, windows)  # the seed's (rebound below)

    def run(name: str, n: int, timed: bool) -> None:
        res = results[name]
        count = len(res["times_s"])
        measured_run(res, name, n, timed, steps, log)
        if len(res["times_s"]) > count and "last_sync_bytes" in res:  # a timed PyTorch run
            res["sync_bytes"].append(res.pop("last_sync_bytes"))

    def program_bytes() -> None:  # the steady-state program's bytes (after warm-ups)
        for name, row in jrows.items():
            results[name]["sync_bytes"].append(row.sync_bytes(windows))

    t_start = time.perf_counter()
    rounds(rows, run, args, log, after_warmup=program_bytes)
    trained = [n for n in rows if n not in TWINS.values()]

    def evaluate(seed: int) -> None:
        for name in trained:
            if results[name].get("error"):
                continue
            if framework(name) == "torch":
                loss = torch_side.ask("eval", name)[min(torch_side.ranks)].get("loss")
            else:
                full = jrows[name].full_params()
                loss = held_out_loss(full) if me == 0 else None
            results[name]["held_out_loss"].append(loss)
            log(f"  {name} seed {seed}: held-out {loss}")

    evaluate(seeds[0])
    total = args.warmup + args.rounds * args.steps
    for seed in seeds[1:]:  # the same rows and steps from another initialisation and order
        log(f"seed {seed}: {total} steps per row, untimed")
        windows = windows_of(seed)
        if torch_side is not None:
            torch_side.ask("reseed", seed)
        for name in trained:
            if framework(name) == "jaxcomm" and name in jrows:
                jrows[name].reset(params_of(seed)[2])
            run(name, total, timed=False)
        evaluate(seed)
    if torch_side is not None:
        torch_side.close()
    write_worker_out(args.worker_out, info, results, t_start)
    return 0


def _betas() -> tuple[float, float]:
    from experiments.lm_step import BETAS

    return BETAS


def _weight_decay() -> float:
    from experiments.lm_step import WEIGHT_DECAY

    return WEIGHT_DECAY


# -- summary and table -------------------------------------------------------------------
def summarize(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """:func:`experiments.bench.peers.summarize` with this workload's twins and f32
    baselines, plus per row ``sync_bytes_per_step`` (median), ``line_rate_s`` (the
    ``tc``-counted bytes at the link's rate), ``over_line_rate_s`` (exposed - line rate),
    ``held_out_bpb`` (per seed) and ``mean_bpb``."""
    import statistics

    from experiments.bench import peers

    out = peers.summarize(run, twins=TWINS, baselines=BASELINES, names=labels())
    bps = run.get("link_bps") or 0
    for name, s in out.items():
        r = run["rows"][name]
        sync = r.get("sync_bytes") or []
        s["sync_bytes_per_step"] = statistics.median(sync) if sync else None
        b = s["link_bytes_per_step"]
        s["line_rate_s"] = None if b is None or not bps else 8 * b / bps
        exposed = s["exposed_comm_s"]
        s["over_line_rate_s"] = (
            None if exposed is None or s["line_rate_s"] is None else exposed - s["line_rate_s"]
        )
        losses = [x for x in r.get("held_out_loss") or [] if x is not None]
        s["held_out_bpb"] = [x / math.log(2) for x in losses]
        s["mean_bpb"] = statistics.fmean(s["held_out_bpb"]) if losses else None
    return out


def f32_band(summary: dict[str, dict[str, Any]]) -> tuple[float, float] | None:
    """``(min, max)`` of every seed's held-out bits per byte of the two f32 rows (None
    without them)."""
    f32 = [x for b in BASELINES.values() if b in summary for x in summary[b]["held_out_bpb"]]
    return (min(f32), max(f32)) if f32 else None


def build_table(summary: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarize`'s rows, then the f32 band, each framework's
    least exposed row whose mean held-out loss is at most the band's top, and the ratio of
    jaxcomm's to FSDP2 HSDP's with the bf16 reduce."""

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    band = f32_band(summary)
    lines = [
        "| row | step s (range) | compute-only s | exposed comm s | link at line rate s "
        "| exposed - line rate s | link MB/step (tc) | sync MB/step (program) "
        "| held-out bits/byte per seed | mean | vs f32 band | vs own f32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        if s.get("error"):
            lines.append(f"| {s['label']} | failed: {s['error'][:160]} |" + " |" * 10)
            continue
        rng = s["step_range_s"]
        step = f"{f(s['step_time_s'], '.3f')} ({rng[0]:.3f}-{rng[1]:.3f})" if rng else "-"
        sp = f"{f(s['speedup'], '.2f')}x" if s["speedup"] is not None else "-"
        mb = None if s["link_bytes_per_step"] is None else s["link_bytes_per_step"] / 1e6
        sync = s["sync_bytes_per_step"]
        sync = None if sync is None else sync / 1e6
        seeds = " ".join(f"{x:.4f}" for x in s["held_out_bpb"]) or "-"
        verdict = "-"
        if band is not None and s["mean_bpb"] is not None:
            m = s["mean_bpb"]
            verdict = "under" if m < band[0] else "over" if m > band[1] else "inside"
        lines.append(
            f"| {s['label']} | {step} | {f(s['compute_s'], '.3f')} | "
            f"{f(s['exposed_comm_s'], '.3f')} | {f(s['line_rate_s'], '.3f')} | "
            f"{f(s['over_line_rate_s'], '.3f')} | {f(mb, '.3f')} | {f(sync, '.3f')} | "
            f"{seeds} | {f(s['mean_bpb'], '.4f')} | {verdict} | {sp} |"
        )
    if band is None:
        return "\n".join(lines)
    lines.append("")
    lines.append(f"f32 band (held-out bits/byte, every seed of the two f32 rows): "
                 f"[{band[0]:.4f}, {band[1]:.4f}]; a row whose mean is inside or under it "
                 "trains as well as f32.")  # fmt: skip
    best: dict[str, str | None] = {}
    for fw in ("jaxcomm", "torch"):
        ok = [n for n, s in summary.items()
              if s["framework"] == fw and n != TWINS[fw] and s.get("exposed_comm_s") is not None
              and s["mean_bpb"] is not None and s["mean_bpb"] <= band[1]]  # fmt: skip
        best[fw] = min(ok, key=lambda n: summary[n]["exposed_comm_s"]) if ok else None
        what = "none"
        if best[fw]:
            what = f"{summary[best[fw]]['label']}, {summary[best[fw]]['exposed_comm_s']:.3f} s"
        lines.append(f"least exposed {fw} row within the f32 band: {what}")
    ref, name = summary.get("torch-hsdp-bf16"), best["jaxcomm"]
    if name and ref and ref.get("exposed_comm_s"):
        ratio = summary[name]["exposed_comm_s"] / ref["exposed_comm_s"]
        lines.append(f"exposed time, {summary[name]['label']} / FSDP2 HSDP bf16 reduce: "
                     f"{ratio:.2f}")  # fmt: skip
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    keys = ", ".join(labels())
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench peers --workload gpt",
        description="PyTorch FSDP2 (HSDP f32 and bf16 reduce; in-node FSDP with an int8 "
        "all-reduce hook) beside jaxcomm's hybrid sharding (shard_params=True with f32, "
        "bf16, int8 and PowerSGD syncs), the byte-level GPT on the standard library's "
        "source, one run on the emulated network (needs root and iproute2, torch).",
    )
    p.add_argument("--workload", choices=["resnet18", "gpt"], default="gpt",
                   help="gpt: this bench; resnet18: DDP and its hooks (peers --help)")  # fmt: skip
    p.add_argument("--link", default="50mbit", help="tc rate of the link between the nodes")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices-per-node", type=int, default=2,
                   help="JAX devices per node process; PyTorch ranks per node, 1 thread "
                   "each")  # fmt: skip
    p.add_argument("--model", default="gpt-mini", help="a jaxcomm.models.GPT_CONFIGS name")
    p.add_argument("--context", type=int, default=64, help="bytes per window")
    p.add_argument("--batch", type=int, default=8, help="global batch of windows (every row)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (constant)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps of every row")
    p.add_argument("--rounds", type=int, default=4, help="paired rounds")
    p.add_argument("--steps", type=int, default=10, help="steps of every row in a round")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (per block)")
    p.add_argument("--eval-windows", type=int, default=64,
                   help="held-out windows for the held-out loss (fixed across rows)")  # fmt: skip
    p.add_argument("--seeds", default="0,1,2",
                   help="comma-separated seeds (initialisation and data order): the timed "
                   "rounds run the first; every other seed trains each row (not the twins) "
                   "the same number of steps again, untimed, for the held-out loss's "
                   "spread")  # fmt: skip
    p.add_argument("--rows", default=None,
                   help=f"comma-separated row keys, in the order each round runs them: {keys} "
                   "(default: all, the frameworks interleaved)")  # fmt: skip
    p.add_argument("--json", default="runs/peers_gpt.json", help="output JSON path")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def default_rows() -> list[str]:
    from experiments.bench import peers_fsdp
    from experiments.bench.peers import _interleave

    return _interleave(list(JAX_ROWS), [r.name for r in peers_fsdp.ROWS])


def validate(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run, or None."""
    from experiments.bench.peers import framework
    from jaxcomm.models import GPT_CONFIGS

    known = set(labels())
    bad = [r for r in args.rows if r not in known]
    if bad:
        return f"--rows: unknown {bad}; choose from {sorted(known)}"
    if args.model not in GPT_CONFIGS:
        return f"--model {args.model!r}: one of {sorted(GPT_CONFIGS)}"
    if not 1 <= args.context <= GPT_CONFIGS[args.model].context:
        return f"--context {args.context}: 1 to {GPT_CONFIGS[args.model].context} for {args.model}"
    devices = args.nodes * args.devices_per_node
    if args.batch % devices:
        return f"--batch {args.batch}: a multiple of the {devices} devices"
    try:
        seeds = [int(x) for x in str(args.seeds).split(",") if x]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        return f"--seeds {args.seeds!r}: comma-separated integers, each once, e.g. 0,1,2"
    if min(args.warmup, args.rounds, args.steps, args.eval_windows) < 1:
        return "--warmup, --rounds, --steps and --eval-windows: at least 1"
    for fw, name in BASELINES.items():
        if any(framework(r) == fw for r in args.rows) and (
            name not in args.rows or TWINS[fw] not in args.rows
        ):
            return f"--rows: {fw} rows need {name!r} and {TWINS[fw]!r} (f32 band, exposed comm)"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    args.rows = [r for r in (args.rows or ",".join(default_rows())).split(",") if r]
    why = validate(args)
    if why:
        parser.error(why)
    args.seeds = [int(x) for x in str(args.seeds).split(",") if x]
    if args.worker:
        return worker(args)
    from experiments.bench.peers import _strip, framework, run_on_testbed, run_record

    modules = ("torch",) if any(framework(r) == "torch" for r in args.rows) else ()
    worker_args = _strip(argv, ("--json",)) + ["--workload", "gpt"]
    rc, run = run_on_testbed(args, worker_args, modules)
    if run is None:
        return rc
    summary = summarize(run)
    run |= {"summary": summary, "f32_band_bpb": f32_band(summary)} | run_record(args, argv)
    m = run["model"]
    print(
        f"\n{args.model} at context {args.context}: {m['jaxcomm']['params']:,} params "
        f"({m['jaxcomm']['grad_bytes'] / 1e6:.2f} MB f32 gradient; torch "
        f"{m.get('torch', {}).get('params', 0):,}), global batch {args.batch}, AdamW lr "
        f"{args.lr}, {args.warmup} + {args.rounds} x {args.steps} steps, link {args.link}, "
        f"{args.nodes} nodes x {args.devices_per_node} devices"
    )
    print(build_table(summary))
    print(f"load: {run['uptime_before']} / {run['uptime_after']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(run, f, indent=1)
    print(f"wrote {args.json}")
    return 0
