import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcomm.models import gradient_shapes, initialize, resnet


@pytest.mark.parametrize(
    "name,count", [("resnet50", 25_557_032), ("resnet-tiny", 436_536), ("resnet-micro", 434_984)]
)
def test_resnet_parameter_counts(name, count):
    # ResNet-50: 25.56M parameters (torchvision); no arrays are allocated.
    shapes = gradient_shapes(name)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == count


def test_tiny_resnet_forward():
    # built by one compiled initializer, run by one compiled forward: op by op (the eager
    # initialisation and forward) takes 20 s of dispatch on 8 fake devices
    graphdef, state = initialize(lambda: nnx.split(resnet("resnet-tiny", 10)))
    out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.ones((2, 32, 32, 3)))
    assert out.shape == (2, 10) and out.dtype == jnp.float32


def test_initialize_gives_the_bits_of_the_default_compile():
    """The platform's initializer options (XLA:CPU: LLVM level 1) change the compile
    time, not the values: every initializer the models use, against the same program
    compiled with the defaults."""

    def create():
        rngs = nnx.Rngs(3)
        return (
            nnx.Conv(16, 32, (3, 3), rngs=rngs).kernel[...],  # lecun normal (truncated)
            nnx.Linear(64, 10, rngs=rngs).kernel[...],
            nnx.Embed(256, 32, rngs=rngs).embedding[...],  # variance scaling (normal)
            jax.nn.initializers.variance_scaling(2.0, "fan_out", "truncated_normal")(
                rngs.params(), (3, 3, 16, 32)
            ),
            jax.random.uniform(rngs.params(), (1000,)),
        )

    ours = initialize(create)
    default = jax.jit(create)()
    for a, b in zip(ours, default, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_unknown_resnet():
    with pytest.raises(ValueError, match="choose one of"):
        resnet("resnet9000")
