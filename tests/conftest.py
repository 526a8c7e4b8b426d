"""Every test runs on 8 emulated CPU devices; the flag must be set before jax is imported.

The tests compile many tiny programs and run each for a few steps, so compile time dominates:
`tests/support/compile_flags.py` cuts it about 4x and leaves the XLA graph (fusion, sharding, collectives)
unchanged.

`shared_cache` keeps expensive results (one-device reference runs) in a directory all xdist
workers share, so a reference is computed once per session, not once per worker.
"""

import hashlib
import os
import pickle

from tests.support.compile_flags import DEVICE_COUNT, FAST_COMPILE

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), DEVICE_COUNT, *FAST_COMPILE]).strip()
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


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory, worker_id):
    # Under xdist each worker's basetemp is <session dir>/popen-gwN; their parent is shared.
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    root = root / "shared_cache"
    root.mkdir(exist_ok=True)
    return SharedCache(root)
