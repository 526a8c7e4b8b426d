"""lm-eval tasks on a model, from the command line (scripts/harness.py) or every
`eval.harness_every_steps` training steps, with the checks of the `eval.harness_*` keys.

    harness = Harness(config, devices)      # once, before the run (None-free: only when the keys turn it on)
    record = harness.run(params, step)      # {"step": 100, "harness/mytask/acc": 0.4, ...}

Tasks are lm-eval's own YAML format, read from `eval.harness_include_path` (a folder of task files
whose data are local files: `dataset_path: json` and `dataset_kwargs.data_files`); names not found
there are looked up among lm-eval's bundled tasks (indexing those takes seconds, and most of them
read the hub). `eval.harness_limit` caps the documents per task (0: all).

In the loop the training params are copied onto a sampling mesh of the training devices (tensor and
expert as trained, data the rest; pipeline and context ranks become data ranks): one extra copy
of the params while the evaluation runs. Every process runs it (the programs are SPMD); the
record comes back on every process. lm-eval is asked not to seed Python's, numpy's or torch's
global generators, and their states are restored afterwards, so training draws what it would have.
"""

from __future__ import annotations

import logging
import os
import random
from contextlib import contextmanager

import numpy as np

from jaxpar.ranges import at_least

KEY_PREFIX = "harness"  # record keys: harness/TASK/METRIC[/FILTER]


def enabled(config) -> bool:
    return int(config.eval.get("harness_every_steps", 0)) > 0


def task_names(text: str) -> list[str]:
    return [name.strip() for name in str(text).split(",") if name.strip()]


def checks(config) -> list[str]:
    """Problems with the eval.harness_* keys that the config alone shows (cheap: no import of lm-eval)."""
    evaluation = config.eval
    errors = at_least("eval.harness_every_steps", evaluation.harness_every_steps, 0)
    errors += at_least("eval.harness_limit", evaluation.harness_limit, 0)
    include = evaluation.harness_include_path
    if include and not os.path.isdir(include):
        errors.append(f"eval.harness_include_path={include!r} is not a folder (of lm-eval task YAML files)")
    if enabled(config) and not task_names(evaluation.harness_tasks):
        errors.append(f"eval.harness_every_steps={evaluation.harness_every_steps} but eval.harness_tasks is empty; "
                      f"name lm-eval tasks, comma-separated")
    return errors


def task_problems(config) -> list[str]:
    """Problems only lm-eval can see: it is installed, every task name is known, the run has a
    tokenizer. Nothing when the harness is off."""
    if not enabled(config) or checks(config):
        return []
    from jaxpar.extras import MissingExtra, require

    try:
        require("lm_eval", f"eval.harness_every_steps={config.eval.harness_every_steps}")
    except MissingExtra as e:
        return [str(e)]
    from jaxpar.sampling.load import run_tokenizer

    errors = [] if run_tokenizer(config) is not None else [
        "eval.harness_every_steps: this run has no tokenizer to give lm-eval text (a token file without its "
        "scripts/prepare_data.py sidecar); set data.tokenizer"]
    return errors + unknown_tasks(task_names(config.eval.harness_tasks), config.eval.harness_include_path)


def unknown_tasks(names: list[str], include_path: str, key: str = "eval.harness_tasks") -> list[str]:
    known = task_manager(names, include_path).all_tasks
    return [f"{key}: {name!r} is not an lm-eval task" + (f" in {include_path} or lm-eval's own" if include_path else "")
            for name in names if name not in known]


def task_manager(names: list[str], include_path: str):
    """lm-eval's TaskManager over `include_path`, indexing lm-eval's bundled tasks only when a name is
    not found there (module docstring)."""
    from lm_eval.tasks import TaskManager

    with quiet_lm_eval():
        if include_path:
            local = TaskManager(include_path=include_path, include_defaults=False)
            if all(name in local.all_tasks for name in names):
                return local
        return TaskManager(include_path=include_path or None)


def evaluate(lm, names: list[str], include_path: str = "", limit: int = 0, num_fewshot: int | None = None,
             log_samples: bool = False, bootstrap_iters: int = 100000) -> dict:
    """lm-eval's `simple_evaluate` of `lm` on tasks `names`, leaving the global random generators as
    they were (`bootstrap_iters`: lm-eval's resamples for the standard errors that need them; 0: none)."""
    import lm_eval

    with _global_rng_kept(), quiet_lm_eval():
        return lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=task_manager(names, include_path), limit=limit or None,
            num_fewshot=num_fewshot, log_samples=log_samples, random_seed=None, numpy_random_seed=None,
            torch_random_seed=None, verbosity="ERROR", bootstrap_iters=bootstrap_iters,
        )


def record(step: int, results: dict) -> dict:
    """One metrics record of an evaluation: harness/TASK/METRIC (the filter appended unless it is
    lm-eval's "none"), standard errors left out."""
    out = {"step": int(step)}
    for task, metrics in sorted(results["results"].items()):
        for name, value in sorted(metrics.items()):
            metric, _, filtered = name.partition(",")
            if not filtered or metric.endswith("_stderr") or not isinstance(value, (int, float, np.number)):
                continue
            out[f"{KEY_PREFIX}/{task}/{metric}" + ("" if filtered == "none" else f"/{filtered}")] = float(value)
    return out


class Harness:
    """The lm-eval model of one training run on its devices, and its evaluations."""

    def __init__(self, config, devices):
        from jaxpar.downstream.model import JaxparLM
        from jaxpar.sampling.engine import Sampler
        from jaxpar.sampling.load import Loaded, run_tokenizer, sampling_mesh

        self.config, self.every = config, int(config.eval.harness_every_steps)
        mesh = sampling_mesh(config.model, {}, dict(config.mesh), list(devices))
        sampler = Sampler(config.model, mesh, config.train.compute_dtype)
        tokenizer = run_tokenizer(config)
        eos = getattr(tokenizer, "eos_token_id", None)  # a byte run has none: data.eos_id, if set
        eos = eos if eos is not None else (int(config.data.eos_id) if config.data.eos_id >= 0 else None)
        self.loaded = Loaded(config.model, sampler, None, tokenizer, eos, "the training params")
        self.lm = JaxparLM(self.loaded)
        self.names = task_names(config.eval.harness_tasks)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def run(self, params, step: int) -> dict:
        """Evaluates `params` (laid out as training keeps them) on the tasks; the record of step `step`."""
        self.lm.params = self.loaded.sampler.place(params)
        try:
            results = evaluate(self.lm, self.names, self.config.eval.harness_include_path, int(self.config.eval.harness_limit),
                               bootstrap_iters=0)  # the record leaves standard errors out
        finally:
            self.lm.params = None  # the copy goes with the evaluation
        return record(step, results)


_KEPT: list[tuple[object, Harness]] = []  # (config, its Harness): the newest run's only


def run_harness(config, params, step: int, devices=None) -> dict:
    """`Harness(config, devices).run(params, step)`, the Harness (its compiled programs) kept for
    the same config object; `devices`: the training mesh's (default: all)."""
    import jax

    if not _KEPT or _KEPT[0][0] is not config:
        _KEPT[:] = [(config, Harness(config, jax.devices() if devices is None else devices))]
    return _KEPT[0][1].run(params, step)


@contextmanager
def _global_rng_kept():
    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


@contextmanager
def quiet_lm_eval(level: int = logging.ERROR):
    """lm-eval's loggers at `level` for the duration (it warns per task about defaulted metric settings)."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval")]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, before):
            logger.setLevel(old)
