"""Run presets for the ResNet experiment: one per kind of machine.

The default preset follows the platform: on CPU ``testbed`` when this machine can build the
emulated network (root, iproute2: ResNet-18 on 2 nodes x 2 devices joined by a 250 Mbit/s
link, ``jaxcomm.tools.testbed``), else ``cpu-smoke`` (a small ResNet on small images that runs on a
small CPU with 8 fake devices); ``gpu-node`` on one GPU node (ResNet-152, 224 x
224, bf16 compute), ``cluster`` when several processes run (ResNet-152 over all nodes, longer
runs, periodic checkpoints). Every field can be overridden on the command line. This module
imports no JAX, so ``--help`` stays instant and the fake-device set-up can
run before JAX is imported.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "LM_MODES",
    "LM_PRESETS",
    "LMPreset",
    "MODES",
    "PRESETS",
    "Preset",
    "default_preset_name",
]

MODES: tuple[str, ...] = ("train", "ablation", "accuracy")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One experiment configuration.

    Attributes:
      name: preset name.
      model: a key of ``jaxcomm.models.RESNET_CONFIGS``.
      image_size: square image side in pixels.
      num_classes: classifier outputs (synthetic data; a folder sets its own).
      per_device_batch: images per device per step (global batch = this x devices).
      steps: training steps of the ``train`` mode.
      warmup_steps: untimed steps per ablation row (the first one compiles).
      timing_steps: timed steps per ablation row and per repeat.
      repeats: timing rounds per ablation row; medians and ranges are reported.
      dtype: compute dtype, ``'float32'`` or ``'bfloat16'`` (params stay float32).
      intra: devices per ``intra`` mesh group; ``None`` = devices of one process.
      lr: peak learning rate per 256 images (scaled linearly with the global batch).
      lr_warmup: learning-rate warm-up steps.
      checkpoint_every: checkpoint period in steps when a checkpoint dir is given.
      accuracy_steps: training steps of the digits quality guard per ablation row.
      accuracy_seeds: runs (seeds) of the quality guard per row, averaged: one run's
        accuracy moves by up to 1.1 points from seed to seed, more than the guard's 0.5.
      modes: the modes run when no mode flag is given.
      link: the emulated link rate (tc units) when the preset builds a testbed; ``None``:
        the preset runs on the devices it is given.
      adapt_windows: ablation rows with an adaptive compressor run under
        ``jaxcomm.CommProfiler.drive`` (the measured communication share in the loop) for
        this many of its windows before they are timed, so the ladder settles on the
        network first, and with ``> 0`` the ``train`` mode drives its step too (log:
        ``adapt.jsonl`` in the output folder); ``0``: no driving (the controller then
        follows the error alone).
      local_sync_every: H of a local-steps row (``jaxcomm.local_sgd``) where no link rate
        is known to choose it from (off the testbed), and the H its choice starts from.
    """

    name: str
    model: str
    image_size: int
    num_classes: int
    per_device_batch: int
    steps: int
    warmup_steps: int
    timing_steps: int
    repeats: int
    dtype: str
    intra: int | None
    lr: float
    lr_warmup: int
    checkpoint_every: int
    accuracy_steps: int
    modes: tuple[str, ...] = MODES
    link: str | None = None
    adapt_windows: int = 0
    accuracy_seeds: int = 1
    local_sync_every: int = 8


PRESETS: dict[str, Preset] = {
    # A small CPU, 8 fake devices: every mode, kept short (README, `make run`).
    "cpu-smoke": Preset(
        name="cpu-smoke",
        model="resnet-tiny",
        image_size=32,
        num_classes=10,
        per_device_batch=4,
        steps=20,
        warmup_steps=2,
        timing_steps=2,
        repeats=8,
        dtype="float32",
        intra=4,
        lr=0.1,
        lr_warmup=2,
        checkpoint_every=10,
        accuracy_steps=300,
    ),
    # One node with several GPUs (e.g. 8 x H100): the seed's model at ImageNet resolution.
    "gpu-node": Preset(
        name="gpu-node",
        model="resnet152",
        image_size=224,
        num_classes=1000,
        per_device_batch=64,
        steps=200,
        warmup_steps=5,
        timing_steps=20,
        repeats=3,
        dtype="bfloat16",
        intra=None,
        lr=0.1,
        lr_warmup=50,
        checkpoint_every=100,
        accuracy_steps=300,
    ),
    # Many nodes (jax.distributed, one process per node): intra = GPUs per node.
    "cluster": Preset(
        name="cluster",
        model="resnet152",
        image_size=224,
        num_classes=1000,
        per_device_batch=32,
        steps=1000,
        warmup_steps=5,
        timing_steps=20,
        repeats=3,
        dtype="bfloat16",
        intra=None,
        lr=0.1,
        lr_warmup=200,
        checkpoint_every=200,
        accuracy_steps=300,
        adapt_windows=4,
    ),
}


# The first run on a machine that can build the emulated network (root, iproute2): 2 nodes x
# 2 CPU devices (one process each) joined by a 50 Mbit/s link, cpu-smoke's tiny ResNet (1.2
# MB of f32 gradient, whose time on the link is several times its compute), so that the
# table with its quality guard stays short on a small CPU.
PRESETS["testbed"] = dataclasses.replace(
    PRESETS["cpu-smoke"], name="testbed", timing_steps=3, repeats=5, intra=None,
    modes=("ablation", "accuracy"), link="50mbit", adapt_windows=4,
)  # fmt: skip
# The networked ablation: ResNet-18 (46.8 MB of f32 gradient) on 32 px images over 250
# Mbit/s: the gradient's time on the link is several times the compute, as on the seed's
# 64-node cluster.
# 8 settling windows (16 steps): the adaptive row settles on its rung before the timing
# (a change inside it is listed in the row's notes, with the rung of every timed window).
# The quality guard averages 3 seeds: its 0.5 points are less than one seed's noise.
PRESETS["testbed-resnet18"] = dataclasses.replace(
    PRESETS["testbed"], name="testbed-resnet18", model="resnet18", timing_steps=2,
    link="250mbit", adapt_windows=8, accuracy_seeds=3,
)  # fmt: skip


LM_MODES: tuple[str, ...] = ("train", "ablation", "memory")


@dataclasses.dataclass(frozen=True)
class LMPreset:
    """One configuration of the LM experiment (``python -m experiments.lm``).

    The fields the ablation reads have :class:`Preset`'s meaning (``per_device_batch``
    counts sequences); the others:

    Attributes:
      model: a key of ``jaxcomm.models.GPT_CONFIGS``.
      context: bytes per training sequence (at most the config's context).
      eval_batches: held-out batches (of the training batch's size) per evaluation.
      modes: the modes run when no mode flag is given (of ``train``, ``ablation``,
        ``memory``).
    """

    name: str
    model: str
    context: int
    per_device_batch: int
    steps: int
    warmup_steps: int
    timing_steps: int
    repeats: int
    dtype: str
    intra: int | None
    lr: float
    lr_warmup: int
    eval_batches: int
    modes: tuple[str, ...] = ("train", "ablation")
    link: str | None = None
    adapt_windows: int = 0
    local_sync_every: int = 8


LM_PRESETS: dict[str, LMPreset] = {
    # Seconds on a small CPU with 8 fake devices: a 2-layer, d 64 GPT on 64-byte windows.
    "cpu-smoke": LMPreset(
        name="cpu-smoke", model="gpt-test", context=64, per_device_batch=4, steps=40,
        warmup_steps=2, timing_steps=2, repeats=3, dtype="float32", intra=4, lr=3e-3,
        lr_warmup=5, eval_batches=4,
    ),
    # A small real run on CPU: 4 layers, d 128, 128-byte windows, a few minutes.
    "cpu-small": LMPreset(
        name="cpu-small", model="gpt-mini", context=128, per_device_batch=2, steps=300,
        warmup_steps=2, timing_steps=2, repeats=3, dtype="float32", intra=4, lr=3e-3,
        lr_warmup=30, eval_batches=16,
    ),
    # One GPU node: GPT-2 small's shape on 1024-byte windows, bf16 compute.
    "gpu-node": LMPreset(
        name="gpu-node", model="gpt2-small", context=1024, per_device_batch=8, steps=2000,
        warmup_steps=5, timing_steps=20, repeats=3, dtype="bfloat16", intra=None, lr=6e-4,
        lr_warmup=200, eval_batches=32,
    ),
    "cluster": LMPreset(
        name="cluster", model="gpt2-small", context=1024, per_device_batch=8, steps=5000,
        warmup_steps=5, timing_steps=20, repeats=3, dtype="bfloat16", intra=None, lr=6e-4,
        lr_warmup=500, eval_batches=32, adapt_windows=4,
    ),
}  # fmt: skip
# On CPU as root: the smoke model on 2 nodes x 2 devices (one process each) joined by a
# 50 Mbit/s link: 0.48 MB of f32 gradient, ~77 ms on the link against ms of compute.
LM_PRESETS["testbed"] = dataclasses.replace(
    LM_PRESETS["cpu-smoke"], name="testbed", timing_steps=3, repeats=5, intra=None,
    modes=("train", "ablation"), link="50mbit", adapt_windows=4,
)  # fmt: skip


def default_preset_name(backend: str, process_count: int, *, testbed: bool = False) -> str:
    """The preset that fits the platform.

    Args:
      backend: ``jax.default_backend()``.
      process_count: ``jax.process_count()``.
      testbed: whether this machine can build the emulated network
        (``jaxcomm.tools.testbed.available()``).

    Returns:
      ``'testbed'`` on one CPU process that can build the network, ``'cpu-smoke'`` on CPU
      otherwise; on accelerators ``'cluster'`` with several processes, else ``'gpu-node'``.
    """
    if backend == "cpu":
        return "testbed" if testbed and process_count == 1 else "cpu-smoke"
    return "cluster" if process_count > 1 else "gpu-node"
