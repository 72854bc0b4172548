"""The README's quick start and the guides' scripts run as written; their links resolve."""

import pathlib
import re

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
PORTING = ROOT / "docs" / "porting.md"
COMPRESSION = ROOT / "docs" / "compression.md"


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
    code = re.search(r"```python\n(.*?)```", _section(COMPRESSION, DILOCO), re.S).group(1)
    namespace: dict = {}
    exec(compile(quick, "README.md", "exec"), namespace)
    before = [np.asarray(x) for x in jax.tree.leaves(namespace["params"])]
    exec(compile(code, "docs/compression.md", "exec"), namespace)
    state = namespace["state"]
    assert state.step == 1
    for a, b in zip(before, jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # a local step: the anchor stays
    total, per_step = map(float, capsys.readouterr().out.split()[-2:])
    assert 0 < per_step < total / 10


DILOCO = "Local steps with a rare, compressed sync (DiLoCo)"


def _section(path: pathlib.Path, title: str) -> str:
    """The text of the ``## title`` section of ``path`` (up to the next ``## ``)."""
    return re.search(rf"## {re.escape(title)}\n(.*?)(?=\n## )", path.read_text(), re.S).group(1)


def _port(title: str) -> tuple[str, str, list[str]]:
    """The section's script after the port, the original rebuilt from its diff block, and
    the diff's changed lines."""
    text = _section(PORTING, title)
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
    exec(compile(code, "docs/porting.md", "exec"), {})
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


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeats get GitHub's ``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(f"{slug}-{n}" if n else slug)
    return out


def _prose(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


@pytest.mark.parametrize(
    "doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_links_resolve(doc):
    """Every relative link names a file that exists and, with ``#anchor``, one of its headings."""
    broken = []
    for line in _prose(doc.read_text()):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(target)
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(target)
    assert not broken, broken
