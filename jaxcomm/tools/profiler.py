"""``CommProfiler``: where a training step's time goes (bandwidth, exposed communication).

Method (every number traceable to a measurement or to the compiled program):

1. ``attach(step, *args)`` compiles the step and reads its collectives from the optimized HLO
   and prices them with :func:`jaxcomm.tools.wire.summarize`, the same count as
   :func:`jaxcomm.wire_bytes`: ``bus_bytes`` are the bytes each rank moves by the nccl-tests
   convention (all-reduce ``2(g-1)/g * S``, reduce-scatter / all-gather / all-to-all
   ``(g-1)/g * S`` with ``S`` the full buffer, collective-permute ``S``), ``comm_bytes`` the
   operand bytes of the same collectives. **Conditionals** (``lax.cond`` / ``lax.switch``:
   ``warmup_steps``, adaptive levels) count their largest branch only, since the program does
   not say which branch a step runs: during a warm-up that is the branch that runs; after
   it, bytes are an upper bound. The stats say so in ``conditionals`` (``'largest_branch'``).
2. It times a *compute-only twin* of the step: the same program with the collectives removed.
   For a :class:`jaxcomm.DataParallel` step, :meth:`attach_data_parallel` builds it by tracing
   the step with ``sync_gradients`` passing gradients through (``DataParallel.compile(...,
   communicate=False)``; compressed syncs included, the scalar metric ``pmean`` stays); any
   other step may pass
   ``compute_only=`` itself.
3. ``record_step()`` times each real step (wall clock, blocking on the outputs).
4. ``comm_time = step_time - compute_time`` (the time communication adds to the step, i.e.
   the exposed part); ``exposed_comm_fraction = comm_time / step_time``;
   ``bandwidth = bus_bytes / comm_time`` (GB/s, bus-bandwidth convention);
   ``exposed_ms_per_collective = comm_time / number of collectives`` (ms; the exposed time
   per counted collective, not a measured per-call latency: overlapped calls cost 0 in
   it). Without a twin, ``comm_time`` is the whole step (a lower bound on bandwidth) and the
   exposed fraction is ``None``.

Overlapped communication (GPU, async collectives) is hidden by design: bandwidth computed from
exposed time is then an upper bound, and the fraction is what overlap did not hide.

Driving adaptive compressors (:meth:`CommProfiler.drive`):

1. Compile the step with the share as an extra input (the HLO census of
   :meth:`attach` is read from it); time the compute-only twin (``compute_time``:
   the same step with every ``sync_gradients`` passing gradients through).
2. Windows are the adaptive compressor's ``adjustment_step`` steps (aligned with
   its ``window_steps``). At a window's end the driver waits for the state (one
   host synchronisation per window) and measures ``step_time`` = the window's wall
   time (from its first step's call: pauses between windows do not count) / steps.
3. ``comm_share = clip(1 - (compute_time + kernel_time[level]) / step_time, 0,
   1)``, put on this process's devices once per window; the steps of the next
   window average it over all devices (one scalar ``pmean``, so processes whose
   clocks differ still decide alike), and the first of them decides.
   ``kernel_time[level]`` is the time the window's rung spends in its own kernels,
   which no link speed changes (with ``calibrate``: :func:`_kernel_times`; without,
   zeros, and a rung whose kernels cost more than the traffic they save looks
   communication-bound on any link). With ``retime_twin`` the twin runs again
   after every ``retime_twin``-th window (a count, not a clock: every process runs
   its collectives at the same step) and the kernel times scale with it, since on
   a shared machine the load moves both.
4. It logs one ``{"event": "adapt_window", ...}`` line per window and one
   ``{"event": "level_change", "reason": "error" | "network", ...}`` per change;
   TensorBoard ``adapt/level_<i>``, ``adapt/error_<i>``, ``adapt/comm_share``,
   ``adapt/step_time``, ``adapt/change_<i>`` (+-1 error, +-2 network).

The share counts all the twin does not run (host time included) as communication.

References:
  NVIDIA nccl-tests, doc/PERFORMANCE.md (algbw/busbw).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxcomm import hlo
from jaxcomm.compression.adaptive import (
    REASONS,
    AdaptiveState,
    adaptive_states,
    ladder,
    map_adaptive,
    with_comm_share,
)
from jaxcomm.front_end import FrontEnd
from jaxcomm.tools import wire
from jaxcomm.validate import check_int

__all__ = ["CommProfiler", "compute_only_step", "median_time"]


def compute_only_step(dp: Any, state: Any, batch: Any) -> Callable:
    """A compiled twin of ``dp``'s step without gradient communication.

    ``dp.compile(..., communicate=False)``: every ``sync_gradients`` passes the gradients
    through (no all-reduce, no compressor collective); the scalar metric ``pmean`` and the
    batch-statistics ``pmean`` stay.

    Args:
      dp: a :class:`jaxcomm.DataParallel`.
      state, batch: example inputs (the twin is compiled for their shapes).

    Returns:
      A callable ``twin(state, batch)`` running the step without gradient collectives.

    Example:
      >>> twin = compute_only_step(dp, state, dp.shard_batch(batch))
    """
    return dp.compile(state, batch, communicate=False)


def median_time(fn: Callable, args: tuple, reps: int) -> float:
    """Median wall time (s) of ``fn(*args)`` over ``reps`` runs after one warm-up run,
    each run waited for with ``jax.block_until_ready``."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class _Step:
    """Handle yielded by :meth:`CommProfiler.record_step`; pass it the step's outputs."""

    def __init__(self):
        self.outputs: Any = None

    def outputs_are(self, outputs: Any) -> Any:
        """Marks ``outputs`` as what the step produced (the profiler blocks on them)."""
        self.outputs = outputs
        return outputs


def _tensorboard_writer(logdir: str) -> Any:
    """A ``tensorboardX.SummaryWriter`` on ``logdir``, or a clear error without tensorboardX."""
    try:
        from tensorboardX import SummaryWriter  # optional: only tensorboard_dir needs it
    except ImportError as err:
        raise ImportError(
            "CommProfiler(tensorboard_dir=...) writes with tensorboardX, which is not "
            "installed; pip install 'jaxcomm[tensorboard]' (or tensorboardX)."
        ) from err
    return SummaryWriter(logdir, filename_suffix=".jaxcomm")


class CommProfiler:
    """Measures a training step's communication: bytes, bandwidth, exposed time and fraction.

    Bytes are read from the compiled HLO and counted as :func:`jaxcomm.wire_bytes` counts
    them: a conditional (warm-up, adaptive levels) at its largest branch.

    Args:
      track_bandwidth: report ``bandwidth`` (GB/s, bus-bandwidth convention).
      track_per_collective: report ``exposed_ms_per_collective`` (ms of exposed
        communication per counted collective).
      log_interval: every this many recorded steps, log the stats (JSON lines).
      log_file: path of the JSON-lines log (default: print to stdout); its folder is
        created if missing.
      tensorboard_dir: also write the stats as TensorBoard scalars there (with
        tensorboardX: ``pip install 'jaxcomm[tensorboard]'``).
      trace_dir: capture a ``jax.profiler`` trace of steps ``trace_steps`` there.
      trace_steps: ``(first, last)`` recorded step numbers to trace (0-based, inclusive).

    Example:
      >>> prof = jaxcomm.CommProfiler(log_interval=100)
      >>> prof.attach_data_parallel(dp, state, batch)
      >>> for batch in data:
      ...     with prof.record_step() as step:
      ...         state, metrics = step.outputs_are(dp(state, batch))
      >>> prof.get_stats()['exposed_comm_fraction']
    """

    def __init__(
        self,
        *,
        track_bandwidth: bool = True,
        track_per_collective: bool = True,
        log_interval: int = 100,
        log_file: str | None = None,
        tensorboard_dir: str | None = None,
        trace_dir: str | None = None,
        trace_steps: tuple[int, int] = (1, 3),
    ):
        log_interval = check_int("log_interval", log_interval, minimum=1)
        fix = "trace_steps is (first, last) with 0 <= first <= last"
        first = check_int("trace_steps[0]", trace_steps[0], minimum=0, fix=fix)
        trace_steps = (first, check_int("trace_steps[1]", trace_steps[1], minimum=first, fix=fix))
        self.track_bandwidth = track_bandwidth
        self.track_per_collective = track_per_collective
        self.log_interval = log_interval
        self.log_file = log_file
        if log_file:  # the log's folder, made now rather than at the first window's write
            os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        self.trace_dir = trace_dir
        self.trace_steps = trace_steps
        self._tb = _tensorboard_writer(tensorboard_dir) if tensorboard_dir else None
        self._tracing = False
        self.step_times: list[float] = []
        self.compute_time: float | None = None
        self.module: hlo.HloModule | None = None
        self.wire: dict | None = None  # jaxcomm.tools.wire.summarize(self.module)
        self.level_changes: list[dict[str, Any]] = []  # drive(): one record per change
        self.windows: list[dict[str, Any]] = []  # drive(): one record per window
        self.kernel_times: list[float] = []  # drive(): each rung's own kernels (s)

    # -- attaching a program ------------------------------------------------------------
    def attach(
        self,
        step: Callable,
        *args: Any,
        mesh: Any = None,
        compute_only: Callable | None = None,
        twin_reps: int = 3,
        compiler_options: dict | None = None,
    ) -> CommProfiler:
        """Reads the collectives of ``step(*args)`` and times ``compute_only(*args)``.

        Args:
          step: the (jitted) step function.
          *args: its example inputs.
          mesh: maps replica groups to mesh axes in the census.
          compute_only: the same step without collectives (the twin), or None.
          twin_reps: timed runs of the twin (median, after one warm-up).
          compiler_options: as used to compile the step.

        Returns:
          self.
        """
        self.module = hlo.collectives(step, *args, mesh=mesh, compiler_options=compiler_options)
        self.wire = wire.summarize(self.module)
        twin_reps = check_int("twin_reps", twin_reps, minimum=1)
        if compute_only is not None:
            self.compute_time = median_time(compute_only, args, twin_reps)
        return self

    def attach_data_parallel(self, dp: Any, state: Any, batch: Any, twin_reps: int = 3):
        """:meth:`attach` for a :class:`jaxcomm.DataParallel` step, twin built automatically.

        Returns:
          self.
        """
        batch = dp.shard_batch(batch)
        twin = compute_only_step(dp, state, batch)
        return self.attach(
            dp.step_fn(state),
            state,
            batch,
            mesh=dp.mesh,
            compute_only=twin,
            twin_reps=twin_reps,
            compiler_options=dp.compiler_options or None,
        )

    def drive(
        self,
        step: Any,
        *args: Any,
        twin_reps: int = 3,
        calibrate: bool = True,
        retime_twin: int = 10,
    ) -> CommProfiler:
        """Puts the measured network in the loop of ``step``'s adaptive compressors.

        After this one call, every call of ``step`` passes the exposed communication share
        measured over the last window into the step (an explicit input, written into each
        :class:`~jaxcomm.compression.AdaptiveState` by
        :func:`~jaxcomm.compression.with_comm_share`), and every level change is logged
        with its reason (JSON lines, TensorBoard). How: the module docstring.

        Args:
          step: any :class:`jaxcomm.front_end.FrontEnd` whose optimizer holds at least one
            ``sync_gradients(compression=adaptive(...))``: a :class:`jaxcomm.DataParallel`
            (``drive(dp, state, batch)``), a :func:`jaxcomm.nnx_data_parallel` step
            (``drive(train_step, model, optimizer, metrics, batch)``) or a
            :func:`jaxcomm.linen_data_parallel` step (``drive(train_step, state, batch)``).
          *args: its arguments as it is called (the state or the NNX objects, current:
            the windows align with their ``window_steps``; and an example batch).
          twin_reps: timed runs of the compute-only twin (and of each rung).
          calibrate: time each rung once to separate its kernels from communication
            (one adaptive compressor only; step 3 of the module docstring).
          retime_twin: windows between timed runs of the twin during training (one run
            after the window, out of the windows' clock; 0: never).

        Returns:
          self; ``level_changes``, ``windows``: the logged records; ``kernel_times``: per
          rung (s; zeros without ``calibrate``, empty with several adaptive compressors).

        Raises:
          TypeError: ``step`` is not a front end (:func:`jaxcomm.pmap_data_parallel`
            included: its state is stored per device).
          ValueError: no adaptive compressor in the optimizer state, several with
            different ``adjustment_step``, ``donate=True`` or ``accumulate='overlap'``
            (the compressor then counts reductions, not steps).

        Example:
          >>> prof = jaxcomm.CommProfiler(log_file="adapt.jsonl")
          >>> prof.drive(dp, state, batch)   # NNX: prof.drive(train_step, model, opt, batch)
          >>> for batch in data:
          ...     state, metrics = dp(state, batch)
          >>> prof.level_changes[0]["reason"]
        """
        twin_reps = check_int("twin_reps", twin_reps, minimum=1)
        retime_twin = check_int(
            "retime_twin", retime_twin, minimum=0, fix="windows between twin re-timings; 0: never"
        )
        step = _front_end(step)
        inputs = step.drive_inputs(*args)
        found, window = _drivable(step, inputs[0])
        driver = _Driver(self, step, window, int(np.asarray(found[0].window_steps)))
        compiled = step.set_feedback(driver, *args)
        ladders = _ladders(step)
        driver.ladders = ladders if len(ladders) == len(found) else None
        self.module = hlo.parse_collectives(compiled.as_text(), mesh=step.mesh)
        self.wire = wire.summarize(self.module)
        twin = step.compile(*args, communicate=False)
        self.compute_time = median_time(twin, inputs, twin_reps)
        driver.levels = [int(np.asarray(a.level)) for a in found]
        rungs = len(ladders[0]) if len(found) == 1 and driver.ladders else 0
        self.kernel_times = [0.0] * rungs
        if calibrate and rungs > 1:
            share = driver._put(-1.0)
            rest = (*inputs[1:], share)
            times = [
                median_time(compiled, (_at_level(step, inputs[0], lv), *rest), twin_reps)
                for lv in range(rungs)
            ]
            self.kernel_times = _kernel_times(times, self.compute_time, ladders[0].wire)
        driver.kernel = self.kernel_times or [0.0]
        driver.compute0 = self.compute_time
        driver.recent = [self.compute_time]
        if retime_twin > 0:
            driver.twin, driver.retime = (twin, inputs[1:]), retime_twin
        return self

    # -- recording ----------------------------------------------------------------------
    @contextlib.contextmanager
    def record_step(self) -> Iterator[_Step]:
        """Times one step. Hand the outputs to ``step.outputs_are(...)`` so the profiler
        waits for them; otherwise it waits for every live JAX array."""
        n = len(self.step_times)
        if self.trace_dir and n == self.trace_steps[0] and not self._tracing:
            jax.profiler.start_trace(self.trace_dir)
            self._tracing = True
        handle = _Step()
        t0 = time.perf_counter()
        yield handle
        jax.block_until_ready(handle.outputs if handle.outputs is not None else jax.live_arrays())
        self.step_times.append(time.perf_counter() - t0)
        if self._tracing and n >= self.trace_steps[1]:
            jax.profiler.stop_trace()
            self._tracing = False
        if len(self.step_times) % self.log_interval == 0:
            self.log()

    # -- results ------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        """Statistics over the recorded steps.

        Returns:
          dict with ``step_time`` (median s), ``steps``, ``comm_bytes`` and ``bus_bytes`` (per
          device per step, from the HLO; ``bus_bytes == jaxcomm.wire_bytes(...)['total']``),
          ``num_collectives`` (the counted ones), ``conditionals`` (how conditionals were
          counted: ``'largest_branch'``), ``compute_time`` (twin, s), ``comm_time`` (s),
          ``exposed_comm_fraction``, ``bandwidth`` (GB/s) and ``exposed_ms_per_collective``
          when tracked. Values that cannot be known are ``None``.
        """
        stats: dict[str, Any] = {"steps": len(self.step_times)}
        step = float(np.median(self.step_times)) if self.step_times else None
        stats["step_time"] = step
        wb = self.wire
        stats["num_collectives"] = wb["num_collectives"] if wb else None
        stats["comm_bytes"] = wb["operand_bytes"] if wb else None
        bus = float(wb["total"]) if wb else None
        stats["bus_bytes"] = bus
        stats["conditionals"] = wire.CONDITIONALS
        stats["compute_time"] = self.compute_time
        comm = None
        if step is not None:
            comm = step if self.compute_time is None else max(step - self.compute_time, 0.0)
        stats["comm_time"] = comm
        stats["exposed_comm_fraction"] = (
            comm / step if step and self.compute_time is not None else None
        )
        if self.track_bandwidth:
            stats["bandwidth"] = bus / comm / 1e9 if bus is not None and comm else None
        if self.track_per_collective:
            n = wb["num_collectives"] if wb else 0
            stats["exposed_ms_per_collective"] = comm / n * 1e3 if comm is not None and n else None
        return stats

    def log(self) -> dict[str, Any]:
        """Writes the current stats as one JSON line (and TensorBoard scalars); returns them."""
        stats = self.get_stats()
        values = {f"comm/{k}": float(v) for k, v in stats.items() if isinstance(v, int | float)}
        self._emit(stats, stats["steps"], values)
        return stats

    def _emit(self, record: dict[str, Any], step: int, scalars: dict[str, float]) -> None:
        """One JSON line (``time`` first), and ``scalars`` at ``step`` in TensorBoard."""
        line = json.dumps({"time": time.time(), **record})
        if self.log_file:
            with open(self.log_file, "a") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)
        if self._tb is not None and scalars:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()  # readable while the run goes on

    def close(self) -> None:
        """Stops a running trace and closes the TensorBoard file."""
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False
        if self._tb is not None:
            self._tb.close()


def _front_end(step: Any) -> FrontEnd:
    """``step`` if it is a :class:`jaxcomm.front_end.FrontEnd`, else a clear error."""
    if not isinstance(step, FrontEnd):
        raise TypeError(
            f"CommProfiler.drive drives a jaxcomm.front_end.FrontEnd, got "
            f"{type(step).__name__} (a jaxcomm.pmap_data_parallel step is none: its state is "
            f"stored per device); build the step with jaxcomm.data_parallel, "
            f"jaxcomm.nnx_data_parallel or jaxcomm.linen_data_parallel."
        )
    return step


def _adaptive_of(front: FrontEnd, state: Any) -> list[AdaptiveState]:
    """The :class:`AdaptiveState` of each adaptive compressor in ``state`` (the program's
    state), optimizer by optimizer, in tree order."""
    return [a for opt in front.optimizer_states(state) for a in adaptive_states(opt)]


def _drivable(dp: FrontEnd, state: Any) -> tuple[list[AdaptiveState], int]:
    """The adaptive states of ``state`` (the program's state) and their one window, or a
    clear error for a step :meth:`CommProfiler.drive` cannot drive."""
    found = _adaptive_of(dp, state)
    if not found:
        raise ValueError(
            "CommProfiler.drive: the optimizer state holds no adaptive compressor; use "
            "jaxcomm.sync_gradients(compression=jaxcomm.compression.adaptive(...))."
        )
    windows = {int(np.asarray(a.window)) for a in found}
    if len(windows) > 1:
        raise ValueError(
            f"CommProfiler.drive: the adaptive compressors have different windows "
            f"(adjustment_step {sorted(windows)}); give them one adjustment_step."
        )
    return found, windows.pop()


def _ladders(dp: FrontEnd) -> list:
    """The ladder (rung names, wire fractions) of each adaptive compressor of ``dp``'s
    syncs, in the order the step runs them."""
    out = []
    for sync in dp.syncs:
        if sync.compression is None:
            continue
        axes = sync.axes if sync.compress_stage == "all" else sync.axes[:-1]
        found = ladder(sync.compression, int(np.prod([dp.mesh.shape[a] for a in axes])))
        if found is not None:
            out.append(found)
    return out


def _kernel_times(times: list[float], compute: float, fractions: tuple[float, ...]) -> list:
    """Each rung's own kernel time (quantization, error feedback, the error sketch).

    The step is timed once at every rung ``l`` (``t_l``, a copy of the state); then
    ``kernel_time[l] = t_l - compute - (wire_l / wire_0) (t_0 - compute)``: the first
    rung's kernels are the zero, its exposed traffic scaled by each rung's wire fraction
    relative to the first's.
    """
    link = max(times[0] - compute, 0.0)  # the first rung's exposed traffic
    return [
        max(t - compute - w / fractions[0] * link, 0.0)
        for t, w in zip(times, fractions, strict=True)
    ]


def _at_level(dp: FrontEnd, state: Any, level: int) -> Any:
    """``state`` (``dp``'s program state) with every adaptive compressor at rung ``level``
    (new level arrays only; the other leaves are shared, so the copy costs nothing)."""

    def put(like, value):
        value = np.asarray(value, like.dtype)
        return jax.make_array_from_callback(like.shape, like.sharding, lambda _: value)

    # A fresh window too: a state at a window's end would let the controller change the
    # rung inside the timed step.
    def fresh(node: AdaptiveState) -> AdaptiveState:
        return node._replace(
            level=put(node.level, level),
            window_steps=put(node.window_steps, 0),
            error_sum=put(node.error_sum, 0.0),
        )

    opts = [map_adaptive(opt, fresh) for opt in dp.optimizer_states(state)]
    return dp.with_optimizer_states(state, opts)


class _Scalars(NamedTuple):
    level: Any
    error_sum: Any
    window_steps: Any
    last_error: Any
    last_reason: Any
    comm_share: Any


class _Driver:
    """The feedback of :meth:`CommProfiler.drive` (the front end's ``set_feedback``)."""

    def __init__(self, prof: CommProfiler, dp: FrontEnd, window: int, phase: int):
        self.prof = prof
        self._front = dp
        self.window = window
        self.levels: list[int] = []
        self.ladders: list | None = None
        self.kernel: list[float] = [0.0]  # drive(): each rung's kernel time (s)
        self.twin: tuple | None = None  # drive(retime_twin=N): (twin, its other inputs)
        self.compute0 = 0.0  # the twin's time when the kernels were calibrated
        self.recent: list[float] = []  # the twin's last timed runs
        self.retime = 0  # windows between twin runs
        self._windows = 0  # windows ended since drive()
        self._sharding = dp.batch_sharding
        self._devices = dp.num_devices
        self._share = self._put(-1.0)  # unknown until the first window is measured
        self._steps = phase % window  # steps into the current window
        self._timed = 0  # steps since the clock started
        self._count = 0  # steps taken since drive()
        self._t0: float | None = None
        self._clock = time.perf_counter

    def _put(self, share: float) -> jax.Array:
        """One value per device (this process's measurement on its devices); the step
        averages them, so processes whose clocks differ still decide alike."""
        return jax.make_array_from_callback(
            (self._devices,), self._sharding, lambda idx: np.full(1, share, np.float32)
        )

    @staticmethod
    def write(opt_state: Any, share: jax.Array) -> Any:
        """Inside the step: the measured share into every adaptive compressor's state."""
        return with_comm_share(opt_state, share)

    def before_step(self) -> jax.Array:
        if self._t0 is None:
            self._t0 = self._clock()
        return self._share

    def _name(self, i: int, level: int) -> str:
        return self.ladders[i][level] if self.ladders else str(level)

    def after_step(self, state: Any) -> None:
        self._steps += 1
        self._timed += 1
        self._count += 1
        if self._steps < self.window:
            return
        jax.block_until_ready(state)
        now = self._clock()
        step_time = (now - self._t0) / self._timed
        start = self._count - self._timed  # the window's first step (since drive)
        self._windows += 1
        if self.twin is not None and self._windows % self.retime == 0:
            fn, example = self.twin  # the load now, out of the windows' clock
            jax.block_until_ready(fn(state, *example))
            self.recent = [*self.recent, self._clock() - now][-3:]
            self.prof.compute_time = float(np.median(self.recent))
        # The next window's clock starts at its first step: a pause between windows
        # (evaluation, a checkpoint, other programs) is not communication.
        self._t0, self._steps, self._timed = None, 0, 0
        # The scalars only (never the per-device residuals): one small copy per window.
        found = jax.device_get(
            [_Scalars(a.level, a.error_sum, a.window_steps, a.last_error, a.last_reason,
                      a.comm_share)
             for a in _adaptive_of(self._front, state)]
        )  # fmt: skip
        # The rung the window ran (decisions are taken at a window's first step).
        compute = self.prof.compute_time or 0.0
        kernel = self.kernel[int(found[0].level)] if len(self.kernel) > 1 else 0.0
        kernel *= compute / self.compute0 if self.compute0 else 1.0
        share = min(max(1.0 - (compute + kernel) / step_time, 0.0), 1.0) if step_time > 0 else 0.0
        self._share = self._put(share)
        self.prof.step_times.append(step_time)
        scalars = {"adapt/comm_share": share, "adapt/step_time": step_time}
        for i, (a, old) in enumerate(zip(found, self.levels, strict=True)):
            level = int(a.level)
            scalars[f"adapt/level_{i}"] = float(level)
            scalars[f"adapt/error_{i}"] = float(a.error_sum) / max(int(a.window_steps), 1)
            if level == old:
                continue
            reason = int(a.last_reason)
            change = {
                "event": "level_change",
                "step": start,
                "sync": i,
                "from": self._name(i, old),
                "to": self._name(i, level),
                "reason": REASONS[reason],
                "error": float(a.last_error),
                "comm_share": float(a.comm_share),  # the mean over devices it decided from
            }
            self.prof.level_changes.append(change)
            self.prof._emit(change, start, {f"adapt/change_{i}": float(reason * (level - old))})
        self.levels = [int(a.level) for a in found]
        record = {
            "event": "adapt_window",
            "step": self._count,
            "step_time": step_time,
            "compute_time": compute,
            "kernel_time": kernel,
            "comm_share": share,
            "levels": [self._name(i, v) for i, v in enumerate(self.levels)],
            "errors": [scalars[f"adapt/error_{i}"] for i in range(len(found))],
        }
        self.prof.windows.append(record)
        self.prof._emit(record, self._count, scalars)
