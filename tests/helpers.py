"""Shared test harness (not a test module): mesh axes, per-device inputs, ``run_sharded``,
and the bitwise replica comparison that every test that trains uses.

Replicas are compared by their bits, never by ``sharding.is_fully_replicated`` (which is
true by declaration and cannot fail). This comparison is written independently of
``jaxcomm.check_replicas`` (the library's runtime check), so that each checks the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.state import state_partition_specs

AX = ("inter", "intra")
ROOT = Path(__file__).resolve().parents[1]

# XLA:CPU's quick compile for tests that check paths, bytes and agreement rather than speed:
# the same HLO passes (the same collectives and bytes), LLVM without its costly passes.
# As compiler options of one program, and as the XLA_FLAGS of the processes a test starts
# (the make-run path on the testbed: 0.8x the CPU of the default compile).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
FAST_COMPILE_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items())


def f16_converts() -> bool:
    """Whether XLA:CPU here can convert float32 <-> float16 at all.

    XLA:CPU converts f16 with the F16C instructions; limited below them
    (``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2``) its JIT calls ``__extendhfsf2`` /
    ``__truncsfhf2``, which it does not link, and even ``x.astype(jnp.float16)`` fails with
    "Failed to materialize symbols". Where this is False, JAX itself cannot compute in f16,
    so the fp16 and float16 cases are skipped (``tests/conftest.py``), not failed.
    """
    x = np.arange(4, dtype=np.float32)
    try:
        y = jax.jit(lambda v: (v.astype(jnp.float16) * 2).astype(jnp.float32))(x)
        return bool(np.array_equal(np.asarray(y), 2 * x))
    except jax.errors.JaxRuntimeError:
        return False


def per_device(mesh, x: Any, axes: tuple[str, ...] = AX) -> Any:
    """Puts ``x`` (a pytree whose leaves have one leading row per device) on ``mesh``,
    split along its leading axis over ``axes``."""
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a), NamedSharding(mesh, P(axes))), x)


def replicated(mesh, x: Any) -> Any:
    """Puts ``x`` on every device of ``mesh``."""
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), x)


def shard(fn, mesh, *, in_specs: Any = None, out_specs: Any = None, check_vma: bool = True):
    """``jax.shard_map(fn, ...)`` with the replication check on by default; ``in_specs``
    default ``P(AX)`` (inputs split over the devices), ``out_specs`` default ``P()``."""
    in_specs = P(AX) if in_specs is None else in_specs
    out_specs = P() if out_specs is None else out_specs
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


def sharded(fn, mesh, *, compiler_options=None, **specs):
    """``jax.jit(shard(fn, mesh, **specs))``, with optional per-function XLA options."""
    return jax.jit(shard(fn, mesh, **specs), compiler_options=compiler_options)


def abstract_per_device(mesh, shape: tuple[int, ...], dtype=np.float32) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` of ``(devices, *shape)`` split over ``AX`` (for lowering)."""
    n = mesh.devices.size
    return jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P(AX)))


def run_sharded(fn, mesh, *args, in_specs: Any = None, out_specs: Any = None, check_vma=True):
    """Runs ``fn`` on the per-device values of ``args`` inside ``shard_map`` over ``mesh``."""
    return sharded(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)(*args)


def state_specs(init, mesh, axes: tuple[str, ...] = AX) -> Any:
    """PartitionSpecs of the state ``init()`` builds inside ``shard_map``: leaves inside
    ``jaxcomm.PerDevice`` get ``P(axes)`` (stacked per device), the others ``P()``."""
    # Only the structure and shapes are needed: per-device leaves may be typed varying.
    abstract = jax.eval_shape(
        jax.shard_map(init, mesh=mesh, in_specs=(), out_specs=P(), check_vma=False)
    )
    return state_partition_specs(abstract, axes)


def _bits(a: Any) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


def replica_mismatches(tree: Any) -> list[str]:
    """One line per leaf typed replicated whose copies differ in some bit across devices."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array) or not leaf.sharding.is_fully_replicated:
            continue
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)  # typed keys: compare their uint32 words
        shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
        ref = _bits(shards[0].data)
        differ = [s.device.id for s in shards[1:] if _bits(s.data) != ref]
        if differ:
            out.append(f"{jax.tree_util.keystr(path)}: devices {differ} differ from device 0")
    return out


def assert_replicas_equal(tree: Any) -> int:
    """Asserts every leaf typed replicated holds the same bits on every device.

    Returns:
      The number of replicated leaves compared (callers may assert it is non-zero).
    """
    bad = replica_mismatches(tree)
    assert not bad, "replicas differ:\n" + "\n".join(bad)
    return sum(
        1
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated
    )


def copy_mismatches(tree: Any) -> list[str]:
    """One line per leaf (replicated or split, e.g. over ``'intra'`` only) of which two
    devices holding the same slice hold different bits: the shards are grouped by their
    index into the global array, so a leaf split over ``'intra'`` is compared across
    ``'inter'`` (the devices of the same ``'intra'`` position)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        groups: dict[tuple, list] = {}
        for s in leaf.addressable_shards:
            key = tuple((i.start, i.stop, i.step) for i in s.index)
            groups.setdefault(key, []).append(s)
        for key, shards in groups.items():
            shards = sorted(shards, key=lambda s: s.device.id)
            ref = _bits(shards[0].data)
            differ = [s.device.id for s in shards[1:] if _bits(s.data) != ref]
            if differ:
                out.append(
                    f"{jax.tree_util.keystr(path)} slice {key}: devices {differ} differ from "
                    f"device {shards[0].device.id}"
                )
    return out


def assert_copies_equal(tree: Any) -> int:
    """Asserts every pair of devices holding the same slice of a leaf holds the same bits
    (:func:`copy_mismatches`). Returns the number of leaves held by more than one device
    per slice (callers may assert it is non-zero)."""
    bad = copy_mismatches(tree)
    assert not bad, "copies differ:\n" + "\n".join(bad)
    count = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            keys = [tuple((i.start, i.stop) for i in s.index) for s in leaf.addressable_shards]
            count += len(set(keys)) < len(keys)
    return count


def assert_rows_equal(stacked: Any) -> None:
    """Asserts the per-device rows of ``stacked`` (out_specs ``P(AX)``) are bitwise equal."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked)[0]:
        rows = np.asarray(leaf)
        for i in range(1, rows.shape[0]):
            assert _bits(rows[i]) == _bits(rows[0]), (
                f"{jax.tree_util.keystr(path)}: device row {i} differs from row 0"
            )


def train(dp, state, batches, *, check: bool = True):
    """Runs ``dp`` over ``batches``; after every step asserts replicas agree bitwise.

    Returns:
      ``(state, metrics)`` of the last step.
    """
    metrics = None
    for batch in batches:
        state, metrics = dp(state, batch)
        if check:
            assert assert_replicas_equal(state) > 0
    return state, metrics


def assert_trees_bitwise_equal(a: Any, b: Any) -> None:
    """Asserts two pytrees (e.g. a straight and a resumed train state) hold the same bits,
    leaf for leaf, naming the first leaf that differs."""
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b), (len(flat_a), len(flat_b))
    for (path, x), y in zip(flat_a, flat_b, strict=True):
        if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert _bits(x) == _bits(y), f"{jax.tree_util.keystr(path)} differs"


def launch_two_processes(*command: str, timeout: float, env: dict | None = None) -> str:
    """Runs ``command`` as 2 processes x 2 CPU devices under ``python -m jaxcomm.tools.launch``
    (``jax.distributed`` over gloo on loopback), the repository and ``tests/`` importable.

    Returns:
      The processes' stdout and stderr (lines prefixed ``[rank]``); asserts they all
      exited with 0.
    """
    from jaxcomm import distributed

    full = {k: v for k, v in os.environ.items() if k not in distributed.ENV_VARS}
    # 2 devices each, not conftest's 8; the quick compile (a caller's env may set its own)
    full |= {"XLA_FLAGS": FAST_COMPILE_FLAGS, "JAX_PLATFORMS": "cpu"}
    path = [str(ROOT), str(ROOT / "tests"), full.get("PYTHONPATH", "")]
    full["PYTHONPATH"] = os.pathsep.join(path)
    full |= env or {}
    cmd = [sys.executable, "-m", "jaxcomm.tools.launch", "--nprocs", "2", "--local-devices", "2"]
    p = subprocess.run(
        [*cmd, "--", *command], env=full, capture_output=True, text=True, timeout=timeout
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    return out
