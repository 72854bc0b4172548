"""A Flax NNX language-model training script, as public NNX tutorials write one (not a
test module).

Its shape is that of the miniGPT tutorial of the JAX AI Stack, "Train a miniGPT language
model with JAX" (https://github.com/jax-ml/jax-ai-stack, docs/source/JAX_for_LLM_pretraining.md,
Apache License 2.0): a GPT of token and position embeddings, transformer blocks of
``nnx.MultiHeadAttention`` with a causal mask, ``nnx.LayerNorm`` and a feed-forward pair
of ``nnx.Linear``, and a linear head; ``nnx.Optimizer(model, optax.adam(1e-3))``; a
``loss_fn(model, batch)`` returning the loss and logits; an ``@nnx.jit``
``train_step(model, optimizer, metrics, batch)`` with ``nnx.value_and_grad(...,
has_aux=True)``, ``metrics.update`` and ``optimizer.update``; targets made by a
``jax.vmap`` shift; each batch put on the mesh with ``jax.device_put(..., NamedSharding(
mesh, P('batch', None)))`` on the tutorial's 8-way data-parallel mesh. Written anew here
for flax 0.12 (``optimizer.update(model, grads)``, ``wrt=nnx.Param``), smaller, and
without what the step does not depend on: the tensor-parallel annotations
(``nnx.with_partitioning`` over ``'model'``, of size 1 on that mesh), tiktoken, grain and
TinyStories (here: the bytes of Python standard-library modules, split into documents at
blank lines, a byte per token) and text generation.

``tests/nnx_lm_script_ported.py`` is this file ported to jaxcomm (hybrid-sharded);
``tests/test_nnx_lm_script.py`` counts the changed lines and runs both.
"""

import os
from dataclasses import dataclass

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

mesh = Mesh(mesh_utils.create_device_mesh((8, 1)), ("batch", "model"))


def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate)
        self.layer_norm1 = nnx.LayerNorm(num_features=embed_dim, epsilon=1e-6, rngs=rngs)
        self.linear1 = nnx.Linear(embed_dim, ff_dim, rngs=rngs)
        self.linear2 = nnx.Linear(ff_dim, embed_dim, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=rate)
        self.layer_norm2 = nnx.LayerNorm(num_features=embed_dim, epsilon=1e-6, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        mask = causal_attention_mask(inputs.shape[1])
        attention = self.mha(inputs_q=inputs, mask=mask, decode=False)
        attention = self.dropout1(attention, deterministic=not training)
        out1 = self.layer_norm1(inputs + attention)
        ffn = self.linear2(nnx.relu(self.linear1(out1)))
        ffn = self.dropout2(ffn, deterministic=not training)
        return self.layer_norm2(out1 + ffn)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        return self.token_emb(x) + self.pos_emb(positions)


class MiniGPT(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, num_heads, ff_dim, num_blocks, rngs):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.List(
            [TransformerBlock(embed_dim, num_heads, ff_dim, rngs=rngs) for _ in range(num_blocks)]
        )
        self.output_layer = nnx.Linear(embed_dim, vocab_size, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        x = self.embedding_layer(inputs)
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x, training=training)
        return self.output_layer(x)


# One transformer block, as the Keras miniGPT the tutorial follows; a byte vocabulary.
vocab_size, maxlen, embed_dim, num_heads, feed_forward_dim, num_blocks = 256, 32, 32, 2, 64, 1


@dataclass
class TextDataset:
    data: list
    maxlen: int

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx: int):
        encoding = list(self.data[idx])[: self.maxlen]  # a byte per token
        return encoding + [0] * (self.maxlen - len(encoding))  # pad to maxlen


def load_and_preprocess_data(batch_size, maxlen, modules=("functools", "textwrap")):
    text = b"".join(open(os.path.join(os.path.dirname(os.__file__), f"{m}.py"), "rb").read()
                    for m in modules)  # fmt: skip
    stories = [s for s in text.split(b"\n\n") if s.strip()]
    dataset = TextDataset(stories, maxlen)
    for i in range(0, len(dataset) - batch_size + 1, batch_size):  # drop the remainder
        yield np.array([dataset[j] for j in range(i, i + batch_size)], np.int32)


def loss_fn(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


@nnx.jit
def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch[1])
    optimizer.update(model, grads)


def train(num_steps=100, batch_size=64, log_every=10):
    """Trains the model; returns it and the logged train losses."""
    model = MiniGPT(maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_blocks,
                    rngs=nnx.Rngs(0))  # fmt: skip
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    prep_target_batch = jax.vmap(lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0]))))
    metrics_history = {"train_loss": []}
    for step, batch in enumerate(load_and_preprocess_data(batch_size, maxlen)):
        if step == num_steps:
            break
        input_batch = jnp.array(batch)
        target_batch = prep_target_batch(input_batch)
        batch = jax.device_put((input_batch, target_batch), NamedSharding(mesh, P("batch", None)))
        train_step(model, optimizer, metrics, batch)
        if (step + 1) % log_every == 0:
            for metric, value in metrics.compute().items():
                metrics_history[f"train_{metric}"].append(float(value))
            metrics.reset()
            print(f"Step {step + 1}, Loss: {metrics_history['train_loss'][-1]:.4f}")
    return model, metrics_history["train_loss"]


if __name__ == "__main__":
    train()
