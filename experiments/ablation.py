"""Runs the ablation rows: step time, speedup, communication fraction, images/s, accuracy.

Speed (``run_speed``). For each available row the ResNet step is built with the row's
``sync_gradients`` arguments, compiler options and mesh, together with its *compute-only
twin*: the same step, same mesh and options, with no gradient synchronisation (each device
applies its own gradient; the small batch-statistics and metrics ``pmean`` stay in both).
Rows that differ only in ``sync_gradients`` arguments share one twin.
After ``warmup`` untimed steps (compilation included), all rows and their twins are timed
round-robin, ``repeats`` rounds of ``steps`` steps each, on one fixed synthetic batch. Each
round gives a mean step time; the best round (as ``timeit`` reports: slower rounds measure
other processes' interference) gives the figures below; the medians are in the JSON too.

* ``step_time_s``: the row's step time,
* ``comm_fraction = (step - twin) / step``: the share of the step that gradient
  synchronisation adds and does not hide behind compute (collectives plus any compression
  work), i.e. the exposed communication. Step and twin run back to back, so slow drift
  in machine load cancels; on a busy CPU it is still noisy and can come out slightly
  negative, which is reported as measured.
* ``speedup``: baseline step time over the row's, ``images_per_s``: global batch over
  step time.

Quality (``run_accuracy``). The digits quality guard of the compression issue,
``jaxcomm.bench.digits.digits_accuracy``, trains a small model on scikit-learn's bundled
digits under each row's settings and returns the test accuracy; where that module is not
installed, accuracy is reported as missing.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax

import jaxcomm
from experiments import step as steplib
from experiments.data import SyntheticImages
from experiments.presets import Preset
from experiments.rows import Call, Resolved

__all__ = ["DIGITS", "run_accuracy", "run_speed"]

DIGITS = Call("bench.digits.digits_accuracy", call=False)


def _timed(fn: Callable, state: Any, batch: Any, n: int) -> tuple[Any, float, Any]:
    wait = steplib.one_step_in_flight()
    t0 = time.perf_counter()
    metrics = None
    for _ in range(n):
        state, metrics = fn(state, batch)
        if wait:
            jax.block_until_ready(state)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t0) / n, metrics


def _base_result(r: Resolved) -> dict:
    return {
        "config": r.row.config,
        "technique": r.row.technique,
        "status": "missing" if r.missing else "ok",
        "missing": r.missing,
        "techniques": list(r.techniques),
        "settings": r.describe(),
        "step_time_s": None,
        "compute_only_step_time_s": None,
        "speedup": None,
        "comm_fraction": None,
        "comm_fraction_source": None,
        "images_per_s": None,
    }


class _Step:
    """A compiled step with its own state: ``run(n)`` times ``n`` steps on ``batch``."""

    def __init__(self, dp: Any, state: Any, batch: Any):
        self.dp, self.state, self.batch = dp, state, batch
        self.metrics = None

    def run(self, steps: int) -> float:
        self.state, t, self.metrics = _timed(self.dp, self.state, self.batch, steps)
        return t


class _Bench:
    """One row's step and its compute-only twin. Rows with the same mesh and compiler
    options share one twin (the twin has no sync, so the sync settings do not change it)."""

    def __init__(
        self, r: Resolved, preset: Preset, *, intra: int | None, seed: int, twins: dict | None
    ):
        sync, options, mesh_kwargs = r.build()
        mesh = jaxcomm.make_mesh(intra=intra, **mesh_kwargs)
        self.devices = mesh.devices.size
        self.mesh_shape = dict(mesh.shape)
        self.global_batch = preset.per_device_batch * self.devices
        parts = steplib.make_model(preset.model, preset.num_classes, dtype=preset.dtype, seed=seed)
        schedule = steplib.learning_rate(
            lr=preset.lr,
            global_batch=self.global_batch,
            warmup=preset.lr_warmup,
            total_steps=preset.steps,
        )
        dp, state = steplib.build_step(
            parts, steplib.make_optimizer(sync, schedule), mesh, compiler_options=options
        )
        data = SyntheticImages(
            dp.batch_sharding,
            global_batch=self.global_batch,
            image_size=preset.image_size,
            num_classes=preset.num_classes,
            dtype=steplib.DTYPES[preset.dtype],
            seed=seed,
        )
        batch = data.batch(0)
        warmup = max(1, preset.warmup_steps)
        t0 = time.perf_counter()
        self.full = _Step(dp, state, batch)
        self.full.run(warmup)  # compiles
        settings = r.describe()
        key = repr((settings["make_mesh"], settings["compiler_options"]))
        if twins is not None and key not in twins:
            twin_dp, twin_state = steplib.build_step(
                parts,
                steplib.make_optimizer(None, schedule),
                mesh,
                compiler_options=options,
                compute_only=True,
            )
            twins[key] = _Step(twin_dp, twin_state, batch)
            twins[key].run(warmup)
        self.twin = None if twins is None else twins[key]
        self.compile_s = time.perf_counter() - t0
        self.t_full: list[float] = []
        self.t_twin: list[float] = []

    def run(self, steps: int) -> None:
        self.t_full.append(self.full.run(steps))
        if self.twin is not None:
            self.t_twin.append(self.twin.run(steps))

    def result(self) -> dict:
        # Best round, as timeit does: slower rounds are other processes' interference.
        step_time = min(self.t_full)
        twin_time = min(self.t_twin) if self.t_twin else None
        return {
            "step_time_s": step_time,
            "step_time_median_s": statistics.median(self.t_full),
            "compute_only_step_time_s": twin_time,
            "compute_only_step_time_median_s": twin_time and statistics.median(self.t_twin),
            "rounds": len(self.t_full),
            "comm_fraction": twin_time and (step_time - twin_time) / step_time,
            "comm_fraction_source": twin_time
            and "compute-only twin (same step without sync_gradients)",
            "images_per_s": self.global_batch / step_time,
            "warmup_s": self.compile_s,
            "global_batch": self.global_batch,
            "devices": self.devices,
            "mesh": self.mesh_shape,
            "loss": float(self.full.metrics["loss"]),
        }


def _error(res: dict, e: Exception) -> None:
    res.update(status="error", error=f"{type(e).__name__}: {e}")
    res["traceback"] = traceback.format_exc(limit=8)


def run_speed(
    resolved: Sequence[Resolved],
    preset: Preset,
    *,
    intra: int | None,
    seed: int = 0,
    progress: Callable[[Sequence], Any] = iter,
    twins: bool = True,
) -> list[dict]:
    """Times every available row (see the module docstring).

    All rows are built and compiled first; then the timing rounds go round-robin over the
    rows (row 1 step and twin, row 2 step and twin, ...), ``repeats`` times, so that a
    change in machine load hits every row alike and the speedups are side by side.

    Args:
      resolved: from ``experiments.rows.resolve_rows``.
      preset: model, image size, batch per device, warm-up / timing steps and repeats.
      intra: ``make_mesh(intra=...)``.
      seed: model and data seed.
      progress: wraps the row iterable (e.g. ``tqdm``) of the build-and-compile phase.
      twins: also time each row's compute-only twin (``False``: only the rows, and the
        ``compute_only_*`` and ``comm_fraction`` fields are ``None``; used where the step
        has no communication to expose, e.g. one device).

    Returns:
      One dict per row, with ``status`` ``'ok'``, ``'missing'`` (technique not installed:
      ``missing`` says why) or ``'error'`` (it raised: ``error`` holds the message).
    """
    results = [_base_result(r) for r in resolved]
    benches: dict[int, _Bench] = {}
    twin_steps: dict[str, _Step] | None = {} if twins else None
    for i, r in enumerate(progress(resolved)):
        if r.missing is None:
            try:
                benches[i] = _Bench(r, preset, intra=intra, seed=seed, twins=twin_steps)
            except Exception as e:  # report the row, keep the other rows going
                _error(results[i], e)
    for _ in range(preset.repeats):
        for i, bench in list(benches.items()):
            try:
                bench.run(preset.timing_steps)
            except Exception as e:
                _error(results[i], e)
                del benches[i]
    for i, bench in benches.items():
        results[i].update(bench.result())
    base = next((x for x in results if x["config"] == "baseline" and x["step_time_s"]), None)
    for x in results:
        if base and x["step_time_s"]:
            x["speedup"] = base["step_time_s"] / x["step_time_s"]
    return results


def run_accuracy(
    resolved: Sequence[Resolved],
    *,
    intra: int | None,
    steps: int,
    seed: int = 0,
    progress: Callable[[Sequence], Any] = iter,
) -> list[dict]:
    """The digits quality guard under every available row.

    Returns:
      One dict per row: ``config``, ``accuracy_status`` (``'ok'``, ``'missing'``,
      ``'error'``), ``accuracy``, ``final_loss`` and ``accuracy_note``.
    """
    try:
        digits_accuracy = DIGITS.lookup()
        unavailable = None
    except LookupError as e:
        digits_accuracy, unavailable = None, str(e)
    out = []
    for r in progress(resolved):
        res = {"config": r.row.config, "accuracy": None, "final_loss": None}
        if r.missing is not None:
            res.update(accuracy_status="missing", accuracy_note=r.missing)
        elif digits_accuracy is None:
            res.update(accuracy_status="missing", accuracy_note=unavailable)
        else:
            try:
                sync, options, mesh_kwargs = r.build()
                mesh = jaxcomm.make_mesh(intra=intra, **mesh_kwargs)
                got = digits_accuracy(
                    sync, steps=steps, seed=seed, mesh=mesh, compiler_options=options or None
                )
                res.update(
                    accuracy_status="ok",
                    accuracy=float(got["accuracy"]),
                    final_loss=float(got["final_loss"]),
                    accuracy_note=None,
                )
            except Exception as e:
                res.update(accuracy_status="error", accuracy_note=f"{type(e).__name__}: {e}")
        out.append(res)
    return out
