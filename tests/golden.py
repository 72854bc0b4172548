"""The golden cases: every option of the gradient sync on fixed inputs (not a test module).

Each case builds a data-parallel step of the small MLP (``tests/mlp.py``) with the public
API only, runs it for ``STEPS`` steps on fixed batches from fixed params, and records a
SHA-256 digest of every leaf of the final state (params, optimizer state, step) and of the
last metrics. ``tests/test_golden.py`` compares the digests with the recorded ones in one
process (a 2 x 4 mesh of fake devices) and in two processes on loopback (2 x 2), so a
refactoring of the core is checked bit for bit.

The digests are bound to the platform (XLA:CPU) and to the JAX version in use: regenerate
them with ``JAXCOMM_GOLDEN_WRITE=1 python -m pytest tests/test_golden.py`` and name every
intended change of bits in the commit that changes them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm

C = jaxcomm.compression
STEPS = 3
GOLDEN_DIR = Path(__file__).with_name("golden")
# One optimisation level for every case: the digests depend on it, not the refactoring.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _sync(**kw: Any) -> Callable[[], optax.GradientTransformation]:
    return lambda: optax.chain(jaxcomm.sync_gradients(min_size=64, **kw), optax.adam(1e-2))


def _local(**kw: Any) -> Callable[[], optax.GradientTransformation]:
    return lambda: jaxcomm.local_sgd(optax.sgd(0.05), min_size=64, **kw)


#: name -> (optimizer factory, data_parallel keyword arguments)
CASES: dict[str, tuple[Callable[[], optax.GradientTransformation], dict]] = {
    **{f"alg:{a}": (_sync(algorithm=a), {}) for a in jaxcomm.collectives.ALGORITHMS},
    "comp:bf16": (_sync(compression=C.bf16()), {}),
    "comp:fp16": (_sync(compression=C.fp16()), {}),
    "comp:int8": (_sync(compression=C.int8(block=32)), {}),
    "comp:int4": (_sync(compression=C.int4(block=32)), {}),
    "comp:int8_error_feedback": (_sync(compression=C.int8(block=32, error_feedback=True)), {}),
    "comp:topk": (_sync(compression=C.topk(0.1)), {}),
    "comp:random_k": (_sync(compression=C.random_k(0.25)), {}),
    "comp:powersgd": (_sync(compression=C.powersgd(rank=2)), {}),
    "comp:adaptive": (
        _sync(compression=C.adaptive(0.5, adjustment_step=1, error_low=0.2, error_high=0.3)),
        {},
    ),
    "stage:int8_inter_hierarchical": (
        _sync(algorithm="hierarchical", compression=C.int8(block=32), compress_stage="inter"),
        {},
    ),
    "stage:int4_inter_ring": (
        _sync(algorithm="ring", compression=C.int4(block=32), compress_stage="inter"),
        {},
    ),
    "warmup:int8": (_sync(compression=C.int8(block=32), warmup_steps=1), {}),
    "buckets:fixed": (_sync(bucket_bytes=(256, 1024)), {}),
    "buckets:auto_int8": (_sync(bucket_bytes="auto", compression=C.int8(block=32)), {}),
    "microbatches:2": (_sync(algorithm="hierarchical"), {"microbatches": 2}),
    "local_sgd:h2": (_local(sync_every=2), {}),
    "local_sgd:h2_int8_fragments2": (
        _local(sync_every=2, fragments=2, compression=C.int8(block=32)),
        {},
    ),
}


def _leaf_digest(x: Any) -> str:
    """SHA-256 of a leaf's bits on this process: every addressable copy, in device order."""
    h = hashlib.sha256()
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
        parts = [np.asarray(s.data) for s in shards]
    else:
        parts = [np.asarray(x)]
    for a in parts:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()[:24]


def digests(tree: Any) -> dict[str, str]:
    """Leaf path -> digest of its bits on this process."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): _leaf_digest(x) for path, x in flat}


def run_case(name: str, mesh: Any) -> dict[str, str]:
    """Runs one case on ``mesh`` and returns the digests of its final state and metrics.

    With several processes each passes its own part of every global batch (the rows of its
    devices, in mesh order).
    """
    make_tx, kwargs = CASES[name]
    dp = jaxcomm.data_parallel(mlp_loss, make_tx(), mesh, compiler_options=FAST, **kwargs)
    state = dp.init(mlp_init(jax.random.key(0)))
    metrics = None
    n = jax.process_count()
    for batch in mlp_batches(STEPS, seed=1, size=16):
        if n > 1:  # this process's contiguous part of the global batch
            k = jax.process_index()
            batch = jax.tree.map(lambda x, k=k: np.split(x, n)[k], batch)
        state, metrics = dp(state, batch)
    return digests({"state": state, "metrics": metrics})


def golden_path(setting: str) -> Path:
    """The recorded digests of ``setting`` (``'one_process'`` or ``'two_processes'``)."""
    return GOLDEN_DIR / f"{setting}.json"


def load(setting: str) -> dict[str, dict[str, str]]:
    return json.loads(golden_path(setting).read_text())


def save(setting: str, table: dict[str, dict[str, str]]) -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    golden_path(setting).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
