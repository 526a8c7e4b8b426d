"""Experiment trackers: where a run's metrics go besides metrics.jsonl (`train.loggers`).

One record per tracker (`Tracker`), each through its own library, owning its config keys (`keys`,
added to the `train` section by `jaxpar.config`), the folder it writes in the workdir and how it opens:
- tensorboard: event files under WORKDIR/tensorboard (tensorboardX, a dependency);
- wandb: Weights & Biases, offline by default (`train.wandb_mode`): the run's files under
  WORKDIR/wandb, uploaded later with `wandb sync WORKDIR/wandb` (online mode logs as it goes);
- mlflow: an MLflow tracking store, by default the file store WORKDIR/mlruns (no server; MLflow 3
  keeps it in maintenance mode behind MLFLOW_ALLOW_FILE_STORE, which this sets for it), or any
  `train.mlflow_tracking_uri` (sqlite:///..., http://...).
Each logs the run's config once (W&B's config, MLflow's params), then every metrics.jsonl record:
steps, evaluations and the goodput at the end, against the record's `step` (list values, MoE router
statistics, one metric per element: `router_load/3`).

A resumed run continues the same tracked run: the ids are kept in WORKDIR/trackers.json, written when
a tracker opens a run, moved aside with the run's other files by `--overwrite`. Steps a fault made the
run redo are logged again (the later value is the one that counts; the losses are bitwise the same).
Only process 0 logs. A tracker whose package is missing is one line naming the extra at preflight.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxpar.extras import installed, missing_line, require
from jaxpar.ranges import one_of

IDS_FILE = "trackers.json"
WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class Key:
    """One of a tracker's keys: `train.<name>`."""

    name: str
    default: str
    meaning: str  # one line, for the config reference


@dataclass(frozen=True)
class Tracker:
    name: str  # as train.loggers names it
    module: str  # the package it imports (`jaxpar.extras` names its pip extra)
    folder: str  # what it writes in the workdir (None: nothing there)
    keys: tuple[Key, ...]
    open: Callable  # (train section, workdir, config dict, run id or None) -> session
    checks: Callable = lambda train: []  # one line per bad key value


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a metrics record (not `step`), lists one value per element."""
    out = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (int, float, list)) or isinstance(value, bool):
            continue
        values = np.asarray(value, dtype=np.float64)
        if values.size == 0:
            continue
        if values.ndim == 0:
            out[key] = float(values)
        else:
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(values.ravel())})
    return out


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as {dotted key: text} (MLflow's params)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = json.dumps(value) if not isinstance(value, str) else value
    return out


# -- tensorboard ---------------------------------------------------------------------------------


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when it is
    installed only to accept torch tensors, which jaxpar never logs, and that import took 2.2 of a
    tiny run's first seconds (the test extras install torch). A torch already imported is kept."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects without it
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class _TensorBoard:
    def __init__(self, train, workdir, config, run_id):
        SummaryWriter = _summary_writer()  # noqa: N806 (the library's class)
        self.writer, self.id = SummaryWriter(os.path.join(workdir, "tensorboard")), None

    def log(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, ended: str) -> None:
        self.writer.close()


# -- Weights & Biases ------------------------------------------------------------------------------


class _WandB:
    def __init__(self, train, workdir, config, run_id):
        wandb = require("wandb", "train.loggers=wandb")
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        self.run = wandb.init(project=train.wandb_project, mode=train.wandb_mode, dir=workdir, id=run_id, resume="allow",
                              name=os.path.basename(os.path.normpath(workdir)), config=config, settings=settings)
        self.run.define_metric("*", step_metric="step")  # records carry their step; a redone step is logged again
        self.id = self.run.id

    def log(self, record: dict) -> None:
        self.run.log({"step": int(record["step"]), **scalars(record)})

    def close(self, ended: str) -> None:
        self.run.finish(exit_code=0 if ended == "done" else 1)


def _wandb_checks(train) -> list[str]:
    return one_of("train.wandb_mode", train.wandb_mode, WANDB_MODES) + (
        [] if str(train.wandb_project).strip() else ["train.wandb_project='' must name a project"])


# -- MLflow ----------------------------------------------------------------------------------------


def mlflow_uri(train, workdir: str) -> str:
    return str(train.mlflow_tracking_uri) or "file:" + os.path.join(os.path.abspath(workdir), "mlruns")


class _MLflow:
    STATUS = {"done": "FINISHED", "Interrupted": "KILLED"}

    def __init__(self, train, workdir, config, run_id):
        uri = mlflow_uri(train, workdir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this
        mlflow = require("mlflow", "train.loggers=mlflow")
        from mlflow.entities import Param

        self.Metric = mlflow.entities.Metric
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        if run_id is not None:  # the resumed run's params were logged at its first start (MLflow's params never change)
            self.client.update_run(run_id, status="RUNNING")
            self.id = run_id
            return
        experiment = self.client.get_experiment_by_name(train.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(train.mlflow_experiment)
        self.id = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.normpath(workdir))).info.run_id
        params = [Param(k, v) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.id, params=params[i : i + 100])

    def log(self, record: dict) -> None:
        now, step = int(time.time() * 1000), int(record["step"])
        metrics = [self.Metric(key, value, now, step) for key, value in scalars(record).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.id, metrics=metrics[i : i + 1000])

    def close(self, ended: str) -> None:
        self.client.set_terminated(self.id, status=self.STATUS.get(ended, "FAILED"))


TRACKERS = (
    Tracker("tensorboard", "tensorboardX", "tensorboard", (), _TensorBoard),
    Tracker("wandb", "wandb", "wandb", (
        Key("wandb_project", "jaxpar", "with train.loggers naming wandb: the W&B project"),
        Key("wandb_mode", "offline", "with train.loggers naming wandb: offline (files under WORKDIR/wandb, for wandb sync) or "
            "online"),
    ), _WandB, _wandb_checks),
    Tracker("mlflow", "mlflow", "mlruns", (
        Key("mlflow_tracking_uri", "", "with train.loggers naming mlflow: the tracking store; empty: the file store "
            "WORKDIR/mlruns"),
        Key("mlflow_experiment", "jaxpar", "with train.loggers naming mlflow: the experiment the run is logged in"),
    ), _MLflow),
)
NAMES = tuple(t.name for t in TRACKERS)
KEYS = tuple(key for t in TRACKERS for key in t.keys)
FOLDERS = tuple(t.folder for t in TRACKERS)


def selected(train) -> list[Tracker]:
    """The trackers `train.loggers` names (tensorboard left out by `train.tensorboard=False`)."""
    names = [n.strip() for n in str(train.loggers).split(",") if n.strip()]
    return [t for t in TRACKERS if t.name in names and (t.name != "tensorboard" or train.tensorboard)]


def checks(train) -> list[str]:
    """Bad tracker settings, one line each naming the key; a missing package names its extra."""
    names = [n.strip() for n in str(train.loggers).split(",") if n.strip()]
    errors = [f"train.loggers={train.loggers!r}: {n!r} is not one of {', '.join(NAMES)}" for n in names if n not in NAMES]
    for tracker in TRACKERS:
        if tracker.name in names:
            errors += tracker.checks(train)
            if tracker.module != "tensorboardX" and not installed(tracker.module):
                errors.append(missing_line(tracker.module, f"train.loggers={train.loggers!r}"))
    return errors


class Sessions:
    """The open trackers of one run (process 0): `log(record)` to each, `close(ended)`."""

    def __init__(self, config, workdir: str):
        self.workdir, self.sessions = workdir, []
        ids = _read_ids(workdir)
        as_dict = json.loads(config.to_json_best_effort())
        for tracker in selected(config.train):
            session = tracker.open(config.train, workdir, as_dict, ids.get(tracker.name))
            self.sessions.append(session)
            if session.id is not None:
                ids[tracker.name] = session.id
        if ids:
            _write_ids(workdir, ids)

    def log(self, record: dict) -> None:
        for session in self.sessions:
            session.log(record)

    def close(self, ended: str) -> None:
        sessions, self.sessions = self.sessions, []
        for session in sessions:
            session.close(ended)


def _read_ids(workdir: str) -> dict:
    try:
        with open(os.path.join(workdir, IDS_FILE)) as f:
            ids = json.load(f)
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _write_ids(workdir: str, ids: dict) -> None:
    tmp = os.path.join(workdir, f"{IDS_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(ids, f)
    os.replace(tmp, os.path.join(workdir, IDS_FILE))
