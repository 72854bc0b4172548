"""Worker for tests/test_golden.py: run under ``python -m jaxcomm.launch`` (not a test module).

Runs every golden case on the 2 x 2 mesh of two processes and writes this process's
digests to ``$JC_GOLDEN_OUT/p<process>.json``.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jaxcomm  # noqa: E402

jaxcomm.init_distributed()

import jax  # noqa: E402
from golden import CASES, run_case  # noqa: E402

mesh = jaxcomm.make_mesh()
table = {name: run_case(name, mesh) for name in CASES}
out = Path(os.environ["JC_GOLDEN_OUT"]) / f"p{jax.process_index()}.json"
out.write_text(json.dumps(table, indent=1, sort_keys=True))
print(f"GOLDEN_DONE process={jax.process_index()} cases={len(table)}")
