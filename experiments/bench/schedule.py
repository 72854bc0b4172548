"""``python -m experiments.bench schedule``: a train step's compiled schedule per XLA option set.

Compiles (never runs) one data-parallel train step for 8 devices and prints the schedule
report (:mod:`jaxcomm.tools.schedule`) for each option set: XLA defaults, the overlap options
(latency-hiding scheduler), and all-reduce combine thresholds of 0, 1 MiB and 30 MiB.

* GPU variant (a GPU is present, or ``--variant gpu``): the GPU client mocks an 8-GPU
  topology (``jax_mock_gpu_topology``, default ``1x8x1``: 8 hosts x 1 GPU, mock NCCL; XLA
  requires the mock's GPUs per host to equal the real machine's, so one lent GPU mocks 8
  hosts of one GPU), so one real GPU compiles the 8-device program; async start/done
  pairs and the compute scheduled between them show the overlap.
* CPU variant (no GPU): 8 fake CPU devices. XLA:CPU collectives are synchronous and its
  all-reduce combiner ignores the GPU thresholds, so the CPU table shows bucket counts and
  sizes only (with ``--no-cpu-combiner``, which is on by default, the CPU combiner is off so
  each bucket stays one all-reduce). The GPU variant needs a GPU.

Writes all reports as JSON with ``--json PATH`` (rewritten after each option set, so a run
cut short keeps the sets it finished). ``--option-sets`` compiles a subset,
``--extra-options`` adds XLA options to every set (dropped with a message if this jaxlib
lacks them), ``--image-size`` / ``--num-classes`` shape a ResNet; ``python -m
experiments.bench gpu`` runs it for ResNet-50 at 224 px on 8 mocked GPUs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

MiB = 1 << 20


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.bench schedule", description=__doc__)
    p.add_argument("--variant", choices=("auto", "gpu", "cpu"), default="auto")
    p.add_argument(
        "--mock-topology",
        default="1x8x1",
        help="slices x hosts x GPUs per host; GPUs per host must equal this machine's GPUs",
    )
    p.add_argument(
        "--model", default="mlp", help="mlp, or a jaxcomm.models ResNet name (resnet-tiny, ...)"
    )
    p.add_argument("--width", type=int, default=1024, help="mlp width")
    p.add_argument("--depth", type=int, default=8, help="mlp layers")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--algorithm", default="hierarchical")
    p.add_argument("--bucket", default=None, help="MIN,MAX bucket bytes for sync_gradients")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--image-size", type=int, default=32, help="ResNet input side in pixels")
    p.add_argument("--num-classes", type=int, default=10, help="ResNet classifier outputs")
    p.add_argument(
        "--option-sets",
        default=None,
        help=f"comma-separated option sets to compile (default: all of {list(OPTION_SETS)})",
    )
    p.add_argument(
        "--extra-options",
        default=None,
        help="JSON dict of XLA options added to every option set "
        "(e.g. '{\"xla_gpu_autotune_level\": 0}' for faster GPU compiles)",
    )
    p.add_argument(
        "--accumulate",
        choices=("local", "overlap"),
        default="overlap",
        help="with --microbatches: 'overlap' (default here: the schedule of per-microbatch "
        "reductions is what this report studies) or 'local' (one reduction per step)",
    )
    p.add_argument("--rows", action="store_true", help="print every collective, not only totals")
    p.add_argument("--json", default=None, help="write the reports here (after each option set)")
    return p.parse_args(argv)


#: Option set names, in the order they are compiled.
OPTION_SETS = (
    "defaults",
    "overlap",
    "overlap+pipeline",
    "combine=0",
    "combine=1MiB",
    "combine=30MiB",
)


def option_sets(variant: str, names=None) -> dict[str, dict]:
    """The compiler options of each option set (``OPTION_SETS``) for ``variant``.

    Args:
      variant: ``'gpu'`` or ``'cpu'`` (the CPU variant adds ``disable_passes
        ('cpu-all-reduce-combiner')`` to every set, and a ``cpu-combiner-on`` set).
      names: the sets to keep (default: all).

    Returns:
      ``{name: compiler_options}``, options checked against the installed jaxlib.

    Raises:
      ValueError: an unknown name in ``names``.
    """
    from jaxcomm import xla

    names = list(OPTION_SETS) if names is None else list(names)
    unknown = [n for n in names if n not in OPTION_SETS]
    if unknown:
        raise ValueError(f"unknown option sets {unknown}; choose from {list(OPTION_SETS)}.")
    builders = {
        "defaults": lambda: {},
        "overlap": xla.overlap_options,
        "overlap+pipeline": lambda: xla.overlap_options(pipeline=("all-reduce",)),
        "combine=0": lambda: xla.combine_options(all_reduce=0),
        "combine=1MiB": lambda: xla.combine_options(all_reduce=MiB),
        "combine=30MiB": lambda: xla.combine_options(all_reduce=30 * MiB),
    }
    base = xla.disable_passes("cpu-all-reduce-combiner") if variant == "cpu" else {}
    out = {n: xla.merge_options(base, builders[n]()) for n in names}
    if variant == "cpu":  # XLA:CPU's own combiner, for comparison with the explicit buckets
        out["cpu-combiner-on"] = {}
    return out


def _gpu_plugin() -> bool:
    """Whether a CUDA plugin for jaxlib is installed (checked without creating a backend)."""
    return any(
        importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")
    )


def _setup_backend(args) -> str:
    """Chooses the variant and configures the backend before any device is created."""
    import jax

    variant = args.variant
    if variant == "auto":
        variant = "gpu" if _gpu_plugin() else "cpu"
    if variant == "gpu":
        # Must precede the GPU client's creation: one real GPU then compiles for 8.
        jax.config.update("jax_mock_gpu_topology", args.mock_topology)
        jax.config.update("jax_platforms", "cuda")
        return variant
    try:  # a no-op when the CPU backend exists already (e.g. under pytest's 8 devices)
        jax.config.update("jax_num_cpu_devices", 8)
    except Exception:
        pass
    jax.config.update("jax_platforms", "cpu")
    if len(jax.devices()) < 8:
        raise SystemExit(
            "the CPU variant needs 8 devices: run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu"
        )
    return variant


def _model(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    if args.model == "mlp":
        sizes = [args.width] * (args.depth + 1)
        f32 = jnp.float32
        params = [
            {"w": jax.ShapeDtypeStruct((a, b), f32), "b": jax.ShapeDtypeStruct((b,), f32)}
            for a, b in zip(sizes[:-1], sizes[1:], strict=True)
        ]

        def loss(p, batch):
            h = batch["x"]
            for layer in p:
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return jnp.mean((h - batch["y"]) ** 2)

        batch = {
            "x": jax.ShapeDtypeStruct((args.batch, args.width), jnp.float32),
            "y": jax.ShapeDtypeStruct((args.batch, args.width), jnp.float32),
        }
        return loss, params, None, batch, False
    from flax import nnx

    from jaxcomm.models import resnet

    model = nnx.eval_shape(lambda: resnet(args.model, num_classes=args.num_classes))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    def loss(p, s, batch):
        m = nnx.merge(graphdef, p, s, copy=True)  # fresh Variables at this trace level
        logits = m(batch["x"])
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))
        return nll, (nnx.state(m, nnx.BatchStat), {})

    batch = {
        "x": jax.ShapeDtypeStruct((args.batch, args.image_size, args.image_size, 3), jnp.float32),
        "y": jax.ShapeDtypeStruct((args.batch,), np.int32),
    }
    return loss, params, stats, batch, True


def abstract_state(dp, params, model_state=None):
    """``dp``'s train state as ``jax.ShapeDtypeStruct`` with the state's shardings.

    Args:
      dp: a ``jaxcomm.DataParallel``.
      params: the params (arrays or ``jax.ShapeDtypeStruct``).
      model_state: the model state, if ``dp`` has one.

    Returns:
      The abstract ``TrainState``, placed as ``dp`` places it.
    """
    import jax

    state = jax.eval_shape(dp.init, params, model_state)
    return _abstract(state, dp.state_shardings(state))


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    variant = _setup_backend(args)
    import jax
    import optax

    import jaxcomm
    from jaxcomm import xla

    mesh = jaxcomm.make_mesh() if variant == "gpu" else jaxcomm.make_mesh(intra=4)
    loss, params, stats, batch, with_state = _model(args)
    bucket = None
    if args.bucket:
        bucket = tuple(int(v) for v in args.bucket.split(","))
    tx = optax.chain(
        jaxcomm.sync_gradients(algorithm=args.algorithm, bucket_bytes=bucket), optax.sgd(0.1)
    )
    dp = jaxcomm.data_parallel(
        loss,
        tx,
        mesh,
        with_model_state=with_state,
        microbatches=args.microbatches,
        accumulate=args.accumulate,
    )
    state = abstract_state(dp, params, stats)
    batch = _abstract(batch, jax.tree.map(lambda _: dp.batch_sharding, batch))
    names = args.option_sets.split(",") if args.option_sets else None
    extra = json.loads(args.extra_options) if args.extra_options else {}
    sets = option_sets(variant, names)
    n_params = sum(int(x.size) for x in jax.tree.leaves(state.params))
    header = (
        f"variant={variant} devices={len(jax.devices())} ({jax.devices()[0].platform}) "
        f"mesh={dict(mesh.shape)} model={args.model} params={n_params} "
        f"algorithm={args.algorithm} bucket_bytes={bucket} microbatches={args.microbatches} "
        f"accumulate={args.accumulate} "
        f"jax={jax.__version__} python={platform.python_version()}"
    )
    try:  # extras are a convenience (e.g. faster compiles): drop them if this XLA lacks them
        extra = xla.check_options(extra)
    except xla.XlaOptionError as e:
        print(f"ignoring --extra-options: {e}")
        extra = {}
    header += f" extra_options={extra}"
    print(header)
    if variant == "cpu":
        print(
            "CPU variant: 8 fake CPU devices, XLA:CPU all-reduce combiner off; CPU collectives "
            "are synchronous and ignore the GPU overlap/threshold flags. "
            "The GPU variant needs a GPU (python -m experiments.bench schedule --variant gpu)."
        )
    runs = [(label, xla.merge_options(opts, extra)) for label, opts in sets.items()]
    results = {}
    step = dp.step_fn(state)
    for label, compiler_options in runs:
        t0 = time.perf_counter()
        rep = jaxcomm.tools.schedule.schedule_report(
            step, state, batch, mesh=mesh, compiler_options=compiler_options or None
        )
        secs = time.perf_counter() - t0
        colls = rep.collectives
        print(f"\n== {label}: {compiler_options or 'XLA defaults'} (compiled in {secs:.1f} s)")
        text = rep.format()
        print(text if args.rows else text.split("\n\n", 1)[-1])
        results[label] = {
            "options": compiler_options,
            "collectives": len(colls),
            "async": sum(s.is_async for s in colls),
            "overlapped": sum(s.overlapped for s in colls),
            "report": json.loads(rep.to_json()),
            "compile_s": secs,
        }
        if args.json:  # after each set: a run cut short keeps the sets it finished
            _write_json(args.json, header, variant, results)
    print(f"\n{'options':<18} {'collectives':>11} {'async':>5} {'overlapped':>10}")
    for label, r in results.items():
        print(f"{label:<18} {r['collectives']:>11} {r['async']:>5} {r['overlapped']:>10}")
    return 0


def _write_json(path: str, header: str, variant: str, results: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"header": header, "variant": variant, "results": results}, f, indent=1)
    os.replace(tmp, path)
