"""Scale simulator: step time of data-parallel training on clusters we do not have.

``python -m jaxcomm.tools.simulate --model resnet152 --topology fat_tree --nodes 16,64,256,1024``
prints the all-reduce time per algorithm and the step time, speedup and communication
fraction with the optimisations stacked as rows:

====================  =====================================================================
baseline              flat ``psum`` (NCCL's ring/tree), one collective per gradient tensor,
                      after the backward pass, f32, nodes in scheduler (random) order
+hierarchical         intra-node reduce-scatter / inter-node all-reduce / all-gather
+overlap              each collective starts when its gradients are ready in the backward pass
+compression          the compressor ``--compression`` (default bf16) on ``--compress-stage``
                      (default the inter-node stage): its wire bytes, collectives, codec
                      (``--codec``), packing and calls
+topology             ranks placed leaf/pod-contiguously and the algorithm per collective
                      chosen by ``jaxcomm.cost.choose``
+batching             gradients fused into ``--bucket-mb`` buckets (default 25 MiB, DDP)
====================  =====================================================================

Beside them, the sharded-optimizer rows (``data_parallel(shard_optimizer=True)``, ZeRO-1/2):
gradients reduce-scattered and params all-gathered hierarchically, f32 and ZeRO++-style int8
gradients with bf16 params (:data:`SHARDED_ROWS`, ``jaxcomm.cost.sharded_time``), nothing
overlapped with compute, with each row's bytes per device beside data parallelism's.

Every collective call costs ``--launch-us`` (or the calibration's ``call_s`` by kind) plus
``jaxcomm.cost``'s time. Each row also states its bound: the speedup if its communication
stream (codec included) were hidden behind compute, beside the baseline's own ceiling
(everything hidden: ``1 / (1 - comm share)``).

``--check RESULTS.json`` instead simulates a measured testbed table (``python -m
experiments.resnet152 --preset testbed-resnet18``) row by row from a calibration of that
testbed and of this machine's codec, and prints each prediction beside the measurement.
See ``docs/simulator.md`` for the assumptions and the comparison with public figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxcomm import cost
from jaxcomm.buckets import AutoBuckets
from jaxcomm.tools import calibration as cal
from jaxcomm.tools.step_model import DEFAULT_COMPUTE_S, Workload, step_time, workload
from jaxcomm.topology import Level, Topology, aware_order, dgx_h100, fat_tree, load, ring_hops
from jaxcomm.topology.placement import random_order

__all__ = [
    "CHECK_TOLERANCE",
    "CODECS",
    "DEFAULT_COMPUTE_S",
    "ROWS",
    "SHARDED_ROWS",
    "Workload",
    "busbw_table",
    "check_testbed",
    "codec_table",
    "format_check",
    "format_tables",
    "main",
    "simulate",
    "step_time",
    "testbed_row_config",
    "testbed_topology",
    "workload",
]

DEFAULT_NODES = (16, 32, 64, 128, 256, 512, 1024)
#: ``--codec`` names: an H200's kernels (``jaxcomm.cost.H200_CODEC``) or no codec time.
CODECS = ("h200", "none")
#: The check passes when every row's prediction is within this fraction of the measurement.
CHECK_TOLERANCE = 0.15

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


#: The sharded rows: (name, gradient codec, param-gather codec), ``None`` for f32.
SHARDED_ROWS: tuple[tuple[str, str | None, str | None], ...] = (
    ("sharded f32", None, None),
    ("sharded int8+bf16", "int8", "bf16"),
)


def _sharded_rows(
    wl: Workload, topology: Topology, base: float, codec, calls
) -> list[dict[str, Any]]:
    """The :data:`SHARDED_ROWS` on ``topology``: the step is compute, then the
    reduce-scatter and the param all-gather (``jaxcomm.cost.sharded_time``)."""
    rows = []
    for name, grad, params in SHARDED_ROWS:
        r = cost.sharded_time(
            wl.total_bytes, topology, grad=cost.parse_compression(grad),
            params=cost.parse_compression(params), codec=codec, call_s=calls,
        )  # fmt: skip
        step = wl.compute_s + r["total_s"]
        rows.append({"row": name, "step_s": step, "comm_s": r["total_s"],
                     "codec_s": r["codec_s"], "call_s": r["call_s"], "calls": r["calls"],
                     "exposed_s": r["total_s"], "comm_fraction": r["total_s"] / step,
                     "wire_bytes": r["wire_bytes"], "speedup": base / step,
                     "efficiency": wl.compute_s / step})  # fmt: skip
    return rows


def codec_table(name: str | None) -> tuple[dict[str, cost.Codec], str]:
    """A codec table by ``--codec`` value.

    Args:
      name: 'h200', 'none', or a calibration file with a ``codec`` section.

    Returns:
      ``(kernel -> Codec, description)``.

    Raises:
      ValueError: a file without a codec section (or unreadable / malformed).

    Example:
      >>> table, what = codec_table('h200')
    """
    if name in (None, "none"):
        return {}, "none (codec time not counted)"
    if name == "h200":
        date = cost.measured("h200_codec.json")["date"]
        return dict(cost.H200_CODEC), f"h200 (gpu_check {date} kernel figures)"
    c = cal.load(name)
    if not c.codec:
        raise ValueError(
            f"--codec {name}: the file has no 'codec' section; write one with `python -m "
            f"experiments.bench compression --calibration {name}`, or use one of {list(CODECS)}."
        )
    return dict(c.codec), f"{name} ({c.meta.get('machine', 'machine not recorded')})"


def _call_costs(launch_s: float, calibration: cal.Calibration | None) -> dict[str, float]:
    out = {k: float(launch_s) for k in cost.CALL_KINDS}
    if calibration is not None:
        out.update(calibration.call_s)
    return out


def simulate(
    wl: Workload,
    topology_for: Callable[[int], Topology],
    nodes: Sequence[int] = DEFAULT_NODES,
    *,
    compression_ratio: float | None = None,
    compression: cost.Compression | None = None,
    compress_stage: str = "inter",
    codec: dict[str, cost.Codec] | None = None,
    bucket_bytes: int = 25 * 2**20,
    launch_s: float = 10e-6,
    call_s: Mapping[str, float] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Runs every row of :data:`ROWS` and every algorithm for each node count.

    Args:
      wl: the workload.
      topology_for: node count -> topology (aware placement; rows without '+topology' use
        a random placement drawn with ``seed``).
      nodes: node counts.
      compression_ratio: a ratio-only '+compression': wire bytes divided by this, no
        codec, no change of collective; used only when ``compression`` is None.
      compression: the compressor of '+compression' and the rows after it.
      compress_stage: 'inter' (only the node-spanning stage) or 'all'.
      codec: kernel -> :class:`jaxcomm.cost.Codec`; None: no codec time.
      bucket_bytes: bucket size of '+batching'.
      launch_s: fixed cost per collective call (every kind not in ``call_s``).
      call_s: fixed cost per call by kind (:data:`jaxcomm.cost.CALL_KINDS`).
      seed: placement seed.

    Returns:
      A JSON-ready dict (see ``--json``).

    Example:
      >>> res = simulate(workload('resnet152'), lambda n: fat_tree(n, 16, 8, oversubscription=2),
      ...                [64], compression=cost.parse_compression('adaptive(int4)'),
      ...                codec=cost.H200_CODEC)
    """
    if compression is None and compression_ratio is None:
        compression_ratio = 1.0
    calls = {k: float(launch_s) for k in cost.CALL_KINDS}
    calls.update(call_s or {})
    out: dict[str, Any] = {
        "workload": {"name": wl.name, "bytes": wl.total_bytes, "tensors": len(wl.leaf_bytes),
                     "compute_s": wl.compute_s},
        "compression": None if compression is None else compression.spec,
        "compression_ratio": compression_ratio if compression is None else None,
        "compress_stage": compress_stage, "bucket_bytes": bucket_bytes, "launch_s": launch_s,
        "call_s": calls, "nodes": {},
    }  # fmt: skip
    for n in nodes:
        out["nodes"][str(n)] = _at_nodes(
            wl, topology_for(n), seed, compression_ratio, compression, compress_stage,
            bucket_bytes, calls, codec,
        )  # fmt: skip
    return out


def _at_nodes(
    wl: Workload,
    aware: Topology,
    seed: int,
    compression_ratio: float | None,
    compression: cost.Compression | None,
    compress_stage: str,
    bucket_bytes: int,
    calls: dict[str, float],
    codec: dict[str, cost.Codec] | None,
) -> dict[str, Any]:
    """One node count of :func:`simulate`: every row of :data:`ROWS` on ``aware`` (the
    topology with its aware placement) or on a random placement drawn with ``seed``."""
    rand = aware.with_placement(random_order(aware, seed))
    ar = {a: cost.predict(a, wl.total_bytes, aware) for a in cost.ALGORITHMS}
    rows, base = [], None
    for name, cfg in ROWS:
        r = step_time(
            wl,
            aware if cfg["aware"] else rand,
            algorithm=cfg["algorithm"],
            overlap=cfg["overlap"],
            compression_ratio=(compression_ratio or 1.0) if cfg["compress"] else 1.0,
            compression=compression if cfg["compress"] else None,
            compress_stage=compress_stage,
            bucket_bytes=bucket_bytes if cfg["batch"] else None,
            call_s=calls,
            codec=codec,
        )
        base = base or r["step_s"]
        rows.append({"row": name, **r, "speedup": base / r["step_s"],
                     "efficiency": wl.compute_s / r["step_s"],
                     "bound_speedup": base / max(wl.compute_s, r["comm_s"])})  # fmt: skip
    return {
        "topology": aware.describe(),
        "devices": aware.num_devices,
        "ring_hops": {
            "random": ring_hops(aware, random_order(aware, seed)),
            "aware": ring_hops(aware, aware_order(aware)),
        },  # fmt: skip
        "allreduce_s": ar,
        "rows": rows,
        "sharded": _sharded_rows(wl, aware, base, codec, calls),
        "dp_wire_bytes": cost.sharded_time(wl.total_bytes, aware)["wire_bytes"],
        "ceiling_speedup": base / wl.compute_s,
    }


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
    comp = result.get("compression") or (f"wire ratio {result.get('compression_ratio')} (no codec)")
    lines = [
        f"workload {wl['name']}: {wl['bytes'] / 1e6:.1f} MB of gradients in {wl['tensors']} "
        f"tensors, compute {wl['compute_s'] * 1e3:.0f} ms/step",
        f"+compression: {comp}, stage {result.get('compress_stage')}; codec "
        f"{result.get('codec', 'none')}",
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
    lines += ["", "step time with optimisations stacked (bound: the speedup with the row's "
              "communication stream, codec included, hidden behind compute)"]  # fmt: skip
    lines.append(
        f"{'nodes':>6} {'row':<14} {'step ms':>9} {'speedup':>8} {'bound':>7} "
        f"{'comm %':>7} {'eff %':>6} {'codec ms':>9} {'calls':>6}  algorithms"
    )
    for n, r in result["nodes"].items():
        for row in r["rows"]:
            algs = ",".join(f"{k}:{v}" for k, v in sorted(row["algorithms"].items()))
            lines.append(
                f"{n:>6} {row['row']:<14} {row['step_s'] * 1e3:9.1f} {row['speedup']:7.2f}x "
                f"{row['bound_speedup']:6.2f}x {row['comm_fraction'] * 100:6.1f}% "
                f"{row['efficiency'] * 100:5.1f}% {row['codec_s'] * 1e3:9.2f} "
                f"{row['calls']:>6}  {algs}"
            )
        lines.append(
            f"{n:>6} {'(ceiling)':<14} {'':>9} {r['ceiling_speedup']:7.2f}x  all communication "
            f"hidden: 1 / (1 - {r['rows'][0]['comm_fraction']:.3f}) of the baseline"
        )
    lines += _format_sharded(result)
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


def _format_sharded(result: dict[str, Any]) -> list[str]:
    """The sharded rows' table: step time, speedup over the baseline, bytes per device
    against data parallelism's f32 hierarchical all-reduce."""
    lines = ["", "sharded optimizer state (ZeRO-1/2, nothing overlapped; bytes per device "
             "against data parallelism's f32 hierarchical all-reduce)",
             f"{'nodes':>6} {'row':<18} {'step ms':>9} {'speedup':>8} {'comm %':>7} "
             f"{'codec ms':>9} {'MB/device':>10} {'x DP':>6}"]  # fmt: skip
    for n, r in result["nodes"].items():
        for row in r.get("sharded", []):
            lines.append(
                f"{n:>6} {row['row']:<18} {row['step_s'] * 1e3:9.1f} {row['speedup']:7.2f}x "
                f"{row['comm_fraction'] * 100:6.1f}% {row['codec_s'] * 1e3:9.2f} "
                f"{row['wire_bytes'] / 1e6:10.1f} {row['wire_bytes'] / r['dp_wire_bytes']:6.3f}"
            )
    return lines


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


# --- the testbed check ----------------------------------------------------------------------
def testbed_topology(inter: int, intra: int, link_bps: float) -> Topology:
    """The emulated cluster of ``python -m jaxcomm.tools.testbed`` before calibration: ``inter``
    nodes of ``intra`` devices, each node's one link of ``link_bps`` bit/s shared by its
    devices (level-1 oversubscription ``intra``, as ``fat_tree`` writes a NIC shared by
    ``devices_per_node / nics_per_node``). Latencies and the intra-node bandwidth are
    placeholders for :func:`jaxcomm.tools.calibration.apply`.

    Args:
      inter: nodes.
      intra: devices per node.
      link_bps: link rate, bit/s per direction.

    Returns:
      A two-level :class:`~jaxcomm.topology.Topology`.

    Example:
      >>> testbed_topology(2, 2, 250e6).levels[1].bandwidth
      31250000.0
    """
    return Topology(
        (
            Level("node", intra, 0.3e9, 50e-6),
            Level("switch", inter, link_bps / 8, 100e-6, oversubscription=float(intra)),
        ),
        name=f"testbed {inter}x{intra} at {link_bps / 1e6:g} Mbit/s",
    )


_COMPRESSOR = re.compile(r"jaxcomm\.compression\.(\w+)(?:\[(.*)\])?$")


def testbed_row_config(row: Mapping[str, Any], technique: str | None = None) -> dict[str, Any]:
    """The simulator's settings for one row of an ablation results JSON.

    The row's ``settings.sync_gradients`` give the algorithm, compressor, stage and
    buckets. An adaptive compressor is priced at the rung its timed windows ran
    (``adaptive.level``), with the block and rounding that the ``technique`` text of the
    row that added it names ("nearest", "blocks of N"; else the factory's 256,
    stochastic). XLA:CPU runs its collectives synchronously, so no row overlaps
    communication with compute; uncompressed leaves are packed as ``jaxcomm.allreduce``
    packs them.

    Args:
      row: one entry of the results list.
      technique: the text describing the row's compressor (default the row's own
        ``technique``; rows after the one that added it describe something else).

    Returns:
      ``{algorithm, compression, compress_stage, bucket_bytes, overlap, packing}``.

    Raises:
      ValueError: a compressor the simulator does not price.
    """
    sync = row.get("settings", {}).get("sync_gradients", {})
    text = sync.get("compression")
    comp = None
    if text:
        m = _COMPRESSOR.match(str(text))
        if not m:
            raise ValueError(f"row {row.get('config')!r}: compressor {text!r} is not known.")
        name = m.group(1)
        tech = str(row.get("technique", "") if technique is None else technique)
        blk = re.search(r"blocks? of (\d+)", tech)
        block = int(blk.group(1)) if blk else 256
        stochastic = "nearest" not in tech
        if name == "adaptive":
            rung = (row.get("adaptive") or {}).get("level")
            if not rung:
                raise ValueError(f"row {row.get('config')!r}: adaptive without 'adaptive.level'.")
            comp = f"adaptive({rung}, block={block}, stochastic={stochastic})"
        elif name in ("int8", "int4"):
            comp = f"{name}(block={block}, stochastic={stochastic})"
        else:
            comp = name
    bucket = sync.get("bucket_bytes")
    if bucket == "auto":  # synchronous collectives: AutoBuckets takes the fewest buckets
        largest = max(AutoBuckets().candidates)
        bucket = (largest, largest)
    return {
        "algorithm": sync.get("algorithm", "hierarchical"),
        "compression": comp,
        "compress_stage": sync.get("compress_stage", "all"),
        "bucket_bytes": tuple(bucket) if isinstance(bucket, list) else bucket,
        "overlap": False,
        "packing": "allreduce",
    }


def check_testbed(
    rows: Sequence[Mapping[str, Any]],
    calibration: cal.Calibration,
    wl: Workload,
    *,
    codec: dict[str, cost.Codec] | None,
    statistic: str = "best",
    tolerance: float = CHECK_TOLERANCE,
) -> dict[str, Any]:
    """Simulates every measured row of a testbed ablation and compares.

    Each row runs with its own compute-only twin as compute (the simulator's input, the
    same statistic as the step time) on :func:`testbed_topology` of its mesh and link,
    calibrated (network alpha/beta, ``call_s``), with ``codec``.

    Args:
      rows: the results JSON's rows.
      calibration: a calibration measured on that testbed.
      wl: the model's workload (its compute is replaced per row).
      codec: kernel -> :class:`jaxcomm.cost.Codec` (this machine's).
      statistic: 'best' or 'median' (the JSON's ``step_time_best_s`` /
        ``step_time_median_s`` and their twins; a JSON written before the medians has the
        best round in ``step_time_s``). 'best' matches the calibrations, which keep the
        best of their runs; the ablation table reports the medians.
      tolerance: the largest ``|predicted / measured - 1|`` that passes.

    Returns:
      ``{'rows': [...], 'passed': bool, ...}``; each row has its config, measured and
      predicted seconds, the error and the predicted parts (exposed communication, codec,
      calls).

    Raises:
      ValueError: unknown ``statistic``, a row without mesh or link, or a compressor the
        simulator does not price.
    """
    if statistic not in ("median", "best"):
        raise ValueError(f"statistic={statistic!r}: choose 'median' or 'best'.")
    sfx = "_median_s" if statistic == "median" else "_best_s"
    calls = _call_costs(0.0, calibration)
    out = []
    skipped: list[str] = []
    described: dict[str, str] = {}  # compressor text -> technique of the row that added it
    for row in rows:
        text = str(row.get("settings", {}).get("sync_gradients", {}).get("compression"))
        described.setdefault(text, str(row.get("technique", "")))
        if row.get("status", "ok") != "ok":
            continue
        if row.get("sync_every"):  # local_sgd: no step model of local steps yet
            skipped.append(str(row.get("config")))
            continue
        mesh, link = row.get("mesh"), row.get("link_bps")
        if not mesh or not link:
            raise ValueError(f"row {row.get('config')!r}: needs 'mesh' and 'link_bps'.")
        topo = cal.apply(testbed_topology(mesh["inter"], mesh["intra"], float(link)), calibration)
        cfg = testbed_row_config(row, described[text])
        # The compute is the row's own twin's, taken from the table; the communication,
        # codec and call costs come from the calibrations.
        compute = float(row.get(f"compute_only_step_time{sfx}", row["compute_only_step_time_s"]))
        measured = float(row.get(f"step_time{sfx}", row["step_time_s"]))
        r = step_time(
            dataclasses.replace(wl, compute_s=compute),
            topo,
            algorithm=cfg["algorithm"],
            overlap=cfg["overlap"],
            compression=cost.parse_compression(cfg["compression"]),
            compress_stage=cfg["compress_stage"],
            bucket_bytes=cfg["bucket_bytes"],
            call_s=calls,
            codec=codec,
            packing=cfg["packing"],
        )
        err = r["step_s"] / measured - 1.0
        out.append({"config": row.get("config"), "compression": cfg["compression"],
                    "measured_s": measured, "compute_s": compute, "predicted_s": r["step_s"],
                    "error": err, "ok": abs(err) <= tolerance, "comm_s": r["comm_s"],
                    "codec_s": r["codec_s"], "call_s": r["call_s"], "calls": r["calls"],
                    "link_bytes_measured": row.get("link_bytes")})  # fmt: skip
    return {"statistic": statistic, "tolerance": tolerance, "workload": wl.name,
            "workload_bytes": wl.total_bytes, "rows": out, "skipped": skipped,
            "passed": bool(out) and all(r["ok"] for r in out)}  # fmt: skip


def format_check(result: Mapping[str, Any]) -> str:
    """The check as a table, one line per row, and the verdict."""
    lines = [
        f"testbed check ({result['statistic']} step times; workload {result['workload']}, "
        f"{result['workload_bytes'] / 1e6:.2f} MB): each row within "
        f"{result['tolerance'] * 100:.0f}%",
        f"{'row':<15} {'measured ms':>11} {'compute ms':>10} {'predicted ms':>12} {'error':>7} "
        f"{'comm ms':>8} {'codec ms':>8} {'calls ms':>8}  compressor",
    ]  # fmt: skip
    for r in result["rows"]:
        lines.append(
            f"{r['config']:<15} {r['measured_s'] * 1e3:11.0f} {r['compute_s'] * 1e3:10.0f} "
            f"{r['predicted_s'] * 1e3:12.0f} {r['error'] * 100:+6.1f}% "
            f"{r['comm_s'] * 1e3:8.0f} {r['codec_s'] * 1e3:8.0f} {r['call_s'] * 1e3:8.1f}  "
            f"{r['compression'] or '-'}" + ("" if r["ok"] else "  OUT OF BOUNDS")
        )
    for name in result.get("skipped", []):
        lines.append(f"{name:<15} not checked: the simulator has no model of local steps")
    worst = max((abs(r["error"]) for r in result["rows"]), default=float("nan"))
    lines.append(
        ("PASS" if result["passed"] else "FAIL") + f": largest error {worst * 100:.1f}% "
        f"(bound {result['tolerance'] * 100:.0f}%)"
    )
    return "\n".join(lines)


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
        if calib.axes:
            return lambda n: cal.apply(make(n), calib)
    return make


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxcomm.tools.simulate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=None,
                   help="resnet18 ... resnet152, or a gradient size in bytes (default resnet152; "
                   "with --check resnet18)")  # fmt: skip
    p.add_argument(
        "--num-classes", type=int, default=None,
        help="classifier outputs of a ResNet (default 1000; with --check 10)",
    )  # fmt: skip
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
    p.add_argument("--compression", default=None,
                   help="compressor of +compression, e.g. bf16, int8, 'int4(block=64)', "
                   "'topk(0.01)', 'powersgd(4)', 'adaptive(int4)' (default bf16)")  # fmt: skip
    p.add_argument("--compress-stage", default="inter", choices=("inter", "all"),
                   help="compress only the node-spanning stage (default) or all of it")  # fmt: skip
    p.add_argument("--compression-ratio", type=float, default=None,
                   help="a ratio-only model: wire bytes divided by this, no codec (instead of "
                   "--compression)")  # fmt: skip
    p.add_argument("--codec", default=None,
                   help="h200 | none | a calibration file with a codec section (default: "
                   "--calibration's codec if it has one, else h200)")  # fmt: skip
    p.add_argument("--bucket-mb", type=float, default=25.0, help="MiB per bucket (+batching)")
    p.add_argument("--launch-us", type=float, default=10.0,
                   help="fixed cost per collective call (kinds the calibration lacks)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random placement seed")
    p.add_argument(
        "--calibration",
        default=None,
        help="JSON of measured alpha/beta per mesh axis, points, call costs and/or codec",
    )
    p.add_argument(
        "--busbw",
        action="store_true",
        help="also print predicted nccl-tests bus bandwidth per message size",
    )
    p.add_argument(
        "--check", default=None,
        help="a testbed ablation results JSON: simulate each row from --calibration and "
        "--codec and compare (exit 1 if a row is off by more than 15%%)",
    )  # fmt: skip
    p.add_argument("--statistic", default="best", choices=("median", "best"),
                   help="--check: compare the best (default: as the calibrations keep their "
                   "runs) or the median step times (as the ablation table reports its "
                   "rows)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    return p


def _check_main(args, argv) -> int:
    if not args.calibration:
        print("error: --check needs --calibration (a calibration of the testbed)", file=sys.stderr)
        return 2
    try:
        with open(args.check) as f:
            rows = json.load(f)
        if isinstance(rows, Mapping):
            rows = rows.get("rows", [])
        calib = cal.load(args.calibration)
        codec, what = codec_table(args.codec or (args.calibration if calib.codec else "none"))
        model = args.model or "resnet18"
        model = int(model) if model.isdigit() else model
        wl = workload(model, 1.0, num_classes=args.num_classes or 10)
        result = check_testbed(rows, calib, wl, codec=codec, statistic=args.statistic)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(results=args.check, calibration=args.calibration, codec=what,
                  command="python -m jaxcomm.tools.simulate " + " ".join(argv))  # fmt: skip
    print(f"measured: {args.check}\ncalibration: {args.calibration}\ncodec: {what}")
    print(format_check(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["passed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.check:
        return _check_main(args, argv)
    try:
        nodes = [int(v) for v in args.nodes.split(",") if v]
        model = args.model or "resnet152"
        model = int(model) if model.isdigit() else model
        compute = None if args.compute_ms is None else args.compute_ms / 1e3
        wl = workload(model, compute, num_classes=args.num_classes or 1000)
        if args.compression is not None and args.compression_ratio is not None:
            raise ValueError(
                "give --compression (a compressor) or --compression-ratio (the wire ratio "
                "alone, no codec), not both."
            )
        if args.compression_ratio is not None and not args.compression_ratio >= 1:
            raise ValueError(f"--compression-ratio {args.compression_ratio}: must be >= 1.")
        compression = (
            None if args.compression_ratio is not None
            else cost.parse_compression(args.compression or "bf16")
        )  # fmt: skip
        calib = cal.load(args.calibration) if args.calibration else None
        codec_name = args.codec or (args.calibration if calib and calib.codec else "h200")
        codec, what = codec_table(codec_name)
        result = simulate(wl, _topology_for(args), nodes,
                          compression_ratio=args.compression_ratio, compression=compression,
                          compress_stage=args.compress_stage, codec=codec,
                          bucket_bytes=int(args.bucket_mb * 2**20),
                          launch_s=args.launch_us * 1e-6,
                          call_s=dict(calib.call_s) if calib else None,
                          seed=args.seed)  # fmt: skip
        result["codec"] = what
        if calib is not None and calib.axes:
            result["calibration"] = {
                "axes": {k: dataclasses.asdict(v) for k, v in calib.axes.items()},
                "errors": cal.prediction_errors(calib),
            }
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["command"] = "python -m jaxcomm.tools.simulate " + " ".join(argv)
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
