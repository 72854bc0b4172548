"""jaxcomm: less communication and less waiting for data-parallel training on JAX/XLA."""

from jaxcomm import (
    axis_names,
    buckets,
    checkpoint,
    collectives,
    compression,
    cost,
    deprecated,
    diloco,
    distributed,
    dynamic_scale,
    elastic,
    gathering,
    hlo,
    host_memory,
    ordering,
    outputs,
    sharded,
    tools,
    topology,
    xla,
)
from jaxcomm.checkpoint import Checkpointer
from jaxcomm.collectives import allreduce, flat_allreduce, hierarchical_allreduce
from jaxcomm.diloco import LocalSGDState, local_sgd
from jaxcomm.distributed import init_distributed
from jaxcomm.gathering import gather_params, gathered_layers
from jaxcomm.lift import lift_opt_state
from jaxcomm.mesh import DATA_AXES, make_mesh
from jaxcomm.nnx import (
    LinenDataParallel,
    NnxDataParallel,
    linen_data_parallel,
    nnx_data_parallel,
    replicated_params,
)
from jaxcomm.pmap import PmapDataParallel, pmap_data_parallel
from jaxcomm.replicas import ReplicaDivergenceError, check_replicas
from jaxcomm.sharded import ShardedState
from jaxcomm.state import PerDevice
from jaxcomm.sync import (
    GradientSync,
    HostPhase,
    SyncGradientsState,
    SyncRequest,
    gradient_sync,
    sync_gradients,
)
from jaxcomm.tools.profiler import CommProfiler
from jaxcomm.tools.wire import wire_bytes
from jaxcomm.train import DataParallel, TrainState, data_parallel

#: The release: the minor number changes with the public API (a name added, moved or
#: removed), the patch number otherwise; CHANGELOG.md lists each release's changes.
__version__ = "0.2.0"


def __getattr__(name: str):
    """The names moved in 0.2.0 (``jaxcomm.testbed``, ``jaxcomm.ShardedDataParallel``, ...):
    the new object, with a ``DeprecationWarning`` naming it (``jaxcomm.deprecated``)."""
    return deprecated.moved_attribute(name)


__all__ = [
    "Checkpointer",
    "CommProfiler",
    "DATA_AXES",
    "DataParallel",
    "GradientSync",
    "LocalSGDState",
    "HostPhase",
    "LinenDataParallel",
    "NnxDataParallel",
    "PerDevice",
    "PmapDataParallel",
    "ReplicaDivergenceError",
    "ShardedState",
    "SyncGradientsState",
    "SyncRequest",
    "TrainState",
    "allreduce",
    "axis_names",
    "buckets",
    "check_replicas",
    "checkpoint",
    "collectives",
    "compression",
    "cost",
    "data_parallel",
    "deprecated",
    "diloco",
    "distributed",
    "dynamic_scale",
    "elastic",
    "flat_allreduce",
    "gather_params",
    "gathered_layers",
    "gathering",
    "gradient_sync",
    "hierarchical_allreduce",
    "hlo",
    "host_memory",
    "init_distributed",
    "lift_opt_state",
    "linen_data_parallel",
    "local_sgd",
    "make_mesh",
    "nnx_data_parallel",
    "ordering",
    "outputs",
    "pmap_data_parallel",
    "replicated_params",
    "sharded",
    "sync_gradients",
    "tools",
    "topology",
    "wire_bytes",
    "xla",
]
