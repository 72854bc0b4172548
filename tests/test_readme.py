"""The README's quick start runs as written."""

import pathlib
import re

import jax
import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_quick_start_runs(capsys):
    block = re.search(r"## Quick start.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["state"].step == 1
    out = capsys.readouterr().out
    # hierarchical: reduce-scatter (intra), all-reduce (inter), all-gather (intra)
    assert "reduce-scatter ('intra',)" in out and "all-gather ('intra',)" in out


def test_local_sgd_section_runs(capsys):
    quick = re.search(r"## Quick start.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    code = re.search(r"```python\n(.*?)```", _section(DILOCO), re.S).group(1)
    namespace: dict = {}
    exec(compile(quick, "README.md", "exec"), namespace)
    before = [np.asarray(x) for x in jax.tree.leaves(namespace["params"])]
    exec(compile(code, "README.md", "exec"), namespace)
    state = namespace["state"]
    assert state.step == 1
    for a, b in zip(before, jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # a local step: the anchor stays
    total, per_step = map(float, capsys.readouterr().out.split()[-2:])
    assert 0 < per_step < total / 10


DILOCO = "Local steps with a rare, compressed sync (DiLoCo)"


def _section(title: str) -> str:
    return re.search(rf"## {re.escape(title)}\n(.*?)(?=\n## )", README.read_text(), re.S).group(1)


def _port(title: str) -> tuple[str, str, list[str]]:
    """The section's script after the port, the original rebuilt from its diff block, and
    the diff's changed lines."""
    text = _section(title)
    diff = re.search(r"```diff\n(.*?)```", text, re.S).group(1).splitlines()
    changed = [line for line in diff if not line.startswith("@@")]
    after = re.findall(r"```python\n(.*?)```", text, re.S)[-1]
    hunks: list[tuple[list[str], list[str]]] = []
    for line in diff:
        if line.startswith("@@"):
            hunks.append(([], []))
        else:
            hunks[-1][0 if line.startswith("-") else 1].append(line[1:])
    before = after
    for minus, plus in hunks:
        new = "".join(f"{m}\n" for m in minus)
        old = "".join(f"{p}\n" for p in plus)
        assert before.count(old) == 1, old
        before = before.replace(old, new)
    return before, after, changed


def _run(code: str, capsys) -> str:
    exec(compile(code, "README.md", "exec"), {})
    return capsys.readouterr().out


def _accuracy(out: str) -> float:
    return float(re.findall(r"test accuracy ([0-9.]+)", out)[-1])


@pytest.mark.parametrize("flavour", ["NNX", "Linen"])
def test_flax_port(flavour, capsys):
    """At most 10 changed lines, the body of train_step unchanged, and the data-parallel
    script's test accuracy within noise of the one-device original's."""
    before, after, diff = _port(f"Port a Flax {flavour} training script")
    assert len(diff) <= 10
    body = re.search(r"def train_step\(.*?\n\n\n", before, re.S).group(0)
    assert body in after
    one = _accuracy(_run(before, capsys))
    eight = _accuracy(_run(after, capsys))
    assert one > 0.8 and abs(one - eight) < 0.05, (one, eight)
