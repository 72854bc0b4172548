"""``python -m experiments.bench compression``: bytes on the wire, kernel time and accuracy per
compressor.

For every compressor (and the uncompressed baseline) it reports:

* the wire-byte ratio of one ``sync_gradients`` update against the uncompressed one
  (same algorithm), for a ResNet-50-sized and a ResNet-152-sized gradient tree
  (``jaxcomm.models.gradient_shapes``: ``jax.eval_shape``, nothing is run), read from the
  compiled HLO by ``jaxcomm.wire_bytes`` on the 8-device ``('inter', 'intra')`` mesh, and
  the same ratio for the *node-spanning* collectives only (those whose replica groups
  include the ``'inter'`` axis: the hierarchical baseline sends 1/4 of its data there,
  a flat all-to-all over all 8 devices counts fully);
* compress + decompress time per MB of f32 gradient on this machine (one device, no
  collective: quantize/dequantize, select/scatter, the PowerSGD products and QR);
* the digits test accuracy (``experiments.bench.digits.digits_accuracy``, 300 steps).

Writes a JSON file (``--json``) and prints a Markdown table.

With ``--calibration FILE`` it instead measures the codec of every compressor for the cost
model (:func:`codec_calibration`): encode and decode seconds per f32 byte of each kernel
in ``jaxcomm.cost.CODEC_KERNELS``, with ``--codec-devices`` devices running it at once (the
devices of a node share its cores, as on the testbed), written as the ``codec`` section of
a ``jaxcomm.tools.calibration`` file that ``python -m jaxcomm.tools.simulate --codec FILE`` reads::

    python -m experiments.bench compression --calibration codec_cpu.json --codec-devices 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "CODEC_DEVICES",
    "codec_calibration",
    "configs",
    "kernel_ms_per_mb",
    "main",
    "wire_ratio",
]

#: Devices that run the codec at once by default: the testbed's 2 nodes x 2 devices on this
#: machine's 2 cores.
CODEC_DEVICES = 4


def configs() -> dict[str, dict]:
    """Benchmark rows: name -> ``sync_gradients`` keyword arguments."""
    from jaxcomm import compression as C

    return {
        "none (f32)": {},
        "bf16": {"compression": C.bf16()},
        "fp16": {"compression": C.fp16()},
        "int8": {"compression": C.int8()},
        "int8, inter stage only": {"compression": C.int8(), "compress_stage": "inter"},
        "int4": {"compression": C.int4()},
        "topk(0.01)+EF": {"compression": C.topk(0.01)},
        "topk(0.01)+EF, min_size=4096": {"compression": C.topk(0.01), "min_size": 4096},
        "random_k(0.01)+EF": {"compression": C.random_k(0.01)},
        "powersgd(rank=4)": {"compression": C.powersgd(rank=4)},
        "adaptive (start bf16)": {"compression": C.adaptive()},
    }


def _sync_fn(mesh, kwargs):
    import jaxcomm

    tx = jaxcomm.sync_gradients(**kwargs)

    def local(g):
        out, _ = tx.update(g, tx.init(g))
        return out

    rep = jax.sharding.PartitionSpec()
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=rep, out_specs=rep, check_vma=False))


def wire_ratio(mesh, tree, kwargs, baseline: dict | None = None) -> dict:
    """Wire bytes of one update of ``tree`` (ShapeDtypeStructs) with ``kwargs``.

    Returns:
      ``{'total': bytes, 'inter': bytes, 'ratio': total / baseline total,
      'inter_ratio': inter / baseline inter}`` (ratios only with a ``baseline``).
    """
    import jaxcomm

    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), tree)
    wb = jaxcomm.wire_bytes(_sync_fn(mesh, kwargs), args, mesh=mesh)
    inter = sum(v for k, v in wb["by_axis"].items() if "inter" in k.split("+"))
    out = {"total": wb["total"], "inter": inter}
    if baseline is not None:
        out["ratio"] = wb["total"] / baseline["total"]
        out["inter_ratio"] = inter / baseline["inter"]
    return out


def _time(fn, *args, repeats: int = 5) -> float:
    from jaxcomm.tools.profiler import median_time

    return median_time(fn, args, repeats)


def kernel_ms_per_mb(name: str, n: int = 1 << 22) -> float | None:
    """Local compress + decompress time (ms per MB of f32) for the compressor ``name``."""
    from jaxcomm.compression.keys import dither_seed
    from jaxcomm.compression.powersgd import orthogonalize
    from jaxcomm.compression.quantize import dequantize, quantize
    from jaxcomm.compression.sparse import select_topk

    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    key = jax.random.key(1)
    mb = n * 4 / 2**20
    if name.startswith("none"):
        return None
    if name in ("bf16", "fp16"):
        dt = jnp.bfloat16 if name == "bf16" else jnp.float16
        fn = jax.jit(lambda x: (x / 8).astype(dt).astype(jnp.float32))
    elif name.startswith("int8") or name == "int4":
        bits = 4 if name == "int4" else 8

        def fn(x, key):
            q, s = quantize(x.reshape(8, -1), bits, 256, key)
            return dequantize(q, s, bits, 256)

        fn = jax.jit(fn)
        return 1e3 * _time(fn, x, key) / mb
    elif name.startswith("topk"):
        k = n // 100

        def fn(x, key):
            seed = dither_seed(key)
            idx, vals = select_topk(x, k, method="sampled", sample=n // 100, seed=seed)
            return jnp.zeros((n + 1,), jnp.float32).at[idx].add(vals)[:n]

        fn = jax.jit(fn)
        return 1e3 * _time(fn, x, key) / mb
    elif name.startswith("random_k"):
        k = n // 100
        seg = n // k

        def fn(x, key):
            idx = jnp.arange(k) * seg + jax.random.randint(key, (k,), 0, seg)
            return jnp.zeros((n,), jnp.float32).at[idx].set(x[idx])

        fn = jax.jit(fn)
        return 1e3 * _time(fn, x, key) / mb
    elif name.startswith("powersgd"):
        m = x.reshape(2048, -1)
        q = jax.random.normal(key, (m.shape[1], 4))

        def fn(m, q):
            p = orthogonalize(m @ q)
            qn = m.T @ p
            return p @ qn.T

        fn = jax.jit(fn)
        return 1e3 * _time(fn, m, q) / mb
    else:
        return None  # adaptive: the time of its current level
    return 1e3 * _time(fn, x) / mb


# Codec kernels that run as a compressor's mean over the nodes (timed round trip, their
# own decode timed apart): kernel -> the cost model's compressor of that kernel.
_ROUND_TRIP = {
    "int8": "int8(block={b}, stochastic=True)",
    "int8-nearest": "int8(block={b}, stochastic=False)",
    "int4": "int4(block={b}, stochastic=True)",
    "int4-nearest": "int4(block={b}, stochastic=False)",
    "bf16": "bf16",
    "fp16": "fp16",
    "topk": "topk(0.01)",
    "random_k": "random_k(0.01)",
}


def _round_trip(kernel: str, n: int, block: int, m: int, g: int):
    """(mean over 'inter' of one device's ``n`` f32, as the compressor computes it at
    ``compress_stage='inter'``, with error feedback; its decode kernel and inputs, on one
    device)."""
    from jaxcomm.compression.cast import bf16_mean
    from jaxcomm.compression.keys import dither_seed, two_phase_seeds
    from jaxcomm.compression.quantize import quantize, to_bytes, two_phase_mean
    from jaxcomm.compression.sparse import random_k_mean, topk_mean

    key = jax.random.key(1)
    axes = ("inter",)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    if kernel.startswith("int"):
        bits, stochastic = int(kernel[3]), not kernel.endswith("nearest")

        def mean(c):
            seeds = two_phase_seeds(key, lax.axis_index(axes), 0) if stochastic else None
            return two_phase_mean(c, axes, bits=bits, block=block, seeds=seeds, gather_axis="intra")

        blocks = -(-n // (m * block))
        chunk = (blocks, block if bits == 8 else block // 2)
        xs = jnp.pad(jnp.concatenate([x] * g), (0, g * m * blocks * block - g * n))
        buf = to_bytes(*quantize(xs.reshape(g * m, blocks * block), bits, block, None))
        return mean, _decoder(chunk, bits, block), (buf,), g * n
    if kernel in ("bf16", "fp16"):
        dt = jnp.bfloat16 if kernel == "bf16" else jnp.float16

        def mean(c):
            if dt == jnp.bfloat16:
                return bf16_mean(c, axes, "flat")
            lo = (c / m).astype(dt)  # fp16(): pre-divided, summed in 16 bits
            return _f32(lax.psum(lo, axes)), _f32(lo) * m

        words = x.astype(dt)
        return mean, _f32, (words,), n
    ratio = 0.01
    k = -(-n // 100)
    if kernel == "topk":

        def mean(c):
            seed = dither_seed(key, lax.axis_index(axes), 0)
            return topk_mean(c, axes, ratio=ratio, method="sampled", sample_ratio=0.01, seed=seed)

        idx = jnp.tile(jnp.arange(k, dtype=jnp.int32) * 97 % n, m)
        vals = jnp.ones((m * k,), jnp.float32)

        def decode(i, v):
            return jnp.zeros((n + 1,), jnp.float32).at[i].add(v)[:n] / m

        return mean, decode, (idx, vals), n

    def mean(c):
        return random_k_mean(c, axes, "flat", ratio=ratio, key=key)

    idx = jnp.arange(k, dtype=jnp.int32) * (n // k)
    vals = jnp.ones((k,), jnp.float32)
    return mean, lambda i, v: jnp.zeros((n + 1,), jnp.float32).at[i].set(v)[:n], (idx, vals), n


def _f32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _decoder(chunk: tuple[int, int], bits: int, block: int):
    """The int8/int4 decode of gathered means (``two_phase_mean``'s last kernel): bytes
    to values and scales, dequantized, flattened."""
    from jaxcomm.compression.quantize import dequantize, from_bytes

    def decode(buf):
        return dequantize(*from_bytes(buf, chunk, bits), bits, block).reshape(-1)

    return decode


def _time_round_trip(mean, n: int, devices, repeats: int) -> float:
    """Best time of ``mean`` with error feedback (``c = x + r``; ``r' = c - sent``) on a
    ``(len(devices) // 2, 2)`` ('inter', 'intra') mesh, each device its own ``n`` f32."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(-1, 2), ("inter", "intra"))
    spec = P(("inter", "intra"))
    d = len(devices)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (d, n)), NamedSharding(mesh, spec))
    r = jax.device_put(
        0.01 * jax.random.normal(jax.random.key(2), (d, n)), NamedSharding(mesh, spec)
    )

    def local(x, r):
        c = x[0] + r[0]
        out, sent = mean(c)
        return out[None], (c - sent)[None]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                              check_vma=False))  # fmt: skip
    jax.block_until_ready(f(x, r))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, r))
        times.append(time.perf_counter() - t0)
    return min(times)


def _powersgd_kernels(n: int, rank: int = 4, rows: int = 2048):
    """PowerSGD's encode (``P = M Q``, orthogonalize, ``Q = M^T P``, with the residual
    added) and decode (``M - P Q^T``, the new residual) on one ``(rows, n / rows)``
    matrix."""
    from jaxcomm.compression.powersgd import orthogonalize

    key = jax.random.key(1)
    m = jax.random.normal(jax.random.key(0), (rows, n // rows), jnp.float32)
    rm = 0.01 * m
    q0 = jax.random.normal(key, (n // rows, rank), jnp.float32)

    def enc(m, rm, q):
        c = m + rm
        pm = orthogonalize(c @ q)
        return pm, c.T @ pm

    pm, qn = jax.jit(enc)(m, rm, q0)
    return enc, (m, rm, q0), (lambda c, a, b: c - a @ b.T), (m, pm, qn)


def _best_time(fn, args, devices, repeats: int) -> float:
    """Best wall time (s) of ``fn`` run on every one of ``devices`` at once (shard_map over
    a 1-D mesh, each device its own copy of ``args``), after one warm-up run."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
    spec = P("d")
    stacked = [
        jax.device_put(jnp.stack([a] * len(devices)), NamedSharding(mesh, spec)) for a in args
    ]

    def local(*xs):
        res = fn(*(x[0] for x in xs))
        return jax.tree.map(lambda y: y[None], res)

    outs = jax.eval_shape(fn, *args)
    f = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(args),
                      out_specs=jax.tree.map(lambda _: spec, outs), check_vma=False)
    )  # fmt: skip
    jax.block_until_ready(f(*stacked))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*stacked))
        times.append(time.perf_counter() - t0)
    return min(times)


def codec_calibration(
    *,
    devices: int = CODEC_DEVICES,
    nbytes: int = 16 << 20,
    block: int = 256,
    repeats: int = 7,
    kernels: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Encode/decode seconds per f32 byte of every codec kernel on this machine.

    Every kernel runs on ``devices`` devices at once, each on its own ``nbytes`` of f32
    (the devices share the cores, as on the testbed); a time is the best of ``repeats``
    runs after one warm-up (as little of the machine's other load as the runs caught).

    * The compressors of ``jaxcomm.compression`` (int8/int4 stochastic and nearest, bf16,
      fp16, top-k 1 %, random-k 1 %) run as they do at ``compress_stage='inter'``: their
      mean over the 'inter' axis of a ``(devices/2, 2)`` ('inter', 'intra') mesh (int8/int4
      gather their encoded means over 'intra' and decode them), with error feedback (the
      residual added before, ``c - sent`` after). Their decode kernel is timed apart; the
      decode rate is its time per f32 byte out, and the encode rate the rest of the round
      trip per byte encoded (``jaxcomm.cost.codec_counts`` of the cost model). The
      in-process collectives' own time (a copy) stays in the encode rate.
    * PowerSGD rank 4 on one 2048-row matrix: encode ``P = M Q``, orthogonalize,
      ``Q = M^T P``; decode ``M - P Q^T``.
    * adaptive's error sketch (two sketches of ``n``, encode only) and the packing copy
      (``x * 2``).

    Args:
      devices: devices running each kernel at once (even, >= 4, <= ``jax.device_count()``).
      nbytes: f32 bytes per device (a power of two such as 16 MiB).
      block: int8/int4 block.
      repeats: timed runs per kernel.
      kernels: the ``jaxcomm.cost.CODEC_KERNELS`` to time (default all).

    Returns:
      ``{'codec': {kernel: {encode_s_per_byte, decode_s_per_byte, source}}, 'meta': {...}}``,
      a ``jaxcomm.tools.calibration`` file.

    Raises:
      ValueError: a device count or size that does not fit.

    Example:
      >>> doc = codec_calibration(devices=4, nbytes=1 << 20, repeats=3)
    """
    from jaxcomm import cost

    devices, n, want = _check_codec_args(devices, nbytes, block, kernels)
    devs = jax.devices()[:devices]
    m, g = devices // 2, 2
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    src = (
        f"python -m experiments.bench compression --calibration: best of {repeats}, {devices} "
        f"devices at once, {4 * n} bytes each"
    )
    codec: dict[str, Any] = {}

    def record(name, enc, dec, te, td):
        codec[name] = {"encode_s_per_byte": enc, "decode_s_per_byte": dec, "source": src}
        print(f"{name:>13}: encode {te * 1e3:8.2f} ms, decode {td * 1e3:8.2f} ms per call "
              f"({4 * n / 2**20:.0f} MiB per device, {devices} at once)", flush=True)  # fmt: skip

    for name, spec in _ROUND_TRIP.items():
        if name not in want:
            continue
        comp = cost.parse_compression(spec.format(b=block))
        mean, decode, dargs, out_n = _round_trip(name, n, block, m, g)
        t_rt = _time_round_trip(mean, n, devs, repeats)
        t_dec = _best_time(decode, dargs, devs, repeats)
        dec_rate = t_dec / (4 * out_n)
        enc_b, dec_b = cost.codec_counts(comp, 4 * n, m, gather=g if comp.gathers else 1)
        enc_rate = max(t_rt - dec_rate * dec_b, 0.0) / enc_b
        record(name, enc_rate, dec_rate, t_rt - dec_rate * dec_b, dec_rate * dec_b)
    if "powersgd" in want:
        enc, eargs, dec, dargs = _powersgd_kernels(n)
        te, td = _best_time(enc, eargs, devs, repeats), _best_time(dec, dargs, devs, repeats)
        record("powersgd", te / (4 * n), td / (4 * n), te, td)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    if "sketch" in want:
        te = _best_time(_sketch_kernel(), (x, 0.5 * x), devs, repeats)
        record("sketch", te / (4 * n), 0.0, te, 0.0)
    if "copy" in want:
        te = _best_time(lambda x: x * 2.0, (x,), devs, repeats)
        record("copy", te / (4 * n), te / (4 * n), te, te)
    meta = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "devices_at_once": devices,
        "mesh": {"inter": m, "intra": g},
        "bytes_per_device": 4 * n,
        "block": block,
        "repeats": repeats,
        "statistic": "best",
        "load_average_before": list(load) if load else None,
        "load_average_after": list(os.getloadavg()) if load else None,
    }
    return {"codec": codec, "meta": meta}


def _check_codec_args(
    devices: int, nbytes: int, block: int, kernels: tuple[str, ...] | None
) -> tuple[int, int, tuple[str, ...]]:
    """:func:`codec_calibration`'s arguments checked: ``(devices, f32 count, kernels)``.

    Raises:
      ValueError: a device count, size or kernel that does not fit.
    """
    from jaxcomm import cost
    from jaxcomm.validate import check_int

    devices = check_int(
        "devices", devices, minimum=4, maximum=jax.device_count(),
        fix=f"an even count from 4 to the {jax.device_count()} devices present",
    )  # fmt: skip
    if devices % 2:
        raise ValueError(f"devices={devices}: must be even (nodes of 2 devices); e.g. 4.")
    n = check_int("nbytes", nbytes, minimum=8 * block * devices) // 4
    if n % (devices * block) or n % 2048:
        raise ValueError(
            f"nbytes={nbytes}: the f32 count {n} must divide by devices x block "
            f"({devices * block}) and by 2048 (PowerSGD's rows); use e.g. 16 MiB."
        )
    want = cost.CODEC_KERNELS if kernels is None else tuple(kernels)
    bad = [k for k in want if k not in cost.CODEC_KERNELS]
    if bad or not want:
        raise ValueError(
            f"kernels={kernels!r}: {bad or 'none given'}; choose from {list(cost.CODEC_KERNELS)}."
        )
    return devices, n, want


def _sketch_kernel():
    """adaptive's error sketch of one buffer: the sketches of the error and of the input."""
    from jaxcomm.compression.adaptive import error_sketch

    def sketch(c, o):
        seed = jnp.uint32(11)
        return error_sketch(o - c, seed, 1021), error_sketch(c, seed, 1021)

    return sketch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench compression",
        description="Wire-byte ratio (ResNet-50/152 gradient trees), kernel time per MB and "
        "digits accuracy for every compressor, on 8 (fake) devices.",
    )
    p.add_argument("--models", default="resnet50,resnet152", help="comma-separated ResNets")
    p.add_argument("--digits-steps", type=int, default=300, help="0 skips the digits runs")
    p.add_argument("--only", default="", help="row names separated by ';' (default: all)")
    p.add_argument("--json", default="runs/compression_bench.json", help="output JSON path")
    p.add_argument(
        "--calibration", default=None,
        help="measure the codec kernels for the cost model and write them here (only that)",
    )  # fmt: skip
    p.add_argument("--codec-devices", type=int, default=CODEC_DEVICES,
                   help="devices running each codec kernel at once")  # fmt: skip
    p.add_argument("--codec-mib", type=int, default=16, help="MiB of f32 per device")
    p.add_argument("--codec-block", type=int, default=256, help="int8/int4 block")
    p.add_argument("--codec-repeats", type=int, default=7, help="timed runs (best is kept)")
    args = p.parse_args(argv)
    if args.calibration:
        from jaxcomm.host_memory import keep_freed_memory

        keep_freed_memory()  # as the testbed's processes run (before any JAX computation)
    if jax.device_count() < 8:
        from experiments.bench.digits import reexec_with_fake_devices

        return reexec_with_fake_devices("compression", argv)

    if args.calibration:
        return _write_calibration(args, argv)

    import jaxcomm
    from experiments.bench.digits import digits_accuracy
    from jaxcomm.models import gradient_shapes

    mesh = jaxcomm.make_mesh(intra=4)
    rows = configs()
    if args.only:
        keep = [s.strip() for s in args.only.split(";")]
        rows = {k: v for k, v in rows.items() if k in keep or k.startswith("none")}
    models = [m for m in args.models.split(",") if m]
    trees = {m: gradient_shapes(m) for m in models}
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "rows": {},
    }
    base: dict[str, dict] = {}
    for name, kw in rows.items():
        row: dict[str, Any] = {}
        for m in models:
            t = time.perf_counter()
            w = wire_ratio(mesh, trees[m], kw, base.get(m))
            if name.startswith("none"):
                base[m] = w
                w = {**w, "ratio": 1.0, "inter_ratio": 1.0}
            w["compile_s"] = time.perf_counter() - t
            row[m] = w
        row["ms_per_mb"] = kernel_ms_per_mb(name)
        if args.digits_steps:
            d = digits_accuracy(kw, steps=args.digits_steps)
            row["digits_accuracy"] = d["accuracy"]
            row["digits_final_loss"] = d["final_loss"]
        results["rows"][name] = row
        print(f"done: {name}", flush=True)

    _print_table(results["rows"], models, base)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=float)
    print(f"wrote {args.json}")
    return 0


def _write_calibration(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--calibration FILE``: :func:`codec_calibration` written as a calibration file."""
    try:
        doc = codec_calibration(
            devices=args.codec_devices, nbytes=args.codec_mib << 20, block=args.codec_block,
            repeats=args.codec_repeats,
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc["meta"]["command"] = "python -m experiments.bench compression " + " ".join(argv or [])
    os.makedirs(os.path.dirname(os.path.abspath(args.calibration)), exist_ok=True)
    with open(args.calibration, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.calibration}")
    return 0


def _print_table(rows: dict[str, dict], models: list[str], base: dict[str, dict]) -> None:
    """The Markdown table of the rows, then each model's uncompressed bytes per step."""
    header = ["compressor"]
    for m in models:
        header += [f"{m} bytes ratio", f"{m} node-spanning ratio"]
    header += ["compress+decompress ms/MB", "digits acc"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, row in rows.items():
        cells = [name]
        for m in models:
            cells += [f"{row[m]['ratio']:.4f}", f"{row[m]['inter_ratio']:.4f}"]
        ms = row["ms_per_mb"]
        cells.append("-" if ms is None else f"{ms:.2f}")
        acc = row.get("digits_accuracy")
        cells.append("-" if acc is None else f"{acc:.4f}")
        print("| " + " | ".join(cells) + " |")
    for m in models:
        print(f"{m}: uncompressed bytes per device per step {base[m]['total'] / 2**20:.1f} MiB")
