"""``python -m jaxcomm.bench compression``: bytes on the wire, kernel time and accuracy per
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
* the digits test accuracy (``jaxcomm.bench.digits.digits_accuracy``, 300 steps).

Writes a JSON file (``--json``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["configs", "kernel_ms_per_mb", "main", "wire_ratio"]


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
    from jaxcomm.profiler import median_time

    return median_time(fn, args, repeats)


def kernel_ms_per_mb(name: str, n: int = 1 << 22) -> float | None:
    """Local compress + decompress time (ms per MB of f32) for the compressor ``name``."""
    from jaxcomm.compression.powersgd import orthogonalize
    from jaxcomm.compression.quantize import dequantize, dither_seed, quantize
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxcomm.bench compression",
        description="Wire-byte ratio (ResNet-50/152 gradient trees), kernel time per MB and "
        "digits accuracy for every compressor, on 8 (fake) devices.",
    )
    p.add_argument("--models", default="resnet50,resnet152", help="comma-separated ResNets")
    p.add_argument("--digits-steps", type=int, default=300, help="0 skips the digits runs")
    p.add_argument("--only", default="", help="row names separated by ';' (default: all)")
    p.add_argument("--json", default="runs/compression_bench.json", help="output JSON path")
    args = p.parse_args(argv)
    if jax.device_count() < 8:
        from jaxcomm.bench.digits import reexec_with_fake_devices

        return reexec_with_fake_devices("compression", argv)

    import jaxcomm
    from jaxcomm.bench.digits import digits_accuracy
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

    header = ["compressor"]
    for m in models:
        header += [f"{m} bytes ratio", f"{m} node-spanning ratio"]
    header += ["compress+decompress ms/MB", "digits acc"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, row in results["rows"].items():
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
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=float)
    print(f"wrote {args.json}")
    return 0
