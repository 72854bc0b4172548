"""Scale simulator: step time of data-parallel training on clusters we do not have.

``python -m jaxcomm.simulate --model resnet152 --topology fat_tree --nodes 16,64,256,1024``
prints the all-reduce time per algorithm and the step time, speedup and communication
fraction with the optimisations stacked as rows:

====================  =====================================================================
baseline              flat ``psum`` (NCCL's ring/tree), one collective per gradient tensor,
                      after the backward pass, f32, nodes in scheduler (random) order
+hierarchical         intra-node reduce-scatter / inter-node all-reduce / all-gather
+overlap              each collective starts when its gradients are ready in the backward pass
+compression          bf16 on the wire (``--compression-ratio``, default 2)
+topology             ranks placed leaf/pod-contiguously and the algorithm per collective
                      chosen by ``jaxcomm.cost.choose``
+batching             gradients fused into ``--bucket-mb`` buckets (default 25 MiB, DDP)
====================  =====================================================================

Every collective costs ``--launch-us`` plus ``jaxcomm.cost.predict``. See
``docs/simulator.md`` for the assumptions and the comparison with public figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxcomm import calibration as cal
from jaxcomm import cost
from jaxcomm.step_model import DEFAULT_COMPUTE_S, Workload, step_time, workload
from jaxcomm.topology import Topology, aware_order, dgx_h100, fat_tree, load, ring_hops
from jaxcomm.topology.placement import random_order

__all__ = [
    "DEFAULT_COMPUTE_S",
    "ROWS",
    "Workload",
    "busbw_table",
    "format_tables",
    "main",
    "simulate",
    "step_time",
    "workload",
]

DEFAULT_NODES = (16, 32, 64, 128, 256, 512, 1024)

ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("baseline", dict(algorithm="flat", overlap=False, compress=False, aware=False, batch=False)),
    ("+hierarchical", dict(algorithm="hierarchical", overlap=False, compress=False, aware=False,
                           batch=False)),
    ("+overlap", dict(algorithm="hierarchical", overlap=True, compress=False, aware=False,
                      batch=False)),
    ("+compression", dict(algorithm="hierarchical", overlap=True, compress=True, aware=False,
                          batch=False)),
    ("+topology", dict(algorithm="auto", overlap=True, compress=True, aware=True, batch=False)),
    ("+batching", dict(algorithm="auto", overlap=True, compress=True, aware=True, batch=True)),
)  # fmt: skip


def simulate(
    wl: Workload,
    topology_for: Callable[[int], Topology],
    nodes: Sequence[int] = DEFAULT_NODES,
    *,
    compression_ratio: float = 2.0,
    bucket_bytes: int = 25 * 2**20,
    launch_s: float = 10e-6,
    seed: int = 0,
) -> dict[str, Any]:
    """Runs every row of :data:`ROWS` and every algorithm for each node count.

    Args:
      wl: the workload.
      topology_for: node count -> topology (aware placement; rows without '+topology' use
        a random placement drawn with ``seed``).
      nodes: node counts.
      compression_ratio: wire ratio of '+compression'.
      bucket_bytes: bucket size of '+batching'.
      launch_s: fixed cost per collective call.
      seed: placement seed.

    Returns:
      A JSON-ready dict (see ``--json``).
    """
    out: dict[str, Any] = {"workload": {"name": wl.name, "bytes": wl.total_bytes,
                                        "tensors": len(wl.leaf_bytes),
                                        "compute_s": wl.compute_s},
                           "compression_ratio": compression_ratio, "bucket_bytes": bucket_bytes,
                           "launch_s": launch_s, "nodes": {}}  # fmt: skip
    for n in nodes:
        aware = topology_for(n)
        rand = aware.with_placement(random_order(aware, seed))
        ar = {a: cost.predict(a, wl.total_bytes, aware) for a in cost.ALGORITHMS}
        rows, base = [], None
        for name, cfg in ROWS:
            r = step_time(
                wl,
                aware if cfg["aware"] else rand,
                algorithm=cfg["algorithm"],
                overlap=cfg["overlap"],
                compression_ratio=compression_ratio if cfg["compress"] else 1.0,
                bucket_bytes=bucket_bytes if cfg["batch"] else None,
                launch_s=launch_s,
            )
            base = base or r["step_s"]
            rows.append({"row": name, **r, "speedup": base / r["step_s"],
                         "efficiency": wl.compute_s / r["step_s"]})  # fmt: skip
        out["nodes"][str(n)] = {
            "topology": aware.describe(),
            "devices": aware.num_devices,
            "ring_hops": {
                "random": ring_hops(aware, random_order(aware, seed)),
                "aware": ring_hops(aware, aware_order(aware)),
            },  # fmt: skip
            "allreduce_s": ar,
            "rows": rows,
        }
    return out


BUSBW_SIZES = tuple(1 << k for k in range(10, 33, 2))  # 1 KiB .. 4 GiB


def busbw_table(topology: Topology, sizes: Sequence[int] = BUSBW_SIZES) -> dict[str, Any]:
    """Predicted nccl-tests bus bandwidth (bytes/s) per algorithm and all-reduce size."""
    p = topology.num_devices
    return {
        a: {str(n): cost.busbw(n, p, cost.predict(a, n, topology)) for n in sizes}
        for a in cost.ALGORITHMS
    }


def format_busbw(name: str, table: dict[str, Any]) -> str:
    sizes = list(next(iter(table.values())))
    lines = [f"predicted all-reduce bus bandwidth (GB/s), {name}",
             f"{'bytes':>11} " + " ".join(f"{a:>16}" for a in table)]  # fmt: skip
    for n in sizes:
        lines.append(f"{n:>11} " + " ".join(f"{table[a][n] / 1e9:16.1f}" for a in table))
    return "\n".join(lines)


def format_tables(result: dict[str, Any]) -> str:
    """The two tables (all-reduce per algorithm; stacked rows) as text."""
    wl = result["workload"]
    lines = [
        f"workload {wl['name']}: {wl['bytes'] / 1e6:.1f} MB of gradients in {wl['tensors']} "
        f"tensors, compute {wl['compute_s'] * 1e3:.0f} ms/step",
        "",
        "all-reduce of the whole gradient (ms), aware placement",
        f"{'nodes':>6} {'devices':>7} " + " ".join(f"{a:>16}" for a in cost.ALGORITHMS)
        + f" {'hops rand/aware':>16}",
    ]  # fmt: skip
    for n, r in result["nodes"].items():
        hops = f"{r['ring_hops']['random']:.2f}/{r['ring_hops']['aware']:.2f}"
        lines.append(
            f"{n:>6} {r['devices']:>7} "
            + " ".join(f"{r['allreduce_s'][a] * 1e3:16.2f}" for a in cost.ALGORITHMS)
            + f" {hops:>16}"
        )
    lines += ["", "step time with optimisations stacked"]
    lines.append(f"{'nodes':>6} {'row':<14} {'step ms':>9} {'speedup':>8} {'comm %':>7} "
                 f"{'eff %':>6} {'calls':>6}  algorithms")  # fmt: skip
    for n, r in result["nodes"].items():
        for row in r["rows"]:
            algs = ",".join(f"{k}:{v}" for k, v in sorted(row["algorithms"].items()))
            lines.append(
                f"{n:>6} {row['row']:<14} {row['step_s'] * 1e3:9.1f} {row['speedup']:7.2f}x "
                f"{row['comm_fraction'] * 100:6.1f}% {row['efficiency'] * 100:5.1f}% "
                f"{row['collectives']:>6}  {algs}"
            )
    if "calibration" in result:
        lines += ["", "calibration: prediction error per message size"]
        lines.append(f"{'axis':<8} {'collective':<18} {'p':>3} {'bytes':>11} {'measured ms':>12} "
                     f"{'model ms':>10} {'error':>7}")  # fmt: skip
        for e in result["calibration"]["errors"]:
            lines.append(
                f"{e['axis']:<8} {e['collective']:<18} {e['group_size'] or '-':>3} "
                f"{e['bytes']:>11} {e['measured_s'] * 1e3:12.3f} {e['predicted_s'] * 1e3:10.3f} "
                f"{e['error'] * 100:6.1f}%"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Writes a PNG: all-reduce time per algorithm and step time per row vs nodes."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [int(n) for n in result["nodes"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for a in cost.ALGORITHMS:
        ax1.plot(nodes, [r["allreduce_s"][a] * 1e3 for r in result["nodes"].values()], "o-",
                 label=a)  # fmt: skip
    ax1.set(xscale="log", yscale="log", xlabel="nodes", ylabel="all-reduce (ms)",
            title=f"{result['workload']['name']}: one all-reduce of all gradients")  # fmt: skip
    for i, (name, _) in enumerate(ROWS):
        ax2.plot(nodes, [r["rows"][i]["step_s"] * 1e3 for r in result["nodes"].values()], "o-",
                 label=name)  # fmt: skip
    ax2.set(xscale="log", xlabel="nodes", ylabel="step time (ms)", title="optimisations stacked")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _topology_for(args) -> Callable[[int], Topology]:
    if args.topology == "fat_tree":

        def make(n: int) -> Topology:  # noqa: E306
            return fat_tree(n, args.nodes_per_leaf, args.leaves_per_pod,
                            nics_per_node=args.nics_per_node,
                            link_bandwidth=args.link_gbps * 1e9 / 8,
                            oversubscription=args.oversubscription or 2.0)  # fmt: skip
    elif args.topology == "dgx_h100":

        def make(n: int) -> Topology:  # noqa: E306
            return dgx_h100(n, oversubscription=args.oversubscription or 1.0)
    else:
        base = load(args.topology)

        def make(n: int) -> Topology:
            return base if n == base.num_nodes else base.with_nodes(n)

    if args.calibration:
        calib = cal.load(args.calibration)
        return lambda n: cal.apply(make(n), calib)
    return make


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxcomm.simulate", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model",
        default="resnet152",
        help="resnet50 | resnet101 | resnet152, or a gradient size in bytes",
    )
    p.add_argument(
        "--topology", default="fat_tree", help="fat_tree | dgx_h100 | path to a topology JSON file"
    )
    p.add_argument(
        "--nodes", default=",".join(map(str, DEFAULT_NODES)), help="comma-separated node counts"
    )
    p.add_argument("--nodes-per-leaf", type=int, default=16)
    p.add_argument("--leaves-per-pod", type=int, default=8)
    p.add_argument("--nics-per-node", type=int, default=1, help="fat_tree: NICs per node")
    p.add_argument("--link-gbps", type=float, default=100.0, help="fat_tree: Gb/s per NIC")
    p.add_argument(
        "--oversubscription",
        type=float,
        default=None,
        help="down:up ratio of the tiers above the leaf (default fat_tree 2, dgx_h100 1)",
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="compute per step; default per model (see DEFAULT_COMPUTE_S)",
    )
    p.add_argument("--compression-ratio", type=float, default=2.0)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="MiB per bucket (+batching)")
    p.add_argument("--launch-us", type=float, default=10.0, help="fixed cost per collective")
    p.add_argument("--seed", type=int, default=0, help="random placement seed")
    p.add_argument(
        "--calibration",
        default=None,
        help="JSON of measured alpha/beta per mesh axis and/or raw points",
    )
    p.add_argument(
        "--busbw",
        action="store_true",
        help="also print predicted nccl-tests bus bandwidth per message size",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    args = p.parse_args(argv)  # fmt: skip
    try:
        nodes = [int(v) for v in args.nodes.split(",") if v]
        model = int(args.model) if args.model.isdigit() else args.model
        compute = None if args.compute_ms is None else args.compute_ms / 1e3
        wl = workload(model, compute)
        result = simulate(wl, _topology_for(args), nodes,
                          compression_ratio=args.compression_ratio,
                          bucket_bytes=int(args.bucket_mb * 2**20),
                          launch_s=args.launch_us * 1e-6, seed=args.seed)  # fmt: skip
        if args.calibration:
            calib = cal.load(args.calibration)
            result["calibration"] = {
                "axes": {k: dataclasses.asdict(v) for k, v in calib.axes.items()},
                "errors": cal.prediction_errors(calib),
            }
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["command"] = "python -m jaxcomm.simulate " + " ".join(argv or sys.argv[1:])
    print(format_tables(result))
    if args.busbw:
        make = _topology_for(args)
        result["busbw"] = {}
        for n in nodes:
            topo = make(n)
            result["busbw"][str(n)] = busbw_table(topo)
            print()
            print(format_busbw(topo.describe(), result["busbw"][str(n)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
