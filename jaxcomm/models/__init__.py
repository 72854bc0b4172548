"""Reference models whose gradient trees the benchmarks, the simulator and the experiments use."""

from jaxcomm.models.resnet import RESNET_CONFIGS, ResNet, gradient_shapes, resnet

__all__ = ["RESNET_CONFIGS", "ResNet", "gradient_shapes", "resnet"]
