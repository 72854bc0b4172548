"""``python -m experiments.bench testbed``: gradient all-reduce across an emulated slow link.

Builds a :class:`jaxcomm.tools.testbed.Testbed` (2 nodes x 2 devices by default) per link rate and
runs this module with ``--worker`` on every node. The worker times, side by side in one run:

* jaxcomm methods on a data-parallel step whose gradient is a ``size``-byte f32 buffer
  (``loss = <w, x>``, so the gradient is the local batch row and compute is negligible):
  flat psum, hierarchical, int8 (flat, and on the inter stage only), topk(1%), powersgd,
  each with the line-rate time of the bytes its compiled HLO sends across a node's link
  (``jaxcomm.wire_bytes(...)['crossing']['inter']``) and its efficiency (that time / the
  time the sync adds to the step);
* the same step without any collective (the compute-only twin), to show the overhead;
* probes on the same buffer: the flat psum alone (as PyTorch's rows time theirs), psum over
  ``intra`` alone and over ``inter`` alone (their bus bandwidths give the measured
  intra:inter ratio), the three hierarchical stages, the sharded optimizer's two inter
  stages (a reduce-scatter on S/g and an all-gather back to it), and the overlap probe: an
  inter psum beside independent compute in one program, to see whether XLA:CPU runs them
  concurrently;
* PyTorch's gloo ``all_reduce`` in f32 and fp16 (the DDP default and its fp16 hook), one rank
  per device, on the same namespaces, when torch is importable.

Speedups are ``flat time / method time`` from the same run. ``busbw/link`` is the flat psum's
bus bandwidth (``2(p-1)/p * S / t``, the bytes each rank sends on a ring) over the link rate.

Example:
  sudo python -m experiments.bench testbed --links 1gbit,250mbit --sizes-mib 16,64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

COMPRESSORS = {  # row name -> (factory name in jaxcomm.compression, args, sync_gradients kwargs)
    "int8": ("int8", {}, {"algorithm": "flat"}),
    "int8, inter stage only (hierarchical)": (
        "int8",
        {},
        {"algorithm": "hierarchical", "compress_stage": "inter"},
    ),
    "topk(1%)": ("topk", {"ratio": 0.01}, {"algorithm": "flat"}),
    "powersgd(r=4)": ("powersgd", {"rank": 4}, {"algorithm": "flat"}),
}
COLS = 1024  # gradient shape (rows, 1024): a matrix, so PowerSGD has something to factor


def _worker_jax(sizes_mib: list[int], reps: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm.tools.profiler import median_time

    mesh = jaxcomm.make_mesh()
    axes = ("inter", "intra")
    n_dev = mesh.devices.size
    me, ldev = jax.process_index(), jax.local_device_count()
    rows_out: list[dict[str, Any]] = []

    def loss_fn(params, batch):
        return jnp.vdot(params["w"], batch["x"][0])

    for size_mib in sizes_mib:
        rows = size_mib * (1 << 20) // 4 // COLS
        nbytes = rows * COLS * 4
        local = np.stack(
            [
                np.random.default_rng(d).standard_normal((rows, COLS), dtype=np.float32)
                for d in range(me * ldev, (me + 1) * ldev)
            ]
        )
        # The exact mean, to check every method (each process regenerates all devices' rows).
        want = sum(
            np.random.default_rng(d).standard_normal((rows, COLS), dtype=np.float32)
            for d in range(n_dev)
        ) / np.float32(n_dev)
        sharding = NamedSharding(mesh, P(axes))
        batch = {"x": jax.make_array_from_process_local_data(sharding, local)}
        params = {"w": jnp.zeros((rows, COLS), jnp.float32)}

        def step_of(tx, require_sync=True, params=params, batch=batch):
            dp = jaxcomm.data_parallel(loss_fn, tx, mesh, require_sync=require_sync)
            state = dp.init(params)
            fn = dp.lower(state, batch).compile()
            wire = jaxcomm.wire_bytes(fn, mesh=mesh)
            return state, lambda: fn(state, batch), wire["crossing"].get("inter", 0.0)

        methods: dict[str, Any] = {
            "flat psum": optax.chain(jaxcomm.sync_gradients(algorithm="flat")),
            "hierarchical": optax.chain(jaxcomm.sync_gradients(algorithm="hierarchical")),
        }
        for name, (factory, kwargs, sync_kwargs) in COMPRESSORS.items():
            comp = getattr(jaxcomm.compression, factory)(**kwargs)
            methods[name] = optax.chain(jaxcomm.sync_gradients(compression=comp, **sync_kwargs))
        results: dict[str, dict[str, Any]] = {}
        for name, tx in methods.items():
            state, run, crossing = step_of(tx)
            t = median_time(run, (), reps)
            new = run()[0].params["w"]
            got = np.asarray(new.addressable_shards[0].data)  # params 0 + mean grad
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            results[name] = {"time_s": t, "rel_error": err, "link_bytes": crossing}
        _, run, _ = step_of(optax.identity(), require_sync=False)
        results["compute only (no collective)"] = {"time_s": median_time(run, (), reps)}
        # Probes on the same buffer: psum over one axis alone (their bus bandwidths give the
        # intra:inter ratio), and the three stages of the hierarchical all-reduce.
        g, m = mesh.shape["intra"], mesh.shape["inter"]
        x1 = jax.make_array_from_process_local_data(sharding, local.reshape(ldev, -1))
        xs = jax.make_array_from_process_local_data(
            sharding, local.reshape(ldev, -1)[:, : x1.shape[1] // g]
        )
        xc = jax.make_array_from_process_local_data(  # one device's chunk of S/g
            sharding, local.reshape(ldev, -1)[:, : x1.shape[1] // g // m]
        )
        p = g * m
        probes = {  # name -> (fn, input, bytes moved per rank by the nccl-tests convention)
            # the flat all-reduce alone, as PyTorch's rows time theirs
            "psum over all (flat, alone)": (lambda v: lax.psum(v, axes), x1, 2 * (p - 1) / p),
            "psum over intra only": (lambda v: lax.psum(v, "intra"), x1, 2 * (g - 1) / g),
            "psum over inter only": (lambda v: lax.psum(v, "inter"), x1, 2 * (m - 1) / m),
            "  stage 1: reduce-scatter intra": (
                lambda v: lax.psum_scatter(v, "intra", scatter_dimension=1, tiled=True), x1,
                (g - 1) / g),
            "  stage 2: psum inter on S/g": (lambda v: lax.psum(v, "inter"), xs,
                2 * (m - 1) / m / g),
            "  stage 3: all-gather intra": (
                lambda v: lax.all_gather(v, "intra", axis=1, tiled=True), xs, (g - 1) / g),
            # the sharded optimizer's inter stages (jaxcomm.sharded): the same link bytes
            # as stage 2, in two collectives
            "  sharded: reduce-scatter inter on S/g": (
                lambda v: lax.psum_scatter(v, "inter", scatter_dimension=1, tiled=True), xs,
                (m - 1) / m / g),
            "  sharded: all-gather inter to S/g": (
                lambda v: lax.all_gather(v, "inter", axis=1, tiled=True), xc,
                (m - 1) / m / g),
        }  # fmt: skip
        for name, (fn, arg, factor) in probes.items():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
            t = median_time(lambda f=f, arg=arg: f(arg), (), reps)
            results[name] = {"time_s": t, "busbw_GBps": factor * nbytes / t / 1e9}
        results.update(_overlap_probe(mesh, x1, reps))
        rows_out.append({"bytes": nbytes, "results": results})
    return rows_out


def _overlap_probe(mesh, x, reps: int) -> dict[str, dict[str, float]]:
    """Whether XLA:CPU runs a collective concurrently with independent compute.

    Three programs: an inter-node psum of ``x`` alone, a chain of matrix products alone
    (about as long), and both in one program with no data dependence between them. If the
    runtime overlapped them, the third would take about the longer of the two; if it runs
    them one after the other, about their sum. ``overlap`` is the share of the shorter one
    that was hidden: ``(comm + compute - both) / min(comm, compute)``.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm.tools.profiler import median_time

    axes = ("inter", "intra")
    ldev = jax.local_device_count()
    sharding = NamedSharding(mesh, P(axes))
    a = jax.make_array_from_process_local_data(
        sharding, np.full((ldev, 384, 384), 1e-3, np.float32)
    )

    def work(m):
        for _ in range(32):
            m = jnp.tanh(m @ m)
        return m

    def program(fn, n_in):
        specs = (P(axes),) * n_in
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs,
                                     check_vma=False))  # fmt: skip

    comm_fn = program(lambda v: (lax.psum(v, "inter"),), 1)
    compute_fn = program(lambda m: (work(m),), 1)
    comm = median_time(lambda: comm_fn(x), (), reps)
    compute = median_time(lambda: compute_fn(a), (), reps)
    both_fn = program(lambda v, m: (lax.psum(v, "inter"), work(m)), 2)
    both = median_time(lambda: both_fn(x, a), (), reps)
    hidden = (comm + compute - both) / min(comm, compute)
    return {
        "overlap probe: psum inter alone": {"time_s": comm, "probe": True},
        "overlap probe: compute alone": {"time_s": compute, "probe": True},
        "overlap probe: both, independent": {"time_s": both, "probe": True, "overlap": hidden},
    }


def _torch_rank(rank, world, addr, port, sizes_mib, reps, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    out = {}
    for size_mib in sizes_mib:
        n = size_mib * (1 << 20) // 4
        for dtype, label in ((torch.float32, "torch gloo all_reduce f32"),
                             (torch.float16, "torch gloo all_reduce fp16")):  # fmt: skip
            x = torch.ones(n, dtype=dtype)
            dist.all_reduce(x)
            dist.barrier()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
                dist.barrier()
            out[(size_mib, label)] = sorted(times)[len(times) // 2]
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def _worker_torch(sizes_mib: list[int], reps: int) -> dict | str:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch not installed (pip install 'jaxcomm[bench]')"
    import multiprocessing as mp

    node = int(os.environ["JAXCOMM_PROCESS_ID"])
    nodes = int(os.environ["JAXCOMM_NUM_PROCESSES"])
    dpn = int(os.environ["JAXCOMM_LOCAL_DEVICES"])
    addr = os.environ["JAXCOMM_COORDINATOR"].split(":")[0]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_torch_rank,
            args=(node * dpn + i, nodes * dpn, addr, 23457, sizes_mib, reps, queue),
        )
        for i in range(dpn)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800) if node == 0 else {}
    for p in procs:
        p.join(timeout=120)
    return result


def worker(args) -> int:
    import jaxcomm

    jaxcomm.init_distributed(collective_timeout_s=300)
    import jax

    rows = _worker_jax(args.sizes_mib, args.reps)
    torch_res = _worker_torch(args.sizes_mib, args.reps)
    if jax.process_index() == 0:
        for row in rows:
            size_mib = row["bytes"] >> 20
            for label in ("torch gloo all_reduce f32", "torch gloo all_reduce fp16"):
                if isinstance(torch_res, str):
                    row["results"][label] = {"missing": torch_res}
                else:
                    row["results"][label] = {"time_s": torch_res[(size_mib, label)]}
        with open(args.worker_out, "w") as f:
            json.dump(
                {
                    "link_bps": int(os.environ.get("JAXCOMM_TESTBED_LINK_BPS", 0)),
                    "nodes": jax.process_count(),
                    "devices_per_node": jax.local_device_count(),
                    "rows": rows,
                },
                f,
            )
    return 0


def _table(run: dict[str, Any]) -> list[str]:
    link = run["link_bps"] / 8  # bytes/s
    p = run["nodes"] * run["devices_per_node"]
    lines = []
    for row in run["rows"]:
        res, nbytes = row["results"], row["bytes"]
        flat = res["flat psum"]["time_s"]
        intra = res["psum over intra only"]["busbw_GBps"]
        inter = res["psum over inter only"]["busbw_GBps"]
        busbw = 2 * (p - 1) / p * nbytes / flat
        g = run["devices_per_node"]
        # Bytes per link direction, from each method's compiled HLO (wire_bytes' 'crossing'):
        # a node-ordered ring crosses each node's link once per direction.
        for r in res.values():
            if r.get("link_bytes") is not None:
                r["link_bound_s"] = r["link_bytes"] / link
        lines.append(
            f"\nlink {run['link_bps'] / 1e6:.0f} Mbit/s, {nbytes >> 20} MiB f32, "
            f"{run['nodes']} nodes x {run['devices_per_node']} devices: flat busbw "
            f"{busbw / 1e6:.1f} MB/s = {busbw / link:.2f} of the link; intra:inter bus "
            f"bandwidth per rank {intra * 1e3:.0f}:{inter * 1e3:.0f} MB/s = "
            f"{intra / inter:.1f}x (inter psum uses {g * inter * 1e9 / link:.2f} of the link)"
        )
        lines.append(
            f"  {'method':32s} {'time ms':>9s} {'vs flat':>8s} {'rel err':>9s} {'bound ms':>9s}"
            f" {'effic.':>7s}"
        )
        compute = res["compute only (no collective)"]["time_s"]
        for name, r in res.items():
            if "missing" in r:
                lines.append(f"  {name:32s} {'missing: ' + r['missing']}")
                continue
            if r.get("probe"):
                extra = f"   {r['overlap']:.0%} of the shorter hidden" if "overlap" in r else ""
                lines.append(f"  {name:32s} {r['time_s'] * 1e3:9.1f}{extra}")
                continue
            if "busbw_GBps" in r:  # a stage probe: its bus bandwidth, not a speedup
                bw = r["busbw_GBps"] * 1e3
                # an inter probe: g groups share the link, each at its bus bandwidth
                use = f" = {g * bw * 1e6 / link:.2f} of the link" if "inter" in name else ""
                lines.append(f"  {name:32s} {r['time_s'] * 1e3:9.1f}   busbw {bw:.0f} MB/s{use}")
                continue
            err = f"{r['rel_error']:.1e}" if "rel_error" in r else ""
            bound = f"{r['link_bound_s'] * 1e3:.1f}" if "link_bound_s" in r else ""
            eff = ""
            if r.get("link_bound_s") and r["time_s"] > compute:
                # efficiency: line-rate time of the bytes / the time the sync adds to the step
                r["link_efficiency"] = r["link_bound_s"] / (r["time_s"] - compute)
                eff = f"{r['link_efficiency']:.2f}"
            lines.append(
                f"  {name:32s} {r['time_s'] * 1e3:9.1f} {flat / r['time_s']:7.2f}x {err:>9s}"
                f" {bound:>9s} {eff:>7s}"
            )
    return lines


def run_worker(
    bench: str, worker_args: list[str], **testbed_kwargs: Any
) -> tuple[int, dict[str, Any] | None]:
    """Runs ``python -m experiments.bench BENCH --worker --worker-out OUT *worker_args`` on every
    node of a :class:`jaxcomm.tools.testbed.Testbed` (``testbed_kwargs``) and reads the JSON that
    node 0 wrote to ``OUT``.

    Returns:
      ``(returncode, results)``; ``results`` is None when the run failed.
    """
    from jaxcomm.tools import testbed

    with tempfile.TemporaryDirectory(prefix=f"jc-{bench}-") as tmp:
        out = os.path.join(tmp, "node0.json")
        cmd = [sys.executable, "-m", "experiments.bench", bench, "--worker", "--worker-out", out]
        with testbed.Testbed(**testbed_kwargs) as tb:
            rc = tb.run(cmd + list(worker_args))
        if rc != 0:
            return rc, None
        with open(out) as f:
            return 0, json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench testbed",
        description="All-reduce methods and PyTorch gloo across emulated nodes (needs root).",
    )
    parser.add_argument("--links", default="1gbit,250mbit", help="comma-separated tc rates")
    parser.add_argument("--sizes-mib", default="16,64", help="comma-separated sizes in MiB")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes_mib = [int(s) for s in str(args.sizes_mib).split(",")]
    if args.worker:
        return worker(args)

    from jaxcomm.tools import testbed

    ok, why = testbed.available()
    if not ok:
        print(f"bench testbed: cannot run here: {why}", file=sys.stderr)
        return 2
    runs = []
    for link in args.links.split(","):
        worker_args = ["--sizes-mib", ",".join(map(str, args.sizes_mib)), "--reps", str(args.reps)]
        rc, run = run_worker(
            "testbed", worker_args, nodes=args.nodes, devices_per_node=args.devices_per_node,
            link=link,
        )  # fmt: skip
        if rc != 0:
            print(f"bench testbed: the run at {link} failed with {rc}", file=sys.stderr)
            return rc
        run["link"] = link
        runs.append(run)
        print("\n".join(_table(run)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
