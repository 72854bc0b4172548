import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.models import gradient_shapes, resnet


@pytest.mark.parametrize("name,count", [("resnet50", 25_557_032), ("resnet-tiny", 436_536)])
def test_resnet_parameter_counts(name, count):
    # ResNet-50: 25.56M parameters (torchvision); no arrays are allocated.
    shapes = gradient_shapes(name)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == count


def test_tiny_resnet_forward():
    # build and run it in one compiled program: op by op (the eager initialisation and
    # forward) takes 20 s of dispatch on 8 fake devices
    out = jax.jit(lambda x: resnet("resnet-tiny", 10)(x))(jnp.ones((2, 32, 32, 3)))
    assert out.shape == (2, 10) and out.dtype == jnp.float32


def test_unknown_resnet():
    with pytest.raises(ValueError, match="choose one of"):
        resnet("resnet9000")
