"""ResNet data-parallel experiment with jaxcomm: train, ablation table, quality guard.

Usage: ``python -m experiments.resnet152 [--help]``. With no arguments it runs the preset of
the platform (``cpu-smoke`` on CPU, with 8 fake CPU devices unless ``XLA_FLAGS`` sets a
count) in all three modes: a short training run, the ablation table (each communication
technique added in turn: step time, speedup, exposed communication, images/s) and the digits
accuracy of every row. Results go to ``--out`` (``results.json``, ``ablation.png``,
``train.json``, ``meta.json``).

On CPU, when this machine can build the emulated network (root and iproute2), the default
is the ``testbed`` preset: the command re-runs itself as one process per emulated node under
``jaxcomm.tools.testbed`` (2 nodes x 2 devices, ``--link`` between them) and the table gains the
link columns (bytes per step across the link from the compiled HLO, their line-rate time,
efficiency). Otherwise it runs on fake CPU devices and says, before the table, what those
can and cannot show.

Multi-process: start one process per node with ``jaxcomm.tools.launch``, the testbed, SLURM or
Open MPI; ``jax.distributed`` is initialised from the environment, each process feeds its
own part of every batch, and process 0 prints and writes the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from experiments import runtime
from experiments.presets import MODES, PRESETS, default_preset_name

_OVERRIDES = {
    # flag: (Preset field, type, help)
    "model": (str, "ResNet name (resnet-micro, resnet-tiny, resnet18, ..., resnet152)"),
    "image_size": (int, "square image side in pixels"),
    "num_classes": (int, "classes of the synthetic data (a --data-dir sets its own)"),
    "per_device_batch": (int, "images per device per step (global batch = this x devices)"),
    "steps": (int, "training steps (also the length of the learning-rate schedule)"),
    "warmup_steps": (int, "untimed steps per ablation row (the first compiles)"),
    "timing_steps": (int, "timed steps per ablation row and repeat"),
    "repeats": (int, "timing rounds per ablation row (medians and ranges reported)"),
    "dtype": (str, "compute dtype: float32 or bfloat16 (params stay float32)"),
    "intra": (int, "devices per 'intra' mesh group (default: preset; none = per process)"),
    "lr": (float, "peak learning rate per 256 images"),
    "lr_warmup": (int, "learning-rate warm-up steps"),
    "checkpoint_every": (int, "checkpoint period in steps (with --checkpoint-dir)"),
    "accuracy_steps": (int, "digits training steps per row of the quality guard"),
    "accuracy_seeds": (int, "quality-guard runs per row (seeds), averaged"),
    "adapt_windows": (
        int,
        "adaptive compression follows the measured network (CommProfiler"
        ".drive): --ablation runs this many windows of an adaptive row before "
        "timing it, --train drives its step when > 0; 0: not driven",
    ),  # fmt: skip
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.resnet152",
        description=(
            "Data-parallel ResNet training with jaxcomm. Modes: --train (a training run "
            "with progress bar and optional checkpoints), --ablation (baseline, "
            "+hierarchical, +overlap, +compression, +topology, +batching, each adding one "
            "technique: step time, speedup, exposed communication fraction, images/s), "
            "--accuracy "
            "(digits test accuracy under each row). No mode flag: all three."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="configuration; default: testbed on CPU as root with iproute2 (an emulated "
        "network), else cpu-smoke on CPU, gpu-node on one GPU process, cluster with several "
        "processes",
    )
    g.add_argument("--train", action="store_true", help="run the training mode")
    g.add_argument("--ablation", action="store_true", help="run the ablation table")
    g.add_argument(
        "--accuracy",
        action="store_true",
        help="run the digits quality guard under each ablation row",
    )
    g.add_argument(
        "--rows", default=None, help="comma-separated ablation rows to run (default: all)"
    )
    g.add_argument(
        "--config",
        default=None,
        help="ablation row whose settings --train uses (default: the last row, "
        "i.e. every technique)",
    )
    g.add_argument(
        "--out",
        default="runs/resnet152",
        help="output folder for results.json, ablation.png, train.json, meta.json",
    )
    g.add_argument("--seed", type=int, default=0, help="model, data and shuffling seed")
    o = p.add_argument_group("preset overrides (default: the preset's value)")
    for name, (typ, text) in _OVERRIDES.items():
        o.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=text)
    d = p.add_argument_group("data and checkpoints")
    d.add_argument(
        "--data-dir",
        default=None,
        help="ImageNet-layout folder (class sub-folders of JPEGs) for --train; "
        "default: synthetic ImageNet-shaped batches",
    )
    d.add_argument("--workers", type=int, default=8, help="JPEG decoding threads")
    d.add_argument("--prefetch", type=int, default=2, help="batches decoded ahead")
    d.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save orbax checkpoints of the full train state and data position here during --train",
    )
    d.add_argument(
        "--resume",
        action="store_true",
        help="continue --train from the newest checkpoint in --checkpoint-dir",
    )
    d.add_argument(
        "--elastic",
        default=None,
        metavar="MIN:MAX",
        help="--train under PyTorch's elastic agent (torchrun --nnodes=MIN:MAX "
        "--nproc-per-node=1 --no-python python -m experiments.resnet152 ...): one JAX "
        "process per node, the global batch of MAX nodes kept on fewer, resumed from the "
        "newest complete checkpoint in --checkpoint-dir (written asynchronously) on "
        "whatever nodes are left, refused below MIN; docs/elastic.md",
    )
    d.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=20,
        metavar="S",
        help="multi-process: jax.distributed's coordinator declares a silent process dead "
        "after S seconds (jaxcomm.init_distributed's heartbeat_timeout_s): how long the "
        "survivors of a lost node wait before they end (--elastic: the detection part of "
        "a restart, docs/elastic.md#where-a-restart-spends-its-time)",
    )
    d.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop --train after this step (an interruption; the schedule still "
        "spans --steps, so a later --resume continues the same run)",
    )
    n = p.add_argument_group("emulated network (--preset testbed; needs root and iproute2)")
    n.add_argument(
        "--link", default=None, help="link rate between nodes, tc units (default: the preset's)"
    )
    n.add_argument("--nodes", type=int, default=2, help="emulated nodes (processes)")
    n.add_argument("--devices-per-node", type=int, default=2, help="CPU devices per node")
    n.add_argument(
        "--leaves",
        type=int,
        default=1,
        help="leaf switches joined by a spine (node i under leaf i %% LEAVES): +topology then "
        "orders the inter ring by leaf, and a measured 'spine MB' column is added",
    )
    n.add_argument("--spine", default=None, help="spine link rate (default: --link)")
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="fake CPU devices when XLA_FLAGS sets no device count (ignored on GPU)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _launch_testbed(
    args,
    argv: list[str],
    preset,
    testbed: tuple[bool, str],
    *,
    module: str = "experiments.resnet152",
) -> int:
    """Runs this command (``python -m module``) once per emulated node under
    ``jaxcomm.tools.testbed``; its exit code.

    ``testbed`` is :func:`_testbed_status`'s ``(ok, why)``.
    """
    from jaxcomm.tools.testbed import Testbed

    ok, why = testbed
    if not ok:
        print(f"--preset {preset.name} builds an emulated network and cannot here: {why}.\n"
              "Run it as root with iproute2 installed, or choose --preset cpu-smoke.",
              file=sys.stderr)  # fmt: skip
        return 2
    link = args.link or preset.link
    child, skip = [], False
    for a in argv:  # the same command, with the preset named (a default one included)
        if not skip and not a.startswith("--preset"):
            child.append(a)
        skip = a == "--preset"
    child = [sys.executable, "-m", module, "--preset", preset.name, *child]
    with Testbed(nodes=args.nodes, devices_per_node=args.devices_per_node, link=link,
                 leaves=args.leaves, spine=args.spine) as tb:  # fmt: skip
        fabric = f", {tb.leaves} leaves joined by a {tb.spine} spine" if tb.leaves > 1 else ""
        what = f"{args.nodes} nodes x {args.devices_per_node} CPU devices, link {link}"
        print(f"[testbed] {what} per direction between nodes{fabric} ({' '.join(child[1:])})",
              flush=True)  # fmt: skip
        return tb.run(child)


def _preset(args, jax, *, testbed: bool = False) -> Any:
    name = args.preset or default_preset_name(
        jax.default_backend(), jax.process_count(), testbed=testbed
    )
    overrides = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    if jax.process_count() > 1 and args.intra is None:
        overrides["intra"] = None  # intra groups = the devices of one process (node)
    preset = dataclasses.replace(PRESETS[name], **overrides)
    from jaxcomm.validate import check_int

    check_int("--adapt-windows", preset.adapt_windows, minimum=0,
              fix="windows of driven adaptive steps before timing; 0: not driven")  # fmt: skip
    check_int("--accuracy-seeds", preset.accuracy_seeds, minimum=1,
              fix="quality-guard runs per row, e.g. 3")  # fmt: skip
    return preset


def _select_rows(resolved, names: str | None):
    if not names:
        return resolved
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [r.row.config for r in resolved]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"--rows: unknown rows {unknown}; choose from {known}.")
    return [r for r in resolved if r.row.config in wanted]


def _run_train(args, preset, resolved, *, is_main: bool) -> dict:
    import jax

    import jaxcomm
    from experiments import step as steplib
    from experiments.data import SyntheticImages
    from experiments.training import train
    from jaxcomm.checkpoint import Checkpointer

    name = args.config or resolved[-1].row.config
    chosen = next((r for r in resolved if r.row.config == name), None)
    if chosen is None:
        names = [r.row.config for r in resolved]
        raise SystemExit(f"--config {name!r} is not a row; choose one of {names}.")
    sync, options, mesh_kwargs = chosen.build()
    mesh = jaxcomm.make_mesh(intra=preset.intra, **mesh_kwargs)
    global_batch = preset.per_device_batch * mesh.devices.size
    if args.elastic is not None:  # the batch of MAX nodes, on however many are left
        from jaxcomm import elastic

        global_batch = preset.per_device_batch * elastic.parse_nodes(args.elastic)[1]
        global_batch *= jax.local_device_count()
        try:
            elastic.per_device_batch(global_batch, mesh.devices.size)
        except ValueError as e:
            raise SystemExit(f"--elastic: {e}") from None
    folder = _image_folder(args, preset, global_batch)
    num_classes = preset.num_classes if folder is None else folder.num_classes
    parts = steplib.make_model(preset.model, num_classes, dtype=preset.dtype, seed=args.seed)
    schedule = steplib.learning_rate(
        lr=preset.lr, global_batch=global_batch, warmup=preset.lr_warmup, total_steps=preset.steps
    )
    driven = chosen.local is None and steplib.drives_adaptive(sync, preset.adapt_windows)
    local = None
    if chosen.local is not None:  # no link measurement here: the preset's H
        local = {**chosen.local, "sync_every": preset.local_sync_every}
    dp, state = steplib.build_step(
        parts, steplib.make_optimizer(sync, schedule, local=local), mesh,
        compiler_options=options, donate=not driven,
    )  # fmt: skip
    data = folder or SyntheticImages(
        dp.batch_sharding,
        global_batch=global_batch,
        image_size=preset.image_size,
        num_classes=num_classes,
        dtype=steplib.DTYPES[preset.dtype],
        seed=args.seed,
    )
    meta = {
        "preset": preset.name,
        "model": preset.model,
        "config": name,
        "seed": args.seed,
        "data": args.data_dir or "synthetic",
        "global_batch": global_batch,
    }
    ckpt = None
    if args.checkpoint_dir:  # an elastic job claims its folder under the agent's run id
        job = os.environ.get("TORCHELASTIC_RUN_ID") if args.elastic is not None else None
        ckpt = Checkpointer(args.checkpoint_dir, async_save=True, job=job)
    start = 0
    _phase(args, "built")
    if args.resume or (args.elastic is not None and ckpt.latest_step() is not None):
        state, start = _resume(ckpt, state, meta, dp=dp if args.elastic is not None else None)
    _phase(args, "restored")
    stop = preset.steps if args.stop_at is None else min(args.stop_at, preset.steps)
    if driven:  # the adaptive compressor follows the measured network (adapt.jsonl: its log)
        os.makedirs(args.out, exist_ok=True)
        log = os.path.join(args.out, "adapt.jsonl") if is_main else os.devnull
        jaxcomm.CommProfiler(log_file=log).drive(dp, state, data.batch(start))
    if is_main:
        print(
            f"train: {preset.model} {preset.image_size}px {preset.dtype}, config {name} "
            f"({', '.join(chosen.techniques)}), mesh {dict(mesh.shape)}, global batch "
            f"{global_batch}, steps {start}..{stop}"
        )
    state, position, summary = train(
        dp,
        state,
        data,
        start=start,
        stop=stop,
        checkpointer=ckpt,
        every=preset.checkpoint_every,
        meta=meta,
        progress=is_main and not args.no_progress,
        log_every=1 if preset.steps <= 100 else 10,
        step_log=os.path.join(args.out, "steps.jsonl") if is_main and args.elastic else None,
    )
    if ckpt is not None:
        ckpt.close()
    ips = None
    if summary["timed_steps"]:
        ips = global_batch * summary["timed_steps"] / summary["seconds"]
    losses = summary["losses"]
    result = {
        **meta,
        "devices": int(mesh.devices.size),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "start": start,
        "position": position,
        "step": int(jax.device_get(state.step)),
        "losses": losses,
        "images_per_s": ips,
        "settings": chosen.describe(),
    }
    if is_main and losses:
        first, last = min(losses), max(losses)
        print(
            f"train: loss {losses[first]:.4f} (step {first}) -> {losses[last]:.4f} "
            f"(step {last}), {ips or 0:.1f} images/s after compilation"
        )
    return result


def _image_folder(args, preset, global_batch: int):
    """The ``--data-dir`` image folder of this process's share of each batch, or None."""
    import jax

    from experiments.data import ImageFolder

    if not args.data_dir:
        return None
    return ImageFolder(
        args.data_dir,
        image_size=preset.image_size,
        global_batch=global_batch,
        seed=args.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=args.workers,
        prefetch=args.prefetch,
    )


def _resume(ckpt, state, meta: dict, dp=None):
    """``--resume``: the latest checkpoint's state and position, checked against ``meta``
    (a checkpoint of another run is refused); with ``dp`` (``--elastic``) on this run's
    device count, whatever it was written on (``jaxcomm.elastic.restore``)."""
    if ckpt is None:
        raise SystemExit("--resume needs --checkpoint-dir.")
    if ckpt.latest_step() is None:
        raise SystemExit(f"--resume: no checkpoint in {ckpt.directory}.")
    if dp is not None:
        from jaxcomm import elastic

        try:
            state, saved = elastic.restore(ckpt, dp, state, global_batch=meta["global_batch"])
        except ValueError as e:
            raise SystemExit(f"--elastic: {e}") from None
    else:
        state, saved = ckpt.restore(state)
    clash = {k: (saved.get(k), v) for k, v in meta.items() if saved.get(k) != v}
    if clash:
        raise SystemExit(f"--resume: the checkpoint is of another run: {clash}")
    return state, int(saved["position"])


def _elastic_setup(parser: argparse.ArgumentParser, args) -> None:
    """``--elastic``: checks the flags, joins the agent's job (``JAXCOMM_*`` variables)."""
    from jaxcomm import elastic

    try:
        elastic.parse_nodes(args.elastic)
        env = elastic.agent_env(args.devices_per_node)
    except ValueError as e:
        parser.error(str(e))
    if args.ablation or args.accuracy or not args.train:
        parser.error("--elastic runs --train only: add --train (and no --ablation/--accuracy).")
    if not args.checkpoint_dir:
        parser.error("--elastic needs --checkpoint-dir (a folder every node can read).")
    if args.resume:
        parser.error("--elastic resumes by itself from the newest complete checkpoint.")
    os.environ.update(env)


def _testbed_status(jax) -> tuple[bool, str]:
    """``jaxcomm.tools.testbed.available()`` for one CPU process (it probes with a namespace, so
    it is asked once per run); elsewhere ``(False, reason)``."""
    if runtime.distributed_requested():
        return False, "already one process of a distributed job"
    if jax.default_backend() != "cpu":
        return False, f"the default backend is {jax.default_backend()}, not the CPU"
    from jaxcomm.tools.testbed import available

    return available()


def _phase(args, name: str) -> None:
    """``--elastic``: appends when a phase of the start ended to ``<out>/phases.jsonl``
    (rank 0 only), the kill test's recovery table (``experiments.elastic``)."""
    if args.elastic is None or os.environ.get("RANK", "0") != "0":
        return
    os.makedirs(args.out, exist_ok=True)
    line = {"phase": name, "time": time.time(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}  # fmt: skip
    with open(os.path.join(args.out, "phases.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.elastic is not None:
        _phase(args, "main")
        _elastic_setup(parser, args)
    runtime.ensure_cpu_devices(args.cpu_devices)  # before JAX is imported
    import jax

    runtime.init_distributed(heartbeat_timeout_s=args.heartbeat_timeout)
    _phase(args, "distributed")
    if args.elastic is not None:
        from jaxcomm import elastic

        try:
            elastic.check_minimum(jax.process_count(), elastic.parse_nodes(args.elastic)[0])
        except ValueError as e:
            raise SystemExit(f"--elastic: {e}") from None
    from experiments import ablation, report
    from experiments.rows import resolve_rows

    testbed = _testbed_status(jax)
    preset = _preset(args, jax, testbed=testbed[0])
    if preset.link is not None and not runtime.distributed_requested():
        return _launch_testbed(args, argv, preset, testbed)
    link_bps = runtime.testbed_link_bps()
    is_main = jax.process_index() == 0
    modes = [m for m in MODES if getattr(args, m)] or list(preset.modes)
    resolved = _select_rows(resolve_rows(), args.rows)
    out = args.out
    meta = _run_meta("python -m experiments.resnet152", argv, preset, modes, link_bps)
    if is_main:
        os.makedirs(out, exist_ok=True)
        print(
            f"preset {preset.name}: {meta['devices']} {meta['backend']} devices "
            f"({meta['device_kind']}), {meta['processes']} process(es); modes {modes}"
        )
    progress = iter
    if is_main and not args.no_progress:
        from tqdm.auto import tqdm

        progress = lambda rows, desc="": tqdm(rows, desc=desc, unit="row", dynamic_ncols=True)  # noqa: E731
    status = 0
    if "train" in modes:
        train_result = _run_train(args, preset, resolved, is_main=is_main)
        if is_main:
            with open(os.path.join(out, "train.json"), "w") as f:
                json.dump(train_result, f, indent=2, default=str)
    rows = None
    seconds = meta["seconds"] = {}
    t0 = time.perf_counter()
    if "ablation" in modes:
        rows = ablation.run_speed(
            resolved,
            preset,
            intra=preset.intra,
            seed=args.seed,
            progress=lambda r: progress(r, desc="ablation") if progress is not iter else iter(r),
            link_bps=link_bps,
        )
        status |= any(r["status"] == "error" for r in rows)
        seconds["ablation"] = time.perf_counter() - t0
    if "accuracy" in modes:
        t0 = time.perf_counter()
        acc = ablation.run_accuracy(
            resolved,
            intra=preset.intra,
            steps=preset.accuracy_steps,
            seed=args.seed,
            seeds=preset.accuracy_seeds,
            progress=lambda r: progress(r, desc="accuracy") if progress is not iter else iter(r),
            periods={x["config"]: x.get("sync_every") for x in rows or []},
            local_sync_every=preset.local_sync_every,
        )
        status |= any(a["accuracy_status"] == "error" for a in acc)
        seconds["accuracy"] = time.perf_counter() - t0
        if rows is None:
            rows = [
                {
                    "config": r.row.config,
                    "status": "ok",
                    "techniques": list(r.techniques),
                    "step_time_s": None,
                    "speedup": None,
                    "comm_fraction": None,
                    "images_per_s": None,
                }
                for r in resolved
            ]
        rows = report.merge_accuracy(rows, acc)
    if rows is not None and is_main:
        _report(rows, meta, preset, out, testbed)
    if is_main:
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    return int(status)


def _run_meta(command: str, argv: list[str], preset, modes: list[str], link_bps) -> dict:
    """What ran where: the command, preset, modes, devices, link and load (``meta.json``)."""
    import jax

    return {
        "command": " ".join([command, *argv]),
        "preset": dataclasses.asdict(preset),
        "modes": modes,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "processes": jax.process_count(),
        "jax": jax.__version__,
        "link": os.environ.get("JAXCOMM_TESTBED_LINK"),
        "link_bps": link_bps,
        "load_average": os.getloadavg(),
    }


def _table_context(meta: dict, testbed: tuple[bool, str], command: str) -> str | None:
    """The line(s) before a table: what fake devices can show, or the link and load."""
    from experiments import report

    if meta["backend"] == "cpu" and meta["processes"] == 1 and meta["devices"] > 1:
        why = "this machine can build it" if testbed[0] else testbed[1]
        return report.fake_devices_note(meta["devices"], why, command=command)
    if meta["link_bps"]:
        return (f"link {meta['link']} per direction between {meta['processes']} nodes; "
                f"load average {meta['load_average'][0]:.2f}")  # fmt: skip
    return None


def _report(rows: list[dict], meta: dict, preset, out: str, testbed: tuple[bool, str]) -> None:
    """Prints the table and its summary line (added to ``meta``), writes the JSON and chart."""
    from experiments import report

    print()
    context = _table_context(meta, testbed, "python -m experiments.resnet152")
    if context:
        print(context)
    print(report.format_table(rows))
    summary = report.summary_line(rows)
    if summary:
        print(summary)
        meta["summary"] = summary
    report.write_json(rows, os.path.join(out, "results.json"))
    title = (
        f"{preset.model}, {preset.image_size}px, {meta['devices']} x "
        f"{meta['device_kind']}, batch {preset.per_device_batch}/device"
    )
    report.write_chart(rows, os.path.join(out, "ablation.png"), title=title)
    print(f"\nwrote {out}/results.json and {out}/ablation.png")


def _main(entry=None) -> int:
    """Runs ``entry`` (default :func:`main`); a :class:`ProcessesBroken` ends it with one
    line and exit code 3."""
    from experiments.ablation import ProcessesBroken

    try:
        return (entry or main)()
    except ProcessesBroken as e:
        # One line, and out: the peers are ended by the launcher (or the coordination
        # service's heartbeat), not left waiting in a collective.
        print(f"error: {e}. The processes cannot go on together; stopping.", file=sys.stderr,
              flush=True)  # fmt: skip
        return 3


if __name__ == "__main__":
    sys.exit(_main())
