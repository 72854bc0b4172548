"""Ablation output: the table on stdout, ``results.json`` and a PNG chart."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

__all__ = [
    "fake_devices_note",
    "format_table",
    "merge_accuracy",
    "summary_line",
    "write_chart",
    "write_json",
]


def fake_devices_note(
    devices: int, testbed: str, *, command: str = "python -m experiments.resnet152"
) -> str:
    """Two lines printed before a table measured on fake CPU devices of one process.

    Args:
      devices: the number of fake devices.
      testbed: whether this machine can build the emulated network, in words (the reason
        from ``jaxcomm.tools.testbed.available()`` when it cannot).
      command: the experiment's command (its ``--preset testbed`` is suggested).
    """
    cores = os.cpu_count()
    return (
        f"note: {devices} fake CPU devices share {cores} cores with no slow link between them: "
        "each technique can only add work here (the table shows that it runs, and its cost).\n"
        f"      to see them win: as root, {command} --preset testbed "
        f"(emulated network; {testbed}); python -m jaxcomm.tools.simulate; "
        "--preset gpu-node on GPUs"
    )


#: Quality counts as unchanged when every row's digits accuracy is within this of the
#: baseline's (0.5 points).
QUALITY_TOLERANCE = 0.005


def merge_accuracy(rows: Sequence[dict], accuracy: Sequence[dict]) -> list[dict]:
    """Adds the accuracy columns to the speed rows (matched by ``config``)."""
    by_config = {a["config"]: a for a in accuracy}
    return [{**r, **{k: v for k, v in by_config.get(r["config"], {}).items()}} for r in rows]


def summary_line(rows: Sequence[dict]) -> str | None:
    """One line that reads the table: the last row's speedup over the baseline, the exposed
    communication share of both, and the quality guard, computed from ``rows``.

    Returns ``None`` when the baseline or the last row has no step time.

    Example:
      ``stacked 2.61x (2.50-2.70x over 5 paired rounds) (+batching vs baseline); exposed
      communication 77% -> 12% of the step, 0.32 s -> 0.08 s; quality unchanged (digits
      within 0.3 points)``
    """
    timed = [r for r in rows if r.get("step_time_s")]
    base = next((r for r in timed if r["config"] == "baseline"), None)
    if base is None or len(timed) < 2:
        return None
    last = timed[-1]
    speedup = last.get("speedup") or base["step_time_s"] / last["step_time_s"]
    stacked = f"stacked {speedup:.2f}x"
    if last.get("speedup_range"):
        lo, hi = last["speedup_range"]
        stacked += f" ({lo:.2f}-{hi:.2f}x over {last.get('rounds')} paired rounds)"
    parts = [f"{stacked} ({last['config']} vs baseline)"]
    fb, fl = base.get("comm_fraction"), last.get("comm_fraction")
    if fb is not None and fl is not None:
        comm = f"exposed communication {fb:.0%} -> {fl:.0%} of the step"
        comm += f", {base['exposed_comm_s']:.3g} s -> {last['exposed_comm_s']:.3g} s"
        parts.append(comm)
    slower = [
        r["config"] for r in timed if r is not base and r["step_time_s"] > base["step_time_s"]
    ]
    if slower:
        parts.append(f"slower than the baseline: {', '.join(slower)}")
    acc = {r["config"]: r.get("accuracy") for r in rows if r.get("accuracy") is not None}
    if "baseline" in acc and len(acc) > 1:
        worst = max(acc, key=lambda k: abs(acc[k] - acc["baseline"]))
        gap = abs(acc[worst] - acc["baseline"])
        if gap <= QUALITY_TOLERANCE:
            parts.append(f"quality unchanged (digits within {gap * 100:.1f} points of baseline)")
        else:
            parts.append(
                f"quality changed: {worst} digits {acc[worst]:.3f} vs baseline "
                f"{acc['baseline']:.3f}"
            )
    return "; ".join(parts)


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def _with_range(r: dict, key: str, spec: str, scale: float = 1.0, unit: str = "") -> str:
    """``median [low-high]`` of ``r[key]`` and ``r[key + '_range']`` (or ``..._range_s``)."""
    v = r.get(key)
    if v is None:
        return "-"
    rng = r.get(f"{key}_range") or r.get(key.removesuffix("_s") + "_range_s")
    text = format(v * scale, spec) + unit
    if rng:
        text += f" [{format(rng[0] * scale, spec)}-{format(rng[1] * scale, spec)}]"
    return text


def format_table(
    rows: Sequence[dict], *, rate: tuple[str, str] = ("images_per_s", "img/s"), memory: bool = False
) -> str:
    """A fixed-width table of medians over the rounds, each with its range: config,
    status, step ms, compute-only ms, exposed communication ms, speedup, comm %, the rate
    (``rate``: the row's key and the column's name; images/s by default, an LM's
    ``('rate_per_s', 'tok/s')``), with ``memory`` the state's MB per device (params, model
    and optimizer state on one device: ``state_bytes_per_device``) and the compiled step's
    temporary buffers per device (XLA's memory analysis: activations, gathered params);
    on a network the link columns (MB per step across a node's link from the HLO, with
    the transport's measured framing of its calls added, and as the kernel counted it,
    their line-rate time, the sync alone's time, efficiency = bound / sync alone, the
    share of the sync the step hides), on a leaf-spine fabric the MB per
    step the spine carried (measured), and (when measured) digits accuracy. Under the
    table: neighbours whose step-time ranges overlap (not ranked), errors, the rungs a
    driven adaptive row ran and the period of local steps."""
    with_acc = any("accuracy_status" in r for r in rows)
    with_link = any(r.get("link_bound_s") is not None for r in rows)
    head = ["config", "status", "step ms", "compute ms", "exposed ms", "speedup", "comm %"]
    head.append(rate[1])
    if memory:
        head += ["state MB/dev", "temp MB/dev"]
    with_spine = any(r.get("spine_bytes_measured") is not None for r in rows)
    if with_link:
        head += ["link MB", "+framing", "kernel MB", "bound ms", "sync ms", "effic."]
        head.append("hidden %")
    if with_spine:
        head.append("spine MB")
    if with_acc:
        head.append("digits acc")
    lines = []
    notes = []
    for r in rows:
        cells = [
            r["config"],
            r.get("status", "-"),
            _with_range(r, "step_time_s", ".1f", 1e3),
            _fmt(r.get("compute_only_step_time_s"), ".1f", 1e3),
            _with_range(r, "exposed_comm_s", ".1f", 1e3),
            _with_range(r, "speedup", ".2f", unit="x"),
            _fmt(r.get("comm_fraction"), ".1f", 100),
            _fmt(r.get(rate[0]), ".0f"),
        ]
        if memory:
            temp = (r.get("program_memory") or {}).get("temp")
            cells += [_fmt(r.get("state_bytes_per_device"), ".2f", 1e-6), _fmt(temp, ".2f", 1e-6)]
        if with_link:
            cells += [
                _fmt(r.get("link_bytes"), ".3f", 1e-6),
                _fmt(r.get("link_bytes_expected"), ".3f", 1e-6),
                _fmt(r.get("link_bytes_measured"), ".3f", 1e-6),
                _fmt(r.get("link_bound_s"), ".0f", 1e3),
                _fmt(r.get("sync_alone_s"), ".0f", 1e3),
                _fmt(r.get("link_efficiency"), ".2f"),
                _fmt(_share_or_none(r.get("hidden_share")), ".0f", 100),
            ]
        if with_spine:
            cells.append(_fmt(r.get("spine_bytes_measured"), ".1f", 1e-6))
        if with_acc:
            acc = r.get("accuracy")
            cells.append(_fmt(acc, ".3f") if acc is not None else r.get("accuracy_status", "-"))
        lines.append(cells)
        for key in ("error", "accuracy_note"):
            if r.get(key):
                notes.append(f"  {r['config']}: {key.replace('_', ' ')}: {r[key]}")
        if r.get("adaptive"):  # a driven adaptive row: the rungs it ran
            ad = r["adaptive"]
            moves = ", ".join(
                f"step {c['step']} {c['from']}->{c['to']} ({c['reason']})" for c in ad["changes"]
            )
            notes.append(
                f"  {r['config']}: adaptive timed at {'/'.join(dict.fromkeys(ad['timed_levels']))}"
                f", median round at {'/'.join(dict.fromkeys(ad['median_round_levels']))}"
                f" (changes: {moves or 'none'})"
            )
        if r.get("sync_every"):  # local steps: the period, and what link MB means there
            notes.append(
                f"  {r['config']}: a sync every {r['sync_every']} steps (H, chosen for the "
                "link); link MB is per step, the sync's bytes spread over H"
            )
    notes[:0] = _overlapping_neighbours(rows) + _shares_out_of_bounds(rows)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 2 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    out = [fmt_row(head), "  ".join("-" * w for w in widths), *map(fmt_row, lines)]
    if notes:
        out += ["", "notes:", *notes]
    return "\n".join(out)


def _share_or_none(share: float | None) -> float | None:
    """A share as printed: ``None`` (``-``) outside [0, 1], which no share can be."""
    return share if share is not None and 0.0 <= share <= 1.0 else None


def _shares_out_of_bounds(rows: Sequence[dict]) -> list[str]:
    """A note for each row whose measured hidden share lies outside [0, 1] (the JSON keeps
    it): its exposed communication and its sync alone differ by more than their noise."""
    return [
        f"  {r['config']}: hidden share not printed: exposed "
        f"{r['exposed_comm_s'] * 1e3:.1f} ms against the sync alone's "
        f"{r['sync_alone_s'] * 1e3:.1f} ms (rounds' noise)"
        for r in rows
        if r.get("hidden_share") is not None and _share_or_none(r["hidden_share"]) is None
    ]


def _overlapping_neighbours(rows: Sequence[dict]) -> list[str]:
    """A note for each pair of neighbouring rows whose step-time ranges over the rounds
    overlap: the rounds cannot rank them."""
    timed = [r for r in rows if r.get("step_time_range_s")]
    notes = []
    for a, b in zip(timed, timed[1:], strict=False):
        (a0, a1), (b0, b1) = a["step_time_range_s"], b["step_time_range_s"]
        if a0 <= b1 and b0 <= a1:
            notes.append(
                f"  {a['config']} and {b['config']}: step times overlap over the rounds "
                f"({a0 * 1e3:.1f}-{a1 * 1e3:.1f} vs {b0 * 1e3:.1f}-{b1 * 1e3:.1f} ms): "
                "not ranked"
            )
    return notes


def write_json(rows: Sequence[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(list(rows), f, indent=2, default=str)


def write_chart(rows: Sequence[dict], path: str, *, title: str) -> None:
    """Bar charts of step time (speedup on top), communication fraction and accuracy.

    Rows without a measurement are drawn as an empty hatched slot labelled with their status.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("step time (ms)", "step_time_s", 1e3), ("exposed comm. (%)", "comm_fraction", 100)]
    if any(r.get("accuracy") is not None for r in rows):
        panels.append(("digits test accuracy", "accuracy", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    names = [r["config"] for r in rows]
    x = range(len(rows))
    for ax, (label, key, scale) in zip(axes, panels, strict=True):
        vals = [r.get(key) for r in rows]
        heights = [0.0 if v is None else v * scale for v in vals]
        bars = ax.bar(x, heights, color="#4477aa")
        top = max([h for h in heights if h] or [1.0])
        for i, (b, v) in enumerate(zip(bars, vals, strict=True)):
            if v is None:
                status = rows[i].get("status", "-")
                if key == "accuracy":
                    status = rows[i].get("accuracy_status", status)
                ax.bar(i, top * 0.15, color="none", edgecolor="grey", hatch="//")
                ax.text(i, top * 0.17, status, ha="center", fontsize=8, color="grey")
            elif key == "step_time_s" and rows[i].get("speedup"):
                ax.text(
                    i,
                    b.get_height(),
                    f"{rows[i]['speedup']:.2f}x",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.axhline(0, color="black", lw=0.5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
