"""Reference models whose gradient trees the benchmarks, the simulator and the experiments use."""

from jaxcomm.models.gpt import (
    GPT,
    GPT_CONFIGS,
    GPTConfig,
    gpt,
    gpt_config,
    gpt_param_shapes,
    param_count,
)
from jaxcomm.models.init import initialize
from jaxcomm.models.resnet import RESNET_CONFIGS, ResNet, gradient_shapes, resnet

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_CONFIGS",
    "RESNET_CONFIGS",
    "ResNet",
    "gpt",
    "gpt_config",
    "gpt_param_shapes",
    "gradient_shapes",
    "initialize",
    "param_count",
    "resnet",
]
