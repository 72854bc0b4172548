"""A GPT-style decoder-only language model in Flax NNX (Radford et al., 2019).

Token and learned position embeddings, ``layers`` pre-LayerNorm blocks (causal multi-head
self-attention, then a 4x MLP with GELU, each in a residual branch), a final LayerNorm and
an output head that is the token embedding's transpose (tied, as GPT-2) unless
``tied=False``. Initialisation as GPT-2: normal(0.02) weights, zero biases, the residual
projections scaled by ``1 / sqrt(2 layers)``.

In a hybrid-sharded step that gathers per layer (``jaxcomm.data_parallel(...,
shard_params=True, gather='layer')``) the blocks run as one scan that gathers each
block's params inside a rematerialised body (``jaxcomm.gathered_layers``), and the
embeddings and the final LayerNorm are gathered once (``jaxcomm.gather_params``);
elsewhere both helpers do nothing and the model is the plain one.

Named configs (:data:`GPT_CONFIGS`) go from ``'gpt-test'`` (2 layers, d 64: a test size)
through GPT-2 small's shape (``'gpt2-small'``: 12 layers, d 768, 12 heads, context 1024)
to GPT-2 medium's and large's. The vocabulary is bytes (256): GPT-2 small has 85.8M
parameters here and 124.4M with GPT-2's vocabulary of 50257 (:func:`param_count` with
``vocab=50257``).

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners", 2019 (GPT-2).
  Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcomm.gathering import gather_params, gathered_layers

BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT.

    Attributes:
      layers: transformer blocks.
      d_model: width of the residual stream.
      heads: attention heads (``d_model`` must be a multiple).
      context: longest sequence (rows of the position embedding).
      vocab: token ids ``0 .. vocab-1`` (256: bytes).
      mlp_ratio: the MLP's hidden width over ``d_model``.
      tied: the output head is the token embedding's transpose (no parameters of its own).
    """

    layers: int
    d_model: int
    heads: int
    context: int
    vocab: int = BYTE_VOCAB
    mlp_ratio: int = 4
    tied: bool = True

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not a multiple of heads={self.heads}; "
                "choose heads that divide it."
            )


GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-test": GPTConfig(layers=2, d_model=64, heads=4, context=64),
    "gpt-mini": GPTConfig(layers=4, d_model=128, heads=4, context=256),
    "gpt2-small": GPTConfig(layers=12, d_model=768, heads=12, context=1024),
    # GPT-2 medium's width, 16 layers: the fewest whose replicated AdamW step (params,
    # gradients, two moments: 16 bytes a param) exceeds 24 GiB on 8 devices (202.9M
    # params, 201.9M at context 64: 24.06 GiB; 15 layers: 22.6 GiB)
    "gpt-200m": GPTConfig(layers=16, d_model=1024, heads=16, context=1024),
    "gpt2-medium": GPTConfig(layers=24, d_model=1024, heads=16, context=1024),
    "gpt2-large": GPTConfig(layers=36, d_model=1280, heads=20, context=1024),
}


def param_count(config: GPTConfig) -> int:
    """Parameters of a GPT of this shape, by the closed formula.

    ``V d + T d`` (token and position embeddings), then per block two LayerNorms
    (``4 d``), the query/key/value projection (``3 d^2 + 3 d``), the output projection
    (``d^2 + d``) and the MLP (``2 m d^2 + m d + d``): ``(4 + 2 m) d^2 + (9 + m) d``, for
    ``m = 4`` ``12 d^2 + 13 d``; then the final LayerNorm (``2 d``) and, untied, the head
    (``V d``, no bias). GPT-2 small with GPT-2's vocabulary: 124,439,808.

    Example:
      >>> param_count(dataclasses.replace(GPT_CONFIGS['gpt2-small'], vocab=50257))
      124439808
    """
    d, m, n_layers = config.d_model, config.mlp_ratio, config.layers
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * m * d * d + m * d + d)
    head = 0 if config.tied else config.vocab * d
    return config.vocab * d + config.context * d + n_layers * block + 2 * d + head


class _Attention(nnx.Module):
    def __init__(self, c: GPTConfig, *, dtype, rngs):
        init = nnx.initializers.normal(0.02)
        resid = nnx.initializers.normal(0.02 / math.sqrt(2 * c.layers))
        self.heads = c.heads
        self.qkv = nnx.Linear(c.d_model, 3 * c.d_model, kernel_init=init, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(c.d_model, c.d_model, kernel_init=resid, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        shape = (b, t, self.heads, d // self.heads)
        y = jax.nn.dot_product_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), is_causal=True
        )
        return self.proj(y.reshape(b, t, d))


class _Block(nnx.Module):
    def __init__(self, c: GPTConfig, *, dtype, rngs):
        init = nnx.initializers.normal(0.02)
        resid = nnx.initializers.normal(0.02 / math.sqrt(2 * c.layers))
        hidden = c.mlp_ratio * c.d_model
        self.ln1 = nnx.LayerNorm(c.d_model, dtype=dtype, rngs=rngs)
        self.attn = _Attention(c, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.d_model, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(c.d_model, hidden, kernel_init=init, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(hidden, c.d_model, kernel_init=resid, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    """Decoder-only LM: ``tokens (batch, time) int -> logits (batch, time, vocab) f32``.

    Position ``t``'s logits predict token ``t + 1`` and depend on tokens ``0 .. t`` only.

    Args:
      config: a :class:`GPTConfig` (see ``GPT_CONFIGS``).
      dtype: compute dtype (``jnp.bfloat16`` for mixed precision; params stay float32).
      rngs: ``nnx.Rngs``.
    """

    def __init__(self, config: GPTConfig, *, dtype=None, rngs):
        c = config
        init = nnx.initializers.normal(0.02)
        self.config = c
        self.wte = nnx.Embed(c.vocab, c.d_model, embedding_init=init, dtype=dtype, rngs=rngs)
        self.wpe = nnx.Embed(c.context, c.d_model, embedding_init=init, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([_Block(c, dtype=dtype, rngs=rngs) for _ in range(c.layers)])
        self.ln_f = nnx.LayerNorm(c.d_model, dtype=dtype, rngs=rngs)
        self.head = (
            None
            if c.tied
            else nnx.Linear(
                c.d_model, c.vocab, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs
            )  # fmt: skip
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.config.context:
            raise ValueError(
                f"GPT: a sequence of {t} tokens is longer than the context "
                f"{self.config.context}; cut it to at most {self.config.context}."
            )
        wte, wpe, ln_f, head = _gathered(self.wte, self.wpe, self.ln_f, self.head)
        x = wte(tokens) + wpe(jnp.arange(t))
        if len(self.blocks):
            graphdef = nnx.graphdef(self.blocks[0])
            layers = [nnx.state(block) for block in self.blocks]
            x = gathered_layers(functools.partial(_apply, graphdef))(layers, x)
        x = ln_f(x)
        logits = wte.attend(x) if head is None else head(x)
        return logits.astype(jnp.float32)


def _gathered(*modules: nnx.Module | None) -> list[nnx.Module | None]:
    """``modules`` with their params gathered in a per-layer hybrid step, in one call of
    ``jaxcomm.gather_params`` (their small blocks in one all-gather), else themselves."""
    split = [None if m is None else nnx.split(m) for m in modules]
    params = [None if s is None else s[1] for s in split]
    gathered = gather_params(params)
    if gathered is params:
        return list(modules)
    return [None if s is None else nnx.merge(s[0], g) for s, g in zip(split, gathered, strict=True)]


def _apply(graphdef: Any, params: Any, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, params)(x)


def gpt(name: str = "gpt2-small", *, dtype=None, seed: int = 0, **overrides: Any) -> GPT:
    """Builds a GPT by name (a key of ``GPT_CONFIGS``), fields overridden by keyword
    (e.g. ``context=128``, ``tied=False``)."""
    return GPT(gpt_config(name, **overrides), dtype=dtype, rngs=nnx.Rngs(seed))


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """``GPT_CONFIGS[name]`` with ``overrides`` (:class:`GPTConfig` fields) replaced."""
    if name not in GPT_CONFIGS:
        raise ValueError(f"gpt name {name!r} is not known; choose one of {sorted(GPT_CONFIGS)}.")
    return dataclasses.replace(GPT_CONFIGS[name], **overrides)


@functools.lru_cache(maxsize=8)
def gpt_param_shapes(name: str = "gpt2-small", **overrides: Any) -> Any:
    """The parameter (= gradient) tree of a GPT as ``jax.ShapeDtypeStruct``s, without
    allocating it (``nnx.eval_shape``)."""
    abstract = nnx.eval_shape(lambda: gpt(name, **overrides))
    params = nnx.state(abstract, nnx.Param)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
