"""Text on every machine without a download: the Python standard library's source files.

The corpus is the bytes of every ``*.py`` file under ``sysconfig.get_paths()['stdlib']``
(``site-packages`` left out, so installed packages do not change it), in sorted order of
their paths relative to that folder. Tokens are bytes (vocabulary 256). The held-out split
is by file: every ``held_out_every``-th file (positions ``k - 1, 2k - 1, ...`` of the
sorted list) is held out, the others train, so no file's text is in both. Each split is its
files' bytes end to end.

Batches are addressed by *position*, like ``experiments.data``'s: batch ``position`` holds
``global_batch`` windows of ``context + 1`` bytes whose starts are drawn uniformly by
``numpy.random.default_rng((seed, position))``; inputs are the first ``context`` bytes,
targets the last ``context``. Every process draws the same global batch on the host
(``global_batch x (context + 1)`` bytes) and places its own devices' rows.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxcomm.validate import check_int

__all__ = ["Corpus", "TextWindows", "corpus_files", "load_corpus"]


def corpus_files(root: str | None = None) -> list[str]:
    """The corpus's files: every ``*.py`` under ``root`` (default: the standard library),
    outside ``site-packages``, as sorted paths relative to ``root``."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "__pycache__")]
        found += [
            os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")
        ]
    return sorted(found)


class Corpus(NamedTuple):
    """The two splits as byte arrays, and where they came from.

    Attributes:
      train: the training files' bytes, ``uint8``, end to end.
      held_out: the held-out files' bytes.
      train_files: the training files (paths relative to ``root``).
      held_out_files: the held-out files.
      root: the folder read.
      digest: SHA-256 of both splits (the same corpus on two machines has the same digest).
    """

    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    root: str
    digest: str

    def describe(self) -> dict[str, Any]:
        """Sizes and identity, JSON-friendly."""
        return {
            "root": self.root,
            "train_files": len(self.train_files),
            "held_out_files": len(self.held_out_files),
            "train_bytes": int(self.train.size),
            "held_out_bytes": int(self.held_out.size),
            "sha256": self.digest,
        }


@functools.lru_cache(maxsize=4)
def load_corpus(root: str | None = None, *, held_out_every: int = 20) -> Corpus:
    """Reads the corpus and splits it by file (see the module docstring).

    Args:
      root: a folder of ``*.py`` files (default: the standard library).
      held_out_every: every this-many-th file is held out (>= 2).

    Returns:
      A :class:`Corpus` (cached: one read per process).
    """
    check_int("held_out_every", held_out_every, minimum=2, fix="e.g. 20: every 20th file")
    root = root or sysconfig.get_paths()["stdlib"]
    files = corpus_files(root)
    if len(files) < held_out_every:
        raise ValueError(
            f"load_corpus: {root!r} has {len(files)} .py files, fewer than held_out_every="
            f"{held_out_every}; point root at a folder with more files."
        )
    held = [f for i, f in enumerate(files) if i % held_out_every == held_out_every - 1]
    kept = [f for i, f in enumerate(files) if i % held_out_every != held_out_every - 1]

    def read(names: list[str]) -> np.ndarray:
        chunks = []
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(np.frombuffer(f.read(), np.uint8))
        return np.concatenate(chunks)

    train, held_out = read(kept), read(held)
    digest = hashlib.sha256(train.tobytes() + b"\0held-out\0" + held_out.tobytes()).hexdigest()
    return Corpus(train, held_out, tuple(kept), tuple(held), root, digest)


class TextWindows:
    """Random windows of a byte array as LM batches, addressed by position.

    Args:
      tokens: the split's bytes (``Corpus.train`` or ``Corpus.held_out``).
      sharding: the batch sharding of the step (``DataParallel.batch_sharding``), or
        ``None`` for host arrays.
      global_batch: windows per step over all devices and processes.
      context: tokens per window that the model reads.
      seed: batch ``position`` draws its starts from ``default_rng((seed, position))``.

    Example:
      >>> data = TextWindows(load_corpus().train, dp.batch_sharding, global_batch=32,
      ...                    context=128)
      >>> for position, batch in data.iterate(start=0, stop=10):
      ...     state, metrics = dp(state, batch)   # batch['tokens']: (32, 129) int32
    """

    def __init__(
        self,
        tokens: np.ndarray,
        sharding: NamedSharding | None,
        *,
        global_batch: int,
        context: int,
        seed: int = 0,
    ):
        check_int("global_batch", global_batch, minimum=1, fix="windows per step, e.g. 32")
        check_int("context", context, minimum=1, fix="tokens per window, e.g. 128")
        if tokens.size <= context + 1:
            raise ValueError(
                f"TextWindows: {tokens.size} tokens hold no window of context {context} + 1; "
                "use a shorter context or a larger split."
            )
        self.tokens, self.sharding = tokens, sharding
        self.global_batch, self.context, self.seed = global_batch, context, seed

    def host_batch(self, position: int) -> dict[str, np.ndarray]:
        """Batch ``position`` on the host: ``{'tokens': (global_batch, context + 1) int32}``."""
        rng = np.random.default_rng((self.seed, position))
        starts = rng.integers(0, self.tokens.size - self.context - 1, size=self.global_batch)
        rows = self.tokens[starts[:, None] + np.arange(self.context + 1)]
        return {"tokens": rows.astype(np.int32)}

    def batch(self, position: int) -> dict[str, Any]:
        """Batch ``position``, placed with ``sharding`` (each process its own devices' rows)."""
        host = self.host_batch(position)
        if self.sharding is None:
            return host
        return {
            k: jax.make_array_from_callback(v.shape, self.sharding, lambda idx, v=v: v[idx])
            for k, v in host.items()
        }

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Any]]:
        """Yields ``(position, batch)`` from ``start`` up to ``stop`` (exclusive, or forever)."""
        position = start
        while stop is None or position < stop:
            yield position, self.batch(position)
            position += 1
