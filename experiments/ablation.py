"""Runs the ablation rows: step time, speedup, communication fraction, images/s, accuracy.

Speed (``run_speed``). For each available row the workload's step (``step.Workload``: the
ResNet's by default, ``experiments.lm_step.workload`` for the LM) is built with the row's
``sync_gradients`` arguments, compiler options and mesh, together with its *compute-only
twin*: the same step, same mesh and options, with no gradient synchronisation (each device
applies its own gradient; the small batch-statistics and metrics ``pmean`` stay in both).
Rows that differ only in ``sync_gradients`` arguments or in their layout
(``Row.data_parallel``) share one twin, in the replicated layout: a sharded row's exposed
communication counts its gathers and reduce-scatters inside the node with its sync. On a
network the row also gets its *sync alone*: the row's optimizer, its sync included, on gradients of
the model's shapes with no model (``experiments.step.sync_only_loss_fn``; a driven
adaptive row's at the rung it settled on, ``rows.pin_adaptive``).
After ``warmup`` untimed steps (compilation included), all rows are timed round-robin,
``repeats`` rounds of ``steps`` steps each, on one fixed synthetic batch; in each round a
row, its twin and its sync alone run back to back. Every figure is the median over the
rounds, with the range beside it (``*_range_s``; every round in ``*_times_s``):

* ``step_time_s``: the row's step time,
* ``exposed_comm_s``: the median over rounds of (row - twin) of the same round: what
  gradient synchronisation adds to the step and does not hide behind compute (collectives
  plus compression work); ``comm_fraction = exposed_comm_s / step_time_s``. On a busy
  CPU it is noisy and can come out slightly negative, which is reported as measured.
* ``speedup``: the median over rounds of the baseline's time over the row's in the same
  round (``speedup_range``: their range); ``images_per_s``: global batch over step time
  (``rate_per_s``: in the workload's unit, e.g. tokens); ``state_bytes_per_device``: the
  row's train state (params, model and optimizer state) held by one device, read from its
  arrays' shards; ``program_memory``: the compiled step's buffers per device (XLA's
  memory analysis: argument, output, alias, temp bytes).

On a network (``link_bps`` given, e.g. on ``jaxcomm.tools.testbed``), the row beside its
link bound:

* ``link_bytes``: bytes per step that cross a node's link in each direction, read from the
  row's compiled HLO (``jaxcomm.wire_bytes(...)['crossing']['inter']``: every collective
  whose replica groups span the ``inter`` mesh axis counts its per-device bus bytes, because
  a ring ordered by node crosses each node's link once in each direction, carrying what one
  device sends).
* ``link_bytes_measured``: what this node sent into its link per step while the row ran,
  from the ``tc`` counters of its link end (``jaxcomm.tools.testbed.node_link_sent``), as
  TCP payload (headers taken off per packet; ``link_bytes_measured_with_headers`` keeps
  them).
* ``link_bytes_framing``: the transport's framing those calls add, which no HLO shows: the
  row's crossing calls per step (``wire_bytes(...)['crossing_calls']``) times the framing
  per call measured after the timing rounds (``jaxcomm.tools.testbed.framing_per_call``);
  ``link_bytes_expected = link_bytes + link_bytes_framing``, what the counters should read.
* ``link_bound_s = link_bytes / (link_bps / 8)``: the time those bytes need at line rate.
* ``sync_alone_s``: the sync alone's time per step; ``link_efficiency`` = its own bytes'
  line-rate time over it (at most 1 on a link that shapes every byte: nothing is hidden
  in a program with nothing else to run), and ``hidden_share = 1 - exposed / sync alone``:
  the share of the sync that the step hides behind compute. A driven adaptive row's sync
  alone runs at the rung the ladder settled on before timing (``sync_alone_level``), which
  the row may leave under load.
* ``spine_bytes_measured`` (on a leaf-spine testbed only): bytes per step and direction that
  the spine carried while the row ran, from the ``tc`` counters of its link ends: where the
  ranks sit on the fabric, which the HLO cannot show.

Quality (``run_accuracy``). The digits quality guard of the compressors,
``experiments.bench.digits.digits_accuracy``, trains a small model on scikit-learn's bundled
digits under each row's settings and returns the test accuracy, the mean over ``seeds``
runs (model and data order from each seed). One test sample is 0.28 points of the 357,
and the baseline alone moves by up to 1.1 points from seed to seed (0.969-0.980 over
seeds 0-4), more than the guard's 0.5 points: a row is compared with the baseline over
the same seeds.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

import jaxcomm
from experiments import rows
from experiments import step as steplib
from experiments.bench.digits import LEARNING_RATE as DIGITS_LEARNING_RATE
from experiments.bench.digits import digits_accuracy
from experiments.presets import Preset
from experiments.rows import Resolved
from jaxcomm.tools.testbed import framing_per_call, node_link_sent, payload_bytes, spine_bytes

__all__ = ["ProcessesBroken", "run_accuracy", "run_speed", "sync_period"]


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
        "status": "ok",
        "techniques": list(r.techniques),
        "settings": r.describe(),
        "step_time_s": None,
        "compute_only_step_time_s": None,
        "speedup": None,
        "comm_fraction": None,
        "comm_fraction_source": None,
        "images_per_s": None,
        "link_bytes": None,
        "link_bound_s": None,
        "link_efficiency": None,
    }


class _Step:
    """A compiled step with its own state: ``run(n)`` times ``n`` steps on ``batch``.

    The step is compiled once, ahead of time, and that executable is both timed and read
    (``wire``: ``jaxcomm.wire_bytes`` of its HLO), so the bytes are those of the program
    that ran.

    With ``adapt_windows > 0`` (the step has an adaptive compressor), the step runs under
    ``jaxcomm.CommProfiler.drive`` instead (the measured communication share in the loop,
    as a user runs it) and ``adapt_windows`` of its windows run before any timing, so the
    ladder settles on the link first; every timed round is then whole windows (``steps``
    rounded up), so no window's clock spans the other rows' rounds. ``wire`` is read from
    the driven program, its ladder's ``lax.switch`` priced at the rung of the round whose
    time the row reports (:meth:`adaptive_wire`).
    """

    def __init__(
        self, dp: Any, state: Any, batch: Any, *, adapt_windows: int = 0, period: int | None = None
    ):
        self.period = period
        self.batch = dp.shard_batch(batch)
        self.mesh = dp.mesh
        self.state = state
        self.metrics = None
        self.profiler: jaxcomm.CommProfiler | None = None
        self.memory: dict[str, int] | None = None  # the compiled program's, per device
        if adapt_windows:
            # no retime_twin: the ablation times its own twin beside every round
            self.profiler = jaxcomm.CommProfiler(log_file=os.devnull)
            self.profiler.drive(dp, state, self.batch, retime_twin=0)
            self.fn: Callable = dp
            self.window = int(jaxcomm.compression.adaptive_states(state.opt_state)[0].window)
            self.state, _, self.metrics = _timed(
                dp, self.state, self.batch, adapt_windows * self.window
            )
            self.settled = len(self.profiler.windows)
            self.rounds: list[tuple[list[str], int]] = []  # per timed round: rungs, last index
        else:
            # One program for every step (HostPhase(): local steps' phases decided on the
            # devices), timed as it is; on several processes: met after compiling.
            self.fn = dp.compile(state, batch, phase=jaxcomm.HostPhase())
            self.wire = jaxcomm.wire_bytes(self.fn, mesh=dp.mesh)
            self.memory = _program_memory(self.fn)
            if period is not None:  # local steps: a sync every `period` steps, amortized
                local, calls = _local_link_bytes(self.fn, dp.mesh, period)
                self.wire["crossing"] = {"inter": local}
                self.wire["crossing_calls"] = {"inter": calls}

    def run(self, steps: int) -> float:
        if self.profiler is not None:  # whole windows: a window never spans two rounds
            steps = -(-steps // self.window) * self.window
        if self.period is not None:  # whole periods of local steps: one sync per period
            steps = -(-steps // self.period) * self.period
        before = len(self.profiler.windows) if self.profiler is not None else 0
        self.last_steps = steps
        self.state, t, self.metrics = _timed(self.fn, self.state, self.batch, steps)
        if self.profiler is not None:
            # drive's calibration: one adaptive compressor
            (adaptive,) = jaxcomm.compression.adaptive_states(self.state.opt_state)
            names = [w["levels"][0] for w in self.profiler.windows[before:]]
            self.rounds.append((names, int(adaptive.level)))
        return t

    def adaptive_wire(self, median_round: int) -> dict:
        """The driven program's bytes at the rung of timed round ``median_round`` (the rung of
        its last window; a round is one window at the presets' settings), and the ladder's
        log: ``level`` (the final rung), ``timed_levels`` (the rung of every window that
        ended during the timed rounds), ``median_round_levels`` (those of ``median_round``)
        and ``changes`` (every level change, settling included)."""
        prof = self.profiler
        round_names, round_level = self.rounds[median_round]
        rungs = len(prof.kernel_times)
        # drive() summarized the driven program already (prof.wire): its conditionals
        switch = [c for c, b in prof.wire["branches"].items() if len(b) == rungs]
        if len(switch) != 1:
            raise RuntimeError(
                f"expected one conditional with {rungs} branches (the ladder's lax.switch) in "
                f"the driven step, found {len(switch)}: {prof.wire['branches']}"
            )
        self.wire = jaxcomm.tools.wire.summarize(
            prof.module, self.mesh, taken={switch[0]: round_level}
        )
        names = [w["levels"][0] for w in prof.windows]
        return {
            "level": names[-1] if names else None,
            "timed_levels": names[self.settled :],
            "median_round_levels": round_names,
            "changes": [
                {k: c[k] for k in ("step", "from", "to", "reason", "comm_share", "error")}
                for c in prof.level_changes
            ],
            "kernel_times_s": list(prof.kernel_times),
        }


def sync_period(sync_s: float, compute_s: float, *, share: float = 0.1, most: int = 64) -> int:
    """H for local steps on a link: the fewest steps over which one outer sync's link time
    is at most ``share`` of their compute.

    Args:
      sync_s: the link time of one sync (its bytes across a node's link at line rate).
      compute_s: the compute of one step (the compute-only twin's step time).
      share: the most of the compute that the amortized sync may add.
      most: the largest H (the quality guard has been checked up to H = 50).

    Returns:
      ``clip(ceil(sync_s / (share * compute_s)), 1, most)``.

    Example:
      >>> sync_period(0.08, 0.065)   # 80 ms of link per sync, 65 ms of compute per step
      13
    """
    if not (sync_s >= 0 and compute_s > 0 and 0 < share <= 1):
        raise ValueError(
            f"sync_period: need sync_s >= 0, compute_s > 0 and 0 < share <= 1; got "
            f"sync_s={sync_s}, compute_s={compute_s}, share={share}."
        )
    return int(min(max(math.ceil(sync_s / (share * compute_s)), 1), most))


def _local_link_bytes(compiled: Any, mesh: Any, period: int) -> tuple[float, dict[str, float]]:
    """Bytes and crossing calls per step across a node's link of a ``jaxcomm.local_sgd``
    step that syncs once every ``period`` steps: the step without a sync, plus the sync
    step's extra spread over the period (read from the compiled HLO, priced at each
    branch of local_sgd's ``lax.switch``: the last branch syncs nothing)."""
    mod = jaxcomm.hlo.parse_collectives(compiled.as_text(), mesh=mesh)
    tops = {
        c["branch"][0][0] for c in jaxcomm.tools.wire.summarize(mod)["collectives"] if c["branch"]
    }
    if len(tops) != 1:
        raise RuntimeError(f"expected local_sgd's one lax.switch in the step, found {sorted(tops)}")
    (switch,) = tops
    last = max(i for c, i in mod.branches.values() if c == switch)

    def crossing(branch: int) -> tuple[float, dict[str, int]]:
        summary = jaxcomm.tools.wire.summarize(mod, mesh, taken={switch: branch})
        return summary["crossing"].get("inter", 0.0), summary["crossing_calls"].get("inter", {})

    (local, local_calls), (synced, synced_calls) = crossing(last), crossing(0)
    calls = {
        k: local_calls.get(k, 0) + (synced_calls.get(k, 0) - local_calls.get(k, 0)) / period
        for k in {*local_calls, *synced_calls}
    }
    return local + (synced - local) / period, calls


def _row_optimizer(
    workload: steplib.Workload,
    sync: dict,
    schedule: Any,
    local: dict | None,
    period: int | None,
) -> optax.GradientTransformation:
    """The row's optimizer; local steps sync every ``period`` steps."""
    local = None if local is None else {**local, "sync_every": period}
    return workload.optimizer(sync, schedule, local=local)


class _Bench:
    """One row's step and its compute-only twin. Rows with the same mesh and compiler
    options share one twin (the twin has no sync, so the sync settings do not change it)."""

    def __init__(
        self,
        r: Resolved,
        preset: Preset,
        *,
        intra: int | None,
        seed: int,
        twins: dict | None,
        link_bps: float | None = None,
        workload: steplib.Workload = steplib.RESNET,
    ):
        sync, options, mesh_kwargs = r.build()
        mesh = jaxcomm.make_mesh(intra=intra, **mesh_kwargs)
        self.devices = mesh.devices.size
        self.mesh_shape = dict(mesh.shape)
        self.global_batch = preset.per_device_batch * self.devices
        parts = workload.make_parts(preset, seed)
        schedule = workload.schedule(preset, self.global_batch)
        loss_fn = workload.loss_fn(parts.graphdef)
        self.rate_scale = workload.rate_scale
        driven = r.local is None and steplib.drives_adaptive(sync, preset.adapt_windows)
        sharding = jax.sharding.NamedSharding(mesh, jax.P(tuple(mesh.axis_names)))
        batch = workload.batch(preset, sharding, self.global_batch, seed)
        warmup = max(1, preset.warmup_steps)
        t0 = time.perf_counter()
        settings = r.describe()
        layout = dict(r.data_parallel)
        key = repr((settings["topology"], settings["compiler_options"]))
        if twins is not None and key not in twins:
            twin_dp, twin_state = steplib.build_step(
                parts,
                workload.optimizer(None, schedule),
                mesh,
                compiler_options=options,
                compute_only=True,
                loss_fn=loss_fn,
            )
            twins[key] = _Step(twin_dp, twin_state, batch)
            twins[key].run(warmup)
        self.twin = None if twins is None else twins[key]

        def build(period: int | None):
            return steplib.build_step(
                parts, _row_optimizer(workload, sync, schedule, r.local, period), mesh,
                compiler_options=options, donate=not driven, loss_fn=loss_fn, layout=layout,
            )  # fmt: skip

        self.period = None
        if r.local is None:
            dp, state = build(None)
        else:
            # Local steps: H from the link time of one sync (read from the compiled step
            # at the preset's H) against the compute of a step (the twin's).
            self.period = preset.local_sync_every
            dp, state = build(self.period)
            if r.local.get("sync_every") == "link" and link_bps and self.twin is not None:
                probe = dp.compile(state, batch, phase=jaxcomm.HostPhase())  # with its switch
                sync_bytes, _ = _local_link_bytes(probe, dp.mesh, period=1)
                # One H on every process: from the mean of their measured compute times
                # (each process's own clock would pick its own H, and its own program).
                compute = multihost_utils.process_allgather(np.float64(self.twin.run(3)))
                period = sync_period(sync_bytes * 8 / link_bps, float(np.mean(compute)))
                if period != self.period:
                    self.period = period
                    dp, state = build(period)
            elif r.local.get("sync_every") != "link":
                self.period = int(r.local["sync_every"])
                dp, state = build(self.period)
        self.full = _Step(
            dp, state, batch, adapt_windows=preset.adapt_windows if driven else 0,
            period=self.period,
        )  # fmt: skip
        if not driven:  # a driven step compiled and ran its windows already
            self.full.run(warmup)
        self.twin = None if twins is None else twins[key]
        self.sync_only = None
        # a driven row's sync alone runs at the rung the ladder settled on before timing
        self.sync_level = self._settled_rung(sync) if driven and link_bps else None
        if link_bps:  # the row's sync as its own program, timed beside the row
            only = sync if not driven else rows.pin_adaptive(sync, self.sync_level)
            dp, state = steplib.build_step(
                parts, _row_optimizer(workload, only, schedule, r.local, self.period), mesh,
                compiler_options=options, sync_only=True, layout=layout,
            )  # fmt: skip
            self.sync_only = _Step(dp, state, batch, period=self.period)
            self.sync_only.run(warmup)
        self.compile_s = time.perf_counter() - t0
        self.t_full: list[float] = []
        self.t_twin: list[float] = []
        self.t_sync: list[float] = []
        self.spine: list[float] = []
        self.sent: list[tuple[float, float]] = []  # per round: payload, bytes per step

    def _settled_rung(self, sync: dict) -> str:
        """The rung a driven adaptive row settled on before its timing."""
        (adaptive,) = jaxcomm.compression.adaptive_states(self.full.state.opt_state)
        return jaxcomm.compression.ladder(sync["compression"], self.devices)[int(adaptive.level)]

    def run(self, steps: int) -> None:
        """One round: the row, its compute-only twin and its sync alone, back to back, so the
        per-round differences pair measurements taken under the same load."""
        spine = os.environ.get("JAXCOMM_TESTBED_SPINE")
        before = spine_bytes(spine) if spine else None
        sent = node_link_sent()
        self.t_full.append(self.full.run(steps))
        if sent is not None:
            # tc's counters of this node's end of its link: what it sent, per step
            after = node_link_sent()
            n = self.full.last_steps
            raw = (after[0] - sent[0], after[1] - sent[1])
            self.sent.append((payload_bytes(raw) / n, raw[0] / n))
        if spine:
            # tc's counters of both spine ends, both directions: per step and direction
            self.spine.append((spine_bytes(spine) - before) / self.full.last_steps / 2)
        if self.twin is not None:
            self.t_twin.append(self.twin.run(steps))
        if self.sync_only is not None:
            self.t_sync.append(self.sync_only.run(steps))

    def result(self, link_bps: float | None, framing: dict[str, float | None]) -> dict:
        # Medians over the rounds, with their range; the exposed communication from the
        # per-round differences of row and twin (timed back to back, under the same load).
        step_time = statistics.median(self.t_full)
        twin_time = statistics.median(self.t_twin) if self.t_twin else None
        exposed = [f - t for f, t in zip(self.t_full, self.t_twin, strict=False)]
        median_round = min(range(len(self.t_full)), key=lambda k: abs(self.t_full[k] - step_time))
        adaptive = self.full.adaptive_wire(median_round) if self.full.profiler else None
        crossing = self.full.wire["crossing"].get("inter", 0.0)
        calls = self.full.wire.get("crossing_calls", {}).get("inter", {})
        known = [calls[k] * framing[k] for k in calls if framing.get(k) is not None]
        framed = sum(known) if framing and len(known) == len(calls) else None
        bound = crossing / (link_bps / 8) if link_bps else None
        comm = _median_or_none(exposed)
        sync = self._sync_alone(link_bps, exposed)
        return {
            "step_time_s": step_time,
            "step_time_range_s": [min(self.t_full), max(self.t_full)],
            "step_times_s": list(self.t_full),
            # the simulator's --check reads these four names
            "step_time_median_s": step_time,
            "compute_only_step_time_median_s": twin_time,
            "step_time_best_s": min(self.t_full),
            "compute_only_step_time_best_s": min(self.t_twin) if self.t_twin else None,
            "compute_only_step_time_s": twin_time,
            "compute_only_step_times_s": list(self.t_twin),
            "exposed_comm_s": comm,
            "exposed_comm_range_s": [min(exposed), max(exposed)] if exposed else None,
            "rounds": len(self.t_full),
            "comm_fraction": comm / step_time if comm is not None else None,
            "comm_fraction_source": twin_time
            and "median over rounds of (step - compute-only twin), timed back to back",
            "images_per_s": self.global_batch / step_time,
            # a workload's own unit (an LM's tokens): rate_scale units per batch element
            "rate_per_s": self.global_batch * self.rate_scale / step_time,
            # params + model state + optimizer state on one device, from the arrays' shards
            "state_bytes_per_device": _state_bytes_per_device(self.full.state),
            # the compiled step's memory analysis, per device (None: a driven row)
            "program_memory": self.full.memory,
            "warmup_s": self.compile_s,
            "global_batch": self.global_batch,
            "devices": self.devices,
            "mesh": self.mesh_shape,
            "loss": steplib.host_mean(self.full.metrics["loss"]),
            "wire_bytes": self.full.wire["total"],
            "link_bytes": crossing,
            "link_bps": link_bps,
            "link_bound_s": bound,
            **sync,
            # this node's link end, tc's counters: TCP payload and bytes with headers, per
            # step, the median over the rounds (the HLO's figure is link_bytes)
            "link_bytes_measured": _median_or_none([p for p, _ in self.sent]),
            "link_bytes_measured_with_headers": _median_or_none([b for _, b in self.sent]),
            # the transport's framing of the row's crossing calls (measured per call)
            "link_crossing_calls": calls,
            "link_bytes_framing": framed,
            "link_bytes_expected": None if framed is None else crossing + framed,
            # measured on a leaf-spine testbed (tc counters): what each step sent over the spine
            "spine_bytes_measured": _median_or_none(self.spine),
            # driven adaptive rows: the rungs of the median round (the bytes above), and the log
            "adaptive": adaptive,
            # local steps: H (link_bytes above are per step, the sync's spread over H)
            "sync_every": self.period,
        }

    def _sync_alone(self, link_bps: float | None, exposed: list[float]) -> dict:
        """The row's sync timed as its own program (no model to hide it behind): its line-rate
        bound over its time is the link efficiency, at most 1 where every byte is shaped;
        the share of it that the row's step hides is ``1 - exposed / sync``."""
        if self.sync_only is None or not self.t_sync:
            return {"sync_alone_s": None, "link_efficiency": None, "hidden_share": None}
        t = statistics.median(self.t_sync)
        crossing = self.sync_only.wire["crossing"].get("inter", 0.0)
        bound = crossing / (link_bps / 8)
        return {
            "sync_alone_s": t,
            "sync_alone_range_s": [min(self.t_sync), max(self.t_sync)],
            "sync_alone_link_bytes": crossing,
            # a driven adaptive row: the rung its sync alone ran (the row's own may move on)
            "sync_alone_level": self.sync_level,
            "link_efficiency": bound / t,
            "hidden_share": 1 - statistics.median(exposed) / t if exposed else None,
        }


def _framing(intra: int | None) -> dict[str, float | None]:
    """Transport framing per crossing call, by ``'kind/group size'``, on a testbed node's
    link (empty elsewhere): each collective kind over all devices and over the nodes."""
    if node_link_sent() is None:
        return {}
    mesh = jaxcomm.make_mesh(intra=intra)
    sizes = {mesh.devices.size, mesh.shape["inter"]}
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
    keys = [f"{k}/{n}" for k in kinds for n in sorted(sizes)]
    return framing_per_call(mesh, [*keys, "collective-permute/2"])


def _state_bytes_per_device(state: Any) -> int:
    """Bytes of ``state`` held by its first addressable device (every leaf's shard there):
    the replicated layout's whole state, a sharded layout's share."""
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    device = leaves[0].addressable_shards[0].device if leaves else None
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)


def _program_memory(compiled: Any) -> dict[str, int] | None:
    """A compiled step's per-device buffers from XLA's memory analysis: ``argument``,
    ``output``, ``alias`` (outputs in donated arguments) and ``temp`` (activations,
    gathered params, collectives' buffers) bytes; ``None`` where the backend has none."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    names = ("argument", "output", "alias", "temp")
    return {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in names}


def _median_or_none(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _error(res: dict, e: Exception) -> None:
    res.update(status="error", error=f"{type(e).__name__}: {e}")
    res["traceback"] = traceback.format_exc(limit=8)


class ProcessesBroken(RuntimeError):
    """A collective failed, or a peer died: the processes cannot run another row together.

    Attributes:
      row: the ablation row that was running.
      operation: what it was doing (``'building'``, ``'timing round 2'``, ...).
      process: the process that saw the failure.
    """

    def __init__(self, row: str, operation: str, cause: BaseException):
        self.row, self.operation, self.process = row, operation, jax.process_index()
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        super().__init__(
            f"row {row!r} failed while {operation} on process {self.process}: "
            f"{type(cause).__name__}: {first}"
        )


# What a failed collective or a lost peer says (gloo, XLA:CPU's collectives, the
# coordination service of jax.distributed); other errors (out of memory while compiling,
# a bad setting) leave the processes able to go on.
_BROKEN = ("gloo", "collective", "connection", "timed out", "deadline_exceeded", "heartbeat",
           "barrier", "coordination service")  # fmt: skip


def _breaks_processes(e: BaseException) -> bool:
    if jax.process_count() == 1:
        return False
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, jax.errors.JaxRuntimeError) and any(k in text for k in _BROKEN)


def run_speed(
    resolved: Sequence[Resolved],
    preset: Preset,
    *,
    intra: int | None,
    seed: int = 0,
    progress: Callable[[Sequence], Any] = iter,
    twins: bool = True,
    link_bps: float | None = None,
    workload: steplib.Workload = steplib.RESNET,
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
      link_bps: the inter-node link rate in bit/s per direction (the testbed's ``--link``);
        ``None``: no link-bound columns.
      workload: the model, loss, data and optimizer recipe (``steplib.RESNET``; the LM's
        is ``experiments.lm_step.workload(context)``); ``preset`` is read by it and for the
        timing fields.

    Returns:
      One dict per row, with ``status`` ``'ok'`` or ``'error'`` (it raised: ``error``
      holds the message).
    """
    results = [_base_result(r) for r in resolved]
    benches: dict[int, _Bench] = {}
    twin_steps: dict[str, _Step] | None = {} if twins else None
    for i, r in enumerate(progress(resolved)):
        try:
            benches[i] = _Bench(
                r, preset, intra=intra, seed=seed, twins=twin_steps, link_bps=link_bps,
                workload=workload,
            )  # fmt: skip
        except Exception as e:  # report the row, keep the other rows going
            if _breaks_processes(e):
                raise ProcessesBroken(r.row.config, "building and compiling", e) from e
            _error(results[i], e)
    for k in range(preset.repeats):
        for i, bench in list(benches.items()):
            try:
                bench.run(preset.timing_steps)
            except Exception as e:
                if _breaks_processes(e):
                    row = resolved[i].row.config
                    raise ProcessesBroken(row, f"timing round {k + 1}", e) from e
                _error(results[i], e)
                del benches[i]
    # after the timing: the probes' own collectives and connections stay out of the rounds
    framing = _framing(intra)
    for i, bench in benches.items():
        results[i].update(bench.result(link_bps, framing))
    base = next((x for x in results if x["config"] == "baseline" and x["step_time_s"]), None)
    for x in results:
        if base and x["step_time_s"]:
            # paired: round k of the baseline over round k of the row, timed in one pass
            ratios = [b / t for b, t in zip(base["step_times_s"], x["step_times_s"], strict=False)]
            x["speedup"] = statistics.median(ratios)
            x["speedup_range"] = [min(ratios), max(ratios)]
    return results


def run_accuracy(
    resolved: Sequence[Resolved],
    *,
    intra: int | None,
    steps: int,
    seed: int = 0,
    seeds: int = 1,
    progress: Callable[[Sequence], Any] = iter,
    periods: dict[str, int | None] | None = None,
    local_sync_every: int = 8,
) -> list[dict]:
    """The digits quality guard under every available row.

    Args:
      resolved: the rows.
      intra: devices per ``intra`` mesh group.
      steps: training steps per run.
      seed: the first seed; the runs use ``seed, seed + 1, ..., seed + seeds - 1``.
      seeds: runs per row (>= 1); ``accuracy`` and ``final_loss`` are their means.
      progress: wraps the rows (a progress bar).
      periods: row config -> the H its speed run chose (local-steps rows; the guard
        trains with the same H); a row missing here uses ``local_sync_every``.
      local_sync_every: H of a local-steps row without a speed run.

    Returns:
      One dict per row: ``config``, ``accuracy_status`` (``'ok'`` or ``'error'``),
      ``accuracy``, ``final_loss``, ``accuracy_per_seed`` and ``accuracy_note``.
    """
    out = []
    for r in progress(resolved):
        res = {"config": r.row.config, "accuracy": None, "final_loss": None}
        try:
            sync, options, mesh_kwargs = r.build()
            mesh = jaxcomm.make_mesh(intra=intra, **mesh_kwargs)
            guard: tuple[Any, dict[str, Any]] = (sync, {})
            if r.local is not None:  # the same local SGD, H of the speed run, on the guard
                period = (periods or {}).get(r.row.config) or local_sync_every
                carried = {k: sync[k] for k in ("algorithm", "topology") if k in sync}
                transform = jaxcomm.local_sgd(
                    optax.adam(DIGITS_LEARNING_RATE), **{**carried, **r.local, "sync_every": period}
                )
                guard = (None, {"transform": transform, "time_from": period})
                res["sync_every"] = period
            runs = [
                digits_accuracy(
                    guard[0],
                    **guard[1],
                    steps=steps,
                    seed=seed + k,
                    mesh=mesh,
                    compiler_options=options or None,
                )  # fmt: skip
                for k in range(seeds)
            ]
            per_seed = [float(g["accuracy"]) for g in runs]
            res.update(
                accuracy_status="ok",
                accuracy=statistics.fmean(per_seed),
                final_loss=statistics.fmean(float(g["final_loss"]) for g in runs),
                accuracy_per_seed=per_seed,
                accuracy_note=None,
            )
        except Exception as e:
            if _breaks_processes(e):
                raise ProcessesBroken(r.row.config, "training the digits guard", e) from e
            res.update(accuracy_status="error", accuracy_note=f"{type(e).__name__}: {e}")
        out.append(res)
    return out
