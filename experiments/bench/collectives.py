"""``python -m experiments.bench collectives``: an nccl-tests-style all-reduce sweep.

For each buffer size (per device, default 1 KiB to 256 MiB, x4 steps) and each algorithm
(every name in ``jaxcomm.collectives.ALGORITHMS``) and compressor (``--compressors``, the
factories of ``jaxcomm.compression``), on the devices present (fake CPU devices, GPUs, or the
processes of ``python -m jaxcomm.tools.launch``/``mpirun``), it prints size, median time, algbw
``= S / t``, busbw ``= algbw * 2(p-1)/p`` and a correctness check against numpy. With
``--mpi`` under ``mpirun`` (one device per process) it adds mpi4jax rows beside gloo.

It also fits ``t = alpha + beta * S`` to a psum over each mesh axis alone (least squares,
``alpha >= 0``) and writes it with ``--fit`` as
``{"<axis>": {"alpha_s": .., "beta_s_per_byte": ..}, "points": [{"axis", "bytes", "time_s"}]}``,
the calibration input of the cost model. alpha and beta describe the whole collective over
that axis (not one hop); the fit weights residuals by ``1/t``.

Data are small integers, so f32/f64 sums are exact and the check is equality; bf16/f16
rows use the tolerance of their mantissa.

Example:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.bench collectives \\
      --intra 4 --max-bytes 16M --json sweep.json --fit fit.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """'1K', '256M', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.I)
    if not m:
        raise ValueError(f"size {text!r}: use e.g. 1K, 64M, 4096.")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _local_data(n: int, devices: range, dtype) -> Any:
    import numpy as np

    i = np.arange(n, dtype=np.int64)
    return np.stack([((i * 7 + d * 13) % 17 - 8).astype(dtype) for d in devices])


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * bytes`` with ``alpha, beta >= 0``.

    Residuals are weighted by ``1 / t`` (relative error), so that the small sizes, which
    carry the latency, are not drowned by the large ones of a log-spaced sweep.
    """
    import numpy as np

    b = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    if len(points) >= 2:
        beta, alpha = np.polyfit(b, t, 1, w=1.0 / np.maximum(t, 1e-12))
        if alpha >= 0 and beta >= 0:
            return float(alpha), float(beta)
        if beta < 0:  # flat in size: pure latency
            return float(max(t.mean(), 0.0)), 0.0
    return 0.0, float((t * b).sum() / (b * b).sum())  # through the origin


def _compressor(name: str):
    """``'topk(0.01)'`` -> ``jaxcomm.compression.topk(0.01)``, or why there is none (str)."""
    import jaxcomm

    m = re.fullmatch(r"(\w+)(?:\((.*)\))?", name)
    factory = getattr(jaxcomm.compression, m.group(1), None) if m else None
    if factory is None:
        return f"jaxcomm.compression.{name} not found"
    args = [float(a) if "." in a else int(a) for a in (m.group(2) or "").split(",") if a]
    return factory(*args)


def _mpi(args) -> Any:
    """The ``jaxcomm.collectives.mpi`` module with ``--mpi`` where it can run, else why not
    (str); None without ``--mpi``."""
    import jax

    if not args.mpi:
        return None
    from jaxcomm.collectives import mpi as mpi_mod

    ok, why = mpi_mod.available()
    ldev = jax.local_device_count()
    if not ok or ldev != 1:
        return why or f"--mpi needs one device per process, this one has {ldev}"
    return mpi_mod


def _compressor_time(comp, x, n: int, dtype, mesh, reps: int):
    """Median step time of ``sync_gradients(compression=comp)`` on a dot-product loss whose
    gradient is ``x``, and the mean it computed times the device count (device 0's)."""
    import jax.numpy as jnp
    import numpy as np

    import jaxcomm
    from jaxcomm.tools.profiler import median_time

    tx = jaxcomm.sync_gradients(algorithm="flat", compression=comp)
    dp = jaxcomm.data_parallel(
        lambda prm, b: jnp.vdot(prm["w"], b["x"][0]).astype(jnp.float32), tx, mesh
    )
    state = dp.init({"w": jnp.zeros((n,), dtype)})
    step = dp.step_fn(state)
    batch = {"x": x}
    t = median_time(lambda s=step, st=state, b=batch: s(st, b), (), reps)
    got = np.asarray(step(state, batch)[0].params["w"].addressable_shards[0].data)
    return t, got * mesh.devices.size


def _psum_points(x, mesh, nbytes: int, reps: int) -> list[dict[str, Any]]:
    """Median time of a psum of ``x`` over each mesh axis of 2 or more devices alone."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jaxcomm.tools.profiler import median_time

    axes = tuple(mesh.axis_names)
    points = []
    for axis in axes:
        g = mesh.shape[axis]
        if g < 2:
            continue
        f = jax.jit(
            jax.shard_map(
                lambda v, axis=axis: lax.psum(v, axis),
                mesh=mesh,
                in_specs=P(axes),
                out_specs=P(axes),
            )
        )
        t = median_time(lambda f=f, x=x: f(x), (), reps)
        points.append({"axis": axis, "bytes": nbytes, "time_s": t, "group_size": g})
    return points


def _fit(axes: tuple[str, ...], points: list[dict[str, Any]]) -> dict[str, Any]:
    """The alpha-beta fit of each axis's psum times, and the points themselves."""
    fit: dict[str, Any] = {}
    for axis in axes:
        pts = [(q["bytes"], q["time_s"]) for q in points if q["axis"] == axis]
        if pts:
            alpha, beta = fit_alpha_beta(pts)
            fit[axis] = {"alpha_s": alpha, "beta_s_per_byte": beta}
    fit["points"] = [{k: q[k] for k in ("axis", "bytes", "time_s")} for q in points]
    return fit


def run_sweep(args) -> dict[str, Any]:
    """The sweep of the module docstring for parsed ``args`` (see :func:`main`).

    Returns:
      ``{'devices', 'processes', 'mesh', 'platform', 'dtype', 'rows', 'fit'}``: one row per
      size and algorithm, compressor or mpi4jax (time, algbw, busbw, check), and the fit.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm.tools.profiler import median_time

    mesh = jaxcomm.make_mesh(args.intra)
    axes = tuple(mesh.axis_names)
    p = mesh.devices.size
    me, ldev = jax.process_index(), jax.local_device_count()
    dtype = np.dtype(args.dtype) if args.dtype != "bfloat16" else jnp.bfloat16
    itemsize = np.dtype(dtype).itemsize
    sharding = NamedSharding(mesh, P(axes))
    algorithms = (
        args.algorithms.split(",") if args.algorithms else sorted(jaxcomm.collectives.ALGORITHMS)
    )
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    mpi = _mpi(args)
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        n = max(nbytes // itemsize, 1)
        local = _local_data(n, range(me * ldev, (me + 1) * ldev), dtype)
        want = _local_data(n, range(p), np.float64).sum(0)
        x = jax.make_array_from_process_local_data(sharding, local)

        def record(name, t, got, tol, extra=None, n=n, want=want):
            algbw = n * itemsize / t
            err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
            rows.append(
                {"name": name, "bytes": n * itemsize, "time_s": t, "algbw_GBps": algbw / 1e9,
                 "busbw_GBps": algbw * 2 * (p - 1) / p / 1e9, "max_abs_err": err,
                 "ok": bool(err <= tol * max(np.abs(want).max(), 1.0)), **(extra or {})}
            )  # fmt: skip

        tol = 0.0 if itemsize >= 4 else 2.0 ** -(7 if args.dtype == "bfloat16" else 10) * p
        for alg in algorithms:
            f = jax.jit(
                jax.shard_map(
                    lambda v, alg=alg: jaxcomm.allreduce(v[0], algorithm=alg, op="sum")[None],
                    mesh=mesh,
                    in_specs=P(axes),
                    out_specs=P(axes),
                )
            )
            t = median_time(lambda f=f, x=x: f(x), (), args.reps)
            record(alg, t, np.asarray(f(x).addressable_shards[0].data)[0], tol)
        for cname in filter(None, (args.compressors or "").split(",")):
            comp = _compressor(cname)
            if isinstance(comp, str):
                rows.append({"name": cname, "bytes": n * itemsize, "missing": comp})
                continue
            t, got = _compressor_time(comp, x, n, dtype, mesh, args.reps)
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            record(cname, t, got, np.inf, {"rel_error": rel})
        if mpi is not None and not isinstance(mpi, str):
            xl = jax.device_put(local[0], jax.local_devices()[0])
            f = jax.jit(lambda v, m=mpi: m.mpi_allreduce(v, op="sum"))
            t = median_time(lambda f=f, xl=xl: f(xl), (), args.reps)
            record("mpi4jax", t, np.asarray(f(xl)), tol)
        points += _psum_points(x, mesh, n * itemsize, args.reps)
    if isinstance(mpi, str):
        rows.append({"name": "mpi4jax", "missing": mpi})
    return {
        "devices": p,
        "processes": jax.process_count(),
        "mesh": {a: int(mesh.shape[a]) for a in axes},
        "platform": jax.devices()[0].platform,
        "dtype": args.dtype,
        "rows": rows,
        "fit": _fit(axes, points),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"# all-reduce sweep: {result['devices']} {result['platform']} devices, "
        f"{result['processes']} process(es), mesh {result['mesh']}, {result['dtype']}",
        f"{'bytes':>11s} {'name':>16s} {'time us':>11s} {'algbw GB/s':>11s} "
        f"{'busbw GB/s':>11s} {'check':>6s}",
    ]
    for r in result["rows"]:
        if "missing" in r:
            lines.append(f"{r.get('bytes', 0):11d} {r['name']:>16s}  missing: {r['missing']}")
            continue
        check = ("ok" if r["ok"] else "WRONG") if "rel_error" not in r else f"{r['rel_error']:.0e}"
        lines.append(
            f"{r['bytes']:11d} {r['name']:>16s} {r['time_s'] * 1e6:11.1f} "
            f"{r['algbw_GBps']:11.3f} {r['busbw_GBps']:11.3f} {check:>6s}"
        )
    for axis, v in result["fit"].items():
        if axis != "points":
            lines.append(
                f"# fit psum over {axis!r} (group {result['mesh'][axis]}): alpha "
                f"{v['alpha_s'] * 1e6:.1f} us, beta {v['beta_s_per_byte'] * 1e9:.3f} ns/byte "
                f"({1 / v['beta_s_per_byte'] / 1e9 if v['beta_s_per_byte'] else float('inf'):.2f}"
                " GB/s)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench collectives",
        description="nccl-tests-style all-reduce sweep over jaxcomm algorithms and compressors.",
    )
    parser.add_argument("--min-bytes", default="1K", help="smallest buffer per device (1K)")
    parser.add_argument("--max-bytes", default="256M", help="largest buffer per device (256M)")
    parser.add_argument("--factor", type=int, default=4, help="size step factor (4)")
    parser.add_argument("--algorithms", default=None, help="comma list (default: all registered)")
    parser.add_argument(
        "--compressors", default="", help="comma list of jaxcomm.compression factories, "
        "e.g. 'int8,topk(0.01)' (an unknown name gives a 'missing' row)"
    )  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64",
                        "bfloat16", "float16"])  # fmt: skip
    parser.add_argument("--intra", type=int, default=None, help="devices per intra group")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--mpi", action="store_true", help="add mpi4jax rows (under mpirun)")
    parser.add_argument("--json", default=None, help="write rows and fit here")
    parser.add_argument("--fit", default=None, help="write the alpha-beta fit here")
    args = parser.parse_args(argv)
    try:
        args.min_bytes, args.max_bytes = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    except ValueError as e:
        parser.error(str(e))
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        parser.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    from jaxcomm.distributed import launcher_env

    if launcher_env() is not None or "OMPI_COMM_WORLD_SIZE" in os.environ:
        import jaxcomm

        jaxcomm.init_distributed()
    import jax

    result = run_sweep(args)
    if jax.process_index() == 0:
        print(format_table(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.fit:
            with open(args.fit, "w") as f:
                json.dump(result["fit"], f, indent=1)
    failed = [r for r in result["rows"] if r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
