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
the same rank and start as PyTorch's, the sharded optimizer with int8 gradients and bf16
params, and local steps.

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

Training budget (``--budget N``): instead of the timed rounds, each row is trained ``N``
steps from each seed of ``--seeds`` (initialisation and data order), without the testbed
and without root (accuracy does not depend on the link; :func:`budget_worker`), and the
table gives each row's test accuracy per seed, mean, spread and verdict against the f32
band: ``[min, max]`` of every seed's accuracy of the two f32 baselines (jaxcomm's flat
psum, DDP f32); a row whose mean lies inside it has ``equal`` accuracy, over it ``above``
(both count as equal accuracy), under it ``below`` (:func:`budget_summary`). With
``--timed-json`` (a timed run's JSON) each row's exposed communication joins the table,
and the least exposed row of each framework among those of equal accuracy is named with
the ratio of their times (:func:`equal_accuracy_exposure`).

``--workload gpt``: PyTorch FSDP2 beside jaxcomm's hybrid sharding on the byte-level GPT
(:mod:`experiments.bench.peers_lm`, its PyTorch ranks :mod:`experiments.bench.peers_fsdp`).

Example:
  sudo python -m experiments.bench peers --link 250mbit --json docs/results/peers.json
  python -m experiments.bench peers --budget 300 --timed-json docs/results/peers.json
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
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "BUDGET_ROWS",
    "JAX_ROWS",
    "budget_summary",
    "build_budget_table",
    "build_table",
    "equal_accuracy_exposure",
    "main",
    "plot",
    "summarize",
]

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
            mesh = jaxcomm.make_mesh(**mesh_kwargs, devices=list(mesh.devices.flat))
            tx = optax.chain(jaxcomm.sync_gradients(**sync), adam)
            dp_kwargs["compiler_options"] = options
            self.settings = row.describe() | {"adaptive pinned at": args.stacked_rung}
        elif name == "jax-powersgd":
            # the hook's start: f32 all-reduce for the first powersgd_start steps. The
            # factors' all-reduces are hierarchical (the default algorithm): across a
            # node's link they carry the hook's bytes; no padding, as the hook batches none
            comp = jaxcomm.compression.powersgd(rank=args.rank, max_padding=0.0)
            sync = jaxcomm.sync_gradients(compression=comp, warmup_steps=args.powersgd_start)
            tx = optax.chain(sync, adam)
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

    def reset(self, params: Any, model_state: Any) -> None:
        """Starts again from ``params`` and ``model_state`` (fresh optimizer and
        compressor state, step 0), the compiled step kept."""
        self.state = self.dp.init(params, model_state)
        self.steps = 0

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

        if getattr(self, "_predict", None) is None:  # compiled once per row

            @jax.jit
            def predict(params, stats, x):
                model = nnx.merge(graphdef, params, stats)
                model.eval()
                return jnp.argmax(model(x), -1)

            self._predict = predict
        params, stats = host(self.state.params), host(self.state.model_state)
        pred = np.asarray(self._predict(params, stats, data["x_test"]))
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


def _jax_model(seed: int) -> tuple[Any, Any, Any]:
    """``(graphdef, params, batch_stats)`` of the Flax ResNet-18 drawn from ``seed``: one
    compiled initialiser (the values of eager construction), the values kept on the host."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxcomm.models import initialize, resnet

    def create():
        return nnx.split(resnet("resnet18", 10, seed=seed), nnx.Param, nnx.BatchStat)

    graphdef = nnx.eval_shape(create)[0]
    params, stats = jax.tree.map(np.asarray, initialize(create)[1:])
    return graphdef, params, stats


def _torch_cfg(args: argparse.Namespace, data: dict[str, Any], seed: int, ranks_per_node: int,
               threads: int) -> dict[str, Any]:  # fmt: skip
    """The settings of :class:`experiments.bench.peers_torch.TorchRows` (images NCHW)."""
    import numpy as np

    def nchw(x):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))

    return {"x_train": nchw(data["x_train"]), "y_train": data["y_train"],
            "x_test": nchw(data["x_test"]), "y_test": data["y_test"],
            "order": data["order"], "batch": args.batch, "lr": args.lr, "seed": seed,
            "powersgd_rank": args.rank, "powersgd_start": args.powersgd_start,
            "ranks_per_node": ranks_per_node, "threads": threads}  # fmt: skip


# -- the worker (one per node, inside the testbed) ---------------------------------------
class _Torch:
    """Node ``node``'s PyTorch ranks (``cfg['ranks_per_node']`` of them, out of ``nodes``
    times that), driven through queues; the group meets at ``addr:port``. ``target``: the
    ranks' main function (default ``peers_torch.rank_main``; the GPT workload's:
    ``peers_fsdp.rank_main``)."""

    def __init__(self, cfg: dict[str, Any], node: int, nodes: int, addr: str, port: int,
                 target: Callable | None = None):  # fmt: skip
        import multiprocessing as mp

        from experiments.bench import peers_torch

        target = target or peers_torch.rank_main
        dpn = cfg["ranks_per_node"]
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(dpn)]
        self.ranks = [node * dpn + i for i in range(dpn)]
        self.procs = [
            ctx.Process(
                target=target,
                args=(r, nodes * dpn, addr, port, cfg, q, self.results),
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

    from experiments.bench.digits import data_order

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
        threads = max(1, jax.local_device_count() // args.torch_ranks_per_node)
        cfg = _torch_cfg(args, data, args.seed, args.torch_ranks_per_node, threads)
        torch_side = _Torch(
            cfg,
            node=int(os.environ["JAXCOMM_PROCESS_ID"]),
            nodes=int(os.environ["JAXCOMM_NUM_PROCESSES"]),
            addr=os.environ["JAXCOMM_COORDINATOR"].split(":")[0],
            port=TORCH_PORT,
        )

    graphdef, params, stats = _jax_model(args.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    info: dict[str, Any] = {"jaxcomm": {"params": n_params, "grad_bytes": 4 * n_params}}
    mesh = jaxcomm.make_mesh()
    jrows: dict[str, _JaxRow] = {}
    results: dict[str, dict[str, Any]] = {r: {"times_s": [], "bytes": [], "raw_bytes": []}
                                          for r in rows}  # fmt: skip
    log = (lambda *a: print(*a, flush=True)) if me == 0 else (lambda *a: None)

    def steps(name: str, n: int) -> float | None:
        res = results[name]
        if framework(name) == "torch":
            ans = torch_run(torch_side, name, n, res, log)
            if ans is None:
                return None
            a = ans[min(ans)]
            for key in ("fix", "bucket_mb", "stock_error"):
                if a.get(key) is not None:
                    res[key] = a[key]
            return a["time_s"]
        if name not in jrows:
            jrows[name] = _JaxRow(name, args, (graphdef, params, stats), mesh)
            res["settings"] = jrows[name].settings
        return jrows[name].run(n, data)

    def run(name: str, n: int, timed: bool) -> None:
        measured_run(results[name], name, n, timed, steps, log)

    t_start = time.perf_counter()
    tune: dict[str, Any] | None = None
    if torch_side is not None:
        info["torch"] = torch_side.ask("info")[min(torch_side.ranks)]
        if "torch-f32-tuned" in torch_rows:
            cands = [float(c) for c in args.tune_buckets.split(",")]
            tune = torch_side.ask("tune", cands, args.tune_steps)[min(torch_side.ranks)]
            log(f"bucket tuning (s/step by bucket_cap_mb): {tune}")
    rounds(rows, run, args, log)
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
    write_worker_out(args.worker_out, info, results, t_start, bucket_tuning=tune)
    return 0


def torch_run(torch_side: _Torch, name: str, n: int, res: dict[str, Any],
              log: Callable[..., None]) -> dict[int, dict[str, Any]] | None:  # fmt: skip
    """``n`` steps of PyTorch row ``name`` on the local ranks: their answers by rank, or
    None when a rank failed (the error and its trace recorded in ``res``)."""
    ans = torch_side.ask("run", name, n)
    errors = [a for a in ans.values() if "error" in a]
    if not errors:
        return ans
    res["error"], res["trace"] = errors[0]["error"], errors[0].get("trace")
    log(f"  {name}: failed: {res['error']}")
    return None


def measured_run(
    res: dict[str, Any],
    name: str,
    n: int,
    timed: bool,
    steps: Callable[[str, int], float | None],
    log: Callable[..., None],
) -> None:
    """Runs ``steps(name, n)`` (seconds per step, None if the row failed) unless the row
    failed before; when ``timed``, appends its time and node 0's link bytes per step
    (``tc`` counters read before and after) to ``res``."""
    if res.get("error"):
        return
    before = _sent()
    t = steps(name, n)
    if t is None:
        return
    after = _sent()
    if timed:
        from jaxcomm.tools.testbed import payload_bytes

        delta = (after[0] - before[0], after[1] - before[1])
        res["times_s"].append(t)
        res["bytes"].append(payload_bytes(delta) / n)
        res["raw_bytes"].append(delta[0] / n)
    log(f"  {name}: {t:.3f} s/step" + ("" if timed else " (warm-up)"))


def rounds(
    rows: Sequence[str],
    run: Callable[[str, int, bool], None],
    args: argparse.Namespace,
    log: Callable[..., None],
    after_warmup: Callable[[], None] | None = None,
) -> None:
    """The schedule: ``args.warmup`` untimed steps of every row, then ``args.rounds``
    rounds in which every row runs ``args.steps`` timed steps, in ``rows`` order."""
    log(f"warm-up: {args.warmup} steps per row")
    for name in rows:
        run(name, args.warmup, False)
    if after_warmup is not None:
        after_warmup()
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for name in rows:
            run(name, args.steps, True)


def write_worker_out(path: str, model: dict[str, Any], rows: dict[str, Any], t_start: float,
                     **extra: Any) -> None:  # fmt: skip
    """Node 0 writes the run's JSON: the link, the mesh, ``model``, ``extra``, ``rows`` and
    the seconds since ``t_start``."""
    import jax

    if jax.process_index() != 0:
        return
    out = {
        "link_bps": int(os.environ.get("JAXCOMM_TESTBED_LINK_BPS", 0)),
        "nodes": jax.process_count(),
        "devices_per_node": jax.local_device_count(),
        "model": model,
        **extra,
        "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }
    with open(path, "w") as f:
        json.dump(out, f)


# -- the training budget (no testbed) -------------------------------------------------------
#: Rows of the training budget by default: the f32 baselines, the rows that change the
#: update (compression), each once. Left out: the compute-only twins (no synchronised
#: model); DDP's bucket settings and ``gradient_as_bucket_view`` (the same update as
#: ``torch-f32``: see :data:`SAME_UPDATE`); the rest on request (``--rows``).
BUDGET_ROWS = ("jax-f32", "jax-stacked", "jax-powersgd", "torch-f32", "torch-fp16",
               "torch-bf16", "torch-powersgd")  # fmt: skip
#: Timed rows that compute the same update as a budget row (two ranks: a + b = b + a in
#: f32 whatever the bucket bounds), so they take that row's accuracy verdict.
SAME_UPDATE = {"torch-f32-tuned": "torch-f32", "torch-f32-view": "torch-f32"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def budget_worker(
    args: argparse.Namespace, progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Trains every row of ``args.rows`` ``args.budget`` steps from each seed of
    ``args.seeds``; returns each row's test accuracy per seed.

    No testbed (accuracy does not depend on the link): JAX rows in this process on the
    first ``nodes x devices_per_node`` devices, as a ``(nodes, devices_per_node)`` mesh
    whose topology is the testbed's (``JAXCOMM_TOPO_FILE``, so the stacked row compresses
    the same stage); PyTorch rows as ``nodes x torch_ranks_per_node`` gloo ranks on
    loopback. Every row of a seed starts from that seed's initialisation and sees that
    seed's data order. Rows run one after the other, all seeds of a row before the next
    (each JAX row compiled once), in ``--rows`` order; the PyTorch rows run in a thread
    beside the JAX rows (their ranks are processes of their own).

    Args:
      args: the parsed command line (``rows``, ``seeds`` as lists).
      progress: called with the results so far after every (row, seed).

    Returns:
      ``{'rows': {row: {'accuracy': [per seed], 'seconds': [per seed], 'error'?}}, ...}``
      with the seeds, devices, ranks, threads and topology.
    """
    import tempfile
    import threading

    import jax

    import jaxcomm
    from experiments.bench.digits import data_order
    from jaxcomm.tools.testbed import Testbed

    n = args.nodes * args.devices_per_node
    mesh = jaxcomm.make_mesh(intra=args.devices_per_node, devices=jax.devices()[:n])
    x_tr, y_tr, x_te, y_te = digits_images(args.px)
    datas = {
        seed: {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te,
               "order": data_order(seed, args.budget, args.batch), "batch": args.batch}
        for seed in args.seeds
    }  # fmt: skip
    rows = [r for r in args.rows if r not in TWINS.values()]
    world = args.nodes * args.torch_ranks_per_node
    threads = max(1, (os.cpu_count() or 1) // world)
    topo = Testbed(nodes=args.nodes, devices_per_node=args.devices_per_node,
                   link=args.link).topology()  # fmt: skip
    out: dict[str, Any] = {
        "rows": {r: {"accuracy": [], "seconds": []} for r in rows},
        "seeds": list(args.seeds), "torch_threads": threads, "jax_devices": n,
        "torch_ranks": world, "topology": topo,
    }  # fmt: skip
    lock = threading.Lock()

    def record(name: str, seed: int, acc: float, seconds: float) -> None:
        with lock:
            out["rows"][name]["accuracy"].append(acc)
            out["rows"][name]["seconds"].append(seconds)
            print(f"  {name} seed {seed}: accuracy {acc:.3f} ({seconds:.0f} s)", flush=True)
            if progress is not None:
                progress(out)

    torch_rows = [r for r in rows if framework(r) == "torch"]
    failures: list[BaseException] = []

    def torch_part() -> None:
        try:
            _budget_torch(args, torch_rows, datas, world, threads, record, out["rows"])
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            failures.append(e)

    thread = threading.Thread(target=torch_part, daemon=True)
    if torch_rows:
        thread.start()
    with tempfile.TemporaryDirectory() as d:
        topo_file = os.path.join(d, "topology.json")
        with open(topo_file, "w") as f:
            json.dump(topo, f)
        old_topo = os.environ.get("JAXCOMM_TOPO_FILE")
        os.environ["JAXCOMM_TOPO_FILE"] = topo_file
        try:
            _budget_jax(args, [r for r in rows if framework(r) == "jaxcomm"], datas, mesh,
                        record)  # fmt: skip
        finally:
            if old_topo is None:
                os.environ.pop("JAXCOMM_TOPO_FILE", None)
            else:
                os.environ["JAXCOMM_TOPO_FILE"] = old_topo
    if torch_rows:
        thread.join()
    if failures:
        raise failures[0]
    return out


def _budget_torch(args, rows, datas, world, threads, record, results) -> None:
    """The PyTorch rows of :func:`budget_worker`: one set of ranks, re-seeded per run."""
    first = next(iter(datas))
    cfg = _torch_cfg(args, datas[first], first, world, threads)
    side = _Torch(cfg, node=0, nodes=1, addr="127.0.0.1", port=_free_port())
    try:
        for name in rows:
            for seed, data in datas.items():
                t0 = time.perf_counter()
                side.ask("reseed", seed, data["order"])
                answers = side.ask("run", name, args.budget)
                ans = next((a for a in answers.values() if "error" in a), answers[0])
                if "error" in ans:
                    results[name]["error"] = ans["error"]
                    print(f"  {name} seed {seed}: failed: {ans['error']}", flush=True)
                    side.ask("drop", name)
                    break
                acc = side.ask("eval", name)[0]["accuracy"]
                side.ask("drop", name)
                record(name, seed, acc, time.perf_counter() - t0)
    finally:
        side.close()


def _budget_jax(args, rows, datas, mesh, record) -> None:
    """The JAX rows of :func:`budget_worker`: each compiled once, its state re-initialised
    from each seed's model."""
    models = {seed: _jax_model(seed) for seed in datas}
    for name in rows:
        row = None
        for seed, data in datas.items():
            t0 = time.perf_counter()
            graphdef, params, stats = models[seed]
            if row is None:
                seeded = argparse.Namespace(**{**vars(args), "seed": seed})
                row = _JaxRow(name, seeded, models[seed], mesh)
            else:
                row.reset(params, stats)
            row.run(args.budget, data)
            record(name, seed, row.accuracy(graphdef, data), time.perf_counter() - t0)
        del row


def budget_summary(
    accuracies: dict[str, Sequence[float]], baselines: Sequence[str] = tuple(BASELINES.values())
) -> dict[str, Any]:
    """Mean, spread and equal-accuracy verdict of each row's test accuracy over seeds.

    The f32 band is ``[min, max]`` of every seed's accuracy of the f32 baseline rows
    present (``baselines``: jaxcomm's flat f32 psum and PyTorch's DDP f32). A row's
    verdict compares its mean with the band: ``'equal'`` inside it (ends included),
    ``'above'`` over it, ``'below'`` under it; ``'equal'`` and ``'above'`` count as equal
    accuracy (at least f32's).

    Args:
      accuracies: row -> test accuracy per seed (a failed row: an empty list).
      baselines: the f32 rows that make the band.

    Returns:
      ``{'band': [lo, hi], 'band_rows': [...], 'rows': {row: {'label', 'framework',
      'accuracy', 'mean', 'std', 'range', 'verdict'}}}``; ``std`` is the sample standard
      deviation (None for one seed); a row without accuracies has None figures.

    Raises:
      ValueError: no baseline row has an accuracy (no band).
    """
    band_rows = [r for r in baselines if accuracies.get(r)]
    if not band_rows:
        raise ValueError(
            f"budget_summary: no accuracy of the f32 rows {list(baselines)}; the band of "
            "equal accuracy needs at least one (add them to --rows)"
        )
    f32 = [a for r in band_rows for a in accuracies[r]]
    lo, hi = min(f32), max(f32)
    out: dict[str, dict[str, Any]] = {}
    for name, accs in accuracies.items():
        accs = list(accs)
        mean = statistics.fmean(accs) if accs else None
        verdict = None
        if mean is not None:
            verdict = "below" if mean < lo else "above" if mean > hi else "equal"
        out[name] = {
            "label": labels().get(name, name),
            "framework": framework(name),
            "accuracy": accs,
            "mean": mean,
            "std": statistics.stdev(accs) if len(accs) > 1 else None,
            "range": [min(accs), max(accs)] if accs else None,
            "verdict": verdict,
        }
    return {"band": [lo, hi], "band_rows": band_rows, "rows": out}


def equal_accuracy_exposure(budget: dict[str, Any], timed: dict[str, dict[str, Any]]) -> dict:
    """Joins the budget's verdicts with a timed run's exposed communication.

    Args:
      budget: :func:`budget_summary`'s result.
      timed: :func:`summarize`'s result of a timed run (the rows' ``exposed_comm_s``).

    Returns:
      ``{'rows': {timed row: {'exposed_comm_s', 'verdict', 'verdict_of'}}, 'best':
      {framework: row or None}, 'ratio': jaxcomm's best / PyTorch's best exposed time (None
      unless both exist)}``; a timed row takes the verdict of the budget row of the same key
      or of :data:`SAME_UPDATE`; best: the least exposed time among the rows of equal
      accuracy (verdict ``'equal'`` or ``'above'``).
    """
    rows: dict[str, dict[str, Any]] = {}
    for name, t in timed.items():
        if name in TWINS.values() or t.get("exposed_comm_s") is None:
            continue
        src = name if name in budget["rows"] else SAME_UPDATE.get(name)
        verdict = budget["rows"][src]["verdict"] if src in budget["rows"] else None
        rows[name] = {"exposed_comm_s": t["exposed_comm_s"], "verdict": verdict,
                      "verdict_of": src}  # fmt: skip
    best: dict[str, str | None] = {}
    for fw in ("jaxcomm", "torch"):
        ok = [n for n, r in rows.items()
              if framework(n) == fw and r["verdict"] in ("equal", "above")]  # fmt: skip
        best[fw] = min(ok, key=lambda n: rows[n]["exposed_comm_s"]) if ok else None
    ratio = None
    if best["jaxcomm"] and best["torch"]:
        ratio = rows[best["jaxcomm"]]["exposed_comm_s"] / rows[best["torch"]]["exposed_comm_s"]
    return {"rows": rows, "best": best, "ratio": ratio}


def build_budget_table(budget: dict[str, Any], exposure: dict[str, Any] | None = None) -> str:
    """A Markdown table of :func:`budget_summary` (with the timed run's exposed time when
    ``exposure`` is given), then the band's definition and, with ``exposure``, the best
    row of each framework at equal accuracy and their ratio."""

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lo, hi = budget["band"]
    exp_rows = (exposure or {}).get("rows", {})
    lines = [
        "| row | test acc per seed | mean | std (min-max) | vs f32 band | exposed comm s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in budget["rows"].items():
        if r["mean"] is None:
            lines.append(f"| {r['label']} | failed | | | | |")
            continue
        seeds = " ".join(f"{a:.3f}" for a in r["accuracy"])
        spread = f"{f(r['std'], '.3f')} ({r['range'][0]:.3f}-{r['range'][1]:.3f})"
        exp = exp_rows.get(name, {}).get("exposed_comm_s")
        lines.append(f"| {r['label']} | {seeds} | {r['mean']:.3f} | {spread} | "
                     f"{r['verdict']} | {f(exp, '.3f')} |")  # fmt: skip
    band = ", ".join(labels().get(b, b) for b in budget["band_rows"])
    lines.append("")
    lines.append(f"f32 band: [{lo:.3f}, {hi:.3f}], min-max of every seed of {band}; "
                 "a row's mean inside it: equal, over it: above (both count as equal "
                 "accuracy), under it: below.")  # fmt: skip
    if exposure is not None:
        for name, r in exp_rows.items():
            if name not in budget["rows"] and r["verdict_of"]:
                lines.append(
                    f"{labels().get(name, name)}: {r['verdict']} (the update of "
                    f"{r['verdict_of']}), {r['exposed_comm_s']:.3f} s exposed."
                )
        for fw, name in exposure["best"].items():
            what = "none"
            if name is not None:
                what = f"{labels().get(name, name)}, {exp_rows[name]['exposed_comm_s']:.3f} s"
            lines.append(f"best {fw} row at equal accuracy (exposed comm): {what}")
        if exposure["ratio"] is not None:
            lines.append(f"exposed time, jaxcomm's best / PyTorch's best at equal accuracy: "
                         f"{exposure['ratio']:.3f}")  # fmt: skip
    return "\n".join(lines)


def complete_rows(run: dict[str, Any]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """A budget JSON's rows split into those with an accuracy for every seed and the rest
    (a run stopped early, ``'partial'``: its last rows are cut, not averaged over fewer
    seeds).

    Returns:
      ``(complete, cut)``: row -> accuracies per seed.
    """
    n = len(run["seeds"])
    complete = {r: v["accuracy"] for r, v in run["rows"].items() if len(v["accuracy"]) == n}
    cut = {r: v["accuracy"] for r, v in run["rows"].items() if r not in complete}
    return complete, cut


def table_of(paths: str, timed_json: str | None) -> int:
    """``--table-of``: the budget table of budget runs' JSONs (comma-separated, the same
    seeds and settings; a row is taken from the first file where it ran every seed), also
    of runs stopped early."""
    run: dict[str, Any] = {}
    for path in paths.split(","):
        with open(path) as f:
            part = json.load(f)
        if not run:
            run = part
            continue
        if part["seeds"] != run["seeds"]:
            raise SystemExit(f"--table-of: {path} has seeds {part['seeds']}, not {run['seeds']}")
        have, _ = complete_rows(run)
        run["rows"] |= {r: v for r, v in part["rows"].items() if r not in have}
    complete, cut = complete_rows(run)
    budget = budget_summary(complete)
    exposure = None
    if timed_json:
        with open(timed_json) as f:
            timed = json.load(f)
        exposure = equal_accuracy_exposure(budget, timed.get("summary") or summarize(timed))
    print(f"{run.get('command')}\nseeds {run['seeds']}; {run.get('uptime_before')} / "
          f"{run.get('uptime_now') or run.get('uptime_after')}")  # fmt: skip
    print(build_budget_table(budget, exposure))
    for name, accs in cut.items():
        done = " ".join(f"{a:.3f}" for a in accs) or "none"
        print(f"cut (not every seed ran): {labels().get(name, name)}; seeds done: {done}")
    return 0


def budget_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``--budget``: the training-budget comparison (see :func:`budget_worker`)."""
    import jax

    need = args.nodes * args.devices_per_node
    if jax.device_count() < need:
        from experiments.bench.digits import reexec_with_fake_devices

        return reexec_with_fake_devices("peers", argv, need)
    if any(framework(r) == "torch" for r in args.rows):
        try:
            import torch  # noqa: F401
            import torchvision  # noqa: F401
        except ImportError as e:
            print(f"bench peers: {e}; pip install -e '.[bench]'", file=sys.stderr)
            return 2
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    load_before = os.getloadavg()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)

    def progress(partial: dict[str, Any]) -> None:  # what is done so far, if the run stops
        now = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        head = {"partial": True, "command": "python -m experiments.bench peers " + " ".join(argv),
                "uptime_before": uptime_before, "uptime_now": now}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(head | partial, f, indent=1)

    run = budget_worker(args, progress)
    exposure = budget = None
    try:
        budget = budget_summary({r: v["accuracy"] for r, v in run["rows"].items()})
    except ValueError as e:  # no f32 row: its table comes from --table-of with one that has
        print(f"{e}; join this JSON with one that has: --table-of A.json,B.json")
    if args.timed_json and budget is not None:
        with open(args.timed_json) as f:
            timed = json.load(f)
        exposure = equal_accuracy_exposure(budget, timed.get("summary") or summarize(timed))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    run |= {
        "budget": budget,
        "exposure": exposure,
        "timed_json": args.timed_json,
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")},
        "command": "python -m experiments.bench peers " + " ".join(argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "load_avg_before": load_before,
        "uptime_before": uptime_before,
        "uptime_after": uptime,
        "seconds": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(
        f"\nTraining budget: ResNet-18 on digits at {args.px} px, global batch {args.batch}, "
        f"Adam lr {args.lr}, {args.budget} steps, seeds {args.seeds}; JAX {need} devices "
        f"as {args.nodes} x {args.devices_per_node}, PyTorch {run['torch_ranks']} gloo "
        f"ranks x {run['torch_threads']} threads, loopback"
    )
    if budget is not None:
        print(build_budget_table(budget, exposure))
    else:
        for name, r in run["rows"].items():
            print(f"  {labels().get(name, name)}: {r['accuracy']}")
    print(f"load: {uptime_before} / {uptime}; {run['seconds']:.0f} s")
    with open(args.json, "w") as f:
        json.dump(run, f, indent=1)
    print(f"wrote {args.json}")
    return 0


# -- summary, table, plot ------------------------------------------------------------------
def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(
    run: dict[str, Any],
    *,
    twins: dict[str, str] = TWINS,
    baselines: dict[str, str] = BASELINES,
    names: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per-row figures from the worker's per-round measurements.

    Args:
      run: the worker's JSON: ``rows`` maps a row name to ``times_s`` and ``bytes`` (one
        entry per round) and optionally ``accuracy``, ``error``, ``fix``.
      twins, baselines: each framework's compute-only twin and f32 baseline row (the
        GPT workload's differ: ``peers_lm``).
      names: row key -> name in the table (default :func:`labels`).

    Returns:
      Row name -> ``step_time_s``, ``step_range_s``, ``compute_s``, ``exposed_comm_s``,
      ``speedup``, ``speedup_range``, ``link_bytes_per_step``, ``accuracy``, ``error``,
      ``fix``; figures that cannot be computed (a failed row, a missing twin) are None.
    """
    rows = run["rows"]
    names = labels() if names is None else names
    out: dict[str, dict[str, Any]] = {}
    for name, r in rows.items():
        fw = framework(name)
        times = r.get("times_s") or []
        twin = rows.get(twins[fw], {}).get("times_s") or []
        base = rows.get(baselines[fw], {}).get("times_s") or []
        paired = len(twin) == len(times)
        exposed = [t - c for t, c in zip(times, twin, strict=False)] if paired else []
        speed = (
            [b / t for b, t in zip(base, times, strict=False)] if len(base) == len(times) else []
        )
        out[name] = {
            "label": names.get(name, name),
            "framework": fw,
            "step_time_s": _median(times),
            "step_range_s": [min(times), max(times)] if times else None,
            "compute_s": _median(twin),
            "exposed_comm_s": None if name == twins[fw] else _median(exposed),
            "speedup": _median(speed) if name != twins[fw] else None,
            "speedup_range": [min(speed), max(speed)] if speed and name != twins[fw] else None,
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
    keys = ", ".join(labels())
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench peers",
        description="PyTorch DDP (gloo) with its communication hooks beside jaxcomm's rows, "
        "ResNet-18 on digits, one run on the emulated network (needs root and iproute2); "
        "with --budget, their test accuracy over seeds after a training budget (no testbed).",
    )
    p.add_argument(
        "--workload",
        choices=["resnet18", "gpt"],
        default="resnet18",
        help="resnet18: DDP and its hooks (this help); gpt: PyTorch FSDP2 (HSDP f32 and "
        "bf16 reduce, in-node FSDP with an int8 all-reduce hook) beside jaxcomm's "
        "shard_params=True rows on the byte-level GPT, its own flags: "
        "--workload gpt --help (experiments.bench.peers_lm)",
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
                   help="PowerSGD's first compressed step (both frameworks: torch's "
                   "start_powerSGD_iter, jaxcomm's sync_gradients(warmup_steps=...); "
                   "f32 all-reduce before it)")  # fmt: skip
    p.add_argument("--sync-every", type=int, default=8, help="local steps: H")
    p.add_argument("--stacked-rung", default="int4",
                   help="the rung the stacked row's adaptive compressor is held on")  # fmt: skip
    p.add_argument("--tune-buckets", default="1,5,25,100",
                   help="bucket_cap_mb candidates for the tuned DDP row")  # fmt: skip
    p.add_argument("--tune-steps", type=int, default=2, help="timed steps per candidate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated row keys, in the order each round runs them: {keys} "
        "(default: all but those in LEFT_OUT; with --budget: "
        f"{','.join(BUDGET_ROWS)})",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=0,
        help="training-budget mode instead of the timed rounds: train every row of --rows "
        "(but the compute-only twins) this many steps from each of --seeds without the "
        "testbed (no root; accuracy does not depend on the link): JAX rows in one process "
        "on nodes x devices-per-node CPU devices (fake ones if needed) with the testbed's "
        "topology, PyTorch rows as nodes x torch-ranks-per-node gloo ranks on loopback; "
        "prints each row's test accuracy per seed, mean, spread and its verdict against "
        "the f32 rows' band (0: the timed rounds)",
    )
    p.add_argument(
        "--table-of",
        default=None,
        metavar="JSON",
        help="print the budget table of --budget runs' JSONs (comma-separated: rows joined; "
        "also of runs stopped early: rows without every seed are listed as cut) and exit; "
        "with --timed-json",
    )
    p.add_argument("--seeds", default="0,1,2",
                   help="--budget: comma-separated seeds (initialisation, data order)")  # fmt: skip
    p.add_argument(
        "--timed-json",
        default=None,
        help="--budget: a timed run's JSON; its exposed communication per row joins the "
        "table, and the best row of each framework at equal accuracy and the ratio of "
        "their exposed times are printed",
    )
    p.add_argument("--json", default="runs/peers.json",
                   help="output JSON path (--budget: rewritten after every row and seed, "
                   "marked partial until the run ends)")  # fmt: skip
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def default_rows(budget: int) -> list[str]:
    """The rows ``--rows`` defaults to: :data:`BUDGET_ROWS` with ``--budget``, else every
    row but those in :data:`LEFT_OUT`, the two frameworks' rows interleaved."""
    from experiments.bench import peers_torch

    if budget:
        return list(BUDGET_ROWS)
    torch_names = [r.name for r in peers_torch.ROWS]
    return _interleave([r for r in JAX_ROWS if r not in LEFT_OUT], torch_names)


def _interleave(a: list[str], b: list[str]) -> list[str]:
    out = []
    for i in range(max(len(a), len(b))):
        out += a[i : i + 1] + b[i : i + 1]
    return out


def validate(args: argparse.Namespace, torch_names: Sequence[str]) -> str | None:
    """Why these arguments cannot run, or None."""
    rows = [r for r in (args.rows or ",".join(default_rows(args.budget))).split(",") if r]
    known = set(JAX_ROWS) | set(torch_names)
    if args.budget:
        return _validate_budget(args, rows, known)
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


def _validate_budget(args: argparse.Namespace, rows: list[str], known: set[str]) -> str | None:
    bad = [r for r in rows if r not in known]
    if bad:
        return f"--rows: unknown {bad}; choose from {sorted(known)}"
    if args.budget < 1:
        return f"--budget {args.budget}: at least 1 step"
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        return f"--seeds {args.seeds!r}: comma-separated integers, e.g. 0,1,2"
    if not seeds or len(set(seeds)) != len(seeds):
        return f"--seeds {args.seeds!r}: at least one, each once, e.g. 0,1,2"
    devices, world = args.nodes * args.devices_per_node, args.nodes * args.torch_ranks_per_node
    for n, what in ((devices, "devices"), (world, "PyTorch ranks")):
        if args.batch % n:
            return f"--batch {args.batch}: a multiple of the {n} {what}"
    if args.px % 8 or args.px < 8:
        return f"--px {args.px}: a multiple of 8"
    if "jax-local" in rows and args.budget % args.sync_every:
        return f"--budget {args.budget}: a multiple of --sync-every {args.sync_every}"
    if any(r.startswith("torch") and "powersgd" in r for r in rows) and (
        args.powersgd_start < 2 or args.budget <= args.powersgd_start
    ):
        return (f"--powersgd-start {args.powersgd_start}: at least 2 and below --budget "
                f"{args.budget}")  # fmt: skip
    return None


def main(argv: list[str] | None = None) -> int:
    from experiments.bench import peers_torch

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", default="resnet18")
    if pre.parse_known_args(argv)[0].workload == "gpt":
        from experiments.bench import peers_lm

        return peers_lm.main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.table_of:
        return table_of(args.table_of, args.timed_json)
    if args.rows is None:
        args.rows = ",".join(default_rows(args.budget))
    why = validate(args, [r.name for r in peers_torch.ROWS])
    if why:
        parser.error(why)
    args.rows = [r for r in args.rows.split(",") if r]
    if args.budget:
        args.seeds = [int(x) for x in args.seeds.split(",") if x]
        return budget_main(args, argv)
    if args.worker:
        return worker(args)
    modules = ("torch", "torchvision") if any(framework(r) == "torch" for r in args.rows) else ()
    rc, run = run_on_testbed(args, _strip(argv, ("--json", "--plot")), modules)
    if run is None:
        return rc
    summary = summarize(run)
    run |= {
        "summary": summary,
        "left_out": {k: why for k, why in LEFT_OUT.items() if k not in args.rows},
    } | run_record(args, argv)
    uptime = run["uptime_after"]
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
    print(f"load: before {run['load_avg_before'][0]:.2f}; {uptime}")
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


def run_on_testbed(
    args: argparse.Namespace, worker_args: list[str], modules: Sequence[str] = ()
) -> tuple[int, dict[str, Any] | None]:
    """Runs this bench's worker on every node of a testbed (``args.nodes``,
    ``args.devices_per_node``, ``args.link``) after checking that ``modules`` import and
    that the testbed can run here (each failure printed).

    Returns:
      ``(returncode, run)``: node 0's JSON with ``load_avg_before`` and ``uptime_before``
      added, or None when the run could not start or failed.
    """
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"bench peers: {e}; pip install -e '.[bench]'", file=sys.stderr)
            return 2, None
    from experiments.bench.testbed import run_worker
    from jaxcomm.tools import testbed

    ok, why = testbed.available()
    if not ok:
        print(f"bench peers: cannot run here: {why}", file=sys.stderr)
        return 2, None
    # glibc's per-thread malloc arenas hold freed memory: ten models in a process add up
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    load_before = os.getloadavg()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rc, run = run_worker("peers", worker_args, nodes=args.nodes,
                         devices_per_node=args.devices_per_node, link=args.link)  # fmt: skip
    if rc != 0:
        print(f"bench peers: the run failed with {rc}", file=sys.stderr)
        return rc, None
    return 0, run | {"load_avg_before": load_before, "uptime_before": uptime_before}


def run_record(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """What a run's JSON records beside its figures: the link, the settings, the command,
    the machine, the load after it (``uptime``) and the date."""
    return {
        "link": args.link,
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")},
        "command": "python -m experiments.bench peers " + " ".join(argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "load_avg_after": os.getloadavg(),
        "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


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
