"""``wire_bytes``: bytes each device sends, read from the compiled HLO.

Every collective of the compiled program is priced with the nccl-tests *bus bandwidth*
factors (nccl-tests ``doc/PERFORMANCE.md``), ``S`` the full buffer in bytes and ``p`` the
replica group size:

| kind | bytes per device |
|---|---|
| all-reduce | ``2 (p-1)/p S`` |
| reduce-scatter, all-gather, all-to-all | ``(p-1)/p S`` (``S``: the full buffer) |
| collective-permute, collective-broadcast | ``S`` |

Collectives inside the branches of a conditional (``lax.cond`` / ``lax.switch``: warm-up,
adaptive levels) are listed per branch, and ``total`` counts the unconditional ones plus
the **largest** branch of every conditional (nested conditionals recursively), or the
branch that ``taken`` names for it (the branch a run is known to take). A
collective inside a loop body (``lax.scan``) is counted once, i.e. per iteration.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxcomm import hlo

__all__ = ["CONDITIONALS", "bus_bytes", "summarize", "wire_bytes"]


def bus_bytes(c: hlo.Collective) -> float:
    """Bytes one device sends for collective ``c`` (nccl-tests bus factors)."""
    p = max(int(c.group_size), 1)
    if c.kind == "all-reduce":
        return 2.0 * (p - 1) / p * c.operand_bytes
    if c.kind in ("reduce-scatter", "all-to-all"):
        return (p - 1) / p * c.operand_bytes
    if c.kind == "all-gather":
        return (p - 1) / p * c.operand_bytes * p  # S is the gathered buffer
    return float(c.operand_bytes)  # collective-permute, collective-broadcast


# How collectives under a conditional are counted (also a field of CommProfiler's stats):
# the program's HLO does not say which branch runs, so every conditional is priced at its
# largest branch (by bytes), an upper bound on what a step sends.
CONDITIONALS = "largest_branch"


def _new_node() -> dict:
    return {"direct": [], "conds": defaultdict(lambda: defaultdict(_new_node))}


def _counted(node: dict, taken: Mapping[str, int]) -> list[dict]:
    """Records a node counts: its own collectives plus, for every conditional below it, the
    counted records of the branch ``taken`` names for it, else of the branch with the most
    bytes (the first such branch on a tie)."""
    out = list(node["direct"])
    for cond, branches in node["conds"].items():
        if cond in taken:  # a branch without collectives has no node: it counts nothing
            out += _counted(branches[taken[cond]], taken) if taken[cond] in branches else []
            continue
        picks = [_counted(branches[i], taken) for i in sorted(branches)]
        out += max(picks, key=lambda recs: sum(r["bytes"] for r in recs))
    return out


def _split(records: list[dict], key: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for r in records:
        out[r[key]] += r["bytes"]
    return dict(out)


def _slices(mesh: Mesh) -> Iterator[tuple[str, np.ndarray]]:
    """Each mesh axis with its slice: which devices sit at coordinate 0 of that axis (a
    node, for ``'inter'``)."""
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), -1)
    for i, axis in enumerate(mesh.axis_names):
        yield axis, coords[:, i] == 0


def _crossings(r: dict, inside: np.ndarray) -> int:
    """How many of a collective's replica groups have members both inside and outside the
    slice; for a collective-permute, how many of its pairs send from inside to outside."""
    if r["kind"] == "collective-permute":
        return sum(bool(inside[s] and not inside[t]) for s, t in r["pairs"])
    return sum(1 for g in r["groups"] if 0 < sum(bool(inside[d]) for d in g) < len(g))


def _crossing(counted: list[dict], mesh: Mesh) -> dict[str, float]:
    """Bytes per call that leave one slice of each mesh axis (a node, for ``'inter'``), in
    each direction.

    The slice is the devices at coordinate 0 of the axis. A collective's replica group that
    has members both inside and outside the slice is taken as a ring ordered by position,
    which crosses the slice boundary once per direction carrying what one device sends (its
    bus bytes); an all-to-all is no ring: each member sends its ``1/p`` of the operand to
    every other member directly, so ``k`` members inside send ``k (p - k) / p`` operands
    across (more than one device's bus bytes where ``k > 1``). A collective-permute pair
    crosses when its source is inside and its target outside. Groups of the same
    collective that run side by side (e.g. one per intra-node device, each over
    ``'inter'``) share the link, so each counts.
    """
    out = {}
    for axis, inside in _slices(mesh):
        total = 0.0
        for r in counted:
            if r["kind"] == "collective-permute":  # each pair sends its whole operand
                total += _crossings(r, inside) * float(r["operand_bytes"])
            elif r["kind"] == "all-to-all":
                for g in r["groups"]:
                    k = sum(bool(inside[d]) for d in g)
                    total += k * (len(g) - k) / len(g) * float(r["operand_bytes"])
            else:
                total += _crossings(r, inside) * r["bytes"]
        out[axis] = total
    return out


def _crossing_calls(counted: list[dict], mesh: Mesh) -> dict[str, dict[str, int]]:
    """Calls per step that cross one slice of each mesh axis, by ``'kind/group size'``
    (:func:`_crossings`; a collective-permute's pairs count as groups of 2). What a
    transport's per-message framing, which no HLO shows, scales with
    (:func:`jaxcomm.tools.testbed.framing_per_call`).
    """
    out: dict[str, dict[str, int]] = {}
    for axis, inside in _slices(mesh):
        calls: dict[str, int] = {}
        for r in counted:
            n = _crossings(r, inside)
            if n:
                size = 2 if r["kind"] == "collective-permute" else r["group_size"]
                key = f"{r['kind']}/{size}"
                calls[key] = calls.get(key, 0) + n
        out[axis] = calls
    return out


def summarize(
    mod: hlo.HloModule, mesh: Mesh | None = None, *, taken: Mapping[str, int] | None = None
) -> dict:
    """Prices the collectives of a parsed module (see :func:`wire_bytes` for the keys).

    ``crossing`` needs the ``mesh`` the module was compiled for (empty without); ``taken``
    prices the named conditionals at the given branch (:func:`wire_bytes`).

    The one place that walks a module's conditionals: :func:`wire_bytes` and
    :class:`jaxcomm.CommProfiler` both count what this returns.
    """
    root, records = _record_tree(mod)
    taken = dict(taken or {})
    all_indices = _check_taken(mod, taken)
    counted = _counted(root, taken)
    counted_ids = {id(r) for r in counted}
    branches = _branch_bytes(root, all_indices, taken)
    return {
        "total": sum(r["bytes"] for r in counted),
        "by_kind": _split(counted, "kind"),
        "by_axis": _split(counted, "axes_key"),
        "crossing": {} if mesh is None else _crossing(counted, mesh),
        "crossing_calls": {} if mesh is None else _crossing_calls(counted, mesh),
        "operand_bytes": float(sum(r["operand_bytes"] for r in counted)),
        "num_collectives": len(counted),
        "conditionals": CONDITIONALS,
        "taken": taken,
        "unconditional": sum(r["bytes"] for r in records if not r["branch"]),
        "branches": branches,
        "collectives": [
            {
                **{k: v for k, v in r.items() if k not in ("axes_key", "groups", "pairs")},
                "counted": id(r) in counted_ids,
            }
            for r in records
        ],
    }


def _record_tree(mod: hlo.HloModule) -> tuple[dict, list[dict]]:
    """Each collective of ``mod`` as a record (its bus bytes priced), hung in a tree of
    conditionals (``{'direct': [records], 'conds': {cond: {branch: node}}}``)."""
    root = _new_node()
    records = []
    for c in mod.collectives:
        chain = mod.branch_chain(c.computation)
        rec = {
            "kind": c.kind,
            "name": c.name,
            "dtype": c.dtype,
            "axes": c.axes,
            "axes_key": "+".join(c.axes) if c.axes else "unknown",
            "group_size": c.group_size,
            "operand_bytes": c.operand_bytes,
            "bytes": bus_bytes(c),
            "branch": chain,
            "groups": c.replica_groups,
            "pairs": c.source_target_pairs,
        }
        records.append(rec)
        node = root
        for cond, idx in chain:
            node = node["conds"][cond][idx]
        node["direct"].append(rec)
    return root, records


def _check_taken(mod: hlo.HloModule, taken: Mapping[str, int]) -> dict[str, set[int]]:
    """The branch indices of each conditional of ``mod``; a clear error when ``taken``
    names a conditional or a branch the module does not have."""
    all_indices: dict[str, set[int]] = defaultdict(set)
    for cond, idx in mod.branches.values():
        all_indices[cond].add(idx)
    unknown = sorted(set(taken) - set(all_indices))
    if unknown:
        raise ValueError(
            f"taken names conditionals {unknown} that the module does not have; use names "
            f"from the 'branches' key of wire_bytes' result."
        )
    for cond, idx in taken.items():
        if idx not in all_indices[cond]:
            raise ValueError(
                f"taken={{{cond!r}: {idx!r}}}: {cond} has branches "
                f"{sorted(all_indices[cond])}; give one of them."
            )
    return all_indices


def _branch_bytes(
    root: dict, all_indices: Mapping[str, set[int]], taken: Mapping[str, int]
) -> dict[str, dict[int, float]]:
    """The bus bytes each branch of each conditional would count (nested ones as
    ``taken`` or at their largest branch)."""
    branches: dict[str, dict[int, float]] = {}

    def walk(node):
        for cond, bs in node["conds"].items():
            # branches without collectives count 0 (they still matter for the maximum)
            indices = sorted(all_indices.get(cond, set()) | set(bs))
            branches[cond] = {
                i: (sum(r["bytes"] for r in _counted(bs[i], taken)) if i in bs else 0.0)
                for i in indices
            }
            for b in bs.values():
                walk(b)

    walk(root)
    return branches


def _find_mesh(args: Any) -> Mesh | None:
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def wire_bytes(
    fn: Callable,
    *args: Any,
    mesh: Mesh | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    taken: Mapping[str, int] | None = None,
    **kwargs: Any,
) -> dict:
    """Compiles ``fn(*args)`` and returns the bytes each device sends per call.

    Args:
      fn: a function or jitted function (typically a ``jax.shard_map`` of a step), or a
        ``jax.stages.Compiled`` program, read without compiling again (give ``mesh``).
      *args: arrays or ``jax.ShapeDtypeStruct`` with shardings.
      mesh: names the mesh axes of each collective; found from the arguments' shardings
        when not given.
      compiler_options: XLA options for this compilation.
      taken: ``{conditional name: branch index}``: price these conditionals at the branch
        that ran (e.g. an adaptive compressor's ``lax.switch`` at its current level, the
        names from a first call's ``branches``) instead of their largest branch.
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A dict: ``total`` (bytes per device, unconditional + the largest branch of each
      conditional), ``by_kind`` and ``by_axis`` (the same total split by collective kind
      and by mesh axes, ``'inter+intra'``-style keys, ``'unknown'`` without a mesh),
      ``crossing`` (``{axis: bytes}`` with a mesh: the bytes that leave one slice of the
      axis in each direction, i.e. for ``'inter'`` what crosses a node's link per call:
      every replica group spanning nodes counts its bus bytes once, as a ring ordered by
      node crosses each node's link once per direction; groups side by side add up),
      ``crossing_calls`` (``{axis: {'kind/group size': calls}}`` with a mesh: the replica
      groups, or permute pairs, of the counted collectives that cross that boundary),
      ``operand_bytes`` and ``num_collectives`` (input bytes and number of the collectives
      that total counts), ``conditionals`` (the rule: ``'largest_branch'``), ``taken``
      (the conditionals priced at a given branch instead),
      ``unconditional`` (bytes outside any conditional), ``branches`` (``{conditional:
      {branch index: bytes}}``) and ``collectives`` (one dict per collective: kind, name,
      dtype, axes, group_size, operand_bytes, bytes, branch chain, ``counted``: whether
      ``total`` includes it).

    Example:
      >>> wb = jaxcomm.wire_bytes(dp.step_fn(state), state, dp.shard_batch(batch))
      >>> wb['total'], wb['by_kind']
    """
    mesh = mesh if mesh is not None else _find_mesh((args, kwargs))
    mod = hlo.collectives(fn, *args, mesh=mesh, compiler_options=compiler_options, **kwargs)
    return summarize(mod, mesh, taken=taken)
