"""Gradient compressors, each paired with the collective that really moves fewer bytes.

Use them through ``jaxcomm.sync_gradients(compression=...)``:

>>> tx = optax.chain(
...     jaxcomm.sync_gradients(compression=jaxcomm.compression.int8(), min_size=1024),
...     optax.adam(1e-3))

| factory | collective | bytes vs f32 all-reduce |
|---|---|---|
| ``bf16()``, ``fp16()`` | all-reduce in 16 bits (any algorithm) | 0.5 |
| ``int8(block)``, ``int4(block)`` | all-to-all + all-gather of quantized chunks | ~0.25, ~0.13 |
| ``topk(ratio)`` | all-gather of (index, value) | ~p x ratio |
| ``random_k(ratio)`` | all-reduce of the shared-seed selection | ~ratio |
| ``powersgd(rank)`` | two all-reduces (P, Q) | r(n+m)/(nm) |
| ``adaptive(...)`` | its current rung's (a program per rung, on the host) | rung dependent |

Measure with ``jaxcomm.wire_bytes``.

The elementwise ones are each a per-buffer codec (``BufferCodec``: the mean of one flat
buffer and what this device sent) made a compressor by ``from_codec``, with error feedback
as its one option; ``adaptive`` switches between the same codecs (``bf16_codec``,
``int_codec``, ``topk_codec``, ``random_k_codec``, ``full_precision``).
"""

from jaxcomm.compression.adaptive import (
    DEFAULT_LADDER,
    LADDER,
    REASONS,
    AdaptiveState,
    Controller,
    Ladder,
    adaptive,
    adaptive_states,
    ladder,
    map_adaptive,
    with_comm_share,
)
from jaxcomm.compression.base import (
    BufferCodec,
    Compressor,
    ReduceContext,
    from_codec,
    full_precision,
    gather_means,
)
from jaxcomm.compression.cast import Fp16State, bf16, bf16_codec, fp16
from jaxcomm.compression.powersgd import PowerSGDState, powersgd
from jaxcomm.compression.quantize import int4, int8, int_codec, quantized
from jaxcomm.compression.skip import SkipsSteps, step_skipped, unless_skipped
from jaxcomm.compression.sparse import random_k, random_k_codec, topk, topk_codec

__all__ = [
    "DEFAULT_LADDER",
    "LADDER",
    "REASONS",
    "AdaptiveState",
    "BufferCodec",
    "Compressor",
    "Controller",
    "Fp16State",
    "Ladder",
    "PowerSGDState",
    "ReduceContext",
    "SkipsSteps",
    "adaptive",
    "adaptive_states",
    "bf16",
    "bf16_codec",
    "fp16",
    "from_codec",
    "full_precision",
    "gather_means",
    "int4",
    "int8",
    "int_codec",
    "ladder",
    "map_adaptive",
    "powersgd",
    "quantized",
    "random_k",
    "random_k_codec",
    "step_skipped",
    "topk",
    "topk_codec",
    "unless_skipped",
    "with_comm_share",
]
