"""``python -m experiments.bench gpu --out DIR``: every GPU claim of jaxcomm in one short run.

One command for a short loan of one GPU, stopped at ``--budget-s`` (:data:`BUDGET_S`) even
if a part hangs (``--quick``: fewer option sets, rows and repeats). It runs these parts,
each in its own subprocess with its own time limit, so that one that fails, hangs or
crashes is reported (with its traceback) and the others still run. The schedule part only
compiles, so it runs alongside the timed parts (``--sequential``: one after the other):

* ``versions``: jax, jaxlib, the CUDA plugin, flax, optax, the driver (``nvidia-smi``), the
  GPU name and ``device_kind``, and its peak memory bandwidth from :data:`PEAK_BANDWIDTH`.
  It runs first and doubles as the GPU probe.
* ``kernels``: the local compression kernels on the ResNet-152 gradient (60.2M f32):
  int8/int4 quantize and dequantize (:mod:`jaxcomm.compression.quantize`), top-k selection
  (:func:`jaxcomm.compression.sparse.select_topk`), PowerSGD's ``P = M Q``, orthogonalize and
  ``Q = M^T P`` on the ResNet-152 matrices (batched by shape, as the compressor runs them;
  orthogonalize also one matrix at a time), and a plain copy; time per call (jit,
  ``block_until_ready``, the best and the median of several rounds of back-to-back calls)
  and achieved memory bandwidth ``(bytes read + bytes written) / time`` as a fraction of
  the GPU's peak.
* ``schedule``: the compiled schedule of a ResNet-50 data-parallel step (flat all-reduce,
  224 px) for 8 mocked GPUs (``jax_mock_gpu_topology=1x8x1``: 8 hosts of one GPU, since XLA
  requires the mock's GPUs per host to equal the real machine's; mock NCCL: compiled,
  never run) with ``overlap_options``, all-reduce combine thresholds 0 / 1 MiB / 30 MiB and
  XLA defaults (``python -m experiments.bench schedule``): collectives, async start/done
  pairs, compute between each pair, bytes.
* ``options`` (:mod:`experiments.bench.gpu_options`): the data-parallel
  step of every sync option (flat, hierarchical, bf16/int8/int4 on the inter stage,
  adaptive, PowerSGD, top-k, buckets, microbatches, local_sgd) on a small MLP, built with
  the public API. Compiled for 8 mocked GPUs in a 2 x 4 mesh (a subprocess, alongside the
  rest of the part unless ``--sequential``): compile time, kernels, fusions, collectives,
  async pairs and the compute between start and done, collectives inside conditional
  branches, host round trips per step of the program of every step and of each
  steady-state program (the ones the step picks on the host once warm: each adaptive rung,
  local SGD's two branches, int8 after its warm-up: ``warmup``). Run on the real GPU
  (1 x 1 mesh): step time,
  images/s against flat, and two runs from the same state compared bit for bit. Goals: no
  host round trip on an option that does not need one, every collective async, equal bits.
  ``--options`` picks a subset. It runs before ``step``, which gets what is left.
* ``step``: the ``gpu-node`` preset's ResNet-152 step (224 px, bf16) on the real GPU, for
  the ablation rows that need no second device (``baseline``, ``+overlap``; on one GPU
  the mesh is 1 x 1, so the other rows would only repeat them: they are reported as
  skipped unless ``--step-rows`` names them, and then run as the degenerate 1-device case).
* ``overhead`` (:mod:`experiments.bench.overhead`): host time per step of
  ``data_parallel``, the Flax decorators and the pmap entry against the same step written
  by hand, on this GPU, with the flat sync and with adaptive compression (its rung chosen
  on the host). Last: it gets what the budget leaves.

Writes ``DIR/gpu_check.json`` (every part: status ``ok`` / ``failed`` / ``timeout`` /
``skipped``, seconds, data, error and traceback) and prints one compact table per part.
Exits 0 when it ran on a GPU (also when parts failed: see the table), 2 when there is no
GPU (before any work).

The GPU path imports only jax, jaxlib, flax, optax, numpy and the project's own files (no
matplotlib, orbax, tqdm, scikit-learn or pillow).

Example:
  PYTHONPATH=. python -m experiments.bench gpu --out $OUT/gpu
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

__all__ = [
    "PARTS",
    "PEAK_BANDWIDTH",
    "Part",
    "SCHEDULE_SETS",
    "STEP_ROWS",
    "format_report",
    "main",
    "peak_bandwidth",
]

MiB = 1 << 20

#: Peak memory bandwidth (bytes/s) by a substring of ``device.device_kind``, first match
#: wins (``None``: the name covers several memory configurations). Source: NVIDIA's data
#: sheets for each product (HBM/GDDR bandwidth, SXM variants unless the name says PCIe/NVL).
PEAK_BANDWIDTH: tuple[tuple[str, float | None, str], ...] = (
    ("GH200", None, "GH200 ships with 4.0 or 4.9 TB/s HBM: ambiguous"),
    ("H200", 4.8e12, "NVIDIA H200 Tensor Core GPU data sheet: 4.8 TB/s HBM3e"),
    ("H100 PCIe", 2.0e12, "NVIDIA H100 data sheet: PCIe 80GB, 2 TB/s"),
    ("H100 NVL", 3.9e12, "NVIDIA H100 data sheet: NVL 94GB, 3.9 TB/s"),
    ("H100", 3.35e12, "NVIDIA H100 data sheet: SXM5 80GB, 3.35 TB/s"),
    ("B200", 8.0e12, "NVIDIA HGX B200 data sheet: 8 TB/s per GPU"),
    ("A100-SXM4-80GB", 2.039e12, "NVIDIA A100 data sheet: SXM4 80GB, 2,039 GB/s"),
    ("A100 80GB PCIe", 1.935e12, "NVIDIA A100 data sheet: PCIe 80GB, 1,935 GB/s"),
    ("A100", 1.555e12, "NVIDIA A100 data sheet: 40GB, 1,555 GB/s"),
    ("L40S", 0.864e12, "NVIDIA L40S data sheet: 864 GB/s"),
)

#: Option sets of the schedule part (names of ``experiments.bench.schedule.OPTION_SETS``).
# ``defaults`` last: XLA's default all-reduce threshold (31457287 bytes) is combine=30MiB's.
SCHEDULE_SETS = ("overlap", "combine=0", "combine=1MiB", "combine=30MiB", "defaults")
SCHEDULE_SETS_QUICK = ("overlap", "combine=0", "combine=30MiB")
#: Ablation rows (``experiments.rows.ROWS``) that need no second device, timed by default.
STEP_ROWS = ("baseline", "+overlap")
#: Time limit of the whole run (s); a part that would start past it is skipped.
BUDGET_S = 450.0
#: Time limit of the ``options`` part (it runs before ``step``, which gets what is left).
OPTIONS_LIMIT_S = 150.0
#: Time limit of the ``overhead`` part (last: it gets what the budget leaves, up to this).
OVERHEAD_LIMIT_S = 90.0


def peak_bandwidth(device_kind: str) -> tuple[float | None, str]:
    """``(bytes/s or None, source)`` for a ``device_kind`` from :data:`PEAK_BANDWIDTH`."""
    for key, bw, source in PEAK_BANDWIDTH:
        if key.lower() in device_kind.lower():
            return bw, source
    return None, f"{device_kind!r} is not in experiments.bench.gpu.PEAK_BANDWIDTH"


class Skip(Exception):
    """A part (or an item of one) that cannot run here; the message says why."""


class _Emit:
    """A part's result file, rewritten after every item so a killed part keeps its items."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict[str, Any] = {}
        self.status = "running"
        self.error: str | None = None
        self.tb: str | None = None

    def __call__(self, **items: Any) -> None:
        self.data.update(items)
        self.write()

    def write(self) -> None:
        out = {"status": self.status, "data": self.data, "error": self.error}
        out["traceback"] = self.tb
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- parts


def _versions(args: argparse.Namespace, emit: _Emit) -> None:
    import jax
    import jaxlib

    pkgs = {}
    for name in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                 "jax-cuda12-pjrt", "flax", "optax", "numpy"):  # fmt: skip
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    emit(
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        packages=pkgs,
        nvidia_smi=_nvidia_smi(),
    )
    devs = jax.devices()
    kind = devs[0].device_kind
    bw, source = peak_bandwidth(kind)
    emit(
        backend=jax.default_backend(),
        devices=len(devs),
        platform=devs[0].platform,
        device_kind=kind,
        peak_bandwidth_bytes_per_s=bw,
        peak_bandwidth_source=source,
    )


def _nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run([exe, *query], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {e}"
    return (out.stdout or out.stderr).strip()


def _timer(fn: Callable, *xs: Any, rounds: int, inner: int) -> dict[str, float]:
    """Seconds per call: ``rounds`` rounds of ``inner`` back-to-back calls (dispatch is
    asynchronous, so the device stays busy and launch overhead is amortised)."""
    import jax

    jax.block_until_ready(fn(*xs))  # compile
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = [fn(*xs) for _ in range(inner)]
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / inner)
    ts.sort()
    return {"best_s": ts[0], "median_s": ts[len(ts) // 2]}


class _KernelRecorder:
    """Times kernels for the ``kernels`` part and records each under its name.

    Every kernel is jitted and timed by :func:`_timer`; its bandwidth is ``nbytes`` over
    the best time, also as a fraction of the GPU's ``peak``. The part's data is rewritten
    after every kernel, so a part killed at its limit keeps what it finished.
    """

    def __init__(self, emit: _Emit, peak: float | None, rounds: int, inner: int):
        self.emit, self.peak, self.rounds, self.inner = emit, peak, rounds, inner
        self.results: dict[str, dict] = {}

    def __call__(self, name: str, fn: Callable, inputs: tuple, nbytes: int, **extra: Any) -> None:
        import jax

        try:
            t = _timer(jax.jit(fn), *inputs, rounds=self.rounds, inner=self.inner)
        except Exception as e:  # one kernel failing does not stop the others
            self.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": _tb()}
        else:
            self.results[name] = {**t, **self._rate(nbytes, t["best_s"]), **extra}
        self.emit(kernels=self.results)

    def _rate(self, nbytes: int, seconds: float) -> dict[str, Any]:
        bw = nbytes / seconds
        frac = None if self.peak is None else bw / self.peak
        return {"bytes": nbytes, "gb_per_s": bw / 1e9, "fraction_of_peak": frac}

    def combine(self, name: str, first: str, second: str, **extra: Any) -> None:
        """Records ``first`` then ``second`` run as two kernels (times and bytes added)."""
        a, b = self.results.get(first, {}), self.results.get(second, {})
        if "best_s" not in a or "best_s" not in b:
            return
        t = a["best_s"] + b["best_s"]
        self.results[name] = {
            "best_s": t,
            "median_s": a["median_s"] + b["median_s"],
            **self._rate(a["bytes"] + b["bytes"], t),
            **extra,
        }
        self.emit(kernels=self.results)


def _kernels(args: argparse.Namespace, emit: _Emit) -> None:
    """The ``kernels`` part: the local compression kernels on one model's gradient.

    The gradient is laid out as ``two_phase_mean`` pads it for 8 devices: ``(8, m)`` f32,
    ``m`` a multiple of the int8/int4 block.
    """
    import jax
    import jax.numpy as jnp

    from jaxcomm.models import gradient_shapes

    leaves = jax.tree.leaves(gradient_shapes(args.kernel_model))
    n = sum(int(x.size) for x in leaves)
    rows, block = 8, 256
    m = -(-n // (rows * block)) * block  # per-row length, padded as two_phase_mean does
    kind = jax.devices()[0].device_kind
    peak, source = peak_bandwidth(kind)
    rounds, inner = (3, 5) if args.quick else (7, 10)
    emit(
        model=args.kernel_model,
        elements=n,
        padded_elements=rows * m,
        layout=f"({rows}, {m}) f32, block {block} (as two_phase_mean pads for 8 devices)",
        device_kind=kind,
        peak_bandwidth_bytes_per_s=peak,
        peak_bandwidth_source=source,
        bytes_formula="bytes read + bytes written by the kernel's inputs and outputs (minimal "
        "traffic: intermediates assumed fused; random bits of stochastic rounding are made "
        "on chip); GB/s = bytes / best time",
        timing=f"best and median of {rounds} rounds x {inner} back-to-back calls, jit, "
        "block_until_ready",
        kernels={},
    )
    record = _KernelRecorder(emit, peak, rounds, inner)
    key = jax.random.key(0)
    x = jax.random.normal(key, (rows, m), jnp.float32)
    record("copy (x * 2)", lambda x: x * 2.0, (x,), 8 * x.size)
    _quantize_kernels(record, x, key, block)
    _topk_kernels(record, x.reshape(-1)[:n], key, ratio=0.01)
    _powersgd_kernels(record, leaves, key, rank=4)


def _quantize_kernels(record: _KernelRecorder, x: jax.Array, key: jax.Array, block: int) -> None:
    """Stochastic rounding's random bits, int8/int4 quantize and dequantize of ``x``."""
    import jax
    import jax.numpy as jnp

    from jaxcomm.compression.keys import uniform_dither
    from jaxcomm.compression.quantize import dequantize, quantize

    N = x.size
    scales = 4 * N // block
    # The random bits of stochastic rounding alone: threefry against the per-element hash
    # that quantize uses.
    record(
        "uniform [0,1), threefry (jax.random.uniform)",
        lambda k: jax.random.uniform(k, x.shape, jnp.float32),
        (key,),
        4 * N,
    )
    record(
        "uniform [0,1), hash (uniform_dither)", lambda k: uniform_dither(k, x.shape), (key,), 4 * N
    )
    q8n, s8 = jax.jit(lambda x: quantize(x, 8, block, None))(x)
    record(
        "int8 quantize, nearest", lambda x: quantize(x, 8, block, None), (x,), 4 * N + N + scales
    )
    record(
        "int8 quantize, stochastic",
        lambda x, k: quantize(x, 8, block, k),
        (x, key),
        4 * N + N + scales,
    )
    record(
        "int8 dequantize", lambda q, s: dequantize(q, s, 8, block), (q8n, s8), N + scales + 4 * N
    )
    record(
        "int8 quantize+dequantize, one jit (stochastic)",
        lambda x, k: dequantize(*quantize(x, 8, block, k), 8, block),
        (x, key),
        8 * N,
    )
    q4, s4 = jax.jit(lambda x, k: quantize(x, 4, block, k))(x, key)
    record(
        "int4 quantize, stochastic",
        lambda x, k: quantize(x, 4, block, k),
        (x, key),
        4 * N + N // 2 + scales,
    )
    record(
        "int4 dequantize",
        lambda q, s: dequantize(q, s, 4, block),
        (q4, s4),
        N // 2 + scales + 4 * N,
    )
    # The compressor runs quantize and dequantize as two kernels with a collective between.
    record.combine(
        "int8 quantize + dequantize (two kernels, stochastic)",
        "int8 quantize, stochastic",
        "int8 dequantize",
        goal=">= 0.70 of peak",
    )


def _topk_kernels(record: _KernelRecorder, flat: jax.Array, key: jax.Array, ratio: float) -> None:
    """Top-k selection of ``ratio`` of the 1-D ``flat``, exact and sampled."""
    from jaxcomm.compression.keys import dither_seed
    from jaxcomm.compression.sparse import select_topk

    n = flat.size
    k = max(1, int(ratio * n))
    for method in ("exact", "sampled"):
        record(
            f"top-k {ratio:g} selection, {method}",
            lambda c, key, method=method: select_topk(
                c, k, method=method, sample=max(1, n // 100), seed=dither_seed(key)
            ),
            (flat, key),
            4 * n + 8 * k,
            k=k,
        )


def _powersgd_kernels(record: _KernelRecorder, leaves: list, key: jax.Array, rank: int) -> None:
    """PowerSGD on every matrix of ``leaves`` it compresses, as the compressor computes it:
    matrices of one ``(n, m, r)`` shape stacked into one batch."""
    import jax
    import jax.numpy as jnp

    from jaxcomm.compression.powersgd import matrix_shape, orthogonalize, powersgd, shape_groups

    comp = powersgd(rank=rank)
    shapes = [matrix_shape(x.shape) for x in leaves if comp.supports(tuple(x.shape))]
    dims = [(a, b, min(rank, a, b)) for a, b in shapes]
    groups = shape_groups(dims)
    keys = jax.random.split(key, 2 * len(groups))
    mats = [jax.random.normal(keys[j], (len(g), *dims[g[0]][:2]), jnp.float32)
            for j, g in enumerate(groups)]  # fmt: skip
    qs = [jax.random.normal(keys[len(groups) + j], (len(g), *dims[g[0]][1:]), jnp.float32)
          for j, g in enumerate(groups)]  # fmt: skip
    ps = jax.jit(lambda ms, qs: [a @ b for a, b in zip(ms, qs, strict=True)])(mats, qs)
    nm = sum(a * b for a, b, _ in dims)
    nr = sum(a * r for a, _, r in dims)
    mr = sum(b * r for _, b, r in dims)
    info = {"matrices": len(dims), "batches": len(groups), "elements": nm, "rank": rank}
    record("powersgd P = M Q (all matrices, batched by shape)",
           lambda ms, qs: [a @ b for a, b in zip(ms, qs, strict=True)], (mats, qs),
           4 * (nm + mr + nr), **info)  # fmt: skip
    record("powersgd orthogonalize P (all, batched by shape)",
           lambda ps: [orthogonalize(p) for p in ps], (ps,), 8 * nr, **info)  # fmt: skip
    record("powersgd orthogonalize P (all, one matrix at a time)",
           lambda ps: [orthogonalize(m) for p in ps for m in p], (ps,), 8 * nr, **info)  # fmt: skip
    record("powersgd Q = M^T P (all matrices, batched by shape)",
           lambda ms, ps: [jnp.swapaxes(a, -1, -2) @ b for a, b in zip(ms, ps, strict=True)],
           (mats, ps), 4 * (nm + nr + mr), **info)  # fmt: skip


def _tb() -> str:
    return traceback.format_exc(limit=12)


def _schedule(args: argparse.Namespace, emit: _Emit) -> None:
    from experiments.bench import schedule

    raw = os.path.join(args.out, "parts", "schedule_raw.json")
    variant = "cpu" if args.allow_cpu else "gpu"
    sets = SCHEDULE_SETS_QUICK if args.quick else SCHEDULE_SETS
    argv = [
        "--variant", variant, "--mock-topology", args.mock_topology,
        "--model", args.schedule_model, "--image-size", str(args.schedule_image_size),
        "--num-classes", "1000", "--batch", str(8 * args.schedule_batch),
        "--algorithm", "flat", "--option-sets", ",".join(sets), "--json", raw,
    ]  # fmt: skip
    if not args.allow_cpu and args.fast_compile:
        # Conv autotuning dominates the compile time; the schedule comes from XLA's cost
        # model, not from the autotuned kernels.
        argv += ["--extra-options", json.dumps({"xla_gpu_autotune_level": 0})]
    emit(argv=argv, variant=variant, mock_topology=None if args.allow_cpu else args.mock_topology)
    try:
        schedule.main(argv)
    finally:
        if os.path.exists(raw):
            with open(raw) as f:
                emit(**summarize_schedule(json.load(f)))


def summarize_schedule(raw: dict) -> dict:
    """The schedule part's data from ``python -m experiments.bench schedule --json`` output:
    per option set the collectives, async pairs and compute between them, and the goals."""
    sets: dict[str, dict] = {}
    for label, r in raw.get("results", {}).items():
        rows = r["report"]["collectives"]
        ar = [c for c in rows if c["kind"] == "all-reduce"]
        sets[label] = {
            "options": r.get("options"),
            "compile_s": r.get("compile_s"),
            "collectives": r["collectives"],
            "async": r["async"],
            "overlapped": r["overlapped"],
            "all_reduces": len(ar),
            "all_reduce_bytes": [int(c["bytes"]) for c in ar],
            "all_reduce_async": [bool(c["async"]) for c in ar],
            "all_reduce_ops_between": [c["ops_between"] for c in ar],
            "by_kind": {
                f"{s['kind']}@{','.join(s['axes'] or ['?'])}": {
                    k: s[k] for k in ("count", "bytes", "async", "overlapped", "ops_between")
                }
                for s in r["report"]["summary"]
            },
        }
    return {"header": raw.get("header"), "sets": sets, "goals": _schedule_goals(sets)}


def _schedule_goals(sets: dict[str, dict]) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    ov = sets.get("overlap")
    if ov is not None:
        between = ov["all_reduce_ops_between"]
        # Every all-reduce (gradient bucket) but the last in schedule order is an async pair
        # with compute between its start and done.
        goals["overlap: async pairs with compute between, all but the last all-reduce"] = (
            len(between) > 0
            and all(ov["all_reduce_async"])
            and all((b or 0) > 0 for b in between[:-1])
        )
    counts = {k: sets[k]["all_reduces"] for k in ("combine=0", "combine=1MiB", "combine=30MiB")
              if k in sets}  # fmt: skip
    if len(counts) >= 2:
        c = list(counts.values())
        goals["combine: fewer all-reduces as the threshold grows"] = (
            all(a >= b for a, b in zip(c, c[1:], strict=False)) and c[0] > c[-1]
        )
        goals["combine: all-reduce counts"] = counts
    one = sets.get("combine=1MiB")
    if one is not None:
        big = [b for b in one["all_reduce_bytes"] if b > MiB]
        goals["combine=1MiB: all-reduces above 1 MiB (single buffers only)"] = len(big)
    return goals


def _step(args: argparse.Namespace, emit: _Emit) -> None:
    import jax

    import jaxcomm
    from experiments import ablation
    from experiments.presets import PRESETS
    from experiments.rows import resolve_rows

    preset = PRESETS[args.step_preset]
    over = {"warmup_steps": 3, "timing_steps": 5, "repeats": 2}
    if args.quick:
        over = {"warmup_steps": 2, "timing_steps": 3, "repeats": 1}
    if args.per_device_batch:
        over["per_device_batch"] = args.per_device_batch
    preset = dataclasses.replace(preset, **over)
    mesh = jaxcomm.make_mesh()
    wanted = args.step_rows.split(",") if args.step_rows else list(STEP_ROWS)
    if args.quick and not args.step_rows:
        wanted = ["baseline"]
    resolved = resolve_rows()
    known = [r.row.config for r in resolved]
    unknown = [w for w in wanted if w != "all" and w not in known]
    if unknown:
        raise ValueError(f"--step-rows {unknown} not known; choose from {known} or 'all'.")
    one_device = mesh.devices.size == 1
    emit(
        preset=dataclasses.asdict(preset),
        devices=mesh.devices.size,
        mesh=dict(mesh.shape),
        device_kind=jax.devices()[0].device_kind,
        note=(
            "one device: the mesh is 1 x 1, gradient synchronisation has nothing to send; "
            "rows beyond baseline/+overlap need a second device and are skipped unless "
            "--step-rows names them (then they run as the degenerate 1-device case)"
            if one_device
            else None
        ),
        rows={},
    )
    rows: dict[str, dict] = {}
    base = None
    for r in resolved:
        name = r.row.config
        if "all" not in wanted and name not in wanted:
            second = one_device and name not in STEP_ROWS
            why = "needs a second device" if second else "not selected (--step-rows, --quick)"
            rows[name] = {"status": "skipped", "reason": why}
            emit(rows=rows)
            continue
        (res,) = ablation.run_speed([r], preset, intra=None, twins=False)
        res["degenerate_1_device"] = one_device and name not in STEP_ROWS
        if res.get("status") == "ok" and res.get("step_time_s"):
            base = base or (res["step_time_s"] if name == "baseline" else None)
            res["speedup"] = base / res["step_time_s"] if base else None
        rows[name] = res
        emit(rows=rows)


def _options(args: argparse.Namespace, emit: _Emit) -> None:
    from experiments.bench import gpu_options

    # The limit the driver gave this part (its own, or what was left of the budget).
    limit = args.part_limit or args.limits.get("options", OPTIONS_LIMIT_S)
    gpu_options.run_part(args, emit, limit)


def _overhead(args: argparse.Namespace, emit: _Emit) -> None:
    from experiments.bench import overhead

    for compression in ("none", "adaptive"):
        res = overhead.run(rounds=2 if args.quick else 3, steps=50, compression=compression)
        emit(**{compression: res})


@dataclasses.dataclass(frozen=True)
class Part:
    """One independent part of the check.

    Attributes:
      name: ``--parts`` name.
      what: one line for the table.
      timeout_s: its own time limit (the run's budget may cut it shorter).
      run: ``run(args, emit)`` in the part's subprocess; ``emit(**items)`` records data.
      env: environment variables for its subprocess on a GPU.
      cpu_env: the same with ``--allow-cpu``.
      background: run alongside the timed parts (it compiles only and measures no time
        that the others could disturb); ``--sequential`` turns this off.
    """

    name: str
    what: str
    timeout_s: float
    run: Callable[[argparse.Namespace, _Emit], None]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    cpu_env: dict[str, str] = dataclasses.field(default_factory=dict)
    background: bool = False


PARTS: tuple[Part, ...] = (
    Part("versions", "jax/jaxlib/plugin/driver versions, GPU name, peak bandwidth", 45, _versions),
    Part(
        "kernels", "compression kernels on the ResNet-152 gradient: time, bandwidth", 90, _kernels
    ),
    Part(
        "schedule",
        "ResNet-50 step compiled for 8 mocked GPUs: overlap, combine thresholds",
        200,
        _schedule,
        # The compile-only client needs little memory; leave the rest to later parts.
        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        cpu_env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        background=True,
    ),
    Part(
        "options",
        "every sync option: compiled for 8 mocked GPUs (2 x 4), run twice on this GPU",
        OPTIONS_LIMIT_S,
        _options,
        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    ),
    Part("step", "gpu-node preset: ResNet-152 bf16 step time on this GPU", 240, _step),
    Part(
        "overhead",
        "host time per step of each entry against its hand-written twin (flat, adaptive)",
        OVERHEAD_LIMIT_S,
        _overhead,
    ),
)
_BY_NAME = {p.name: p for p in PARTS}


# --------------------------------------------------------------------------- report


def _fmt_s(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3f} ms" if x < 1 else f"{x:.2f} s"


def _fmt_frac(x: Any) -> str:
    return "unknown" if x is None else f"{x:.2f}"


def _fmt_bytes(b: float) -> str:
    for unit, size in (("M", MiB), ("K", 1024)):
        if b >= size:
            return f"{b / size:.1f}{unit}"
    return f"{int(b)}B"


def _fmt_tbs(x: Any) -> str:
    return "unknown" if x is None else f"{x / 1e12:.2f} TB/s"


def _table_versions(d: dict) -> list[str]:
    keys = ("device_kind", "devices", "backend", "jax", "jaxlib", "packages", "nvidia_smi",
            "python", "peak_bandwidth_bytes_per_s", "peak_bandwidth_source")  # fmt: skip
    return [f"  {k:<28} {d[k]}" for k in keys if k in d]


def _table_kernels(d: dict) -> list[str]:
    lines = [
        f"  {d.get('model')} gradient: {d.get('elements')} f32 "
        f"(padded {d.get('padded_elements')}); "
        f"peak {_fmt_tbs(d.get('peak_bandwidth_bytes_per_s'))} "
        f"({d.get('device_kind')})",
        f"  {'kernel':<54} {'best':>11} {'median':>11} {'MB':>9} {'GB/s':>8} {'of peak':>7}",
    ]
    for name, r in d.get("kernels", {}).items():
        if "error" in r:
            lines.append(f"  {name:<54} FAILED: {r['error'][:80]}")
            continue
        lines.append(
            f"  {name:<54} {_fmt_s(r['best_s']):>11} {_fmt_s(r['median_s']):>11} "
            f"{r['bytes'] / 1e6:>9.1f} {r['gb_per_s']:>8.1f} {_fmt_frac(r['fraction_of_peak']):>7}"
        )
    return lines


def _table_schedule(d: dict) -> list[str]:
    lines = [f"  {d.get('header', '')}"] if d.get("header") else []
    lines.append(
        f"  {'options':<15} {'colls':>5} {'async':>5} {'overl.':>6} {'all-red.':>8} "
        f"{'compile':>8}  all-reduce bytes [ops between start/done]"
    )
    for label, s in d.get("sets", {}).items():
        pairs = ", ".join(
            f"{_fmt_bytes(b)}[{'-' if o is None else o}]"
            for b, o in zip(s["all_reduce_bytes"], s["all_reduce_ops_between"], strict=True)
        )
        if len(pairs) > 90:
            pairs = pairs[:87] + "..."
        lines.append(
            f"  {label:<15} {s['collectives']:>5} {s['async']:>5} {s['overlapped']:>6} "
            f"{s['all_reduces']:>8} {_fmt_s(s.get('compile_s')):>8}  {pairs}"
        )
    for goal, ok in d.get("goals", {}).items():
        lines.append(f"  goal: {goal}: {ok}")
    return lines


def _table_step(d: dict) -> list[str]:
    p = d.get("preset", {})
    lines = [
        f"  {p.get('model')} {p.get('image_size')}px {p.get('dtype')} per-device batch "
        f"{p.get('per_device_batch')}, {p.get('warmup_steps')} warm-up + "
        f"{p.get('repeats')} x {p.get('timing_steps')} timed steps; mesh {d.get('mesh')} "
        f"on {d.get('device_kind')}",
    ]
    if d.get("note"):
        lines.append(f"  note: {d['note']}")
    lines.append(f"  {'row':<15} {'status':<8} {'step':>11} {'images/s':>9} {'warm-up':>8}")
    for name, r in d.get("rows", {}).items():
        if r.get("status") != "ok":
            why = r.get("reason") or r.get("missing") or r.get("error") or ""
            lines.append(f"  {name:<15} {r.get('status', '?'):<8} {why[:90]}")
            continue
        ips = r.get("images_per_s")
        lines.append(
            f"  {name:<15} {'ok':<8} {_fmt_s(r.get('step_time_s')):>11} "
            f"{'-' if ips is None else f'{ips:.0f}':>9} {_fmt_s(r.get('warmup_s')):>8}"
            + ("  (degenerate 1-device)" if r.get("degenerate_1_device") else "")
        )
    return lines


def _table_overhead(d: dict) -> list[str]:
    lines = [f"  {'sync':<9} {'entry':<33} {'step':>9} {'program':>9} {'host':>9} {'/ twin':>7}"]
    for compression, res in d.items():
        for name, r in (res.get("rows") or {}).items():
            lines.append(
                f"  {compression:<9} {name:<33} {r['step_ms']:>6.3f} ms {r['program_ms']:>6.3f} ms "
                f"{r['host_ms']:>6.3f} ms {r['ratio']:>6.2f}x"
            )
    return lines


_TABLES: dict[str, Callable[[dict], list[str]]] = {
    "versions": _table_versions,
    "kernels": _table_kernels,
    "schedule": _table_schedule,
    "options": lambda d: _options_table(d),
    "step": _table_step,
    "overhead": _table_overhead,
}


def _options_table(d: dict) -> list[str]:
    from experiments.bench.gpu_options import format_table

    return format_table(d)


def format_report(result: dict) -> str:
    """The printed summary of a ``gpu_check.json`` dict: one compact table per part."""
    lines = [
        f"GPU check: {result.get('total_s', 0):.0f} s of budget {result.get('budget_s')} s, "
        f"out {result.get('out')}"
    ]
    for name, part in result.get("parts", {}).items():
        status = part.get("status", "?")
        lines.append("")
        lines.append(
            f"== {name}: {status} ({part.get('seconds', 0):.1f} s, limit "
            f"{part.get('timeout_s', 0):.0f} s) {part.get('what', '')}"
            + (" [in the background]" if part.get("background") else "")
            + (
                f" [alongside {', '.join(part['concurrent_with'])}]"
                if part.get("concurrent_with")
                else ""
            )  # fmt: skip
        )
        if part.get("error"):
            lines.append(f"  error: {part['error']}")
        try:
            lines += _TABLES.get(name, lambda d: [f"  {d}"])(part.get("data") or {})
        except Exception as e:  # a malformed part must not hide the others
            lines.append(f"  (table failed: {type(e).__name__}: {e})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- driver


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench gpu",
        description=(__doc__ or "").split("\n\n")[0]
        + " Parts: "
        + "; ".join(f"{x.name} ({x.what}, limit {x.timeout_s:.0f} s)" for x in PARTS)
        + ". Exits 2 without a GPU.",
    )
    p.add_argument("--out", required=True, help="output folder (gpu_check.json, parts/)")
    p.add_argument("--parts", default=",".join(_BY_NAME), help="comma-separated parts to run")
    p.add_argument("--quick", action="store_true", help="fewer option sets, rows and repeats")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run the schedule part alone, not alongside the timed parts (and the options "
        "part's compile half before its runs)",
    )
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="limit for the whole run")
    p.add_argument(
        "--mock-topology",
        default="1x8x1",
        help="slices x hosts x GPUs per host; GPUs per host must equal this machine's GPUs",
    )
    p.add_argument("--schedule-model", default="resnet50")
    p.add_argument("--schedule-image-size", type=int, default=224)
    p.add_argument("--schedule-batch", type=int, default=32, help="per mocked device")
    p.add_argument(
        "--no-fast-compile",
        dest="fast_compile",
        action="store_false",
        help="keep XLA's conv autotuning in the schedule part (slower compiles)",
    )
    p.add_argument("--kernel-model", default="resnet152", help="gradient tree of the kernels")
    p.add_argument(
        "--options",
        default=None,
        help="comma-separated options of the options part (default: all of "
        "experiments.bench.gpu_options.OPTION_NAMES)",
    )
    p.add_argument("--step-preset", default="gpu-node")
    p.add_argument("--per-device-batch", type=int, default=None, help="override the preset's")
    p.add_argument(
        "--step-rows", default=None, help=f"ablation rows to time (default {list(STEP_ROWS)})"
    )
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="for testing the command's plumbing only: run on CPU with tiny sizes",
    )
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="override a part's time limit (repeatable), e.g. step=330",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-limit", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.limits = {}
    for item in args.limit:
        name, _, secs = item.partition("=")
        if name not in _BY_NAME or not secs.replace(".", "", 1).isdigit():
            p.error(f"--limit {item!r}: use PART=SECONDS with PART one of {list(_BY_NAME)}")
        args.limits[name] = float(secs)
    if args.allow_cpu:  # tiny sizes: the plumbing, not the numbers
        args.kernel_model = "resnet-tiny"
        args.schedule_model, args.schedule_image_size, args.schedule_batch = "resnet-tiny", 32, 2
        args.step_preset = "cpu-smoke"
    return args


def _child(args: argparse.Namespace) -> int:
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    emit = _Emit(os.path.join(args.out, "parts", f"{args.child}.json"))
    emit.write()
    try:
        _BY_NAME[args.child].run(args, emit)
        emit.status = "ok"
    except Skip as e:
        emit.status, emit.error = "skipped", str(e)
    except BaseException as e:  # report everything, also SystemExit from argparse
        emit.status, emit.error, emit.tb = "failed", f"{type(e).__name__}: {e}", _tb()
    emit.write()
    return 0 if emit.status != "failed" else 1


def _gpu_plugin() -> bool:
    from experiments.bench.schedule import _gpu_plugin as found

    return found()


class _Running:
    """A part's subprocess, started now; :meth:`finish` waits for it (up to its limit)."""

    def __init__(self, part: Part, args: argparse.Namespace, argv: list[str], limit: float):
        self.part, self.limit = part, limit
        parts_dir = os.path.join(args.out, "parts")
        self.path = os.path.join(parts_dir, f"{part.name}.json")
        self.log = os.path.join(parts_dir, f"{part.name}.log")
        if os.path.exists(self.path):
            os.remove(self.path)
        env = {**os.environ, **(part.cpu_env if args.allow_cpu else part.env)}
        if args.allow_cpu:
            env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, "-m", "experiments.bench.gpu", *argv, "--child", part.name,
               "--part-limit", f"{limit:.1f}"]  # fmt: skip
        self.t0 = time.perf_counter()
        with open(self.log, "w") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

    def finish(self) -> dict:
        timed_out = False
        try:
            rc = self.proc.wait(timeout=max(0.0, self.t0 + self.limit - time.perf_counter()))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(self.proc.pid, signal.SIGKILL)  # the part's own process group only
            rc = self.proc.wait()
        secs = time.perf_counter() - self.t0
        out: dict[str, Any] = {"status": "failed", "data": {}, "error": None, "traceback": None}
        if os.path.exists(self.path):
            with open(self.path) as f:
                out.update(json.load(f))
        if timed_out:
            out["status"] = "timeout"
            out["error"] = f"killed after {self.limit:.0f} s (data holds what it finished)"
        elif out["status"] == "running":
            out["status"] = "failed"
            out["error"] = f"the part's process exited with {rc} before finishing"
        if out["status"] in ("failed", "timeout"):
            with open(self.log) as f:
                out["log_tail"] = f.read()[-4000:]
        out.update(what=self.part.what, seconds=secs, timeout_s=self.limit, returncode=rc)
        out["log"] = self.log
        return out


def _run_part(part: Part, args: argparse.Namespace, argv: list[str], limit: float) -> dict:
    """Runs one part in its own subprocess and returns its result (see :class:`_Running`)."""
    return _Running(part, args, argv, limit).finish()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.child:
        return _child(args)
    names = [n for n in args.parts.split(",") if n]
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown:
        print(f"unknown parts {unknown}; choose from {list(_BY_NAME)}", file=sys.stderr)
        return 2
    if not args.allow_cpu and not _gpu_plugin():
        print(
            "experiments.bench gpu needs a GPU: no CUDA plugin for jaxlib is installed "
            "(jax-cuda13-plugin or jax-cuda12-plugin). Nothing was run.",
            file=sys.stderr,
        )
        return 2
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "command": "python -m experiments.bench gpu " + " ".join(argv),
        "out": args.out,
        "budget_s": args.budget_s,
        "allow_cpu": args.allow_cpu,
        "parts": {},
    }
    # versions first: it is the GPU probe (a CUDA plugin without a GPU falls back to CPU).
    # Then the background parts (compile-only, little GPU work), then the timed ones.
    bg = [n for n in names if _BY_NAME[n].background and not args.sequential]
    order = ["versions", *bg, *(n for n in names if n != "versions" and n not in bg)]
    running: dict[str, _Running] = {}
    for name in order:
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 5:
            result["parts"][name] = {"status": "skipped", "error": "run budget used up",
                                     "seconds": 0, "timeout_s": 0, "data": {}}  # fmt: skip
            continue
        part = _BY_NAME[name]
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name} ...", flush=True)
        run = _Running(part, args, argv, min(args.limits.get(part.name, part.timeout_s), left))
        if name in bg:
            running[name] = run
            continue
        alongside = [n for n, r in running.items() if r.proc.poll() is None]
        result["parts"][name] = run.finish()
        if alongside:
            result["parts"][name]["concurrent_with"] = alongside
        if name == "versions" and not args.allow_cpu:
            platform_ = result["parts"][name].get("data", {}).get("platform")
            if platform_ != "gpu":
                print(
                    f"experiments.bench gpu needs a GPU: JAX found platform {platform_!r} "
                    f"(versions part: {result['parts'][name]['status']}). Nothing else was run.",
                    file=sys.stderr,
                )
                _write(args.out, result, t_start)
                return 2
        if name not in names:
            result["parts"][name]["note"] = "run as the GPU probe"
        _write(args.out, result, t_start)
    for name, run in running.items():
        print(f"[{time.perf_counter() - t_start:6.1f} s] waiting for {name} ...", flush=True)
        result["parts"][name] = {**run.finish(), "background": True}
        _write(args.out, result, t_start)
    result["parts"] = {n: result["parts"][n] for n in order if n in result["parts"]}
    _write(args.out, result, t_start)
    print(format_report(result))
    print(f"\nwrote {os.path.join(args.out, 'gpu_check.json')}")
    return 0


def _write(out: str, result: dict, t_start: float) -> None:
    result["total_s"] = time.perf_counter() - t_start
    path = os.path.join(out, "gpu_check.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    sys.exit(main())
