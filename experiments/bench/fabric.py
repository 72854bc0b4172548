"""``python -m experiments.bench fabric``: rank order on a leaf-spine fabric, on the wire and timed.

Builds a leaf-spine :class:`jaxcomm.tools.testbed.Testbed` (4 nodes under 2 leaf switches joined by
a slower spine by default; node ``i`` hangs under leaf ``i % leaves``, the order a
network-blind scheduler hands out) and runs this module with ``--worker`` on every node. The
worker all-reduces an f32 buffer with a flat ``psum`` over two meshes of the same devices:

* ``process``: ``jaxcomm.make_mesh()`` in process order. With two leaves the nodes alternate
  leaves, so every hop of the ring crosses the spine: the worst order there is.
* ``topology``: ``jaxcomm.make_mesh(topology=jaxcomm.topology.detect())``, which reads the
  testbed's topology file (``JAXCOMM_TOPO_FILE``) and orders the ring by leaf, so it crosses
  the spine twice per ring, the fewest a ring over two leaves can.

For each order and size it reports the bytes the spine carried during one all-reduce (the
``tc`` byte counters of both spine ends, read between barriers, both directions summed) per
byte of buffer, the line-rate time of those bytes on the spine (``bound``: half of them per
direction, at the spine's rate), the median wall time of the all-reduce and its efficiency
(bound / time); ``speedup`` is the process-order time over the topology-order time, measured
side by side in one run. A ring all-reduce sends
``2(p-1)/p`` bytes per buffer byte on each hop, so the counters should read about
``hops crossing * 2(p-1)/p`` plus TCP/IP headers. Every result is checked against the exact
sum.

Example:
  sudo python -m experiments.bench fabric --nodes 4 --leaves 2 --link 1gbit --spine 200mbit \\
      --sizes-mib 4,16 --json fabric.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

AXES = ("inter", "intra")


def _worker(sizes_mib: list[int], reps: int, out_path: str) -> None:
    import jaxcomm

    jaxcomm.init_distributed(collective_timeout_s=300)
    import jax
    import numpy as np
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm.tools.profiler import median_time
    from jaxcomm.tools.testbed import spine_bytes

    # every device holds its process index + 1
    want = jax.local_device_count() * sum(range(1, jax.process_count() + 1))
    orders = (("process", {}), ("topology", {"topology": jaxcomm.topology.detect()}))
    out: dict[str, Any] = {"rows": []}
    for size in sizes_mib:
        n = (size << 20) // 4
        row: dict[str, Any] = {"bytes": 4 * n}
        for label, kwargs in orders:
            mesh = jaxcomm.make_mesh(**kwargs)
            sharding = NamedSharding(mesh, P(AXES))
            local = np.full((jax.local_device_count(), n), jax.process_index() + 1.0, np.float32)
            x = jax.make_array_from_process_local_data(sharding, local)
            fn = jax.jit(
                jax.shard_map(
                    lambda v: lax.psum(v, AXES), mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)
                )
            )
            jax.block_until_ready(fn(x))  # compile and connect outside the counted window
            multihost_utils.sync_global_devices(f"{label} {size} start")
            before = spine_bytes()
            # nobody sends before every process has read its counters
            multihost_utils.sync_global_devices(f"{label} {size} counted")
            y = jax.block_until_ready(fn(x))
            multihost_utils.sync_global_devices(f"{label} {size} end")
            spine = spine_bytes() - before
            if not all(np.all(np.asarray(s.data) == want) for s in y.addressable_shards):
                raise AssertionError(f"{label} order, {size} MiB: the sum is not {want}")
            multihost_utils.sync_global_devices(f"{label} {size} timed")
            row[label] = {
                "order": [d.process_index for d in mesh.devices.flat],
                "spine_per_byte": spine / (4 * n),
                "time_s": median_time(fn, (x,), reps) if reps else None,
            }
        out["rows"].append(row)
    out["nodes"] = jax.process_count()
    out["devices_per_node"] = jax.local_device_count()
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def _table(run: dict[str, Any]) -> list[str]:
    from jaxcomm.tools.testbed import parse_rate

    spine_rate = parse_rate(run["spine"]) / 8  # bytes/s per direction
    p = run["nodes"] * run["devices_per_node"]
    hop = 2 * (p - 1) / p
    lines = [
        f"{run['nodes']} nodes x {run['devices_per_node']} devices, {run['leaves']} leaves, "
        f"node links {run['link']}, spine {run['spine']}; a ring hop carries {hop:.2f} bytes "
        "per buffer byte",
        f"  {'MiB':>5s} {'order':9s} {'ranks by node':15s} {'spine B/B':>9s} {'hops':>5s}"
        f" {'bound ms':>9s} {'time ms':>9s} {'effic.':>7s} {'speedup':>8s}",
    ]
    for row in run["rows"]:
        t_proc = row["process"]["time_s"]
        for label in ("process", "topology"):
            r = row[label]
            t = r["time_s"]
            # the spine's busier direction carries half of both directions' bytes
            r["spine_bound_s"] = r["spine_per_byte"] * row["bytes"] / 2 / spine_rate
            ms = f"{t * 1e3:9.1f}" if t else f"{'-':>9s}"
            eff = f"{r['spine_bound_s'] / t:7.2f}" if t else f"{'-':>7s}"
            speed = f"{t_proc / t:7.2f}x" if t and t_proc else f"{'-':>8s}"
            lines.append(
                f"  {row['bytes'] >> 20:5d} {label:9s} {str(r['order']):15s}"
                f" {r['spine_per_byte']:9.2f} {r['spine_per_byte'] / hop:5.1f}"
                f" {r['spine_bound_s'] * 1e3:9.1f} {ms} {eff} {speed}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench fabric",
        description="Flat all-reduce on a leaf-spine testbed in process order and in the "
        "order jaxcomm.topology gives: spine bytes and time (needs root).",
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--devices-per-node", type=int, default=1)
    parser.add_argument("--leaves", type=int, default=2, help="leaf switches (>= 2)")
    parser.add_argument("--link", default="1gbit", help="node-to-leaf link rate (tc)")
    parser.add_argument("--spine", default="200mbit", help="leaf-to-leaf spine rate (tc)")
    parser.add_argument("--sizes-mib", default="4,16", help="comma-separated sizes in MiB")
    parser.add_argument("--reps", type=int, default=3, help="timed runs (median); 0: bytes only")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in str(args.sizes_mib).split(",")]
    if args.worker:
        _worker(sizes, args.reps, args.worker_out)
        return 0

    from jaxcomm.tools import testbed

    ok, why = testbed.available()
    if not ok:
        print(f"bench fabric: cannot run here: {why}", file=sys.stderr)
        return 2
    from experiments.bench.testbed import run_worker

    worker_args = ["--sizes-mib", ",".join(map(str, sizes)), "--reps", str(args.reps)]
    rc, run = run_worker(
        "fabric", worker_args, nodes=args.nodes, devices_per_node=args.devices_per_node,
        link=args.link, leaves=args.leaves, spine=args.spine,
    )  # fmt: skip
    if rc != 0:
        print(f"bench fabric: the run failed with {rc}", file=sys.stderr)
        return rc
    run.update(leaves=args.leaves, link=args.link, spine=args.spine)
    print("\n".join(_table(run)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
