"""Subprocess side of tests/test_faults.py: scripts/train.py's main, with one fault planted.

python tests/train_worker.py kill_mid_save STEP -- TRAIN_ARGS...
    trains as scripts/train.py would, and SIGKILLs itself as soon as the async save of step STEP
    has started (save() returned, the background commit still writing), like a preempted node.
python tests/train_worker.py limit_file_size BYTES -- TRAIN_ARGS...
    trains with no file allowed to grow past BYTES (RLIMIT_FSIZE; SIGXFSZ ignored, so a write past
    it fails with EFBIG), like a disk that fills while a checkpoint is written.
"""

import glob
import importlib.util
import os
import resource
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_train_script():
    spec = importlib.util.spec_from_file_location("train_script", os.path.join(ROOT, "scripts", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kill_mid_save(step: int, train_args: list[str]) -> int:
    from jaxpar.checkpoint import Checkpoints

    save = Checkpoints.save

    def save_then_die(self, at, state, **kwargs):
        saved = save(self, at, state, **kwargs)
        if saved and at == step:
            pending = glob.glob(os.path.join(self.directory, f"{at}.orbax-checkpoint-tmp*"))
            print(f"save-started {pending}", flush=True)
            if not pending:
                sys.exit(5)  # the commit finished before we could kill it: the test setup failed
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    Checkpoints.save = save_then_die
    return load_train_script().main(train_args)


def limit_file_size(limit: int, train_args: list[str]) -> int:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return load_train_script().main(train_args)


if __name__ == "__main__":
    mode, number, separator, *rest = sys.argv[1:]
    assert separator == "--"
    sys.exit({"kill_mid_save": kill_mid_save, "limit_file_size": limit_file_size}[mode](int(number), rest))
