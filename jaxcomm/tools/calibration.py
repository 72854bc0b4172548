"""Measured alpha and beta per mesh axis, cost per collective call, codec cost: fit, apply
to a topology, report the error.

File format (what ``python -m jaxcomm.tools.calibration`` and ``python -m experiments.bench
compression --calibration`` write; every part optional but one)::

    {
      "intra": {"alpha_s": 2.1e-05, "beta_s_per_byte": 3.0e-10, "group_size": 4},
      "inter": {"alpha_s": 9.0e-05, "beta_s_per_byte": 8.4e-09, "group_size": 2},
      "points": [
        {"axis": "inter", "bytes": 1048576, "time_s": 0.0091, "group_size": 2,
         "collective": "all-reduce"},
        ...
      ],
      "calls": [
        {"axis": "intra", "bytes": 8, "time_s": 0.0038, "group_size": 2,
         "collective": "all-gather"},
        ...
      ],
      "call_s": {"all-gather": 0.0035},
      "codec": {"int8": {"encode_s_per_byte": 2.1e-09, "decode_s_per_byte": 3.0e-10}},
      "meta": {"machine": "...", "command": "..."}
    }

``alpha_s`` is the latency per message and ``beta_s_per_byte`` the inverse bandwidth of one
link of that axis as one device sees it while every device sends (how :func:`measure` runs
it). ``points`` are measured times of one collective over one axis (``collective``:
'all-reduce' (default), 'reduce-scatter', 'all-gather', 'all-to-all' or
'collective-permute'; ``group_size`` defaults to the axis entry's). An axis with points
but no alpha/beta gets them by least squares (on the times, so that the large messages
decide beta) on the ring model (all-reduce: ``2(p-1) alpha + 2(p-1)/p n beta``). ``intra``
calibrates level 0 of a
topology (inside a node), ``inter`` every network level.

``calls`` are near-empty collectives (a few bytes) of each kind, as ``jaxcomm`` issues
them; the fixed cost of a call of that kind (``call_s``, seconds) is what such a call takes
beyond the fitted model of its axis (clipped at 0; the median over axes). ``call_s`` may
also be given directly, as one number (every kind) or by kind (``jaxcomm.cost.CALL_KINDS``).
``codec`` holds encode/decode seconds per f32 byte by kernel (``jaxcomm.cost.CODEC_KERNELS``,
each a ``jaxcomm.cost.Codec``). ``meta`` is free-form (machine, load, command).

Example:
  >>> c = load('docs/results/calibration_testbed_250mbit.json')
  >>> topo = apply(my_topology, c)
  >>> c.call_s, sorted(c.codec)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxcomm.cost import CALL_KINDS, CODEC_KERNELS, Codec
from jaxcomm.topology.io import load_json
from jaxcomm.topology.model import Topology

__all__ = [
    "COLLECTIVES",
    "AxisFit",
    "Calibration",
    "CalibrationError",
    "apply",
    "call_costs",
    "from_dict",
    "load",
    "measure",
    "predict_point",
    "prediction_errors",
]

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# Keys of a calibration file that are not mesh axes.
_RESERVED = ("points", "calls", "call_s", "codec", "meta")


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
    """A validated calibration (build with :func:`from_dict` or :func:`load`).

    Attributes:
      axes: mesh axis -> :class:`AxisFit`.
      points: the measured points, completed (``collective``, ``group_size``).
      calls: the near-empty call measurements, completed alike.
      call_s: collective kind -> fixed seconds per call (given, or derived from ``calls``).
      codec: kernel -> ``jaxcomm.cost.Codec``.
      meta: free-form information from the file.
    """

    axes: Mapping[str, AxisFit]
    points: tuple[Mapping[str, Any], ...] = ()
    calls: tuple[Mapping[str, Any], ...] = ()
    call_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    codec: Mapping[str, Codec] = dataclasses.field(default_factory=dict)
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _terms(collective: str, n: float, p: int) -> tuple[float, float]:
    """(count of alpha, bytes times beta) of a ring-schedule collective."""
    if collective == "all-reduce":
        return 2 * (p - 1), 2 * (p - 1) / p * n
    if collective in ("reduce-scatter", "all-gather", "all-to-all"):
        return p - 1, (p - 1) / p * n
    return 1, n  # collective-permute


def predict_point(fit: AxisFit, point: Mapping[str, Any]) -> float:
    """Seconds the model gives for one measured point."""
    p = int(point.get("group_size") or fit.group_size or 0)
    a, b = _terms(point.get("collective", "all-reduce"), float(point["bytes"]), p)
    return a * fit.alpha + b * fit.beta


def _check_point(
    pt: Any, i: int, sizes: Mapping[str, int | None], field: str = "points"
) -> dict[str, Any]:
    where = f"{field}[{i}]"
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
    # Least squares on the times themselves: the large messages, which carry the bandwidth
    # term of every gradient-sized call, decide beta (a fit of relative errors let
    # millisecond jitter of the smallest calls pull beta 10-13 % off at 16 MiB on the
    # emulated link); the fixed cost of near-empty calls is what ``calls`` measures.
    coef, *_ = np.linalg.lstsq(a, t, rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0:  # through the origin: bandwidth only
        alpha, beta = 0.0, float(a[:, 1] @ t / (a[:, 1] @ a[:, 1]))
    if beta < 0:  # flat in size: latency only
        alpha, beta = float(a[:, 0] @ t / (a[:, 0] @ a[:, 0])), 0.0
    return max(alpha, 0.0), max(beta, 0.0)


def _number(v: Any, where: str, form: str = "a number >= 0") -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
        raise CalibrationError(f"{where}: expected {form}, got {v!r}.")
    return float(v)


def _check_call_s(v: Any) -> dict[str, float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {k: _number(v, "call_s", "a number >= 0 (seconds per call)") for k in CALL_KINDS}
    if not isinstance(v, Mapping):
        raise CalibrationError(
            f"call_s: expected a number (seconds per call) or an object by kind "
            f"{list(CALL_KINDS)}, got {v!r}."
        )
    out = {}
    for k, x in v.items():
        if k not in CALL_KINDS:
            raise CalibrationError(f"call_s.{k}: unknown kind; expected one of {list(CALL_KINDS)}.")
        out[k] = _number(x, f"call_s.{k}", "a number >= 0 (seconds per call)")
    return out


def _check_codec(v: Any) -> dict[str, Codec]:
    if not isinstance(v, Mapping):
        raise CalibrationError(
            "codec: expected an object {kernel: {encode_s_per_byte, decode_s_per_byte}}."
        )
    out = {}
    for k, e in v.items():
        if k not in CODEC_KERNELS:
            raise CalibrationError(
                f"codec.{k}: unknown kernel; expected one of {list(CODEC_KERNELS)}."
            )
        if not isinstance(e, Mapping):
            raise CalibrationError(
                f"codec.{k}: expected an object with encode_s_per_byte, decode_s_per_byte."
            )
        enc, dec = (
            _number(e.get(f), f"codec.{k}.{f}", "a number >= 0 (seconds per f32 byte)")
            for f in ("encode_s_per_byte", "decode_s_per_byte")
        )
        out[k] = Codec(enc, dec, str(e.get("source", "")))
    return out


def call_costs(calls: list[Mapping[str, Any]], fits: Mapping[str, AxisFit]) -> dict[str, float]:
    """Fixed seconds per call by kind: each near-empty call's time beyond its axis's fitted
    model (clipped at 0), the median over the axes measured for that kind.

    Args:
      calls: completed call points (``axis``, ``collective``, ``bytes``, ``time_s``).
      fits: the axis fits.

    Returns:
      ``{kind: seconds}`` for the kinds measured.
    """
    extra: dict[str, list[float]] = {}
    for pt in calls:
        fit = fits.get(pt["axis"])
        model = predict_point(fit, pt) if fit is not None else 0.0
        extra.setdefault(pt["collective"], []).append(max(pt["time_s"] - model, 0.0))
    return {k: float(np.median(v)) for k, v in extra.items()}


def from_dict(d: Mapping[str, Any]) -> Calibration:
    """Validates and completes a calibration (fits the axes that only have points; derives
    ``call_s`` from ``calls`` where it is not given).

    Raises:
      CalibrationError: a malformed field, named in the message.
    """
    if not isinstance(d, Mapping):
        raise CalibrationError("calibration: expected a JSON object {axis: {...}, 'points': [...]}")
    axes_in = {k: v for k, v in d.items() if k not in _RESERVED}
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
    raw_calls = d.get("calls", [])
    if not isinstance(raw_calls, list):
        raise CalibrationError(
            "calls: expected a list of {axis, bytes, time_s, collective} objects."
        )
    calls = [_check_point(pt, i, sizes, "calls") for i, pt in enumerate(raw_calls)]
    call_s = call_costs(calls, fits)
    if "call_s" in d:
        call_s.update(_check_call_s(d["call_s"]))
    codec = _check_codec(d["codec"]) if "codec" in d else {}
    meta = d.get("meta", {})
    if not isinstance(meta, Mapping):
        raise CalibrationError(f"meta: expected an object (free-form), got {meta!r}.")
    if not fits and not call_s and not codec:
        raise CalibrationError(
            "calibration: no axis has alpha_s/beta_s_per_byte or points, and there is no "
            "call_s, calls or codec."
        )
    return Calibration(fits, tuple(points), tuple(calls), call_s, codec, dict(meta))


def load(path: str | os.PathLike) -> Calibration:
    """Reads and validates a calibration file (:func:`from_dict`).

    Args:
      path: the JSON file.

    Returns:
      A :class:`Calibration`.

    Raises:
      CalibrationError: unreadable or malformed, with the file and field named.
    """
    return load_json(path, from_dict, CalibrationError, "calibration")


def apply(topology: Topology, calibration: Calibration) -> Topology:
    """``topology`` with ``intra`` figures on level 0 and ``inter`` on every network level.

    Latency becomes ``alpha``. Level 0's bandwidth becomes ``1 / beta``. ``inter``'s beta
    is what one device sees while every device of its node sends (how :func:`measure`
    runs it), so a node whose devices share their links (level-1 oversubscription ``s``,
    e.g. 8 GPUs on one NIC: ``s = 8``) has an uplink of ``g / beta`` and each network
    level gets bandwidth ``s / beta`` (one flow's ceiling, as the presets define it);
    levels keep their sizes and oversubscription. Axes other than 'intra' and 'inter'
    are ignored.

    Args:
      topology: the cluster.
      calibration: the fits.

    Returns:
      The calibrated topology (name suffixed '+calibrated').

    Example:
      >>> topo = apply(fat_tree(2, 2, None, devices_per_node=2), load('cal.json'))
    """
    levels = list(topology.levels)
    share = levels[1].oversubscription if len(levels) > 1 else 1.0
    for name, sel, scale in (("intra", range(0, 1), 1.0), ("inter", range(1, len(levels)), share)):
        fit = calibration.axes.get(name)
        if fit is None:
            continue
        for i in sel:
            bw = scale / fit.beta if fit.beta > 0 else levels[i].bandwidth
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


# The collectives jaxcomm issues on each axis ('inter': across nodes; 'intra': inside one),
# whose cost per call :func:`measure` times: the hierarchical stages (reduce-scatter and
# all-gather inside the node, all-reduce across), the quantized exchange (all-to-all
# across), the ring algorithms' collective-permute.
_CALL_KINDS_BY_AXIS = {
    "inter": ("all-reduce", "all-to-all", "all-gather", "collective-permute"),
    "intra": ("all-reduce", "reduce-scatter", "all-gather", "collective-permute"),
}


def _collective(kind: str, axis: str, p: int):
    """The per-device function of one collective of ``kind`` over ``axis`` (a row of
    ``(1, n)``), as ``jaxcomm`` issues it."""
    from jax import lax

    from jaxcomm.collectives.base import reduce_scatter
    from jaxcomm.collectives.hierarchical import all_gather_invariant
    from jaxcomm.compression.base import all_to_all_rows

    if kind == "all-reduce":
        return lambda v: lax.psum(v, axis)
    if kind == "reduce-scatter":
        return lambda v: reduce_scatter(v[0], axis)[None]
    if kind == "all-gather":
        return lambda v: all_gather_invariant(v[0], axis)[None, : v.shape[1]]
    if kind == "all-to-all":
        return lambda v: all_to_all_rows(v[0].reshape(p, -1), (axis,)).reshape(1, -1)
    perm = [(i, (i + 1) % p) for i in range(p)]
    return lambda v: lax.ppermute(v, axis, perm)


def measure(
    mesh: Any,
    *,
    sizes: tuple[int, ...] = tuple(1 << k for k in range(12, 25, 3)),
    repeats: int = 5,
    calls: bool = True,
    statistic: str = "median",
) -> dict[str, Any]:
    """Times ``psum`` of f32 buffers over each mesh axis, and one near-empty call of every
    collective kind ``jaxcomm`` issues on it, and returns the file format above.

    Each point is the median (or the best) of ``repeats`` runs after one warm-up, on the
    devices this process sees (all processes of a ``jax.distributed`` job take part). A
    sweep with more
    sizes and collectives belongs to the benchmark tools; this is enough to fit alpha and
    beta per axis and the fixed cost per call.

    Args:
      mesh: the ``('inter', 'intra')`` mesh (``jaxcomm.make_mesh``).
      sizes: bytes per device.
      repeats: timed runs per point.
      calls: also time a call of ``p`` f32 values per device of every kind in
        ``_CALL_KINDS_BY_AXIS`` (the ``calls`` entries).
      statistic: 'median' or 'best' of the runs ('best': as little of a shared machine's
        other load as the runs caught).

    Returns:
      ``{axis: {"group_size": p}, ..., "points": [...], "calls": [...]}`` (alpha/beta and
      ``call_s`` are derived on load).

    Example:
      >>> doc = measure(jaxcomm.make_mesh(intra=2), repeats=3)
    """
    import time

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if statistic not in ("median", "best"):
        raise ValueError(f"statistic={statistic!r} is not known; choose 'median' or 'best'.")
    pick = np.min if statistic == "best" else np.median
    names = tuple(mesh.axis_names)
    sharding = NamedSharding(mesh, P(names))

    def time_it(fn, n: int) -> float:
        local = np.ones((jax.local_device_count(), n), np.float32)
        x = jax.make_array_from_process_local_data(sharding, local)
        f = jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=P(names), out_specs=P(names), check_vma=False)
        )
        f(x).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        return float(pick(times))

    out: dict[str, Any] = {}
    points, call_points = [], []
    for axis in names:
        p = int(mesh.shape[axis])
        if p < 2:
            continue
        out[axis] = {"group_size": p}
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            t = time_it(_collective("all-reduce", axis, p), n)
            points.append({"axis": axis, "bytes": n * 4, "time_s": t, "group_size": p,
                           "collective": "all-reduce"})  # fmt: skip
        if calls:
            for kind in _CALL_KINDS_BY_AXIS.get(axis, ("all-reduce",)):
                t = time_it(_collective(kind, axis, p), p)
                call_points.append({"axis": axis, "bytes": 4 * p, "time_s": t, "group_size": p,
                                    "collective": kind})  # fmt: skip
    out["points"] = points
    if calls:
        out["calls"] = call_points
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxcomm.tools.calibration --intra 4 --out cal.json``: measure and fit.

    Under ``python -m jaxcomm.tools.launch`` or ``python -m jaxcomm.tools.testbed`` every
    process takes part (``jaxcomm.init_distributed``) and process 0 writes the file.
    """
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m jaxcomm.tools.calibration", description=main.__doc__
    )
    ap.add_argument("--intra", type=int, default=None, help="devices per node (make_mesh)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-calls", action="store_true", help="skip the per-call cost points")
    ap.add_argument("--statistic", default="median", choices=("median", "best"),
                    help="per point: the median (default) or the best of the repeats")  # fmt: skip
    ap.add_argument("--out", required=True, help="calibration JSON to write")
    args = ap.parse_args(argv)
    from jaxcomm.distributed import launcher_env

    if launcher_env() is not None:
        from jaxcomm.distributed import init_distributed

        init_distributed(collective_timeout_s=300)
    import platform

    import jax

    from jaxcomm.mesh import make_mesh

    doc = measure(
        make_mesh(args.intra), repeats=args.repeats, calls=not args.no_calls,
        statistic=args.statistic,
    )  # fmt: skip
    fitted = from_dict(doc)
    if jax.process_index() != 0:
        return 0
    for name, fit in fitted.axes.items():
        doc[name].update(alpha_s=fit.alpha, beta_s_per_byte=fit.beta)
        gbps = 1 / max(fit.beta, 1e-30) / 1e9
        print(f"{name}: alpha {fit.alpha * 1e6:.1f} us, 1/beta {gbps:.4f} GB/s")
    for kind, t in sorted(fitted.call_s.items()):
        print(f"call {kind}: {t * 1e3:.3f} ms beyond the axis model")
    doc["call_s"] = dict(fitted.call_s)
    doc["meta"] = {
        "command": "python -m jaxcomm.tools.calibration "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "statistic": args.statistic,
        "repeats": args.repeats,
        "link_bps": os.environ.get("JAXCOMM_TESTBED_LINK_BPS"),
    }
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
