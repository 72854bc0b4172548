"""Quality guard on real data: a small MLP on scikit-learn's ``load_digits``, 8 devices.

:func:`digits_accuracy` trains the same model, with the same seed, data order and step
count, for any ``sync_gradients`` settings, so two settings (e.g. uncompressed vs int8)
can be compared point for point. ``python -m experiments.bench digits [--steps N]`` prints
the test accuracy of the uncompressed baseline.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm.validate import check_int

__all__ = ["data_order", "digits_accuracy", "load_split", "main", "reexec_with_fake_devices"]

HIDDEN = 256
BATCH = 120  # 15 per device on 8 devices; 1440 training images -> 12 steps per epoch
TRAIN = 1440  # the first 1440 of a fixed shuffle train, the remaining 357 test
LEARNING_RATE = 3e-3


@functools.lru_cache(maxsize=1)
def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed train/test split of ``load_digits`` (1797 8x8 images, 10 classes).

    Returns:
      ``(x_train, y_train, x_test, y_test)``; pixels scaled to [0, 1], f32; labels int32.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(1234).permutation(len(x))
    x, y = x[perm], y[perm]
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def _init(seed: int, hidden: int | tuple[int, ...] = HIDDEN) -> dict:
    """MLP parameters ``w1, b1, ..., wN, bN`` (64 -> hidden... -> 10), ``w ~ N(0, 1/fan_in)``.

    ``hidden``: one width or a tuple of widths, one per hidden layer."""
    sizes = (64, *((hidden,) if isinstance(hidden, int) else hidden), 10)
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    params = {}
    for i, (k, n_in, n_out) in enumerate(zip(keys, sizes, sizes[1:], strict=False), 1):
        params[f"w{i}"] = jax.random.normal(k, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
        params[f"b{i}"] = jnp.zeros((n_out,), jnp.float32)
    return params


def _logits(params: dict, x: jax.Array) -> jax.Array:
    n = len(params) // 2
    for i in range(1, n):
        x = jax.nn.relu(x @ params[f"w{i}"] + params[f"b{i}"])
    return x @ params[f"w{n}"] + params[f"b{n}"]


def _loss(params: dict, batch: dict) -> jax.Array:
    logits = _logits(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def data_order(seed: int, steps: int, batch: int) -> np.ndarray:
    """Training-image indices of ``steps`` batches of ``batch``: one permutation of the
    training set per epoch (drawn from ``seed``), its tail that fills no batch dropped."""
    per_epoch = TRAIN // batch
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [rng.permutation(TRAIN)[: per_epoch * batch] for _ in range(-(-steps // per_epoch))]
    )


def digits_accuracy(
    sync_kwargs: dict | None = None,
    *,
    steps: int = 300,
    seed: int = 0,
    mesh=None,
    compiler_options=None,
    optimizer: optax.GradientTransformation | None = None,
    transform: optax.GradientTransformation | None = None,
    wire: bool = False,
    hidden: int | tuple[int, ...] = HIDDEN,
    time_from: int = 1,
    batch_size: int = BATCH,
    dp_kwargs: dict | None = None,
) -> dict:
    """Trains a 64-``hidden``-10 MLP on ``load_digits`` data-parallel; returns its test accuracy.

    The model and data order depend only on ``seed``; ``sync_kwargs`` only changes how
    gradients are synchronised, so results for different settings are comparable.

    Args:
      sync_kwargs: keyword arguments for :func:`jaxcomm.sync_gradients` (e.g.
        ``{'compression': jaxcomm.compression.int8()}``); ``None`` for the defaults.
      steps: optimizer steps (at the default batch 120, 12 steps per epoch).
      seed: initialisation and data-order seed.
      mesh: device mesh; default ``jaxcomm.make_mesh(intra=4)`` (8 devices).
      compiler_options: XLA options for the train step.
      optimizer: the optimizer after ``sync_gradients``; default ``optax.adam`` (learning
        rate ``LEARNING_RATE``). Top-k with error feedback was designed for momentum SGD
        (DGC); with Adam it loses accuracy here (see docs/benchmarks.md).
      transform: the whole optimizer instead of ``sync_gradients`` + ``optimizer`` (e.g.
        ``jaxcomm.local_sgd(...)``); then ``sync_kwargs`` and ``optimizer`` must be None.
      wire: also return ``wire``, ``jaxcomm.wire_bytes`` of the compiled step.
      hidden: the width of the hidden layer (default 256: 78 KB of f32 gradient; the
        gradient is about ``300 * hidden`` bytes, e.g. 16384: 4.9 MB).
      batch_size: the global batch (default 120: 15 per device on 8 devices); a multiple of
        the number of devices.
      dp_kwargs: further keyword arguments of :func:`jaxcomm.data_parallel`, e.g.
        ``{'shard_optimizer': True, 'param_gather': jaxcomm.compression.bf16()}``.
      time_from: ``step_seconds`` times the steps after this many (default 1: the first
        compiles; ``None`` if ``steps <= time_from``). With ``jaxcomm.local_sgd`` pass H:
        the first sync step also sets up its collectives (on gloo, a communicator per
        group), which the baseline does in step 1.

    Returns:
      A dict with ``accuracy`` (test accuracy in [0, 1]), ``final_loss`` (mean training
      loss over the last epoch's steps), ``train_accuracy``, ``steps``, ``seconds`` (wall
      time of the training loop including compilation), ``step_seconds`` and
      ``timed_steps`` (see ``time_from``) and ``opt_state`` (the final
      optimizer state, e.g. to read a compressor's counters); with ``wire``, ``wire``.

    Example:
      >>> base = digits_accuracy()
      >>> q = digits_accuracy({'compression': jaxcomm.compression.int8()})
      >>> base['accuracy'] - q['accuracy']
    """
    import jaxcomm

    steps = check_int("steps", steps, minimum=1)
    hidden = check_int("hidden", hidden, minimum=1, fix="the MLP's hidden width, e.g. 256")
    time_from = check_int("time_from", time_from, minimum=0)
    batch_size = check_int(
        "batch_size", batch_size, minimum=1, maximum=TRAIN, fix="the global batch, e.g. 120"
    )
    mesh = mesh if mesh is not None else jaxcomm.make_mesh(intra=4)
    x_tr, y_tr, x_te, y_te = load_split()
    tx = _optimizer(sync_kwargs, optimizer, transform)
    dp = jaxcomm.data_parallel(
        _loss, tx, mesh, compiler_options=compiler_options, **(dp_kwargs or {})
    )
    state = dp.init(_init(seed, hidden))
    step = dp.step_fn(state)
    t0 = time.perf_counter()
    state, losses, batch, t1 = _train(dp, step, state, steps, seed, batch_size, time_from)
    t2 = time.perf_counter()
    losses = _mean_losses(losses[-(TRAIN // batch_size) :])
    seconds = time.perf_counter() - t0
    # Replicas agree by construction (check_vma); check the bits too, once, after training.
    jaxcomm.check_replicas(state, mesh=mesh, what=f"digits state after {steps} steps")
    params = jax.device_get(state.params)
    pred_te = np.asarray(jnp.argmax(_logits(params, x_te), -1))
    pred_tr = np.asarray(jnp.argmax(_logits(params, x_tr), -1))
    out = {"wire": jaxcomm.wire_bytes(step, state, dp.shard_batch(batch))} if wire else {}
    return out | {
        "accuracy": float(np.mean(pred_te == y_te)),
        "train_accuracy": float(np.mean(pred_tr == y_tr)),
        "final_loss": float(np.mean(losses)),
        "steps": steps,
        "seconds": seconds,
        # wall time per step once compiled (steps time_from+1..N)
        "step_seconds": None if t1 is None else (t2 - t1) / (steps - time_from),
        "timed_steps": max(steps - time_from, 0),
        "opt_state": state.opt_state,
    }


def _optimizer(
    sync_kwargs: dict | None,
    optimizer: optax.GradientTransformation | None,
    transform: optax.GradientTransformation | None,
) -> optax.GradientTransformation:
    """``transform``, or ``sync_gradients(**sync_kwargs)`` then ``optimizer`` (default Adam)."""
    import jaxcomm

    if transform is not None:
        if sync_kwargs is not None or optimizer is not None:
            raise ValueError(
                "digits_accuracy: transform= is the whole optimizer; pass sync_kwargs and "
                "optimizer only without it."
            )
        return transform
    optimizer = optimizer if optimizer is not None else optax.adam(LEARNING_RATE)
    return optax.chain(jaxcomm.sync_gradients(**(sync_kwargs or {})), optimizer)


def _train(dp, step, state, steps: int, seed: int, batch_size: int, time_from: int):
    """Runs ``steps`` steps in :func:`data_order`.

    Returns:
      ``(state, losses, last batch, time after time_from steps or None)``; ``losses`` are
      the step metrics, still on the devices.
    """
    x_tr, y_tr, _, _ = load_split()
    order = data_order(seed, steps, batch_size)
    losses = []
    t1 = None  # after the first time_from steps (compilation, set-up of the collectives)
    for i in range(steps):
        if i == time_from:
            t1 = time.perf_counter()
        idx = order[i * batch_size : (i + 1) * batch_size]
        batch = {"x": x_tr[idx], "y": y_tr[idx]}
        state, metrics = step(state, dp.shard_batch(batch))
        # One step in flight at a time: on XLA:CPU with fake devices, several queued
        # executions of a program with collectives can deadlock the in-process
        # rendezvous (it aborts at its termination timeout on loaded cores).
        jax.block_until_ready(state)
        losses.append(metrics["loss"])
    return state, losses, batch, t1


def _mean_losses(tail: list) -> list[float]:
    """Each step's loss as a float: averaged over devices by the step, or one per device
    under ``jaxcomm.local_sgd`` (averaged here, once; across processes that needs a
    gather)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tail = multihost_utils.process_allgather(tail, tiled=True)
    return [float(np.mean(v)) for v in jax.device_get(tail)]


def reexec_with_fake_devices(name: str, argv: list[str] | None, n: int = 8) -> int:
    """Re-runs ``python -m experiments.bench NAME ARGV`` with ``n`` fake CPU devices.

    JAX reads ``XLA_FLAGS`` once, when it starts, so a benchmark that needs 8 devices on a
    CPU-only machine starts itself again with the flag set.
    """
    import os
    import subprocess
    import sys

    if os.environ.get("JAXCOMM_BENCH_REEXEC"):
        print(f"needs {n} devices, found {jax.device_count()}", file=sys.stderr)
        return 2
    env = dict(os.environ, JAXCOMM_BENCH_REEXEC="1", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    ).strip()
    cmd = [sys.executable, "-m", "experiments.bench", name, *(argv or [])]
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench digits",
        description="Test accuracy of the uncompressed digits MLP on 8 devices.",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if jax.device_count() < 8:
        return reexec_with_fake_devices("digits", argv)
    r = digits_accuracy(steps=args.steps, seed=args.seed)
    r.pop("opt_state")
    print(json.dumps(r, indent=2))
    return 0
