"""Measured alpha and beta per mesh axis: fit, apply to a topology, report the error.

File format (what a benchmark sweep writes; every part optional but one)::

    {
      "intra": {"alpha_s": 2.1e-05, "beta_s_per_byte": 3.0e-10, "group_size": 4},
      "inter": {"alpha_s": 9.0e-05, "beta_s_per_byte": 8.4e-09, "group_size": 2},
      "points": [
        {"axis": "inter", "bytes": 1048576, "time_s": 0.0091, "group_size": 2,
         "collective": "all-reduce"},
        ...
      ]
    }

``alpha_s`` is the latency per message and ``beta_s_per_byte`` the inverse bandwidth of one
link of that axis. ``points`` are measured times of one collective over one axis
(``collective``: 'all-reduce' (default), 'reduce-scatter', 'all-gather' or
'collective-permute'; ``group_size`` defaults to the axis entry's). An axis with points
but no alpha/beta gets them by least squares on the ring model
(all-reduce: ``2(p-1) alpha + 2(p-1)/p n beta``). ``intra`` calibrates level 0 of a
topology (inside a node), ``inter`` every network level.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxcomm.topology.io import load_json
from jaxcomm.topology.model import Topology

__all__ = [
    "AxisFit",
    "measure",
    "Calibration",
    "CalibrationError",
    "apply",
    "from_dict",
    "load",
    "predict_point",
    "prediction_errors",
]

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute")


class CalibrationError(ValueError):
    """A calibration file is malformed; the message names the field and the form."""


@dataclasses.dataclass(frozen=True)
class AxisFit:
    """alpha (s per message) and beta (s per byte) of one mesh axis; ``fitted`` says they
    came from a least-squares fit of the points rather than from the file."""

    alpha: float
    beta: float
    group_size: int | None = None
    fitted: bool = False


@dataclasses.dataclass(frozen=True)
class Calibration:
    axes: Mapping[str, AxisFit]
    points: tuple[Mapping[str, Any], ...] = ()


def _terms(collective: str, n: float, p: int) -> tuple[float, float]:
    """(count of alpha, bytes times beta) of a ring-schedule collective."""
    if collective == "all-reduce":
        return 2 * (p - 1), 2 * (p - 1) / p * n
    if collective in ("reduce-scatter", "all-gather"):
        return p - 1, (p - 1) / p * n
    return 1, n  # collective-permute


def predict_point(fit: AxisFit, point: Mapping[str, Any]) -> float:
    """Seconds the model gives for one measured point."""
    p = int(point.get("group_size") or fit.group_size or 0)
    a, b = _terms(point.get("collective", "all-reduce"), float(point["bytes"]), p)
    return a * fit.alpha + b * fit.beta


def _check_point(pt: Any, i: int, sizes: Mapping[str, int | None]) -> dict[str, Any]:
    where = f"points[{i}]"
    if not isinstance(pt, Mapping):
        raise CalibrationError(f"{where}: expected an object with axis, bytes, time_s.")
    for key, form in (("axis", "a mesh axis name"), ("bytes", "a number > 0"),
                      ("time_s", "a number > 0 (seconds)")):  # fmt: skip
        if key not in pt:
            raise CalibrationError(f"{where}.{key}: missing; expected {form}.")
    for key in ("bytes", "time_s"):
        v = pt[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise CalibrationError(f"{where}.{key}: expected a number > 0, got {v!r}.")
    coll = pt.get("collective", "all-reduce")
    if coll not in COLLECTIVES:
        raise CalibrationError(f"{where}.collective: expected one of {COLLECTIVES}, got {coll!r}.")
    p = pt.get("group_size", sizes.get(pt["axis"]))
    if coll != "collective-permute" and (not isinstance(p, int) or p < 2):
        raise CalibrationError(
            f"{where}.group_size: expected an int >= 2 (devices along {pt['axis']!r}), got "
            f"{p!r}; set it in the point or as {pt['axis']!r}.group_size."
        )
    return {**pt, "collective": coll, "group_size": p}


def _fit(points: list[dict[str, Any]]) -> tuple[float, float]:
    rows = [_terms(pt["collective"], float(pt["bytes"]), pt["group_size"] or 2) for pt in points]
    a = np.array(rows, float)
    t = np.array([pt["time_s"] for pt in points], float)
    # Relative least squares (divide each row by its time) so that small and large messages
    # weigh alike; alpha and beta are clipped at zero.
    coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    return max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)


def from_dict(d: Mapping[str, Any]) -> Calibration:
    """Validates and completes a calibration (fits the axes that only have points).

    Raises:
      CalibrationError: a malformed field, named in the message.
    """
    if not isinstance(d, Mapping):
        raise CalibrationError("calibration: expected a JSON object {axis: {...}, 'points': [...]}")
    axes_in = {k: v for k, v in d.items() if k != "points"}
    sizes: dict[str, int | None] = {}
    given: dict[str, AxisFit] = {}
    for name, entry in axes_in.items():
        if not isinstance(entry, Mapping):
            raise CalibrationError(
                f"{name}: expected an object with alpha_s, beta_s_per_byte, group_size."
            )
        sizes[name] = entry.get("group_size")
        if "alpha_s" in entry or "beta_s_per_byte" in entry:
            vals = []
            for key in ("alpha_s", "beta_s_per_byte"):
                v = entry.get(key)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise CalibrationError(f"{name}.{key}: expected a number >= 0, got {v!r}.")
                vals.append(float(v))
            given[name] = AxisFit(vals[0], vals[1], sizes[name])
    raw = d.get("points", [])
    if not isinstance(raw, list):
        raise CalibrationError("points: expected a list of {axis, bytes, time_s, ...} objects.")
    points = [_check_point(pt, i, sizes) for i, pt in enumerate(raw)]
    fits = dict(given)
    for axis in dict.fromkeys(pt["axis"] for pt in points):
        if axis not in fits:
            pts = [pt for pt in points if pt["axis"] == axis]
            if len({pt["bytes"] for pt in pts}) < 2:
                raise CalibrationError(
                    f"points for axis {axis!r}: need two message sizes or more to fit alpha "
                    f"and beta, or give {axis}.alpha_s and {axis}.beta_s_per_byte."
                )
            alpha, beta = _fit(pts)
            fits[axis] = AxisFit(alpha, beta, sizes.get(axis), fitted=True)
    if not fits:
        raise CalibrationError("calibration: no axis has alpha_s/beta_s_per_byte or points.")
    return Calibration(fits, tuple(points))


def load(path: str | os.PathLike) -> Calibration:
    return load_json(path, from_dict, CalibrationError, "calibration")


def apply(topology: Topology, calibration: Calibration) -> Topology:
    """``topology`` with ``intra`` figures on level 0 and ``inter`` on every network level.

    Latency becomes ``alpha`` and bandwidth ``1 / beta``; levels keep their sizes and
    oversubscription. Axes other than 'intra' and 'inter' are ignored.
    """
    levels = list(topology.levels)
    for name, sel in (("intra", range(0, 1)), ("inter", range(1, len(levels)))):
        fit = calibration.axes.get(name)
        if fit is None:
            continue
        for i in sel:
            bw = 1.0 / fit.beta if fit.beta > 0 else levels[i].bandwidth
            levels[i] = dataclasses.replace(levels[i], latency=fit.alpha, bandwidth=bw)
    return dataclasses.replace(topology, levels=tuple(levels), name=topology.name + "+calibrated")


def prediction_errors(calibration: Calibration) -> list[dict[str, Any]]:
    """For every measured point: the model's time and its relative error.

    Returns:
      Rows ``{axis, collective, group_size, bytes, measured_s, predicted_s, error}`` with
      ``error = predicted / measured - 1``, sorted by axis then size.
    """
    rows = []
    for pt in calibration.points:
        fit = calibration.axes[pt["axis"]]
        pred = predict_point(fit, pt)
        rows.append(
            {
                "axis": pt["axis"],
                "collective": pt["collective"],
                "group_size": pt["group_size"],
                "bytes": pt["bytes"],
                "measured_s": pt["time_s"],
                "predicted_s": pred,
                "error": pred / pt["time_s"] - 1.0,
            }
        )
    return sorted(rows, key=lambda r: (r["axis"], r["bytes"]))


def measure(
    mesh: Any,
    *,
    sizes: tuple[int, ...] = tuple(1 << k for k in range(12, 25, 3)),
    repeats: int = 5,
) -> dict[str, Any]:
    """Times ``psum`` of f32 buffers over each mesh axis and returns the file format above.

    Each point is the median of ``repeats`` runs after one warm-up, on the devices this
    process sees. A sweep with more sizes and collectives belongs to the benchmark tools;
    this is enough to fit alpha and beta per axis.

    Args:
      mesh: the ``('inter', 'intra')`` mesh (``jaxcomm.make_mesh``).
      sizes: bytes per device.
      repeats: timed runs per point.

    Returns:
      ``{axis: {"group_size": p}, ..., "points": [...]}`` (alpha/beta are fitted on load).
    """
    import time

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = tuple(mesh.axis_names)
    out: dict[str, Any] = {}
    points = []
    for axis in names:
        p = int(mesh.shape[axis])
        if p < 2:
            continue
        out[axis] = {"group_size": p}
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = jax.device_put(
                jnp.ones((mesh.devices.size, n), jnp.float32), NamedSharding(mesh, P(names))
            )
            f = jax.jit(
                jax.shard_map(
                    lambda v, a=axis: lax.psum(v, a), mesh=mesh, in_specs=P(names),
                    out_specs=P(names), check_vma=False,
                )
            )  # fmt: skip
            f(x).block_until_ready()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f(x).block_until_ready()
                times.append(time.perf_counter() - t0)
            points.append({"axis": axis, "bytes": n * 4, "time_s": float(np.median(times)),
                           "group_size": p, "collective": "all-reduce"})  # fmt: skip
    out["points"] = points
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxcomm.calibration --intra 4 --out cal.json``: measure and fit."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m jaxcomm.calibration", description=main.__doc__)
    ap.add_argument("--intra", type=int, default=None, help="devices per node (make_mesh)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True, help="calibration JSON to write")
    args = ap.parse_args(argv)
    from jaxcomm.mesh import make_mesh

    doc = measure(make_mesh(args.intra), repeats=args.repeats)
    fitted = from_dict(doc)
    for name, fit in fitted.axes.items():
        doc[name].update(alpha_s=fit.alpha, beta_s_per_byte=fit.beta)
        gbps = 1 / max(fit.beta, 1e-30) / 1e9
        print(f"{name}: alpha {fit.alpha * 1e6:.1f} us, 1/beta {gbps:.2f} GB/s")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    for r in prediction_errors(fitted):
        print(
            f"{r['axis']:<6} {r['bytes']:>10} B measured {r['measured_s'] * 1e3:8.3f} ms "
            f"model {r['predicted_s'] * 1e3:8.3f} ms error {r['error'] * 100:+6.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
