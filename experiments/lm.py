"""Data-parallel GPT training on the Python standard library's bytes, with jaxcomm.

Usage: ``python -m experiments.lm [--help]``. With no arguments it runs the preset of the
platform (``cpu-smoke`` on CPU with 8 fake CPU devices; ``testbed`` on CPU as root with
iproute2; ``gpu-node`` / ``cluster`` on GPUs) in its modes:

* ``--train``: a training run of the chosen ablation row's settings (``--config``, default
  the last row) on random windows of the corpus (``experiments.text``): the held-out loss
  before and after, the train loss, bits per byte, step time and tokens/s.
* ``--ablation``: the rows of ``experiments.resnet152`` (``experiments.rows.ROWS``, each
  adding one communication technique), then the hybrid-sharded row
  (``data_parallel(..., shard_params=True)``, :func:`lm_rows`), timed on the LM by
  ``experiments.ablation``, with each row's state (params + optimizer state) and its
  compiled step's buffers in MB per device.
* ``--memory``: the model compiled from its shapes alone in the replicated and the
  hybrid-sharded layouts (params gathered whole, and per layer): state and step buffers
  per device (for a model too large to allocate replicated, e.g. ``--model
  gpt2-medium``).

``--gather layer`` makes the hybrid-sharded row gather the params one GPT block at a time
(``jaxcomm.data_parallel(..., gather='layer')``); ``--train`` prints the loss of each
step (up to 20) and the process's peak RSS, and ``--eval-batches 0`` skips the held-out
evaluation (which gathers the params on every device), e.g. to train a model whose
replicated state does not fit::

    python -m experiments.lm --preset cpu-smoke --train --config hybrid-sharded \
        --gather layer --model gpt-200m --context 64 --per-device-batch 1 \
        --steps 6 --lr 3e-5 --lr-warmup 0 --eval-batches 0

Results go to ``--out`` (``train.json``, ``results.json``, ``ablation.png``,
``memory.json``, ``meta.json``). On the testbed preset the command re-runs itself as one process per
emulated node under ``jaxcomm.tools.testbed`` and the table gains the link columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import sys
import time

from experiments import runtime
from experiments.presets import LM_MODES, LM_PRESETS, default_preset_name

# The hybrid-sharded row: params, gradients and AdamW state split over a node's
# devices ('intra'), the sync across nodes ('inter') int8-compressed with error feedback, on
# top of the first rows' settings (flat -> hierarchical, overlap options). It does not
# accumulate onto +compression: its adaptive compressor is driven by the profiler's
# feedback, which shard_params=True refuses (jaxcomm/hybrid.py).
HYBRID_ROW_AFTER = "+overlap"


def lm_rows(gather: str = "whole"):
    """The ablation rows of ``experiments.resnet152`` and, after them, the hybrid-sharded
    row on the settings of the rows up to :data:`HYBRID_ROW_AFTER`, its params gathered
    as ``gather`` says (``jaxcomm.data_parallel(gather=...)``: ``'whole'`` at the loss's
    start, ``'layer'`` one GPT block at a time)."""
    import jaxcomm
    from experiments.rows import ROWS, Row, resolve_rows

    hybrid = Row(
        "hybrid-sharded",
        "params, gradients and AdamW state over 'intra'; int8 + error feedback over 'inter'",
        sync={"compression": jaxcomm.compression.int8(block=64, error_feedback=True)},
        data_parallel={"shard_params": True, **({"gather": gather} if gather != "whole" else {})},
    )
    upto = [r.config for r in ROWS].index(HYBRID_ROW_AFTER) + 1
    return [*resolve_rows(), resolve_rows((*ROWS[:upto], hybrid))[-1]]


_OVERRIDES = {
    # flag: (LMPreset field, type, help)
    "model": (
        str,
        "GPT config (gpt-test, gpt-mini, gpt2-small, gpt-200m, gpt2-medium, gpt2-large)",
    ),
    "context": (int, "bytes per training sequence"),
    "per_device_batch": (int, "sequences per device per step (global = this x devices)"),
    "steps": (int, "training steps (also the length of the learning-rate schedule)"),
    "warmup_steps": (int, "untimed steps per ablation row (the first compiles)"),
    "timing_steps": (int, "timed steps per ablation row and repeat"),
    "repeats": (int, "timing rounds per ablation row (medians and ranges reported)"),
    "dtype": (str, "compute dtype: float32 or bfloat16 (params stay float32)"),
    "intra": (int, "devices per 'intra' mesh group (default: preset; none = per process)"),
    "lr": (float, "peak learning rate (AdamW)"),
    "lr_warmup": (int, "learning-rate warm-up steps"),
    "eval_batches": (
        int,
        "held-out batches per evaluation (0: none, e.g. for a model "
        "too large to evaluate with its params gathered on every device)",
    ),
    "adapt_windows": (int, "windows of a driven adaptive row before timing; 0: not driven"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.lm",
        description=(
            "Data-parallel GPT (byte-level) training with jaxcomm on the Python standard "
            "library's source files. Modes: --train (train loss, held-out loss and bits "
            "per byte, tokens/s), --ablation (the rows of experiments.resnet152: baseline, "
            "+hierarchical, +overlap, +compression, +topology, +batching, +local steps, "
            "each adding one technique, then hybrid-sharded (params, gradients and AdamW "
            "state split over a node's devices, int8 sync across nodes, on +overlap's "
            "settings): step time, speedup, exposed communication, tokens/s, state MB per "
            "device). No mode flag: the preset's modes."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument(
        "--preset",
        choices=sorted(LM_PRESETS),
        default=None,
        help="configuration; default: testbed on CPU as root with iproute2 (an emulated "
        "network), else cpu-smoke on CPU, gpu-node on one GPU process, cluster with several",
    )
    g.add_argument("--train", action="store_true", help="run the training mode")
    g.add_argument("--ablation", action="store_true", help="run the ablation table")
    g.add_argument(
        "--memory",
        action="store_true",
        help="compile the step of --model in the replicated and the hybrid-sharded layouts "
        "(params gathered whole, and per layer) from its shapes (nothing allocated): state "
        "and step buffers per device",
    )
    g.add_argument("--rows", default=None, help="comma-separated ablation rows (default: all)")
    g.add_argument(
        "--config",
        default=None,
        help="ablation row whose settings --train uses (default: +local steps, every "
        "technique of experiments.resnet152)",
    )
    g.add_argument(
        "--gather",
        choices=("whole", "layer"),
        default="whole",
        help="where the hybrid-sharded row gathers the params inside the node: whole (every "
        "leaf at the loss's start, kept for the backward pass) or layer (one GPT block at a "
        "time, gathered again in the backward pass: jaxcomm.gathered_layers)",
    )
    g.add_argument("--out", default="runs/lm", help="output folder")
    g.add_argument("--seed", type=int, default=0, help="model and data seed")
    o = p.add_argument_group("preset overrides (default: the preset's value)")
    for name, (typ, text) in _OVERRIDES.items():
        o.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=text)
    n = p.add_argument_group("emulated network (--preset testbed; needs root and iproute2)")
    n.add_argument("--link", default=None, help="link rate between nodes (default: preset's)")
    n.add_argument("--nodes", type=int, default=2, help="emulated nodes (processes)")
    n.add_argument("--devices-per-node", type=int, default=2, help="CPU devices per node")
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="fake CPU devices when XLA_FLAGS sets no device count (ignored on GPU)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _preset(args, jax, *, testbed: bool):
    name = args.preset or default_preset_name(
        jax.default_backend(), jax.process_count(), testbed=testbed
    )
    overrides = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    if jax.process_count() > 1 and args.intra is None:
        overrides["intra"] = None  # intra groups = the devices of one process (node)
    preset = dataclasses.replace(LM_PRESETS[name], **overrides)
    from jaxcomm.models import gpt_config
    from jaxcomm.validate import check_int

    longest = gpt_config(preset.model).context
    check_int("--context", preset.context, minimum=1, maximum=longest,
              fix=f"at most the {preset.model} config's context {longest}")  # fmt: skip
    check_int("--adapt-windows", preset.adapt_windows, minimum=0,
              fix="windows of driven adaptive rows before timing; 0: not driven")  # fmt: skip
    check_int("--eval-batches", preset.eval_batches, minimum=0, fix="e.g. 8; 0: none")
    return preset


def _run_train(args, preset, resolved, *, is_main: bool) -> dict:
    import jaxcomm
    from experiments import lm_step
    from experiments import step as steplib
    from experiments.text import TextWindows, load_corpus
    from experiments.training import train

    name = args.config or "+local steps"
    chosen = next((r for r in resolved if r.row.config == name), None)
    if chosen is None:
        names = [r.row.config for r in resolved]
        raise SystemExit(f"--config {name!r} is not a row; choose one of {names}.")
    sync, options, mesh_kwargs = chosen.build()
    mesh = jaxcomm.make_mesh(intra=preset.intra, **mesh_kwargs)
    global_batch = preset.per_device_batch * mesh.devices.size
    corpus = load_corpus()
    parts = lm_step.make_model(preset.model, context=preset.context, dtype=preset.dtype,
                               seed=args.seed)  # fmt: skip
    lr = lm_step.schedule(lr=preset.lr, warmup=preset.lr_warmup, total_steps=preset.steps)
    driven = chosen.local is None and steplib.drives_adaptive(sync, preset.adapt_windows)
    local = None
    if chosen.local is not None:  # no link measurement here: the preset's H
        local = {**chosen.local, "sync_every": preset.local_sync_every}
    dp, state = steplib.build_step(
        parts, lm_step.make_optimizer(sync, lr, local=local), mesh, compiler_options=options,
        donate=not driven, loss_fn=lm_step.make_loss_fn(parts.graphdef),
        layout=chosen.data_parallel,
    )  # fmt: skip
    # The initial params live on in the state: drop the model's copy (a large model's)
    n_params = _params(parts)
    parts = parts._replace(params=None)
    lm_step.make_model.cache_clear()
    windows = dict(global_batch=global_batch, context=preset.context)
    data = TextWindows(corpus.train, dp.batch_sharding, seed=args.seed, **windows)
    # the held-out windows: fixed positions of their own stream, the same before and after
    held_out = TextWindows(corpus.held_out, dp.batch_sharding, seed=args.seed + 1, **windows)
    evaluate = functools.partial(lm_step.evaluate, parts, data=held_out,
                                 batches=preset.eval_batches)  # fmt: skip
    before = evaluate(state.params) if preset.eval_batches else None
    if driven:
        os.makedirs(args.out, exist_ok=True)
        log = os.path.join(args.out, "adapt.jsonl") if is_main else os.devnull
        jaxcomm.CommProfiler(log_file=log).drive(dp, state, data.batch(0))
    if is_main:
        print(
            f"train: {preset.model} ({n_params:,} params), context {preset.context}, "
            f"{preset.dtype}, config {name} "
            f"({', '.join(chosen.techniques)}), mesh {dict(mesh.shape)}, global batch "
            f"{global_batch} x {preset.context} bytes, steps 0..{preset.steps}"
        )
    state, _, summary = train(
        dp, state, data, start=0, stop=preset.steps, progress=is_main and not args.no_progress,
        log_every=1 if preset.steps <= 100 else 10,
    )  # fmt: skip
    after = evaluate(state.params) if preset.eval_batches else None
    losses = summary["losses"]
    last = [losses[k] for k in sorted(losses)[-min(10, len(losses)) :]]
    step_s = summary["seconds"] / summary["timed_steps"] if summary["timed_steps"] else None
    result = {
        "preset": preset.name,
        "model": preset.model,
        "params": n_params,
        "context": preset.context,
        "config": name,
        "gather": (
            chosen.data_parallel.get("gather", "whole")
            if chosen.data_parallel.get("shard_params")
            else None
        ),  # fmt: skip
        "seed": args.seed,
        "global_batch": global_batch,
        "devices": int(mesh.devices.size),
        "steps": preset.steps,
        "corpus": corpus.describe(),
        "losses": losses,
        "train_loss": sum(last) / len(last) if last else None,
        "held_out_loss_before": before,
        "held_out_loss": after,
        "held_out_bits_per_byte": None if after is None else lm_step.bits_per_byte(after),
        "held_out_tokens": preset.eval_batches * global_batch * preset.context,
        "step_time_s": step_s,
        "tokens_per_s": global_batch * preset.context / step_s if step_s else None,
        "settings": chosen.describe(),
        # the process's high-water mark of resident memory (Linux: KiB), all devices' state
        # and buffers together on a CPU mesh
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_average": os.getloadavg(),
    }
    if is_main:
        c = result["corpus"]
        print(
            f"train: corpus {c['train_bytes'] / 1e6:.2f} MB in {c['train_files']} files, "
            f"held out {c['held_out_bytes'] / 1e6:.2f} MB in {c['held_out_files']} files"
        )
        held = (
            f"held-out loss {before:.4f} -> {after:.4f} nats/byte = "
            f"{result['held_out_bits_per_byte']:.3f} bits/byte ({result['held_out_tokens']:,} "
            "bytes); "
            if after is not None
            else "no held-out evaluation; "
        )
        print(
            f"train: loss {losses[min(losses)]:.4f} (step {min(losses)}) -> "
            f"{result['train_loss']:.4f} (mean of the last {len(last)} logged); {held}"
            + (
                f"{step_s * 1e3:.1f} ms/step, {result['tokens_per_s']:,.0f} tokens/s"
                if step_s
                else ""
            )
            + f"; peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB"
        )
        if len(losses) <= 20:
            print("train: step  loss")
            for k in sorted(losses):
                print(f"train: {k:>4}  {losses[k]:.4f}")
    return result


def _run_memory(args, preset, *, is_main: bool) -> dict:
    """``--memory``: the preset's model compiled in the replicated and the hybrid-sharded
    layouts (params gathered whole, and per layer) from its shapes alone
    (``DataParallel.abstract_state``: nothing allocated), each layout's state per device
    from its shardings and its step's buffers per device from XLA's memory analysis. The
    step donates its input state, as ``--train``'s does (``experiments.step.build_step``):
    its peak is the arguments (the state, whose buffers the new state reuses) plus the
    temporaries."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxcomm
    from experiments import lm_step
    from experiments.step import DTYPES
    from jaxcomm.models import gpt, param_count

    mesh = jaxcomm.make_mesh(intra=preset.intra)
    devices = int(mesh.devices.size)
    global_batch = preset.per_device_batch * devices
    dtype = DTYPES[preset.dtype]
    graphdef, params, model_state = nnx.eval_shape(
        lambda: nnx.split(
            gpt(preset.model, dtype=dtype, context=preset.context), nnx.Param, nnx.BatchStat
        )  # fmt: skip
    )
    tokens = jax.ShapeDtypeStruct((global_batch, preset.context + 1), jnp.int32)

    def per_device(tree) -> int:
        return sum(
            int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )

    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    result = {"model": preset.model, "params": n, "devices": devices, "mesh": dict(mesh.shape),
              "context": preset.context, "global_batch": global_batch, "layouts": {}}  # fmt: skip
    assert n == param_count(jaxcomm.models.gpt_config(preset.model, context=preset.context))
    layouts = (
        ("replicated", {}),
        ("hybrid-sharded", {"shard_params": True}),
        ("hybrid-sharded, per layer", {"shard_params": True, "gather": "layer"}),
    )
    for name, layout in layouts:
        t0 = time.perf_counter()
        tx = lm_step.make_optimizer({"algorithm": "hierarchical"}, preset.lr)
        dp = jaxcomm.data_parallel(lm_step.make_loss_fn(graphdef), tx, mesh,
                                   with_model_state=True, donate=True, **layout)  # fmt: skip
        state = dp.abstract_state(params)._replace(model_state=model_state)
        stats = dp.compile(state, {"tokens": tokens}).memory_analysis()
        row = {"state_bytes_per_device": per_device(state), "compile_s": time.perf_counter() - t0}
        if stats is not None:
            names = ("argument", "output", "alias", "temp")
            row["program_memory"] = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in names}
        result["layouts"][name] = row
        if is_main:
            program = row.get("program_memory", {})
            temp = program.get("temp")
            peak = program.get("argument", 0) + program.get("temp", 0)
            print(
                f"memory: {preset.model} ({n:,} params) {name} on {dict(mesh.shape)}: state "
                f"{row['state_bytes_per_device'] / 1e6:,.1f} MB per device "
                f"({row['state_bytes_per_device'] * devices / 1e6:,.1f} MB on the "
                f"{devices} devices)"
                + (
                    f", step buffers {temp / 1e6:,.1f} MB per device; the step's peak "
                    f"(state + buffers) {peak * devices / 1e9:,.1f} GB on the {devices} devices"
                    if temp
                    else ""
                )
            )
    return result


def _params(parts) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(parts.params)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    runtime.ensure_cpu_devices(args.cpu_devices)  # before JAX is imported
    import jax

    runtime.init_distributed()
    from experiments import ablation, lm_step
    from experiments.resnet152 import _launch_testbed, _run_meta, _select_rows, _testbed_status

    testbed = _testbed_status(jax)
    preset = _preset(args, jax, testbed=testbed[0])
    if preset.link is not None and not runtime.distributed_requested():
        args.leaves, args.spine = 1, None  # _launch_testbed's fabric: one switch
        return _launch_testbed(args, argv, preset, testbed, module="experiments.lm")
    link_bps = runtime.testbed_link_bps()
    is_main = jax.process_index() == 0
    modes = [m for m in LM_MODES if getattr(args, m)] or list(preset.modes)
    resolved = _select_rows(lm_rows(args.gather), args.rows)
    meta = {**_run_meta("python -m experiments.lm", argv, preset, modes, link_bps), "seconds": {}}
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(
            f"preset {preset.name}: {meta['devices']} {meta['backend']} devices "
            f"({meta['device_kind']}), {meta['processes']} process(es); modes {modes}"
        )
    status = 0
    if "train" in modes:
        t0 = time.perf_counter()
        result = _run_train(args, preset, lm_rows(args.gather), is_main=is_main)
        meta["seconds"]["train"] = time.perf_counter() - t0
        if is_main:
            with open(os.path.join(args.out, "train.json"), "w") as f:
                json.dump(result, f, indent=2, default=str)
    if "memory" in modes:
        result = _run_memory(args, preset, is_main=is_main)
        if is_main:
            with open(os.path.join(args.out, "memory.json"), "w") as f:
                json.dump(result, f, indent=2)
    if "ablation" in modes:
        t0 = time.perf_counter()
        progress = iter
        if is_main and not args.no_progress:
            from tqdm.auto import tqdm

            progress = lambda rows: tqdm(rows, desc="ablation", unit="row", dynamic_ncols=True)  # noqa: E731
        rows = ablation.run_speed(
            resolved, preset, intra=preset.intra, seed=args.seed, progress=progress,
            link_bps=link_bps, workload=lm_step.workload(preset.context),
        )  # fmt: skip
        meta["seconds"]["ablation"] = time.perf_counter() - t0
        status |= any(r["status"] == "error" for r in rows)
        if is_main:
            _report(rows, meta, preset, args.out, testbed)
    if is_main:
        with open(os.path.join(args.out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    return int(status)


def _report(rows: list[dict], meta: dict, preset, out: str, testbed: tuple[bool, str]) -> None:
    """Prints the table and its summary line (added to ``meta``), writes the JSON and chart."""
    from experiments import report
    from experiments.resnet152 import _table_context

    print()
    context = _table_context(meta, testbed, "python -m experiments.lm")
    if context:
        print(context)
    print(report.format_table(rows, rate=("rate_per_s", "tok/s"), memory=True))
    # the stacked rows' summary, then the hybrid-sharded row's memory beside the replicated
    summary = report.summary_line([r for r in rows if r["config"] != "hybrid-sharded"])
    hybrid = _hybrid_line(rows)
    for line in (summary, hybrid):
        if line:
            print(line)
    if summary:
        meta["summary"] = summary
    if hybrid:
        meta["hybrid"] = hybrid
    report.write_json(rows, os.path.join(out, "results.json"))
    title = (
        f"{preset.model}, context {preset.context}, {meta['devices']} x "
        f"{meta['device_kind']}, {preset.per_device_batch} sequences/device"
    )
    report.write_chart(rows, os.path.join(out, "ablation.png"), title=title)
    print(f"\nwrote {out}/results.json and {out}/ablation.png")


def _hybrid_line(rows: list[dict]) -> str | None:
    """The hybrid-sharded row against the baseline (replicated): state and step buffers
    per device, step time; ``None`` when either was not timed."""
    by = {r["config"]: r for r in rows if r.get("step_time_s")}
    hybrid, base = by.get("hybrid-sharded"), by.get("baseline")
    if hybrid is None or base is None:
        return None
    mb = lambda r, k: r[k] / 1e6  # noqa: E731
    text = (
        f"hybrid-sharded: state {mb(hybrid, 'state_bytes_per_device'):.2f} MB per device "
        f"against the replicated baseline's {mb(base, 'state_bytes_per_device'):.2f} MB "
        f"({hybrid['state_bytes_per_device'] / base['state_bytes_per_device']:.2f}x, "
        f"intra {hybrid['mesh'].get('intra')})"
    )
    temps = [(r.get("program_memory") or {}).get("temp") for r in (hybrid, base)]
    if None not in temps:
        text += f"; step buffers {temps[0] / 1e6:.2f} vs {temps[1] / 1e6:.2f} MB"
    lo, hi = hybrid.get("speedup_range") or (None, None)
    text += f"; {hybrid['speedup']:.2f}x the baseline's speed"
    if lo is not None:
        text += f" ({lo:.2f}-{hi:.2f}x over {hybrid.get('rounds')} paired rounds)"
    return text


def _main() -> int:
    from experiments.resnet152 import _main as run

    return run(main)


if __name__ == "__main__":
    sys.exit(_main())
