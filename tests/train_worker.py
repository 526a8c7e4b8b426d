"""Subprocess side of tests/test_faults.py: scripts/train.py's main, with one fault planted.

python tests/train_worker.py kill_mid_save STEP -- TRAIN_ARGS...
    trains as scripts/train.py would, and SIGKILLs itself as soon as the async save of step STEP
    has started (save() returned, the background commit still writing), like a preempted node.
"""

import glob
import importlib.util
import os
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


if __name__ == "__main__":
    mode, step, separator, *rest = sys.argv[1:]
    assert mode == "kill_mid_save" and separator == "--"
    sys.exit(kill_mid_save(int(step), rest))
