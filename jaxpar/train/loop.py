"""The training loop: preflight, lock, build, compile and fit check, resume or init, then step, record, save.

Order matters for never losing data: everything a run reads is checked first (`preflight.check_run`,
no writes); then the workdir and the checkpoint directory are locked; the program is built and its step compiled on abstract inputs
and checked against the devices' memory (`jaxpar.train.fit`, before any data is read or state
allocated), then the data loaded and the state restored (newest complete checkpoint that fits) or
initialised. Only then — the run is known to start — is anything of an earlier run touched:
`--overwrite` moves it aside (`jaxpar.train.aside`: deleted at this run's first complete checkpoint,
put back if this run fails before), or a resumed `metrics.jsonl` is cut back to the restored step. A
signal during start-up stops the run at the end of its phase (`StopSignals.check`), one in the loop
after the step with a final checkpoint (during an evaluation: between two of its batches). Data that
fails to read once the run started (a bad record the preflight did not reach) ends it in one line
through one handler (`_data_errors`), after a checkpoint of the steps trained since the last one;
the final checkpoint is saved before the final evaluation. Each step's bookkeeping is its own
function (`_record`, `_after_step`), so the loop body stays a short list of calls.

Checkpoint step numbers count the batches consumed, which is also the `step` field of
metrics.jsonl; `state.step` counts applied updates (it lags on skipped steps). Each checkpoint
also holds the data position (`DocumentBatches.get_state`). With an eval set (`jaxpar.train.eval`)
the run evaluates every `eval.every_steps` steps and at the end, each evaluation its own
metrics.jsonl record.
Multi-process: every process runs the loop; logging, metrics and workdir files are written by
process 0 only, checkpoints by all (each its own shards, `jaxpar.checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time

import jax
from jax.experimental import multihost_utils

from jaxpar import peers
from jaxpar.checkpoint import CheckpointError, Checkpoints, abstract_state, check_shared_storage, compare_configs, tiers
from jaxpar.checkpoint.listing import finished_steps
from jaxpar.checkpoint.storage import check_free_space, is_remote, state_bytes
from jaxpar.checkpoint.tiers import Tiers
from jaxpar.data.batches import DocumentBatches, to_global
from jaxpar.data.corpus import corpus_fingerprint, corpus_tokens, corpus_warnings, describe, eval_enabled, training_stream
from jaxpar.data.documents import DataError
from jaxpar.data.packing import Packer
from jaxpar.downstream import harness as downstream
from jaxpar.interop.peft import initial_params as peft_adapters
from jaxpar.interop.sharded import load_params_onto
from jaxpar.mesh import describe as describe_mesh
from jaxpar.models import lora
from jaxpar.train import aside as asides
from jaxpar.train import goodput, preflight
from jaxpar.train import workdir as workdirs
from jaxpar.train.environment import report
from jaxpar.train.eval import Evaluator, evaluator
from jaxpar.train.fit import compile_fitting
from jaxpar.train.nonfinite import NonFiniteGuard, NonFiniteStop
from jaxpar.train.observe import Observer, measures_peak
from jaxpar.train.progress import Progress, StartupLog
from jaxpar.train.setup import build
from jaxpar.train.signals import Interrupted, StopSignals
from jaxpar.train.start import lock, memory_report, run_preflight, unlock

# Metrics every step reports; anything else a model reports (MoE router stats) is logged as is.
STEP_METRICS = ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped_steps")


class DataFault(preflight.ConfigError):
    """Data the preflight did not read (a bad record deep in a shard) failed to read once the run had
    started: one line naming the key and file, after a checkpoint of what was trained (`_data_errors`)."""


def train(config, workdir: str, devices=None, *, overwrite: bool = False, progress: bool = True) -> list[dict]:
    """Trains to `config.train.steps` steps (resuming from WORKDIR's checkpoints when they fit);
    returns the metrics of the steps run here, which it also appends to WORKDIR/metrics.jsonl.

    Raises ConfigError (bad input, nothing written), WorkdirError (busy, or no lock possible),
    CheckpointError, NonFiniteStop or Interrupted (during start-up: nothing changed; in the loop:
    after a final checkpoint); each message is one line."""
    devices = list(jax.devices() if devices is None else devices)
    ledger = goodput.Ledger(writer=jax.process_index() == 0)  # the run's wall time starts here
    startup = StartupLog(enabled=jax.process_index() == 0, open_lines=jax.process_count() == 1, clock=ledger)
    try:
        with StopSignals() as signals:  # from the first phase on: a signal never raises inside native code
            with startup.phase("checking the config, the data and the workdir"):
                run = run_preflight(config, workdir, devices, overwrite)
            signals.check("preflight", run.workdir.resume_step is not None)
            peers.set_hint(lambda: _resume_point(run.workdir.checkpoint_dir))
            locks = lock(workdir, run.workdir.checkpoint_dir, startup, tiers.local_dir(config))
            try:
                if not overwrite and jax.process_index() == 0:  # earlier starts of this run: goodput accumulates
                    ledger.read_earlier(workdir)
                return _train(config, run, devices, signals, progress, startup)
            finally:
                unlock(locks)
    except (preflight.ConfigError, workdirs.WorkdirError, NonFiniteStop, Interrupted):
        raise  # one-line errors every process reaches together
    except CheckpointError:
        peers.stop_if_peer_lost(collective_failed=False)  # a lost peer ends this process here (exit 4)
        raise
    except Exception:
        peers.stop_if_peer_lost(collective_failed=True)
        raise


def _resume_point(checkpoint_dir: str) -> str:
    steps = finished_steps(checkpoint_dir)
    if not steps:
        return f"no checkpoint was completed in {checkpoint_dir}"
    return f"the newest complete checkpoint, {checkpoint_dir}/{steps[-1]}, is the resume point"


@dataclasses.dataclass
class _Run:
    """What the loop body needs besides the state (built once)."""

    config: object
    plan: workdirs.WorkdirPlan
    program: object
    iterator: DocumentBatches
    checkpoints: Tiers | None
    corpus: dict  # the corpus's identity (size, fingerprint), saved with every checkpoint
    signals: StopSignals
    show_progress: bool
    startup: StartupLog  # process 0's start-up lines (also the lines said before the first step)
    ledger: goodput.Ledger  # where the run's wall time goes (`startup.clock`)
    metrics: workdirs.MetricsLog | None = None
    progress: Progress | None = None
    guard: NonFiniteGuard | None = None
    harness: downstream.Harness | None = None  # lm-eval tasks every eval.harness_every_steps
    observer: Observer | None = None
    evaluator: Evaluator | None = None
    evaluated: int = -1  # the last step evaluated
    aside: asides.Aside | None = None  # the earlier run --overwrite moved aside (process 0), until let go
    start: int = 0  # the step the run started (or resumed) at
    step: int = 0  # the last step trained, and its state: what a data fault saves before it ends the run
    state: object = None


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, flush=True)


def _open_checkpoints(config, plan: workdirs.WorkdirPlan) -> Tiers:
    """The persistent tier, and the local one when checkpoint.local_dir is set (`jaxpar.checkpoint.tiers`)."""
    section, local = config.checkpoint, tiers.local_dir(config)
    keep = int(section.keep) or None  # 0: keep every checkpoint
    persistent = Checkpoints(plan.checkpoint_dir, every_steps=int(section.every_steps), keep=keep, async_save=bool(section.async_save))
    if not local:
        return Tiers(persistent)
    if plan.overwrite:  # the replaced run's cache of restarts goes with it
        if jax.process_index() == 0:
            tiers.clear(local)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxpar-local-tier-cleared")
    return Tiers(persistent, Checkpoints(local, every_steps=int(section.local_every_steps), keep=int(section.local_keep),
                                         async_save=bool(section.async_save)))


def _restore(run: _Run):
    """(state, data position, lines to print) from the newest readable checkpoint, straight onto this
    run's shardings."""
    program = run.program
    restored = run.checkpoints.restore(None, abstract_state(jax.eval_shape(program.init), program.state_shardings))
    # A fallback may have landed on an older checkpoint: its config must fit too.
    notes = compare_configs(restored.config, run.config.to_json_best_effort(), checkpoint=restored.path)
    if problem := workdirs.corpus_changed_problem(restored.path, restored.data_state, run.corpus):
        raise CheckpointError(problem)
    notes.append(f"resumed from checkpoint {restored.path} (step {restored.step})")
    return program.to_storage(restored.state), restored.data_state, notes  # checkpoints hold the natural layer order


def _initial_state(run: _Run):
    hf_dir = run.config.train.init_from_hf
    peft_dir = run.config.train.lora.init_from_peft if "lora" in run.config.train else ""
    if not hf_dir and not peft_dir:
        return run.program.init()
    if hf_dir:
        params = load_params_onto(hf_dir, run.config.model, lora.base_of(run.program.state_shardings.params), run.config.train.param_dtype)
    else:
        params = lora.base_of(jax.device_get(run.program.to_natural(run.program.init()).params))
    if peft_dir:  # the adapters a PEFT adapter folder holds, on the base
        params = peft_adapters(params, peft_dir, run.program.model_config, run.config.train.seed)
    return run.program.init_from_params(params)


def _start(run: _Run, resume_step: int | None) -> None:
    """The run is known to start (state ready, step compiled): now touch the workdir."""
    writer = jax.process_index() == 0
    if writer and run.plan.overwrite:
        run.aside = asides.set_aside(run.plan.workdir, run.plan.checkpoint_dir, workdirs.RUN_FILES)
        if run.aside is not None:
            run.startup.say(f"moved the earlier run aside to {run.aside.where} until this run's first checkpoint")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxpar-workdir-ready")
    if run.checkpoints is None:
        run.checkpoints = _open_checkpoints(run.config, run.plan)
    if writer:
        workdirs.write_config(run.plan.workdir, run.config)
    run.metrics = workdirs.MetricsLog(run.plan.workdir, resume_step, writer=writer)
    run.ledger.open(run.plan.workdir, resume_step, run.start)
    for line in goodput.restart_summary(run.ledger):
        run.startup.say(line)
    _set_quit_note(run)


def _set_quit_note(run: _Run) -> None:
    """What a second signal (quit at once, no final checkpoint) leaves, for its one line."""
    note = f"the newest complete checkpoint in {run.plan.checkpoint_dir} is where a rerun resumes"
    if run.aside is not None:
        note = f"this run has no checkpoint yet: the run --overwrite replaces is kept in {run.aside.where}"
    run.signals.quit_note = note


def _let_go_once_proven(run: _Run) -> None:
    """--overwrite's earlier run is deleted once this run has a complete checkpoint of its own."""
    if run.aside is not None and run.checkpoints.latest_step() is not None:
        run.aside.let_go()
        run.aside = None
        _set_quit_note(run)


def _train(config, pre: preflight.Preflight, devices, signals: StopSignals, progress: bool, startup: StartupLog) -> list[dict]:
    plan, train_cfg = pre.workdir, config.train
    resuming = plan.resume_step is not None
    for note in plan.notes:
        startup.say(note)
    if not is_remote(plan.checkpoint_dir):  # waits for the other processes' answers (up to 10 s)
        shared = startup.phase("checking that every process sees the checkpoint directory")
        with shared if jax.process_count() > 1 else contextlib.nullcontext():
            check_shared_storage(plan.checkpoint_dir)
    with startup.phase("building the model and its shardings"):
        program = build(config, devices)
    if startup.enabled:  # process 0
        for line in report(program.mesh):
            startup.say(line)
        startup.say(f"mesh: {describe_mesh(program.mesh)} on {len(devices)} {devices[0].platform} device{'s' * (len(devices) != 1)}")
        startup.say(describe(config))
        startup.say(memory_report(program))
    signals.check("build", resuming)
    # Compiled on abstract inputs and checked against the devices' memory before any data is read or
    # state allocated (`jaxpar.train.fit`: DoesNotFit, one line); the loop runs this executable.
    with startup.phase("compiling the train step and checking that it fits the devices' memory", kind="compile"):
        step_fn, compile_s = compile_fitting(program, config, devices, say=startup.say)
    signals.check("compile", resuming)
    with startup.phase("opening the data", kind="input"), _data_errors(None):
        warnings = corpus_warnings(config.data)
        corpus = {workdirs.CORPUS_TOKENS: corpus_tokens(config.data), workdirs.CORPUS_FINGERPRINT: corpus_fingerprint(config.data)}
        packer = Packer(training_stream(config), train_cfg.global_batch_size, train_cfg.seq_len + 1, bool(config.data.packing))
        batches = DocumentBatches(packer)
    for warning in warnings:
        startup.say(f"warning: {warning}")
    signals.check("loading data", resuming)
    check_free_space(plan.checkpoint_dir, state_bytes(jax.eval_shape(program.init)))  # before the state, not at the first save
    run = _Run(config, plan, program, batches, None, corpus, signals, progress, startup, startup.clock)
    try:
        history = _run(run, resuming, step_fn, compile_s)
    except BaseException as error:
        _amend(error, _finish(run, failed=True, error=error))
        raise
    _finish(run, failed=False)
    return history


def _run(run: _Run, resuming: bool, step_fn, compile_s: float) -> list[dict]:
    """Restore or initialise the state, then the steps (`step_fn`: the fit-checked executable)."""
    config, program, signals, train_cfg, startup = run.config, run.program, run.signals, run.config.train, run.startup
    if resuming:
        with startup.phase(f"restoring the newest checkpoint of {run.plan.checkpoint_dir}", kind="restore"), _data_errors(run):
            run.checkpoints = _open_checkpoints(config, run.plan)
            state, data_state, notes = _restore(run)
            run.iterator.set_state(data_state)
        for note in notes:
            startup.say(note)
    else:
        hf_dir = config.train.init_from_hf
        with startup.phase(f"reading the initial parameters from transformers checkpoint {hf_dir}" if hf_dir
                           else "initialising the parameters"):
            state = _initial_state(run)
    start = run.start = run.step = run.iterator.step
    run.state = state
    signals.check("restore" if resuming else "init", resuming)
    if start >= train_cfg.steps:
        startup.say(f"nothing to do: the checkpoint is at step {start} and train.steps={train_cfg.steps}")
        return []
    if eval_enabled(config):
        with startup.phase("compiling the evaluation step", kind="compile"):  # before anything is written
            run.evaluator = evaluator(config, program)
    if downstream.enabled(config):
        with startup.phase("preparing the lm-eval tasks", kind="eval"):
            run.harness = downstream.Harness(config, list(program.mesh.devices.flat))
    _start(run, start if resuming else None)
    measuring = measures_peak(program.mesh.devices.flat[0], train_cfg.peak_flops_per_device)
    with startup.phase("timing a matmul: this host's FLOP/s, the peak MFU counts against") if measuring else contextlib.nullcontext():
        run.observer = Observer(config, run.plan.workdir, program, step_fn, compile_s)
    run.guard = NonFiniteGuard(train_cfg, skipped_before=int(jax.device_get(state.loss_scale.skipped_steps)))
    run.progress = Progress(train_cfg.steps, start, train_cfg.log_every, enabled=run.show_progress and jax.process_index() == 0)
    history = []
    with signals.deferred(), _data_errors(run):
        for step in range(start + 1, train_cfg.steps + 1):
            with run.ledger.timed("input"):
                batch = to_global(next(run.iterator), program.batch_sharding)
            with run.observer.step(step):  # the profile window, if this step is in it
                run.ledger.begin_step()
                started = time.perf_counter()
                state, metrics = step_fn(state, batch)
                metrics = jax.device_get(metrics)  # waits for the step, so the timing below is honest
                seconds = time.perf_counter() - started
            run.step, run.state = step, state
            record = _record(step, metrics, config, run.observer.throughput(step, seconds))
            history.append(record)
            _after_step(run, step, state, record, metrics, signals)
        if run.evaluator is not None and run.evaluated != train_cfg.steps:
            _save(run, train_cfg.steps, state, force=True)  # the trained state is safe before the final eval reads data
            if not _evaluate(run, train_cfg.steps, state):
                _wait(run)
                raise _interrupted(run, f"during the final evaluation after step {train_cfg.steps}")
    _save(run, train_cfg.steps, state, force=True)
    _wait(run)
    _let_go_once_proven(run)
    return history


@contextlib.contextmanager
def _data_errors(run: _Run | None):
    """The one handler of data that fails to read once the run has started (before that, the preflight
    names it): a `DataError` (one line naming the key and file) ends the run as a `DataFault` (exit 2),
    after a checkpoint of the steps trained since the last one, so nothing trained is lost."""
    try:
        yield
    except DataError as error:
        raise DataFault(f"{error}; {_saved_before_fault(run)}") from None


def _saved_before_fault(run: _Run | None) -> str:
    if run is None or run.checkpoints is None or run.step <= run.start:
        return "nothing was trained since the run started: fix the data and rerun"
    _save(run, run.step, run.state, force=True)
    _wait(run)
    _let_go_once_proven(run)
    return f"the run stopped after step {run.step}; its state is saved in checkpoint {run.checkpoints.path(run.step)}"


def _interrupted(run: _Run, when: str) -> Interrupted:
    signum = run.signals.agreed()
    name = signal.Signals(signum).name
    path = run.checkpoints.path(run.step)
    return Interrupted(signum, f"interrupted by {name} {when}: checkpoint {path} saved; rerun the same command to resume")


def _amend(error: BaseException, note: str | None) -> None:
    """Adds `note` (what became of the earlier run) to the one-line message of the error ending the run."""
    if note is None:
        return
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}; {note}", *error.args[1:])
    else:
        _say(note)


def _evaluate(run: _Run, step: int, state) -> bool:
    """One evaluation on the eval set: its own metrics.jsonl record and TensorBoard scalars. False:
    a signal stopped it between two batches (nothing is recorded)."""
    with run.ledger.timed("eval"):
        record = run.evaluator.run(state.params, step, stop=run.signals.agreed)
    if record is None:
        return False
    run.evaluated = step
    run.metrics.write(record)
    run.observer.log(record)
    _say(f"eval at step {step}: loss {record['eval_loss']:.4f}, perplexity {record['eval_perplexity']:.2f} "
         f"over {record['eval_tokens']} tokens")
    return True


def _record(step: int, metrics: dict, config, timing: dict) -> dict:
    """The metrics.jsonl line of one step (`timing`: step_s, tokens_per_sec, mfu, compile_s)."""
    record = {
        "step": step,
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "learning_rate": float(metrics["learning_rate"]),
        **timing,
        "skipped_steps": int(metrics["skipped_steps"]),
    }
    if config.train.compute_dtype == "float16":
        record["loss_scale"] = float(metrics["loss_scale"])
    record.update({k: v.tolist() for k, v in metrics.items() if k not in STEP_METRICS})
    return record


def _after_step(run: _Run, step: int, state, record: dict, metrics: dict, signals: StopSignals) -> None:
    """Log, then stop for non-finite values (before any save), save if due, stop if signalled."""
    run.metrics.write(record)
    run.ledger.step(step, record["step_s"])  # after its line: a kill between leaves the step unaccounted, never lost twice
    run.observer.log(record)
    run.progress.update(record)
    run.guard.observe(step, metrics)  # NonFiniteStop: the bad step is logged, never saved
    if run.evaluator is not None and run.evaluator.due(step):
        _evaluate(run, step, state)
    if run.harness is not None and run.harness.due(step):
        with run.ledger.timed("eval"):  # every process: the programs are SPMD
            record = run.harness.run(run.program.to_natural(state).params, step)  # the sampler reads natural layer order
        run.metrics.write(record)
        run.observer.log(record)
    _save(run, step, state)
    _let_go_once_proven(run)
    if signals.agreed() is not None:
        _save(run, step, state, force=True)
        _wait(run)
        _let_go_once_proven(run)
        raise _interrupted(run, f"after step {step}")


def _save(run: _Run, step: int, state, *, force: bool = False) -> None:
    # A failed (background) write surfaces at the next save or wait as one CheckpointError line.
    if not run.checkpoints.should_save(step, force):
        return
    data_state = {**run.iterator.get_state(), **run.corpus}
    with run.ledger.timed("checkpoint"):
        # Checkpoints hold the layers in natural order (`TrainProgram.to_natural`), portable across layouts.
        state = run.program.to_natural(state)
        saved = run.checkpoints.save(step, state, data_state=data_state, config=run.config.to_json_best_effort(), force=force)
    if saved:
        run.ledger.mark(step)


def _wait(run: _Run) -> None:
    with run.ledger.timed("checkpoint"):
        run.checkpoints.wait()


def _finish(run: _Run, failed: bool, error: BaseException | None = None) -> str | None:
    """Closes what the run opened; after a failure, puts back an earlier run --overwrite moved aside
    if this run never completed a checkpoint. Returns a note on the earlier run's fate, if any."""
    run.iterator.close()  # the packing thread
    close_error = None
    if run.checkpoints is not None:
        try:
            with run.ledger.timed("checkpoint"):
                run.checkpoints.close()  # waits for a save still being written
        except CheckpointError as e:
            close_error = None if failed else e  # after a failure, the error that ended the run is the one reported
    ended = "done" if error is None and close_error is None else type(error or close_error).__name__
    if run.ledger.opened:
        _account(run, ended)
    if run.observer is not None:
        run.observer.close(ended)
    if run.progress is not None:
        run.progress.close()
    if run.metrics is not None:
        run.metrics.close()
    if close_error is not None:
        raise close_error
    if run.aside is None:
        return None
    aside, run.aside = run.aside, None
    if finished_steps(run.plan.checkpoint_dir):  # a save completed after all (e.g. while closing)
        aside.let_go()
        return None
    where = aside.where
    try:
        aside.restore()
    except OSError as e:
        return f"the earlier run --overwrite replaces is kept in {where} (moving it back failed: {e})"
    return f"this run wrote no checkpoint, so the earlier run is back in {run.plan.workdir}"


def _account(run: _Run, ended: str) -> None:
    """The run's goodput at its end: a metrics.jsonl record (and the trackers'), the summary lines."""
    attempts = run.ledger.attempts()  # one reading: the record and the printed lines say the same numbers
    record = goodput.record(attempts, run.step)
    run.metrics.write(record)
    if run.observer is not None:
        run.observer.log(record)
    for line in goodput.summary(attempts):
        _say(line)
    run.ledger.close(ended)
