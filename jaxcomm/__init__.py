"""jaxcomm: less communication and less waiting for data-parallel training on JAX/XLA."""

from jaxcomm import collectives, compression, hlo
from jaxcomm.collectives import allreduce, flat_allreduce, hierarchical_allreduce
from jaxcomm.mesh import DATA_AXES, make_mesh
from jaxcomm.state import PerDevice
from jaxcomm.sync import SyncGradientsState, sync_gradients
from jaxcomm.train import DataParallel, TrainState, data_parallel
from jaxcomm.wire import wire_bytes

__version__ = "0.1.0"

__all__ = [
    "DATA_AXES",
    "DataParallel",
    "PerDevice",
    "SyncGradientsState",
    "TrainState",
    "allreduce",
    "collectives",
    "compression",
    "data_parallel",
    "flat_allreduce",
    "hierarchical_allreduce",
    "hlo",
    "make_mesh",
    "sync_gradients",
    "wire_bytes",
]
