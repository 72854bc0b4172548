"""Worker for tests/test_golden.py, run under ``python -m jaxcomm.tools.launch`` (not a test).

Runs the two-process golden cases that can run here (``golden.cases_to_run``) on the 2 x 2
mesh of two processes and writes this process's digests to ``$JC_GOLDEN_OUT/p<process>.json``
and the values of its tolerance cases to ``p<process>.npz``.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jaxcomm  # noqa: E402

jaxcomm.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from golden import cases_to_run, run_cases  # noqa: E402

mesh = jaxcomm.make_mesh()
names, _ = cases_to_run("two_processes")
record = run_cases(names, mesh)
out = Path(os.environ["JC_GOLDEN_OUT"]) / f"p{jax.process_index()}"
out.with_suffix(".json").write_text(json.dumps(record.digests, indent=1, sort_keys=True))
with out.with_suffix(".npz").open("wb") as f:
    np.savez(f, **record.values)
print(f"GOLDEN_DONE process={jax.process_index()} cases={len(names)}")
