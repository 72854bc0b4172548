"""Reading a topology: JSON files and detection from the running job.

File format (units in the key names; ``placement`` and ``gamma_s_per_byte`` optional)::

    {
      "name": "my-cluster",
      "gamma_s_per_byte": 1e-12,
      "levels": [
        {"name": "node", "size": 8,  "bandwidth_GBps": 370, "latency_us": 3},
        {"name": "leaf", "size": 32, "bandwidth_GBps": 48,  "latency_us": 6},
        {"name": "spine", "size": 4, "bandwidth_GBps": 48,  "latency_us": 7,
         "oversubscription": 2}
      ],
      "placement": [0, 1, 2, ...]
    }

or a preset with its arguments: ``{"preset": "dgx_h100", "nodes": 64}``.

``detect()`` reads the file named by ``JAXCOMM_TOPO_FILE`` when set (like NCCL's
``NCCL_TOPO_FILE``); otherwise it builds a topology from ``jax.devices()``: one node per
process (per slice and process on multi-slice TPU), with link figures by platform.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcomm.topology.model import PRESETS, Level, Topology, dgx_h100
from jaxcomm.validate import check_int

__all__ = ["ENV_VAR", "TopologyFileError", "detect", "from_dict", "load", "save", "to_dict"]

ENV_VAR = "JAXCOMM_TOPO_FILE"

_LEVEL_FIELDS = {
    "name": "a string such as 'node' or 'leaf'",
    "size": "an integer >= 1 (children per group of this level)",
    "bandwidth_GBps": "a number > 0 (GB/s per device, 1 GB = 1e9 bytes)",
    "latency_us": "a number >= 0 (microseconds per message)",
    "oversubscription": "a number >= 1 (down:up ratio; optional, default 1)",
}


class TopologyFileError(ValueError):
    """A topology description is malformed; the message names the field and the form."""


def _num(value: Any, field: str, form: str, *, minimum: float, strict: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        raise TopologyFileError(f"{field}: expected {form}, got {value!r}.")
    return float(value)


def _level(d: Any, i: int) -> Level:
    where = f"levels[{i}]"
    if not isinstance(d, Mapping):
        raise TopologyFileError(f"{where}: expected an object with keys {sorted(_LEVEL_FIELDS)}.")
    unknown = set(d) - set(_LEVEL_FIELDS)
    if unknown:
        raise TopologyFileError(
            f"{where}: unknown key(s) {sorted(unknown)}; "
            f"expected keys among {sorted(_LEVEL_FIELDS)}."
        )
    for key in ("name", "size", "bandwidth_GBps", "latency_us"):
        if key not in d:
            raise TopologyFileError(f"{where}.{key}: missing; expected {_LEVEL_FIELDS[key]}.")
    if not isinstance(d["name"], str) or not d["name"]:
        raise TopologyFileError(
            f"{where}.name: expected {_LEVEL_FIELDS['name']}, got {d['name']!r}."
        )
    fix = "children per group of this level"
    size = check_int(f"{where}.size", d["size"], minimum=1, fix=fix, error=TopologyFileError)
    bw = _num(d["bandwidth_GBps"], f"{where}.bandwidth_GBps", _LEVEL_FIELDS["bandwidth_GBps"],
              minimum=0, strict=True)  # fmt: skip
    lat = _num(d["latency_us"], f"{where}.latency_us", _LEVEL_FIELDS["latency_us"],
               minimum=0, strict=False)  # fmt: skip
    over = _num(d.get("oversubscription", 1), f"{where}.oversubscription",
                _LEVEL_FIELDS["oversubscription"], minimum=1, strict=False)  # fmt: skip
    return Level(d["name"], size, bw * 1e9, lat * 1e-6, over)


def from_dict(d: Mapping[str, Any]) -> Topology:
    """Builds a :class:`Topology` from the JSON form (see the module docstring).

    Raises:
      TopologyFileError: a field is missing or malformed; the message names it, e.g.
        ``levels[1].bandwidth_GBps: expected a number > 0 ...``.
    """
    if not isinstance(d, Mapping):
        raise TopologyFileError("topology: expected a JSON object with a 'levels' list.")
    if "preset" in d:
        name = d["preset"]
        if name not in PRESETS:
            raise TopologyFileError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}.")
        args = {k: v for k, v in d.items() if k != "preset"}
        try:
            return PRESETS[name](**args)
        except (TypeError, ValueError) as e:
            raise TopologyFileError(f"preset {name!r} arguments {args}: {e}") from e
    allowed = {"name", "levels", "gamma_s_per_byte", "placement"}
    unknown = set(d) - allowed
    if unknown:
        raise TopologyFileError(
            f"unknown key(s) {sorted(unknown)}; expected keys among {sorted(allowed)}."
        )
    levels = d.get("levels")
    if not isinstance(levels, Sequence) or isinstance(levels, str) or not levels:
        raise TopologyFileError(
            "levels: expected a non-empty list of levels, innermost (the node) first, each "
            f"with keys {sorted(_LEVEL_FIELDS)}; got {levels!r}."
        )
    lv = tuple(_level(x, i) for i, x in enumerate(levels))
    gamma = _num(d.get("gamma_s_per_byte", 0.0), "gamma_s_per_byte", "a number >= 0 (s/byte)",
                 minimum=0, strict=False)  # fmt: skip
    placement = d.get("placement")
    if placement is not None:
        if not isinstance(placement, Sequence) or isinstance(placement, str):
            raise TopologyFileError(
                "placement: expected a list of ints, the physical slot of each node."
            )
        fix = "placement lists the physical slot of each node"
        for i, v in enumerate(placement):
            check_int(f"placement[{i}]", v, minimum=0, fix=fix, error=TopologyFileError)
    try:
        return Topology(lv, gamma=gamma, placement=placement, name=str(d.get("name", "custom")))
    except ValueError as e:
        raise TopologyFileError(str(e)) from e


def to_dict(topology: Topology) -> dict[str, Any]:
    """The JSON form of ``topology`` (inverse of :func:`from_dict`)."""
    out: dict[str, Any] = {
        "name": topology.name,
        "gamma_s_per_byte": topology.gamma,
        "levels": [
            {
                "name": lv.name,
                "size": int(lv.size),
                "bandwidth_GBps": lv.bandwidth / 1e9,
                "latency_us": lv.latency * 1e6,
                "oversubscription": lv.oversubscription,
            }
            for lv in topology.levels
        ],
    }
    if topology.placement is not None:
        out["placement"] = list(topology.placement)
    return out


def load(path: str | os.PathLike) -> Topology:
    """Reads a topology JSON file.

    Raises:
      TopologyFileError: unreadable JSON or a malformed field (the message names the file
        and the field).
    """
    return load_json(path, from_dict, TopologyFileError, "topology")


def load_json(path: str | os.PathLike, parse, error: type[Exception], what: str):
    """Reads JSON from ``path`` and returns ``parse(data)``; every failure becomes ``error``
    with the path in front (unreadable file, invalid JSON, a field ``parse`` rejects)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e}).") from e
    except OSError as e:
        raise error(f"{path}: cannot read the {what} file ({e}).") from e
    try:
        return parse(data)
    except error as e:
        raise error(f"{path}: {e}") from e


def save(topology: Topology, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(topology), f, indent=2)


# Per-platform link figures for detection (no network probing: measured values belong in a
# file or in a calibration, see jaxcomm.tools.simulate --calibration).
_PLATFORM = {
    # gpu: DGX-H100 + NDR 400G figures.
    "cpu": ((5e9, 20e-6), (1.25e9, 50e-6), 1.0 / 5e9),
    "tpu": ((45e9, 5e-6), (12.5e9, 20e-6), 1.0 / 4e11),  # ICI inside a slice, DCN across
}


def detect(devices: Sequence[Any] | None = None, *, env: Mapping[str, str] | None = None):
    """The topology of the running job.

    1. If ``JAXCOMM_TOPO_FILE`` is set, load that file (it wins, like ``NCCL_TOPO_FILE``).
    2. Otherwise one node per process (per (slice, process) on multi-slice TPU) with the
       devices of a process as its node, all nodes under one switch (slices as a level on
       TPU), with link figures by platform: GPU as DGX-H100/NDR-400G, CPU as 10 Gb/s
       Ethernet. These are defaults, not measurements.

    Args:
      devices: default ``jax.devices()``.
      env: default ``os.environ``.

    Returns:
      A :class:`Topology` whose ``num_devices`` equals ``len(devices)``.
    """
    env = os.environ if env is None else env
    path = env.get(ENV_VAR)
    if path:
        try:
            return load(path)
        except TopologyFileError as e:
            raise TopologyFileError(f"{ENV_VAR}: {e}") from e
    if devices is None:
        import jax

        devices = jax.devices()
    devices = list(devices)
    nodes = list(
        dict.fromkeys(
            (getattr(d, "slice_index", 0) or 0, getattr(d, "process_index", 0)) for d in devices
        )
    )
    n_nodes = len(nodes)
    g = len(devices) // max(n_nodes, 1)
    platform = getattr(devices[0], "platform", "cpu") if devices else "cpu"
    if platform == "gpu":
        base = dgx_h100(1)
        intra, inter = base.levels[0], base.levels[1]
        levels = [
            Level("node", g, intra.bandwidth, intra.latency),
            Level("leaf", n_nodes, inter.bandwidth, inter.latency),
        ]
        gamma = base.gamma
    else:
        (bw0, lat0), (bw1, lat1), gamma = _PLATFORM.get(platform, _PLATFORM["cpu"])
        slices = len({s for s, _ in nodes})
        levels = [Level("node", g, bw0, lat0)]
        if slices > 1:
            levels += [
                Level("host", n_nodes // slices, bw0, lat0),
                Level("slice", slices, bw1, lat1),
            ]
        else:
            levels.append(Level("leaf", n_nodes, bw1, lat1))
    return Topology(tuple(levels), gamma=gamma, name=f"detected({platform},{n_nodes}x{g})")
