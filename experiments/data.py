"""Input pipelines: synthetic ImageNet-shaped batches and an ImageNet-layout JPEG folder.

Both address batches by *position* (the number of global batches consumed so far), so a
checkpoint that stores the position resumes the exact data stream, and both hand each
process only its own part of the global batch.

* :class:`SyntheticImages` draws batch ``position`` on the devices from
  ``fold_in(key(seed), position)``: no host work, no transfer, already sharded over the
  data axes (each device draws its own shard).
* :class:`ImageFolder` reads ``root/<class>/<image>`` (the ImageNet training layout),
  shuffles once per epoch with a seeded permutation, decodes with PIL in a thread pool and
  keeps ``prefetch`` batches in flight while the devices compute.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxcomm.validate import check_int

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder", "SyntheticImages"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
# ImageNet channel statistics (torchvision), on the 0..1 scale.
_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)


@functools.lru_cache(maxsize=16)
def _draw_fn(sharding, global_batch, image_size, num_classes, dtype, seed):
    # Cached: the ablation rows share one compiled generator per sharding and shape.
    key = jax.random.key(seed)

    def draw(position):
        k_img, k_lab = jax.random.split(jax.random.fold_in(key, position))
        shape = (global_batch, image_size, image_size, 3)
        return {
            "image": jax.random.normal(k_img, shape, jnp.float32).astype(dtype),
            "label": jax.random.randint(k_lab, (global_batch,), 0, num_classes, jnp.int32),
        }

    return jax.jit(draw, out_shardings={"image": sharding, "label": sharding})


class SyntheticImages:
    """Random ImageNet-shaped batches generated on the devices.

    Args:
      sharding: the batch sharding of the train step (``DataParallel.batch_sharding``).
      global_batch: images per step over all devices and processes.
      image_size: square image side.
      num_classes: label range.
      dtype: image dtype (the model's compute dtype).
      seed: base seed; batch ``position`` uses ``fold_in(key(seed), position)``.

    Example:
      >>> data = SyntheticImages(dp.batch_sharding, global_batch=32, image_size=32,
      ...                        num_classes=10)
      >>> for position, batch in data.iterate(start=0, stop=10): ...
    """

    def __init__(
        self,
        sharding: NamedSharding,
        *,
        global_batch: int,
        image_size: int,
        num_classes: int,
        dtype: Any = jnp.float32,
        seed: int = 0,
    ):
        self.num_classes = num_classes
        self.global_batch = global_batch
        self._draw = _draw_fn(sharding, global_batch, image_size, num_classes, dtype, seed)

    def batch(self, position: int) -> dict[str, jax.Array]:
        """The global batch at ``position`` (a sharded ``jax.Array`` per key)."""
        return self._draw(jnp.asarray(position, jnp.uint32))

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Any]]:
        """Yields ``(position, batch)`` from ``start`` up to ``stop`` (exclusive, or forever)."""
        position = start
        while stop is None or position < stop:
            yield position, self.batch(position)
            position += 1


class ImageFolder:
    """An ImageNet-layout folder (``root/<class>/<image>.jpg``) read with prefetching.

    Classes are the sorted sub-folder names; label ``i`` is the ``i``-th class. Each epoch
    visits every image once in a permutation seeded by ``(seed, epoch)``; the last partial
    batch of an epoch is dropped, so every global batch has ``global_batch`` images. Images
    are resized (shorter side to ``image_size * 8/7``, as in the ImageNet evaluation recipe)
    and centre-cropped to ``image_size``, scaled to 0..1 and normalised with the ImageNet
    channel mean and std. There is no random augmentation, so a resumed run reads exactly
    the images an uninterrupted one would.

    Args:
      root: the folder.
      image_size: output side in pixels.
      global_batch: images per step over all processes; must divide by ``process_count``.
      seed: shuffling seed.
      process_index: this process (``jax.process_index()``).
      process_count: number of processes (``jax.process_count()``).
      workers: decoding threads.
      prefetch: batches decoded ahead of the one being consumed.

    Raises:
      ValueError: no class folders or no images, fewer images than one global batch, or a
        global batch that does not split evenly over the processes.

    Example:
      >>> data = ImageFolder('/data/imagenet/train', image_size=224, global_batch=256,
      ...                    process_index=jax.process_index(),
      ...                    process_count=jax.process_count())
      >>> for position, local_batch in data.iterate(start=0, stop=100):
      ...     state, metrics = dp(state, local_batch)   # shard_batch assembles the global one
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        image_size: int,
        global_batch: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        workers: int = 4,
        prefetch: int = 2,
    ):
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise ValueError(f"ImageFolder root {root!r} is not a directory.")
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        files: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            for f in sorted(os.listdir(folder)):
                if f.lower().endswith(IMAGE_EXTENSIONS):
                    files.append((os.path.join(folder, f), label))
        if not files:
            raise ValueError(
                f"ImageFolder found no images under {root!r}; expected the ImageNet layout "
                f"root/<class>/<image> with extensions {IMAGE_EXTENSIONS}."
            )
        if global_batch % process_count:
            raise ValueError(
                f"global_batch={global_batch} does not divide by process_count="
                f"{process_count}; use a multiple of {process_count}."
            )
        if len(files) < global_batch:
            raise ValueError(
                f"ImageFolder {root!r} has {len(files)} images, fewer than one global batch "
                f"of {global_batch}; lower the batch size or add images."
            )
        workers = check_int("workers", workers, minimum=1)
        prefetch = check_int("prefetch", prefetch, minimum=1)
        self.root = root
        self.files = files
        self.image_size = image_size
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.seed = seed
        self.process_index = process_index
        self.workers = workers
        self.prefetch = prefetch
        self.batches_per_epoch = len(files) // global_batch

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def indices(self, position: int) -> np.ndarray:
        """File indices of this process's part of global batch ``position``."""
        epoch, within = divmod(position, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        start = within * self.global_batch + self.process_index * self.local_batch
        return order[start : start + self.local_batch]

    def _decode(self, path: str) -> np.ndarray:
        from PIL import Image  # only the folder loader needs PIL

        size = self.image_size
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            scale = size * 8 / 7 / min(w, h)
            im = im.resize(
                (max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR
            )
            w, h = im.size
            left, top = (w - size) // 2, (h - size) // 2
            im = im.crop((left, top, left + size, top + size))
            x = np.asarray(im, np.float32) / 255.0
        return (x - _MEAN) / _STD

    def load(self, position: int) -> dict[str, np.ndarray]:
        """Decodes this process's part of global batch ``position`` (no prefetching)."""
        idx = self.indices(position)
        return {
            "image": np.stack([self._decode(self.files[i][0]) for i in idx]),
            "label": np.array([self.files[i][1] for i in idx], np.int32),
        }

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Any]]:
        """Yields ``(position, local_batch)`` from ``start``, ``prefetch`` batches ahead.

        Images are decoded by ``workers`` threads (PIL releases the GIL while decoding);
        closing the generator cancels the images still in flight.
        """
        pool = concurrent.futures.ThreadPoolExecutor(self.workers, "imagefolder")
        pending: collections.deque = collections.deque()
        nxt = start
        try:
            while True:
                # Keep `prefetch` batches queued behind the one being consumed; every image
                # is its own task, so all workers decode, also within one batch.
                while len(pending) < self.prefetch + 1 and (stop is None or nxt < stop):
                    idx = self.indices(nxt)
                    images = [pool.submit(self._decode, self.files[i][0]) for i in idx]
                    labels = np.array([self.files[i][1] for i in idx], np.int32)
                    pending.append((nxt, images, labels))
                    nxt += 1
                if not pending:
                    return
                position, images, labels = pending.popleft()
                yield position, {"image": np.stack([f.result() for f in images]), "label": labels}
        finally:
            for _, images, _ in pending:
                for f in images:
                    f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
