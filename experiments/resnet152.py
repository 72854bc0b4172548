"""ResNet-152 data-parallel experiment (not built yet: see the ResNet issue).

Usage: python -m experiments.resnet152 [--help]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.resnet152",
        description="ResNet-152 data-parallel experiment with jaxcomm (not built yet).",
    )
    parser.parse_args(argv)
    print(
        "experiments.resnet152 is not built yet: the ResNet experiment lands with its own "
        "issue. Run `make test` to exercise the data-parallel step.",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
