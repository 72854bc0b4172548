"""The README's quick start runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_quick_start_runs(capsys):
    block = re.search(r"## Quick start.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["state"].step == 1
    out = capsys.readouterr().out
    # hierarchical: reduce-scatter (intra), all-reduce (inter), all-gather (intra)
    assert "reduce-scatter ('intra',)" in out and "all-gather ('intra',)" in out
