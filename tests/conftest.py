"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture(scope="session")
def mesh():
    """The 2 x 4 ('inter', 'intra') mesh over the 8 fake devices."""
    import jaxcomm

    return jaxcomm.make_mesh(intra=4)
