"""Runtime replica check: every leaf typed replicated holds the same bits on every device.

The train step is built so that shard_map's replication check (``check_vma=True``)
*proves* at trace time that params, model state and the replicated optimizer state are
invariant across the data axes (docs/architecture.md, "Replication invariant"). This module
checks the same property on the values, after the fact, for what the type system cannot
see: a backend that computes one collective differently on two devices, host code that
puts different data on one device, a checkpoint restored unevenly.
``data_parallel(..., check_replicas=N)`` runs :func:`check_replicas` every ``N`` steps.

On one process it compares the bytes of every device's copy. With several processes each
process hashes its devices' copies and the hashes are exchanged
(``jax.experimental.multihost_utils.process_allgather``): 16 bytes per leaf per device.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["ReplicaDivergenceError", "check_replicas", "replica_digests"]

_DIGEST_WORDS = 4  # blake2b digest of 16 bytes, as uint32 words


class ReplicaDivergenceError(RuntimeError):
    """A leaf typed as replicated holds different bits on different devices.

    Attributes:
      paths: ``jax.tree_util.keystr`` of every diverging leaf.
    """

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths


def _digest(shard_data: Any) -> np.ndarray:
    raw = np.ascontiguousarray(np.asarray(shard_data)).view(np.uint8).tobytes()
    d = hashlib.blake2b(raw, digest_size=4 * _DIGEST_WORDS).digest()
    return np.frombuffer(d, np.uint32)


def _key_bits(x: Any) -> Any:
    """Typed PRNG keys (``jax.random.key``) compared by their key data (uint32 words)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _replicated_leaves(tree: Any) -> list[tuple[str, jax.Array]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated:
            out.append((jax.tree_util.keystr(path) or "<root>", leaf))
    return out


def replica_digests(tree: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Hashes of every device's copy of every replicated leaf of ``tree``, all processes.

    Returns:
      ``(paths, device_ids, digests)``: ``digests[i, j]`` (4 uint32 words) is the hash of
      leaf ``paths[i]`` on device ``device_ids[j]``.
    """
    leaves = _replicated_leaves(jax.tree.map(_key_bits, tree))
    if not leaves:
        return [], np.zeros((0,), np.int64), np.zeros((0, 0, _DIGEST_WORDS), np.uint32)
    ids = [s.device.id for s in leaves[0][1].addressable_shards]
    local = np.zeros((len(leaves), len(ids), _DIGEST_WORDS), np.uint32)
    for i, (path, leaf) in enumerate(leaves):
        shards = {s.device.id: s for s in leaf.addressable_shards}
        if sorted(shards) != sorted(ids):
            raise ValueError(
                f"check_replicas: leaf {path} lives on devices {sorted(shards)}, the first "
                f"replicated leaf on {sorted(ids)}; check one mesh's state at a time."
            )
        for j, d in enumerate(ids):
            local[i, j] = _digest(shards[d].data)
    device_ids = np.asarray(ids, np.int64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = np.asarray(multihost_utils.process_allgather(local, tiled=False))
        device_ids = np.asarray(multihost_utils.process_allgather(device_ids, tiled=False))
        local = np.concatenate(list(local), axis=1)  # (leaves, all devices, words)
        device_ids = device_ids.reshape(-1)
    return [p for p, _ in leaves], device_ids, local


def _where(device_id: int, mesh: Mesh | None) -> str:
    if mesh is None:
        return f"{device_id}"
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    pos = np.argwhere(ids == device_id)
    if not len(pos):
        return f"{device_id}"
    coords = ", ".join(f"{a}={int(c)}" for a, c in zip(mesh.axis_names, pos[0], strict=True))
    return f"{device_id} ({coords})"


def check_replicas(tree: Any, *, mesh: Mesh | None = None, what: str = "state") -> None:
    """Raises :class:`ReplicaDivergenceError` if a replicated leaf differs across devices.

    Only leaves whose sharding is fully replicated are compared (sharded leaves, such as
    ``PerDevice`` optimizer state, legitimately differ). Comparison is by bits (a hash of
    each copy's bytes), so ``-0.0`` vs ``0.0`` or two NaN payloads count as different.

    Args:
      tree: a pytree of ``jax.Array`` (e.g. a ``jaxcomm.TrainState``).
      mesh: names the devices by mesh coordinates in the error (optional).
      what: what ``tree`` is, for the message.

    Raises:
      ReplicaDivergenceError: naming each diverging leaf's path and the devices whose
        copy differs from that of the first device.

    Example:
      >>> jaxcomm.check_replicas(state, mesh=dp.mesh)
    """
    paths, device_ids, digests = replica_digests(tree)
    bad, lines = [], []
    for i, path in enumerate(paths):
        ref = digests[i, 0]
        differ = [int(d) for d, h in zip(device_ids, digests[i], strict=True) if (h != ref).any()]
        if differ:
            same = [int(d) for d in device_ids if int(d) not in differ]
            bad.append(path)
            lines.append(
                f"  {what}{path}: devices {[_where(d, mesh) for d in differ]} differ from "
                f"devices {[_where(d, mesh) for d in same]}"
            )
    if bad:
        shown = "\n".join(lines[:10]) + (
            f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
        )
        raise ReplicaDivergenceError(
            f"{len(bad)} leaf/leaves typed as replicated hold different bits on different "
            f"devices:\n{shown}\nA replicated leaf must be identical everywhere; a checkpoint "
            "(or np.asarray) sees only one device's copy. See docs/architecture.md, "
            "'Replication invariant'.",
            bad,
        )
