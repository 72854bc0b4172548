"""A model's initializer as one compiled program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxcomm import backend

__all__ = ["initialize"]


def initialize(create: Callable[[], Any]) -> Any:
    """Runs ``create`` (a function of no arguments that builds a model and returns its
    arrays, e.g. ``nnx.split(resnet(...))``) as one compiled program.

    Op by op, each of an initializer's hundreds of distinct shapes is a dispatch and a
    compile of its own; one program compiles once. The program is compiled with the
    platform's ``initializer_compiler_options`` (``jaxcomm.backend``, reason 10: on
    XLA:CPU, LLVM level 1, 3-4x faster to compile for the same bits).

    Args:
      create: builds the model; its outputs are returned as arrays (static parts, such as
        an NNX ``GraphDef``, are returned as they are).

    Returns:
      ``create()``'s outputs, the values eager construction gives.

    Example:
      >>> graphdef, params = initialize(lambda: nnx.split(resnet("resnet-tiny", 10)))
    """
    options = dict(backend.for_platform(jax.default_backend()).initializer_compiler_options)
    return jax.jit(create).lower().compile(options or None)()
