"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the whole run, shared by the xdist workers and the processes the
# tests start (they inherit the environment): many tests build the same step in a new
# closure, and JAX's persistent cache (keyed by the program, the XLA flags and the devices)
# compiles each program once per run instead of once per test (test_microbatch.py: 116 ->
# 75 s of CPU). The directory is new for every run, so a clean clone still compiles
# everything, and removed at the end by the process that made it. A cache the caller set is
# kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="jaxcomm-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture(scope="session")
def mesh():
    """The 2 x 4 ('inter', 'intra') mesh over the 8 fake devices."""
    import jaxcomm

    return jaxcomm.make_mesh(intra=4)


# The test files by their time, longest first (a full run's --durations=0, summed per
# file, 2026-12-07): `make test` hands each of its two workers a file at a time
# (--dist loadfile, --no-loadscope-reorder) in collection order, so the long files start
# first and the short ones (every file not named, in name order) fill in at the end; a
# long file taken last would leave the other worker idle until it ends. (pytest-xdist's own
# order, by the number of tests in a file, put the one-test kill test last.)
LONGEST_FIRST = (
    "test_testbed.py",
    "test_experiment_ablation.py",
    "test_golden.py",
    "test_replicas.py",
    "test_elastic_processes.py",
    "test_sharded.py",
    "test_launch.py",
    "test_flax_sharded.py",
    "test_pmap_optax.py",
    "test_pmap.py",
    "test_experiment_checkpoint.py",
    "test_sharded_build.py",
    "test_elastic.py",
    "test_flax_imagenet.py",
    "test_bench_gpu.py",
    "test_microbatch.py",
    "test_pmap_entry.py",
    "test_sharded_distributed.py",
    "test_hybrid.py",
    "test_sharded_digits.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    # Where XLA:CPU cannot convert float16 at all (no F16C: see helpers.f16_converts), the
    # cases named for f16 (the fp16 compressor, float16 all-reduces) cannot run in JAX
    # itself; they are skipped with the reason, every other case still runs.
    f16 = [item for item in items if "fp16" in item.name or "float16" in item.name]
    if f16:
        from helpers import f16_converts

        if not f16_converts():
            skip = pytest.mark.skip(
                reason="XLA:CPU here cannot convert float16 (no F16C, e.g. "
                "--xla_cpu_max_isa=SSE4_2): jax.jit(lambda x: x.astype('float16')) fails"
            )
            for item in f16:
                item.add_marker(skip)
