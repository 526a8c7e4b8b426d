"""Optional packages: which pip extra (pyproject.toml's `[project.optional-dependencies]`) installs
each package a feature imports, and the one line a run prints when it is missing.

`pip install -e .` installs what training on the built-in corpus or on text files needs. A feature
that needs more imports it where it is used, through `require`, so a missing package is one line
naming the extra ("... needs transformers, which is not installed: pip install -e ".[data]" ...")
instead of an ImportError traceback. tests/data/test_optional_packages.py holds this table to pyproject.toml.
"""

from __future__ import annotations

import importlib
import importlib.util

# Import name -> (the extra that installs it, in brackets as pip writes it; its pip name).
EXTRAS = {
    "transformers": ("[data]", "transformers"),  # data.tokenizer, scripts/prepare_data.py
    "tokenizers": ("[data]", "tokenizers"),  # transformers' fast tokenizers
    "datasets": ("[data]", "datasets"),  # data.source="datasets", .json / .parquet / .arrow inputs
    "pyarrow": ("[data]", "pyarrow"),  # parquet schemas (installed with datasets)
    "gcsfs": ("[gcs]", "gcsfs"),  # gs:// checkpoint.dir
    "s3fs": ("[s3]", "s3fs"),  # s3:// checkpoint.dir
    "tensorboard": ("[tensorboard]", "tensorboard"),  # viewing a run's scalars (the run writes them without it)
    "torch": ("[test]", "torch"),  # transformers' models: the parity tests, scripts/bench.py generate's peer
    "lm_eval": ("[eval]", "lm_eval"),  # scripts/harness.py, eval.harness_every_steps (jaxpar.downstream)
    "wandb": ("[trackers]", "wandb"),  # train.loggers=wandb
    "mlflow": ("[trackers]", "mlflow"),  # train.loggers=mlflow
    "safetensors": ("[lora]", "safetensors"),  # PEFT adapters: scripts/convert.py --to_peft, train.lora.init_from_peft
}


class MissingExtra(ImportError):
    """An optional package a feature needs is missing or broken; the message is one line."""


def install_hint(module: str) -> str:
    extra, package = EXTRAS[module]
    return f'pip install -e ".{extra}" (or pip install {package})'


def missing_line(module: str, needed_by: str, error: ImportError | None = None) -> str:
    """`needed_by` (a config key or flag with its value) needs `module`: not installed, or (with
    `error` naming another module) installed but failing to import."""
    _, package = EXTRAS[module]
    absent = error is None or (isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in (module, ""))
    if absent:
        return f"{needed_by} needs {package}, which is not installed: {install_hint(module)}"
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{needed_by} needs {package}, which fails to import ({type(error).__name__}: {first}): {install_hint(module)}"


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (a None entry in sys.modules counts as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, needed_by: str):
    """`module`, imported; MissingExtra (one line naming the extra) if it is missing or broken."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(missing_line(module, needed_by, e)) from None
