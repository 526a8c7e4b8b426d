"""Subprocess side of tests/train/test_faults.py: scripts/train.py's main, with one fault planted.

python tests/support/train_worker.py signal_at_PHASE SIGNUM -- TRAIN_ARGS...
    trains, sending itself signal SIGNUM as the start-up phase PHASE begins (preflight, data, build,
    restore, compile; first_step: as the first step's batch is fetched), like a preemption notice
    or a Ctrl-C that arrives at that moment.
python tests/support/train_worker.py limit_file_size BYTES -- TRAIN_ARGS...
    trains with no file allowed to grow past BYTES (RLIMIT_FSIZE; SIGXFSZ ignored, so a write past
    it fails with EFBIG), like a disk that fills while a checkpoint is written.
"""

import importlib.util
import os
import resource
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_train_script():
    spec = importlib.util.spec_from_file_location("train_script", os.path.join(ROOT, "scripts", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _phase_functions():
    """Phase -> (owner, attribute): a function the phase calls first, patched to send the signal."""
    import jax

    from jaxpar.checkpoint.tiers import Tiers
    from jaxpar.data.batches import DocumentBatches
    from jaxpar.train import loop, preflight

    return {
        "preflight": (preflight, "check_run"),
        "data": (loop, "training_stream"),
        "build": (loop, "build"),
        "restore": (Tiers, "restore"),  # the run's checkpoints, one tier or two
        "compile": (jax.stages.Lowered, "compile"),
        "first_step": (DocumentBatches, "__next__"),
    }


def signal_at(phase: str, signum: int, train_args: list[str]) -> int:
    owner, name = _phase_functions()[phase]
    original, sent = getattr(owner, name), []

    def signalling(*args, **kwargs):
        if not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    setattr(owner, name, signalling)
    return load_train_script().main(train_args)


def limit_file_size(limit: int, train_args: list[str]) -> int:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return load_train_script().main(train_args)


if __name__ == "__main__":
    mode, number, separator, *rest = sys.argv[1:]
    assert separator == "--"
    if mode.startswith("signal_at_"):
        sys.exit(signal_at(mode[len("signal_at_"):], int(number), rest))
    sys.exit({"limit_file_size": limit_file_size}[mode](int(number), rest))
