"""Offline stand-in for what Flax's ImageNet ``train.py`` takes from tensorflow, tfds and
its ``input_pipeline`` module: scikit-learn's 8x8 digits instead of ImageNet.

- ``tf``: only the dtypes train.py names (``tf.bfloat16``, ``tf.float16``, ``tf.float32``);
- ``tfds.builder(name)``: a builder whose ``info.splits['train' | 'validation']
  .num_examples`` are the digits train / test split sizes (``experiments.bench.digits``:
  1440 and 357 images, whatever ``name`` says);
- ``create_split(...)``: upstream's signature. The train split comes in ONE fixed order
  (a seeded permutation, the same every epoch), repeating forever; the validation split in
  its stored order, repeating. Every pass yields ``num_examples // batch_size`` batches
  (the tail that fills no batch dropped), so a run restored from a checkpoint at an epoch
  boundary sees exactly the batches an uninterrupted run sees from there on. Batches are
  ``{'image': (batch_size, 8, 8, 3), 'label': (batch_size,)}``: the grey pixels (in [0, 1])
  repeated over 3 channels, as upstream's ``initialized`` builds the model for 3 channels.
  The arrays have the ``_numpy()`` of TF tensors, so upstream's ``prepare_tf_data`` reshapes
  them unchanged to ``(local_devices, per_device, ...)`` numpy arrays.

Not reproduced: upstream's random crops / flips / normalisation (``image_size`` must be 8),
``cache``, ``shuffle_buffer_size`` and ``prefetch`` (accepted, unused).
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.digits import load_split

IMAGE_SIZE = 8
SEED = 0  # the one permutation of the training images

tf = types.SimpleNamespace(bfloat16=jnp.bfloat16, float16=np.float16, float32=np.float32)


class _Tensor(np.ndarray):
    """A numpy array with the ``_numpy()`` that upstream's ``prepare_tf_data`` calls."""

    def _numpy(self) -> np.ndarray:
        return np.asarray(self)


class DigitsBuilder:
    """What train.py reads of a tfds builder: ``info.splits[split].num_examples``."""

    def __init__(self, name: str):
        self.name = name
        x_train, y_train, x_test, y_test = load_split()
        self.data = {"train": (x_train, y_train), "validation": (x_test, y_test)}
        self.info = types.SimpleNamespace(
            splits={
                split: types.SimpleNamespace(num_examples=len(y))
                for split, (_, y) in self.data.items()
            }
        )


tfds = types.SimpleNamespace(builder=DigitsBuilder)


def create_split(
    dataset_builder: DigitsBuilder,
    batch_size: int,
    train: bool,
    dtype=tf.float32,
    image_size: int = IMAGE_SIZE,
    cache: bool = False,
    shuffle_buffer_size: int | None = None,
    prefetch: int = 10,
) -> Iterator[dict]:
    """The split as an endless iterator of host batches (see the module's docstring)."""
    if image_size != IMAGE_SIZE:
        raise ValueError(f"the digits are {IMAGE_SIZE}x{IMAGE_SIZE}; image_size={image_size}")
    name = "train" if train else "validation"
    x, y = dataset_builder.data[name]
    # This process's share of the split, as upstream's f'train[{start}:{start + size}]'.
    size = len(y) // jax.process_count()
    start = jax.process_index() * size
    x, y = x[start : start + size], y[start : start + size]
    if train:
        order = np.random.default_rng(SEED).permutation(size)
        x, y = x[order], y[order]
    images = np.repeat(x.reshape(-1, IMAGE_SIZE, IMAGE_SIZE, 1), 3, axis=-1).astype(dtype)
    labels = y.astype(np.int32)
    per_pass = size // batch_size
    if per_pass == 0:
        raise ValueError(f"batch_size={batch_size} exceeds the {size} {name} images")
    return _batches(images, labels, batch_size, per_pass)


def _batches(images, labels, batch_size: int, per_pass: int) -> Iterator[dict]:
    while True:
        for i in range(per_pass):
            s = slice(i * batch_size, (i + 1) * batch_size)
            yield {"image": images[s].view(_Tensor), "label": labels[s].view(_Tensor)}
