"""ResNet v1.5 in Flax NNX (He et al., 2016; torchvision's stride-on-3x3 variant).

``resnet('resnet152')`` has 60.2M parameters, ``resnet('resnet50')`` 25.6M, as in the
literature; ``'resnet-tiny'`` is a 4-stage basic-block net for 32x32 inputs that trains on
CPU in seconds. ``'resnet-micro'`` is a 2-stage one with about the same gradient bytes
(1.2 MB) in half the leaves: the same data paths in about half the compile time, for tests
of the experiments' paths (same link-bound rows on the testbed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    blocks: tuple[int, ...]
    bottleneck: bool
    widths: tuple[int, ...] = (64, 128, 256, 512)
    small_stem: bool = False  # 3x3 stem without max-pool, for 32x32 images


RESNET_CONFIGS: dict[str, ResNetConfig] = {
    "resnet-tiny": ResNetConfig((1, 1, 1, 1), False, (16, 32, 64, 128), small_stem=True),
    "resnet-micro": ResNetConfig((1, 1), False, (64, 128), small_stem=True),
    "resnet18": ResNetConfig((2, 2, 2, 2), False),
    "resnet34": ResNetConfig((3, 4, 6, 3), False),
    "resnet50": ResNetConfig((3, 4, 6, 3), True),
    "resnet101": ResNetConfig((3, 4, 23, 3), True),
    "resnet152": ResNetConfig((3, 8, 36, 3), True),
}


class _Block(nnx.Module):
    def __init__(self, cin: int, width: int, stride: int, bottleneck: bool, *, dtype, rngs):
        conv = lambda i, o, k, s=1: nnx.Conv(  # noqa: E731
            i, o, (k, k), strides=s, padding=k // 2, use_bias=False, dtype=dtype, rngs=rngs
        )
        bn = lambda c, zero=False: nnx.BatchNorm(  # noqa: E731
            c,
            momentum=0.9,
            dtype=dtype,
            scale_init=nnx.initializers.zeros if zero else nnx.initializers.ones,
            rngs=rngs,
        )
        cout = width * 4 if bottleneck else width
        if bottleneck:
            self.convs = nnx.List([conv(cin, width, 1), conv(width, width, 3, stride),
                                   conv(width, cout, 1)])  # fmt: skip
            self.norms = nnx.List([bn(width), bn(width), bn(cout, zero=True)])
        else:
            self.convs = nnx.List([conv(cin, width, 3, stride), conv(width, cout, 3)])
            self.norms = nnx.List([bn(width), bn(cout, zero=True)])
        self.proj = conv(cin, cout, 1, stride) if (stride != 1 or cin != cout) else None
        self.proj_norm = bn(cout) if self.proj is not None else None

    def __call__(self, x):
        y = x
        for i, (c, n) in enumerate(zip(self.convs, self.norms, strict=True)):
            y = n(c(y))
            if i < len(self.convs) - 1:
                y = nnx.relu(y)
        if self.proj is not None:
            x = self.proj_norm(self.proj(x))
        return nnx.relu(x + y)


class ResNet(nnx.Module):
    """ResNet classifier over NHWC images.

    Args:
      config: a :class:`ResNetConfig` (see ``RESNET_CONFIGS``).
      num_classes: output classes.
      dtype: compute dtype (``jnp.bfloat16`` for mixed precision; params stay float32).
      rngs: ``nnx.Rngs``.
    """

    def __init__(self, config: ResNetConfig, num_classes: int = 1000, *, dtype=None, rngs):
        w0 = config.widths[0]
        k, s = (3, 1) if config.small_stem else (7, 2)
        self.small_stem = config.small_stem
        self.stem = nnx.Conv(3, w0, (k, k), strides=s, padding=k // 2, use_bias=False,
                             dtype=dtype, rngs=rngs)  # fmt: skip
        self.stem_norm = nnx.BatchNorm(w0, momentum=0.9, dtype=dtype, rngs=rngs)
        blocks, cin = [], w0
        for stage, (n, width) in enumerate(zip(config.blocks, config.widths, strict=True)):
            for b in range(n):
                stride = 2 if (b == 0 and stage > 0) else 1
                blocks.append(_Block(cin, width, stride, config.bottleneck, dtype=dtype, rngs=rngs))
                cin = width * 4 if config.bottleneck else width
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_norm(self.stem(x)))
        if not self.small_stem:
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


def resnet(
    name: str = "resnet152", num_classes: int = 1000, *, dtype=None, seed: int = 0
) -> ResNet:
    """Builds a ResNet by name (a key of ``RESNET_CONFIGS``)."""
    if name not in RESNET_CONFIGS:
        raise ValueError(
            f"resnet name {name!r} is not known; choose one of {sorted(RESNET_CONFIGS)}."
        )
    return ResNet(RESNET_CONFIGS[name], num_classes, dtype=dtype, rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=8)
def gradient_shapes(name: str = "resnet152", num_classes: int = 1000) -> Any:
    """The gradient (= parameter) tree of a ResNet as ``jax.ShapeDtypeStruct``s, without
    allocating it (``nnx.eval_shape``)."""
    abstract = nnx.eval_shape(lambda: resnet(name, num_classes))
    params = nnx.state(abstract, nnx.Param)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
