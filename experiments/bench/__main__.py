"""``python -m experiments.bench <name> [args]``: dispatch to ``experiments.bench.<name>.main``.

Every module of this package with a ``main(argv) -> int`` function is a benchmark.
``peers``: PyTorch DDP and its hooks beside jaxcomm (its torch ranks: ``peers_torch``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import experiments.bench as _pkg


def available() -> list[str]:
    names = []
    for info in pkgutil.iter_modules(_pkg.__path__):
        if info.name.startswith("_"):
            continue
        if hasattr(importlib.import_module(f"experiments.bench.{info.name}"), "main"):
            names.append(info.name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m experiments.bench {" + ",".join(names) + "} [args]")
        return 0 if argv else 2
    if argv[0] not in names:
        print(f"unknown benchmark {argv[0]!r}; choose one of {names}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"experiments.bench.{argv[0]}").main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
