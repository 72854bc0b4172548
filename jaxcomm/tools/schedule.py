"""The communication schedule of a compiled step: what overlaps with what.

Overlap is a property of the compiled, scheduled HLO (``is_scheduled=true``; instructions of a
computation are listed in execution order). An async collective is a ``-start``/``-done``
pair (``all-reduce-start`` ... ``all-reduce-done``, or ``async-start`` wrapping a
collective computation, as XLA:GPU writes reduce-scatter); the compute operations the
scheduler put between the two run while the data travels. XLA:CPU collectives are
synchronous: no pairs, no overlap, and the report says so.

The report lists every collective with its kind, mesh axes, dtype and bytes (from
:mod:`jaxcomm.hlo`), whether it is async, and for a pair the number of compute operations
scheduled between start and done.

Example:
  >>> rep = jaxcomm.tools.schedule.schedule_report(dp.step_fn(state), state, batch, mesh=mesh)
  >>> print(rep.format())
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from jax.sharding import Mesh

from jaxcomm.hlo import (
    COLLECTIVE_KINDS,
    Collective,
    HloModule,
    compiled_text,
    instructions,
    parse_collectives,
)

__all__ = ["NON_COMPUTE", "ScheduleReport", "Scheduled", "parse_schedule", "schedule_report"]

#: Opcodes that do no compute work (bookkeeping, aliasing, control, communication).
NON_COMPUTE = frozenset(
    {
        "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "add-dependency", "opt-barrier", "partition-id", "replica-id", "copy-start",
        "copy-done", "async-start", "async-update", "async-done", "send", "send-done",
        "recv", "recv-done", "domain",
    }
    | set(COLLECTIVE_KINDS)
    | {f"{k}-{s}" for k in COLLECTIVE_KINDS for s in ("start", "update", "done")}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One collective in the schedule.

    Attributes:
      collective: kind, axes, dtype, bytes, groups (see :class:`jaxcomm.hlo.Collective`).
      computation: the HLO computation it is scheduled in (the entry, or a loop body).
      position: index of its (start) instruction in that computation.
      is_async: issued as a start/done pair.
      done: name of the matching done instruction (None: synchronous or unpaired).
      ops_between: compute operations scheduled between start and done (None if sync).
      opcodes_between: those operations' opcodes, in order.
      sync_marked: XLA marked the pair ``is_sync`` (it will run synchronously).
      compute_after: compute operations scheduled after the done (or the synchronous op) in
        the same computation: with synchronous collectives (CPU), a gradient collective
        with compute after it was issued before the backward pass finished (interleaved).
    """

    collective: Collective
    computation: str
    position: int
    is_async: bool
    done: str | None
    ops_between: int | None
    opcodes_between: tuple[str, ...]
    sync_marked: bool
    compute_after: int = 0

    @property
    def overlapped(self) -> bool:
        return bool(self.ops_between) and not self.sync_marked


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """The collectives of a compiled module in schedule order, with their overlap.

    Attributes:
      module: the parsed module (:func:`jaxcomm.hlo.parse_collectives`).
      collectives: :class:`Scheduled` entries, per computation in schedule order.
    """

    module: HloModule
    collectives: tuple[Scheduled, ...]

    def by_kind_axes(self) -> dict[tuple[str, tuple[str, ...] | None], dict[str, Any]]:
        """``(kind, axes) -> {'count', 'bytes', 'async', 'overlapped', 'ops_between',
        'interleaved'}`` (interleaved: collectives with compute scheduled after them)."""
        out: dict[tuple[str, tuple[str, ...] | None], dict[str, Any]] = {}
        for s in self.collectives:
            key = (s.collective.kind, s.collective.axes)
            row = out.setdefault(
                key,
                {
                    "count": 0, "bytes": 0.0, "async": 0, "overlapped": 0, "ops_between": 0,
                    "interleaved": 0,
                },
            )  # fmt: skip
            row["count"] += 1
            row["bytes"] += s.collective.operand_bytes
            row["async"] += int(s.is_async)
            row["overlapped"] += int(s.overlapped)
            row["ops_between"] += s.ops_between or 0
            row["interleaved"] += int(s.compute_after > 0)
        return out

    def format(self) -> str:
        """A text table: one row per collective, then a summary by kind and mesh axes."""
        lines = [
            f"{'#':>3} {'kind':<18} {'axes':<16} {'dtype':<5} {'bytes':>12} {'bufs':>4} "
            f"{'async':<5} {'ops between':>11} {'ops after':>9}  computation"
        ]
        for i, s in enumerate(self.collectives):
            c = s.collective
            between = "-" if s.ops_between is None else str(s.ops_between)
            if s.sync_marked:
                between += " (sync)"
            lines.append(
                f"{i:>3} {c.kind:<18} {_axes(c.axes):<16} {c.dtype:<5} "
                f"{int(c.operand_bytes):>12} {c.num_buffers:>4} {'yes' if s.is_async else 'no':<5} "
                f"{between:>11} {s.compute_after:>9}  {s.computation}"
            )
        lines.append("")
        lines.append(
            f"{'kind':<18} {'axes':<16} {'count':>5} {'bytes':>12} {'async':>5} "
            f"{'overlapped':>10} {'ops between':>11} {'interleaved':>11}"
        )
        for (kind, axes), r in self.by_kind_axes().items():
            lines.append(
                f"{kind:<18} {_axes(axes):<16} {r['count']:>5} {int(r['bytes']):>12} "
                f"{r['async']:>5} {r['overlapped']:>10} {r['ops_between']:>11} "
                f"{r['interleaved']:>11}"
            )
        if self.collectives and not any(s.is_async for s in self.collectives):
            lines.append("(all collectives synchronous: no start/done pairs, no overlap)")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as JSON (rows and summary)."""
        rows = [
            {
                "kind": s.collective.kind,
                "axes": s.collective.axes,
                "dtype": s.collective.dtype,
                "bytes": s.collective.operand_bytes,
                "buffers": s.collective.num_buffers,
                "async": s.is_async,
                "ops_between": s.ops_between,
                "compute_after": s.compute_after,
                "sync_marked": s.sync_marked,
                "computation": s.computation,
                "name": s.collective.name,
            }
            for s in self.collectives
        ]
        summary = [
            {"kind": k, "axes": a, **r} for (k, a), r in self.by_kind_axes().items()
        ]  # fmt: skip
        return json.dumps({"collectives": rows, "summary": summary}, indent=1)


def _axes(axes: tuple[str, ...] | None) -> str:
    return ",".join(axes) if axes else "?"


def _first_operand(rest: str) -> str:
    """Name of the single operand of a ``-done`` op: ``(%x)`` or ``((f32[2]) x)``."""
    depth, end = 1, len(rest)
    for k, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = k
            break
    return rest[:end].split()[-1].lstrip("%") if rest[:end].split() else ""


def parse_schedule(text: str, mesh: Mesh | None = None) -> ScheduleReport:
    """Builds the :class:`ScheduleReport` of optimized (scheduled) HLO text.

    Args:
      text: ``compiled.as_text()``.
      mesh: maps replica groups to mesh axis names.

    Returns:
      The report.
    """
    module = parse_collectives(text, mesh)
    by_name = {(c.computation, c.name): c for c in module.collectives}
    wrapped = {c.computation: c for c in module.collectives}  # async-start's computation
    comps = instructions(text)  # computation -> [(name, opcode, rest)] in schedule order
    wrapper_comps = set()
    for instrs in comps.values():
        for _, opcode, rest in instrs:
            if opcode == "async-start":
                cm = re.search(r"calls=%?([\w.\-]+)", rest)
                if cm and cm.group(1) in wrapped:
                    wrapper_comps.add(cm.group(1))
    out: list[Scheduled] = []
    for comp, instrs in comps.items():
        if comp in wrapper_comps:
            continue  # reported at its async-start
        index = {name: i for i, (name, _, _) in enumerate(instrs)}
        for pos, (name, opcode, rest) in enumerate(instrs):
            coll, is_async = None, False
            if opcode == "async-start":
                cm = re.search(r"calls=%?([\w.\-]+)", rest)
                coll = wrapped.get(cm.group(1)) if cm else None
                is_async = True
            elif opcode.removesuffix("-start") in COLLECTIVE_KINDS:
                coll = by_name.get((comp, name))
                is_async = opcode.endswith("-start")
            if coll is None:
                continue
            done, between = None, None
            opcodes: tuple[str, ...] = ()
            if is_async:
                done_pos = _find_done(instrs, index, name)
                if done_pos is not None:
                    done = instrs[done_pos][0]
                    opcodes = tuple(
                        op for _, op, _ in instrs[pos + 1 : done_pos] if op not in NON_COMPUTE
                    )
                    between = len(opcodes)
            end = index[done] if done is not None else pos
            after = sum(op not in NON_COMPUTE for _, op, _ in instrs[end + 1 :])
            out.append(
                Scheduled(
                    collective=coll,
                    compute_after=after,
                    computation=comp,
                    position=pos,
                    is_async=is_async,
                    done=done,
                    ops_between=between,
                    opcodes_between=opcodes,
                    sync_marked=bool(re.search(r'"is_sync"\s*:\s*true', rest)),
                )
            )
    return ScheduleReport(module=module, collectives=tuple(out))


def _find_done(instrs: list[tuple[str, str, str]], index: Mapping[str, int], start: str):
    """Position of the ``-done`` that consumes ``start`` (through ``-update`` ops)."""
    target = start
    for pos in range(index[start] + 1, len(instrs)):
        name, opcode, rest = instrs[pos]
        if opcode.endswith(("-done", "-update")) and _first_operand(rest) == target:
            if opcode.endswith("-done"):
                return pos
            target = name
    return None


def schedule_report(
    fn: Callable,
    *args: Any,
    mesh: Mesh | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> ScheduleReport:
    """Compiles ``fn(*args)`` and reports its collectives and their overlap.

    Args:
      fn: a function or jitted function (e.g. ``DataParallel.step_fn(state)``).
      *args: arrays or ``jax.ShapeDtypeStruct`` with shardings.
      mesh: maps replica groups to mesh axis names.
      compiler_options: XLA options for this compilation (``jaxcomm.xla``).

    Returns:
      A :class:`ScheduleReport`; ``print(report.format())`` prints the table.
    """
    text = compiled_text(fn, *args, compiler_options=compiler_options, **kwargs)
    return parse_schedule(text, mesh)
