"""Every test runs on 8 emulated CPU devices; the flag must be set before jax is imported.

The tests compile many tiny programs and run each for a few steps, so compile time dominates:
`tests/support/compile_flags.py` cuts it about 4x and leaves the XLA graph (fusion, sharding, collectives)
unchanged.

`shared_cache` keeps expensive results (one-device reference runs) in a directory all xdist
workers share, so a reference is computed once per session, not once per worker.

Tiers (markers registered in pyproject.toml): `pytest -n 2 tests` runs everything;
`pytest -n 2 -m "not slow and not multiprocess" tests` is the contributor's loop, which keeps a
few cases of every package (tests/test_tiers.py checks that it does).

GPU tests (`@pytest.mark.gpu`) run where the host has a GPU: with a JAX CUDA plugin installed,
JAX_PLATFORMS is "cpu,cuda", so CPU stays the default backend (every other test is unchanged) and
a `gpu` test places its arrays on `jax.devices("gpu")` itself (`tests/support/platforms.py` says
why the order decides). Run them alone with `pytest -m gpu tests`. Where there is no GPU they are
skipped with the reason "no GPU on this host" (`-ra` lists them); a JAX_PLATFORMS you set is
kept as it is (JAX_PLATFORMS=cpu runs the CPU tests on a GPU host whose CUDA does not start).
"""

import gc
import hashlib
import os
import pickle
import shutil
import tempfile

from tests.support.compile_flags import DEVICE_COUNT, FAST_COMPILE, with_child_site
from tests.support.platforms import CPU_THEN_GPU, gpu_devices, suite_platforms

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), DEVICE_COUNT, *FAST_COMPILE]).strip()
os.environ["JAX_PLATFORMS"] = suite_platforms(os.environ)
# No Python frames in the compiled programs' source locations (JAX keeps up to 100, and under pytest
# most are pytest's): metadata every XLA pass copies. The DeepSeek-V3 ZB-H1 pipeline step (93k
# instructions) compiled in 36 CPU s with 10 frames, 31 with none. Errors and tracebacks are unchanged.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# Every Python started from here on (xdist workers, the runs tests start) imports the child site's
# sitecustomize first: the cyclic collector made rare (pytest_sessionstart says why).
os.environ["PYTHONPATH"] = with_child_site(os.environ.get("PYTHONPATH", ""))
if os.environ["JAX_PLATFORMS"] == CPU_THEN_GPU:
    # Both xdist workers (and the runs they start) open the GPU: none may take 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One persistent XLA cache per session, shared by the xdist workers and every run they start (the
# docs' and scripts' subprocesses compile the same tiny programs many times over): workers and
# children inherit the variable the first process sets. A directory you set yourself is kept.
_OWN_XLA_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_XLA_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-tests-xla-cache-")
    os.environ["JAXPAR_TESTS_XLA_CACHE_OWNER"] = str(os.getpid())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402


class SharedCache:
    def __init__(self, root):
        self.root = root

    def get(self, key: str, compute):
        """`compute()` once per session across xdist workers, keyed by `key`."""
        name = hashlib.sha256(key.encode()).hexdigest()[:24]
        path = self.root / f"{name}.pkl"
        with FileLock(str(path) + ".lock"):
            if path.exists():
                return pickle.loads(path.read_bytes())
            value = compute()
            path.write_bytes(pickle.dumps(value))
            return value


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory, worker_id):
    # Under xdist each worker's basetemp is <session dir>/popen-gwN; their parent is shared.
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    root = root / "shared_cache"
    root.mkdir(exist_ok=True)
    return SharedCache(root)


def pytest_sessionstart(session):
    """Python's cyclic collector, made rare: tracing allocates millions of short-lived objects, and each
    full collection walks every object the worker holds (jax, torch, transformers). Measured on the
    six Gemma 3 schedule cases: 1.8 of 27 CPU s in the collector at the default thresholds, 0.2 s
    with these; what is alive at the start is frozen (never scanned again)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# Every test collected, before `-m` or `-k` deselect any: tests/test_tiers.py reads the fast tier off it.
COLLECTED = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects
def pytest_collection_modifyitems(config, items):
    """Heavy tests first (multiprocess, then slow, then the rest; each in collection order): with
    `-n 2 --dist=worksteal` each worker's queue then ends in quick tests, so the run does not end
    on one worker finishing a long test while the other waits. Every worker sorts alike."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("multiprocess") else 1 if item.get_closest_marker("slow") else 2)
    config.stash[COLLECTED] = list(items)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not gpu_devices():
        pytest.skip(f"no GPU on this host (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']})")


def pytest_unconfigure(config):
    if os.environ.get("JAXPAR_TESTS_XLA_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
