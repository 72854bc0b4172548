"""The training loop of the experiment: steps, progress bar, periodic checkpoints."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax

import jaxcomm
from experiments.step import host_mean, one_step_in_flight
from jaxcomm.checkpoint import Checkpointer

__all__ = ["train"]


def train(
    dp: Callable,
    state: Any,
    data: Any,
    *,
    start: int,
    stop: int,
    checkpointer: Checkpointer | None = None,
    every: int = 0,
    meta: dict | None = None,
    progress: bool = False,
    log_every: int = 1,
    step_log: str | None = None,
) -> tuple[Any, int, dict]:
    """Runs steps on the batches ``start .. stop-1`` of ``data``.

    Args:
      dp: the step (``jaxcomm.DataParallel``).
      state: the train state.
      data: ``SyntheticImages`` or ``ImageFolder`` (anything with ``iterate(start, stop)``
        yielding ``(position, batch)``).
      start: data position to start at (0, or the restored position).
      stop: data position to stop before.
      checkpointer: save every ``every`` steps and at ``stop`` (after checking that the
        replicas of every replicated leaf agree, ``jaxcomm.check_replicas``).
      every: checkpoint period in steps (0: only at the end).
      meta: identity of the run, stored with each checkpoint.
      progress: show a tqdm progress bar (loss, accuracy, images/s).
      log_every: fetch metrics to the host every this many steps (each fetch waits for
        the device).
      step_log: append one JSON line per step here (``step``, wall-clock ``time``,
        ``devices``, the elastic agent's ``restart`` count): when each step ended, e.g.
        across an elastic restart.

    Returns:
      ``(state, position, summary)``: ``position`` is the next batch to read; ``summary``
      holds ``losses`` (fetched ones, by step), ``seconds`` (wall time after the first,
      compiling step, without checkpoint saving), ``timed_steps`` and
      ``checkpoint_seconds``.
    """
    bar = None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # the agent's round
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=stop - start, desc="train", unit="step", dynamic_ncols=True)
    losses: dict[int, float] = {}
    position = start
    t0 = None
    timed = 0
    saving = 0.0
    wait = one_step_in_flight()
    try:
        for position, batch in data.iterate(start=start, stop=stop):
            state, metrics = dp(state, batch)
            done = position + 1
            if wait or t0 is None:
                jax.block_until_ready(state)
            if t0 is None:  # the first step compiles: time from its end
                t0 = time.perf_counter()
            else:
                timed += 1
            if done % max(1, log_every) == 0 or done == stop:
                # local_sgd returns one value per device: their mean
                m = {k: host_mean(v) for k, v in metrics.items()}
                losses[done] = m["loss"]
                if bar is not None:
                    shown = {"loss": f"{m['loss']:.3f}"}
                    if "accuracy" in m:
                        shown["acc"] = f"{m['accuracy']:.2f}"
                    bar.set_postfix(shown)
            if checkpointer is not None and ((every and done % every == 0) or done == stop):
                t_save = time.perf_counter()
                # A checkpoint keeps one copy of each replicated leaf: prove they agree first.
                jaxcomm.check_replicas(state, mesh=getattr(dp, "mesh", None), what=f"step {done}")
                checkpointer.save(state, position=done, meta=meta)
                saving += time.perf_counter() - t_save
            if step_log is not None:
                with open(step_log, "a") as f:
                    line = {"step": done, "time": time.time(), "devices": jax.device_count(),
                            "restart": restart}  # fmt: skip
                    f.write(json.dumps(line) + "\n")
            if bar is not None:
                bar.update(1)
            position = done
        jax.block_until_ready(state)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0 - saving if t0 is not None else 0.0
    summary = {
        "losses": losses,
        "seconds": seconds,
        "timed_steps": timed,
        "checkpoint_seconds": saving,
    }
    return state, position, summary
