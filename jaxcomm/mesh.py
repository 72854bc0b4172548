"""The 2D data-parallel device mesh ``('inter', 'intra')``, and optionally a model axis.

``intra`` groups devices that share a fast link (the GPUs of one node: NVLink); ``inter``
runs across groups (the nodes: InfiniBand or Ethernet). Every jaxcomm collective is written
against these two axis names. ``make_mesh(model=M)`` adds a third, innermost axis
``'model'`` (``AxisType.Auto``) for params a model shards itself (tensor parallelism,
through ``jax.sharding``): the step builders leave it to the compiler and handle only the
data axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxcomm.validate import check_int

INTER = "inter"
INTRA = "intra"
MODEL = "model"
DATA_AXES: tuple[str, str] = (INTER, INTRA)

__all__ = [
    "DATA_AXES",
    "INTER",
    "INTRA",
    "MODEL",
    "check_mesh_axes",
    "make_mesh",
    "valid_intra_sizes",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _process_runs(devices: Sequence[jax.Device]) -> list[int]:
    """Lengths of the runs of consecutive devices that belong to one process."""
    runs: list[int] = []
    last = None
    for d in devices:
        if runs and d.process_index == last:
            runs[-1] += 1
        else:
            runs.append(1)
        last = d.process_index
    return runs


def valid_intra_sizes(devices: Sequence[jax.Device]) -> list[int]:
    """The ``intra`` sizes for which no group spans two processes.

    Args:
      devices: the devices in mesh order.

    Returns:
      Sorted list of valid group sizes.
    """
    n = len(devices)
    out = []
    for g in _divisors(n):
        groups = [devices[i : i + g] for i in range(0, n, g)]
        if all(len({d.process_index for d in grp}) == 1 for grp in groups):
            out.append(g)
    return out


def _sorted_devices(devices: Sequence[jax.Device]) -> list[jax.Device]:
    # Group by process first so that intra groups are process-local, then keep the
    # runtime's order inside a process (never sort by ``device.id``: ids are not contiguous
    # across processes: 0, 1, 2048, 2049 were seen on two processes).
    order = {p: i for i, p in enumerate(dict.fromkeys(d.process_index for d in devices))}
    return sorted(devices, key=lambda d: order[d.process_index])


def make_mesh(
    intra: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    topology: Any | None = None,
    model: int = 1,
) -> Mesh:
    """Builds the ``('inter', 'intra')`` data-parallel mesh (``model > 1``: with a model
    axis, ``('inter', 'intra', 'model')``).

    Args:
      intra: devices per ``intra`` group. Default: the number of devices of one process
        (one node), so ``inter`` is the number of processes. On one process with fake CPU
        devices, pass it to split them, e.g. 8 devices and ``intra=4`` give a 2 x 4 mesh.
      devices: the devices to use, default ``jax.devices()``.
      topology: an optional ``jaxcomm.topology`` cluster description; when given, devices
        are ordered so that ring neighbours are close in the network (see
        ``jaxcomm.topology.order_devices``).
      model: devices per model group, innermost (the closest devices): with ``model > 1``
        the mesh gets a third axis ``'model'`` of type ``AxisType.Auto``, over which a
        model shards its params itself (``NamedSharding(mesh, P(None, 'model'))``, Flax's
        ``nnx.with_partitioning``); ``data_parallel`` handles only the data axes and
        leaves it to the compiler. ``intra`` then counts model groups per node: devices
        per node = ``intra * model``.

    Returns:
      A ``jax.sharding.Mesh`` with axes ``('inter', 'intra')`` and explicit axis types
      (and ``'model'``, automatic).

    Raises:
      ValueError: ``intra`` is below 1, does not divide the device count, or would make an
        ``intra`` group span two processes. The message lists the valid choices.

    Example:
      >>> mesh = jaxcomm.make_mesh(intra=4)   # 8 devices -> Mesh('inter': 2, 'intra': 4)
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("make_mesh got an empty device list; pass devices=jax.devices().")
    if topology is not None:
        from jaxcomm.topology import order_devices  # optional: the topology module

        devs = list(order_devices(topology, devs))
    else:
        devs = _sorted_devices(devs)
    n = len(devs)
    model = check_int("model", model, minimum=1, fix=f"a divisor of the {n} devices")
    if n % model:
        raise ValueError(
            f"make_mesh(model={model}) with {n} devices: model must divide the device count. "
            f"Valid choices: {[d for d in _divisors(n)]}."
        )
    valid = [g // model for g in valid_intra_sizes(devs) if g % model == 0]
    if intra is None:
        intra = _process_runs(devs)[0] // model
    intra = check_int("intra", intra, minimum=1, fix=f"valid choices with {n} devices: {valid}")
    if n % (intra * model) != 0:
        raise ValueError(
            f"make_mesh(intra={intra}, model={model}) with {n} devices: intra * model must "
            f"divide the device count. Valid choices of intra: {valid}."
        )
    if intra not in valid:
        raise ValueError(
            f"make_mesh(intra={intra}) with {n} devices over "
            f"{len(set(d.process_index for d in devs))} processes: an intra group would span "
            f"two processes (intra groups must be node-local). Valid choices: {valid}."
        )
    if model > 1:
        grid = np.array(devs, dtype=object).reshape(n // (intra * model), intra, model)
        types = (AxisType.Explicit, AxisType.Explicit, AxisType.Auto)
        return Mesh(grid, (*DATA_AXES, MODEL), axis_types=types)
    grid = np.array(devs, dtype=object).reshape(n // intra, intra)
    return Mesh(grid, DATA_AXES, axis_types=(AxisType.Explicit, AxisType.Explicit))


def check_mesh_axes(where: str, axes: tuple[str, ...], mesh: Mesh) -> None:
    """Raises if some of ``axes`` are not axes of ``mesh`` (``where`` names the caller)."""
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{where}(axes={axes}): axes {missing} are not in the mesh axes "
            f"{mesh.axis_names}. Build the mesh with jaxcomm.make_mesh()."
        )
