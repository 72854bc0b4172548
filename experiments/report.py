"""Ablation output: the table on stdout, ``results.json`` and a PNG chart."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

__all__ = ["format_table", "merge_accuracy", "write_chart", "write_json"]


def merge_accuracy(rows: Sequence[dict], accuracy: Sequence[dict]) -> list[dict]:
    """Adds the accuracy columns to the speed rows (matched by ``config``)."""
    by_config = {a["config"]: a for a in accuracy}
    return [{**r, **{k: v for k, v in by_config.get(r["config"], {}).items()}} for r in rows]


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def format_table(rows: Sequence[dict]) -> str:
    """A fixed-width table: config, status, step ms, compute-only ms, speedup, comm %,
    images/s and (when measured) digits accuracy; missing rows say what is missing."""
    with_acc = any("accuracy_status" in r for r in rows)
    head = ["config", "status", "step ms", "compute ms", "speedup", "comm %", "img/s"]
    if with_acc:
        head.append("digits acc")
    lines = []
    notes = []
    for r in rows:
        cells = [
            r["config"],
            r.get("status", "-"),
            _fmt(r.get("step_time_s"), ".1f", 1e3),
            _fmt(r.get("compute_only_step_time_s"), ".1f", 1e3),
            _fmt(r.get("speedup"), ".2f") + ("x" if r.get("speedup") else ""),
            _fmt(r.get("comm_fraction"), ".1f", 100),
            _fmt(r.get("images_per_s"), ".0f"),
        ]
        if with_acc:
            acc = r.get("accuracy")
            cells.append(_fmt(acc, ".3f") if acc is not None else r.get("accuracy_status", "-"))
        lines.append(cells)
        for key in ("missing", "error", "accuracy_note"):
            if r.get(key) and not (key == "accuracy_note" and r[key] == r.get("missing")):
                notes.append(f"  {r['config']}: {key.replace('_', ' ')}: {r[key]}")
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 2 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    out = [fmt_row(head), "  ".join("-" * w for w in widths), *map(fmt_row, lines)]
    if notes:
        out += ["", "notes:", *notes]
    return "\n".join(out)


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
