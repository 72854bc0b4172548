"""``python -m experiments.bench compile``: compile time and HLO size of the sync, per option.

For each option (an all-reduce algorithm, bucket sizes, a compressor, the inter-node
compression stage) it builds ``jaxcomm.sync_gradients(...)`` and compiles its ``update``
inside ``jax.shard_map`` on the 2 x 4 mesh ('inter', 'intra') of 8 fake CPU devices over a
model's gradient tree (``jaxcomm.models.gradient_shapes``; ResNet-152 by default: 467
leaves, 60.2M parameters), recording where the time goes:

* ``trace_s``: Python tracing to a jaxpr (``jax.jit(...).trace``), and the jaxpr's
  equation count (``jaxpr_eqns``, nested jaxprs included);
* ``lower_s``: lowering to StableHLO, and the HLO instruction count before XLA's passes
  (``hlo_ops_pre``);
* ``compile_s``: XLA's optimization and code generation, the instruction count of the
  optimized module (``hlo_ops_post``), and its distinct fusion kernels (``kernels``,
  :func:`distinct_kernels`): XLA:CPU compiles each distinct kernel once, so compile time
  follows this count, which unlike the seconds does not depend on the machine's load.

``--step`` also compiles the whole data-parallel train step (``jaxcomm.data_parallel``,
forward, backward, sync, SGD) of a real ResNet (``--step-model``, default ResNet-50 at 32
px, so that the step compiles on a small CPU too). Every option is compiled in the same
process, one after the other, so the ratios to ``flat`` are comparable; the
persistent compilation cache is off, so each compile is real (a fresh ``jax.jit`` per
compile). ``--repeat N`` compiles every option N times in rounds (flat, a, b, flat, a, b,
...) and reports each measure's median: on a shared machine flat's own CPU time varies
between runs, and a single ratio to it carries that variation whole. Prints a table and writes
JSON with ``--json PATH`` (rewritten after each option, so a run cut short keeps what it
finished).

Example::

  python -m experiments.bench compile --options flat,ring,powersgd --json compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
AXES = ("inter", "intra")

#: option name -> keyword arguments of ``jaxcomm.sync_gradients`` (compressors by name,
#: built at run time so this module imports without JAX).
OPTIONS: dict[str, dict[str, Any]] = {
    "flat": {"algorithm": "flat"},
    "hierarchical": {"algorithm": "hierarchical"},
    "ring": {"algorithm": "ring"},
    "tree": {"algorithm": "tree"},
    "halving_doubling": {"algorithm": "halving_doubling"},
    "auto": {"algorithm": "auto"},
    "buckets": {"bucket_bytes": (MiB, 25 * MiB)},
    "bf16": {"compression": "bf16"},
    "fp16": {"compression": "fp16"},
    "int8": {"compression": "int8"},
    "int4": {"compression": "int4"},
    "topk": {"compression": "topk"},
    "random_k": {"compression": "random_k"},
    "powersgd": {"compression": "powersgd"},
    "adaptive": {"compression": "adaptive"},
    "int8_inter": {"compression": "int8", "compress_stage": "inter"},
}


def _compressor(name: str):
    from jaxcomm import compression as C

    builders = {
        "bf16": C.bf16,
        "fp16": C.fp16,
        "int8": C.int8,
        "int4": C.int4,
        "topk": lambda: C.topk(0.01),
        "random_k": lambda: C.random_k(0.01),
        "powersgd": lambda: C.powersgd(rank=4),
        "adaptive": C.adaptive,
    }
    return builders[name]()


def sync_kwargs(option: str) -> dict[str, Any]:
    """The ``sync_gradients`` keyword arguments of ``option`` (a key of :data:`OPTIONS`),
    compressors built; options without ``algorithm`` use the library default."""
    if option not in OPTIONS:
        raise ValueError(f"option {option!r} is not known; choose from {list(OPTIONS)}.")
    kw = dict(OPTIONS[option])
    if "compression" in kw:
        kw["compression"] = _compressor(kw["compression"])
    return kw


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.bench compile", description=__doc__)
    p.add_argument("--model", default="resnet152", help="jaxcomm.models ResNet name")
    p.add_argument(
        "--options",
        default=None,
        help=f"comma-separated options (default: all of {list(OPTIONS)})",
    )
    p.add_argument("--json", default=None, help="write the results here (after each option)")
    p.add_argument(
        "--step", action="store_true", help="also compile the whole data-parallel train step"
    )
    p.add_argument("--step-model", default="resnet50", help="ResNet of the --step train step")
    p.add_argument("--image-size", type=int, default=32, help="--step input side in pixels")
    p.add_argument("--batch", type=int, default=8, help="--step global batch")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="compile every option this many times, in rounds (flat, a, b, flat, a, b, ...); "
        "the table shows each measure's median",
    )
    return p.parse_args(argv)


def _setup_backend() -> None:
    """8 fake CPU devices and no persistent compilation cache (before any device exists)."""
    import jax

    try:  # a no-op when the CPU backend exists already (e.g. under pytest's 8 devices)
        jax.config.update("jax_num_cpu_devices", 8)
    except Exception:
        pass
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_compilation_cache", False)
    # JAX decides once per process whether to use its persistent cache: a process that
    # compiled with one already (the test suite's) decides again, without it.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    if len(jax.devices()) < 8:
        raise SystemExit(
            "needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "JAX_PLATFORMS=cpu"
        )


def _count_eqns(jaxpr) -> int:
    """Equations of a jaxpr, those of nested jaxprs (shard_map, cond, scan, pjit) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(j, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    n += _count_eqns(inner)
                elif hasattr(j, "eqns"):
                    n += _count_eqns(j)
    return n


def hlo_op_count(text: str) -> int:
    """Instructions in an HLO module's text (all computations)."""
    from jaxcomm import hlo

    return sum(len(v) for v in hlo.instructions(text).values())


def distinct_kernels(text: str) -> int:
    """Distinct loop fusions of an optimized HLO module's text: the computations that
    ``kLoop`` / ``kInput`` / ``kOutput`` fusions call, those equal up to names and metadata
    counted once, as XLA:CPU compiles them once (slices at different constant offsets
    differ). ``kCustom`` fusions (YNNPACK's dots and reductions) are left out: they are
    not compiled to LLVM kernels. The count follows the ``FusionCompiler::Compile``
    events of a profiled compile closely (exactly for flat and PowerSGD on ResNet-152's
    sync)."""
    called = set(re.findall(r" fusion\(.*?kind=k(?:Loop|Input|Output), calls=(%[\w.\-]+)", text))
    bodies = set()
    for block in text.split("\n\n"):
        head, _, body = block.lstrip().partition("\n")
        if head.split(" ", 1)[0] in called:
            bodies.add(re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}", "", body))
    return len(bodies)


def measure(fn: Callable, *args: Any) -> dict[str, Any]:
    """Traces, lowers and compiles ``fn`` (jitted) for ``args``; times and sizes each stage.

    Args:
      fn: a ``jax.jit``-ed function.
      *args: ``jax.ShapeDtypeStruct`` arguments (with shardings).

    Returns:
      ``{trace_s, lower_s, compile_s, total_s, cpu_s, jaxpr_eqns, hlo_ops_pre,
      hlo_ops_post, kernels}`` (seconds of wall clock, ``cpu_s`` of process CPU time).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3, c3 = time.perf_counter(), time.process_time()
    text = compiled.as_text()
    return {
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "total_s": t3 - t0,
        # CPU seconds of this process (all threads): on a shared machine less sensitive to
        # other jobs than the wall-clock times.
        "cpu_s": c3 - c0,
        "jaxpr_eqns": _count_eqns(traced.jaxpr.jaxpr),
        "hlo_ops_pre": hlo_op_count(lowered.as_text(dialect="hlo")),
        "hlo_ops_post": hlo_op_count(text),
        "kernels": distinct_kernels(text),
    }


def sync_program(tx, tree, mesh) -> tuple[Callable, tuple]:
    """``jit(shard_map(update))`` of the sync ``tx`` over the gradient tree ``tree``
    (``ShapeDtypeStruct``s), and its abstract arguments ``(grads, state)``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomm.state import stack_local, state_partition_specs, unstack_local

    def init():
        return tx.init(jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), tree))

    # Shapes only: per-device compressor state (typed varying) leaves shard_map unchecked.
    abstract = jax.eval_shape(
        jax.shard_map(init, mesh=mesh, in_specs=(), out_specs=P(), check_vma=False)
    )
    sspecs = state_partition_specs(abstract, AXES)
    state = jax.eval_shape(
        jax.shard_map(
            lambda: stack_local(init()),
            mesh=mesh,
            in_specs=(),
            out_specs=sspecs,
            check_vma=False,
        )
    )
    shard = jax.tree.map(
        lambda s: NamedSharding(mesh, s), sspecs, is_leaf=lambda x: isinstance(x, P)
    )
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shard
    )
    rep = NamedSharding(mesh, P())
    grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), tree)

    def local(g, s):
        out, s = tx.update(g, unstack_local(s))
        return out, stack_local(s)

    # Gradients come in replicated-typed (their values do not matter for a compile), so the
    # program runs unchecked; data_parallel's step (check_vma=True) compiles the same sync.
    fn = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), sspecs), out_specs=(P(), sspecs), check_vma=False
        )
    )
    return fn, (grads, state)


def step_program(tx, model: str, image_size: int, batch: int, mesh) -> tuple[Callable, tuple]:
    """The jitted data-parallel train step (ResNet ``model``, SGD after ``tx``) and its
    abstract arguments ``(state, batch)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jaxcomm
    from jaxcomm.models import resnet

    net = nnx.eval_shape(lambda: resnet(model, num_classes=1000))
    graphdef, params, stats = nnx.split(net, nnx.Param, nnx.BatchStat)

    def loss(p, s, b):
        m = nnx.merge(graphdef, p, s, copy=True)
        logits = m(b["x"])
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1))
        return nll, (nnx.state(m, nnx.BatchStat), {})

    dp = jaxcomm.data_parallel(loss, optax.chain(tx, optax.sgd(0.1)), mesh, with_model_state=True)
    state = jax.eval_shape(dp.init, params, stats)
    shard = dp.state_shardings(state)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shard
    )
    b = {
        "x": jax.ShapeDtypeStruct((batch, image_size, image_size, 3), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch,), np.int32),
    }
    b = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dp.batch_sharding), b
    )
    return dp.step_fn(state), (state, b)


def _median(ms: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key's median over the measurements ``ms`` (dicts of numbers, same keys)."""
    import statistics

    return {k: statistics.median(m[k] for m in ms) for k in ms[0]}


def run(
    options: list[str],
    *,
    model: str = "resnet152",
    step: bool = False,
    step_model: str = "resnet50",
    image_size: int = 32,
    batch: int = 8,
    mesh=None,
    on_result: Callable[[dict, str], None] | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """Compiles the sync (and with ``step`` the train step) of each option.

    Args:
      options: keys of :data:`OPTIONS`, compiled in this order.
      model: ResNet whose gradient tree the sync reduces.
      step: also compile the whole data-parallel step of ``step_model``.
      step_model, image_size, batch: the ``step`` ResNet, input side, global batch.
      mesh: the 2 x 4 mesh (default ``jaxcomm.make_mesh(intra=4)``).
      on_result: called after each compile with the results dict and the option's name.
      repeat: rounds; every round compiles every option once, in order, so that a change
        of the machine's load meets all options alike. Each measure is the median over the
        rounds, the rounds' own values under ``"runs"``.

    Returns:
      ``{"config": {...}, "results": {option: {"sync": measure(...), "step": ...}}}``.
    """
    import jax

    import jaxcomm
    from jaxcomm.models import gradient_shapes

    for o in options:
        sync_kwargs(o)  # unknown names fail before any compile
    mesh = jaxcomm.make_mesh(intra=4) if mesh is None else mesh
    tree = gradient_shapes(model)
    leaves = jax.tree.leaves(tree)
    out: dict[str, Any] = {
        "config": {
            "model": model,
            "leaves": len(leaves),
            "parameters": sum(int(x.size) for x in leaves),
            "mesh": dict(mesh.shape),
            "options": {o: {k: repr(v) for k, v in OPTIONS[o].items()} for o in options},
            "step_model": step_model if step else None,
            "step_image_size": image_size if step else None,
            "step_batch": batch if step else None,
            "jax": jax.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_start": os.getloadavg(),
            "repeat": repeat,
        },
        "results": {},
    }
    runs: dict[str, list[dict]] = {o: [] for o in options}
    for _ in range(repeat):
        for o in options:
            fn, args = sync_program(jaxcomm.sync_gradients(axes=AXES, **sync_kwargs(o)), tree, mesh)
            res = {"sync": measure(fn, *args)}
            if step:
                tx = jaxcomm.sync_gradients(axes=AXES, **sync_kwargs(o))
                fn, args = step_program(tx, step_model, image_size, batch, mesh)
                res["step"] = measure(fn, *args)
            runs[o].append(res)
            out["results"][o] = {
                part: _median([r[part] for r in runs[o]]) for part in runs[o][0]
            } | {"runs": runs[o]}
            out["config"]["load_average_end"] = os.getloadavg()
            if on_result is not None:
                on_result(out, o)
    return out


def table(out: dict[str, Any]) -> str:
    """The results as a text table, with the total wall-clock and CPU time's ratio to
    ``flat`` (when measured)."""
    res = out["results"]
    base = res.get("flat")
    parts = [p for p in ("sync", "step") if any(p in r for r in res.values())]
    head = ["option"]
    for p in parts:
        head += [f"{p} trace s", f"{p} lower s", f"{p} compile s", f"{p} total s", "x flat"]
        head += [f"{p} CPU s", "x flat"]
        head += [f"{p} eqns", f"{p} HLO pre", f"{p} HLO post", f"{p} kernels"]
    rows = [head]
    for name, r in res.items():
        row = [name]
        for p in parts:
            m = r.get(p)
            if m is None:
                row += ["-"] * 11
                continue
            b = None if base is None else base.get(p)
            ratio = "-" if b is None else f"{m['total_s'] / b['total_s']:.2f}"
            cpu_ratio = "-" if b is None else f"{m['cpu_s'] / b['cpu_s']:.2f}"
            row += [f"{m['trace_s']:.2f}", f"{m['lower_s']:.2f}", f"{m['compile_s']:.2f}"]
            row += [f"{m['total_s']:.2f}", ratio, f"{m['cpu_s']:.2f}", cpu_ratio]
            row += [str(m["jaxpr_eqns"]), str(m["hlo_ops_pre"]), str(m["hlo_ops_post"])]
            row += [str(m.get("kernels", "-"))]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    options = args.options.split(",") if args.options else list(OPTIONS)
    if args.repeat < 1:
        print(f"--repeat={args.repeat} must be >= 1, e.g. 3", file=sys.stderr)
        return 2
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        print(f"unknown options {unknown}; choose from {list(OPTIONS)}", file=sys.stderr)
        return 2
    _setup_backend()

    def save(out, option):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        runs = out["results"][option]["runs"]
        r = runs[-1]  # this round's compile, not the median so far
        print(
            f"{option} (round {len(runs)}/{args.repeat}): sync {r['sync']['total_s']:.1f} s"
            + (f", step {r['step']['total_s']:.1f} s" if "step" in r else ""),
            flush=True,
        )

    out = run(
        options,
        model=args.model,
        step=args.step,
        step_model=args.step_model,
        image_size=args.image_size,
        batch=args.batch,
        on_result=save,
        repeat=args.repeat,
    )
    c = out["config"]
    print(
        f"\nmodel={c['model']} leaves={c['leaves']} params={c['parameters']} mesh={c['mesh']} "
        f"jax={c['jax']} cpus={c['cpus']} load={c['load_average_start']} -> "
        f"{c['load_average_end']}"
    )
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
