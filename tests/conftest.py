"""Every test runs on 8 emulated CPU devices; the flag must be set before jax is imported.

The tests compile many tiny programs and run each for a few steps, so compile time dominates: LLVM
optimisation level 0 halves it and leaves the XLA graph (fusion, sharding, collectives) unchanged.

`shared_cache` keeps expensive results (one-device reference runs) in a directory all xdist
workers share, so a reference is computed once per session, not once per worker.

JAX's persistent compilation cache lives in the session's temp directory, shared by the xdist
workers and by the scripts the tests run in subprocesses (they inherit JAX_COMPILATION_CACHE_DIR):
the same program compiled again (an init shared by layouts that differ only in the step, every
subprocess of a fault or resume test) is read back instead. A size limit turns on JAX's file lock,
so a reader never sees a half-written entry; a damaged entry is recompiled with a warning.
"""

import hashlib
import os
import pickle

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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


def _session_root(config):
    # Under xdist each worker's basetemp is <session dir>/popen-gwN; their parent is shared.
    root = config._tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    cache = _session_root(config) / "xla_cache"
    cache.mkdir(exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)


@pytest.fixture(scope="session")
def shared_cache(pytestconfig):
    root = _session_root(pytestconfig) / "shared_cache"
    root.mkdir(exist_ok=True)
    return SharedCache(root)
