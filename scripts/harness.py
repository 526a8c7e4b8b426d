"""Downstream evaluation: lm-eval-harness tasks on a trained model, on a mesh of the devices.

  python scripts/harness.py run --workdir=RUN --tasks=mytask --include_path=tasks/ [--limit=100]
  python scripts/harness.py run --from_hf=HF_DIR --tasks=a,b --include_path=tasks/ --output=results.json
  python scripts/harness.py lm_eval -- --model jaxpar --model_args workdir=RUN --tasks mytask --include_path tasks/

`run`: weights from exactly one of --workdir (its newest complete checkpoint, or --step), --checkpoint
or --from_hf, as scripts/sample.py reads them; tasks are lm-eval task names, looked up first in
--include_path (a folder of lm-eval task YAML files; their data local: `dataset_path: json` with
`dataset_kwargs.data_files`), then among lm-eval's own. Prints lm-eval's results table; --output
writes the results as JSON (with every request's scores too, given --log_samples).
`lm_eval`: lm-eval's own command line with jaxpar registered as `--model jaxpar` (the words after
`--` go to it unchanged); model_args: workdir=, checkpoint=, step=, from_hf=, batch_size=,
max_length=, max_gen_toks=, data=, tensor=, expert=.
Mesh: --cpu_devices=N emulates N devices; --tensor / --expert / --data as scripts/sample.py.
Bad input: one line per problem on stderr, exit code 2, before the model is loaded.
"""

from __future__ import annotations

import json
import os
import sys

from jaxpar import command
from jaxpar.command import Command, Flag

MESH_FLAGS = ("data", "expert", "tensor")
FLAGS = (
    Flag("workdir", str, "", "a training workdir: its newest complete checkpoint (or --step)"),
    Flag("checkpoint", str, "", "a checkpoint directory (e.g. from scripts/convert.py --to_checkpoint)"),
    Flag("step", int, -1, "the checkpoint step to load (-1: the newest complete one)", at_least=-1),
    Flag("from_hf", str, "", "a transformers checkpoint directory"),
    Flag("tasks", list, "", "lm-eval task names, comma-separated", required=True),
    Flag("include_path", str, "", "a folder of lm-eval task YAML files"),
    Flag("limit", int, 0, "documents per task (0: all)", at_least=0),
    Flag("num_fewshot", int, -1, "few-shot examples per document (-1: each task's own)", at_least=-1),
    Flag("batch_size", int, 16, "rows per forward / generation batch (rounded up to the mesh's batch ranks)", at_least=1),
    Flag("max_length", int, 0, "the longest input in tokens, cut from the left (0: model.max_position_embeddings)", at_least=0),
    Flag("max_gen_toks", int, 256, "new tokens per generation when a task does not say", at_least=1),
    Flag("output", str, "", "write the results to this JSON file"),
    Flag("log_samples", bool, False, "with --output: every request's scores and generations too"),
    *(Flag(axis, int, 0, f"mesh.{axis} of the evaluation mesh (0: the default)", at_least=0) for axis in MESH_FLAGS),
)


def checks(args) -> list[str]:
    from jaxpar.loading.load import source_problems

    problems = []
    problems += source_problems(args.workdir, args.checkpoint, args.from_hf, args.step)
    if args.include_path and not os.path.isdir(args.include_path):
        problems.append(f"--include_path={args.include_path} is not a folder (of lm-eval task YAML files)")
    if args.log_samples and not args.output:
        problems.append("--log_samples needs --output=FILE")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        problems.append(f"--output={args.output}: its folder does not exist")
    elif args.output and os.path.isdir(args.output):
        problems.append(f"--output={args.output} is a folder; name a file")
    return problems


def _lm_eval(needed_by: str):
    from jaxpar.extras import MissingExtra, require

    try:
        require("lm_eval", needed_by)
    except MissingExtra as e:
        raise command.UsageError(str(e)) from None


def run_tasks(args, _) -> int:
    _lm_eval("scripts/harness.py")
    from lm_eval.utils import make_table

    from jaxpar.checkpoint import CheckpointError
    from jaxpar.downstream import harness
    from jaxpar.loading.lm_eval import JaxparRunLM
    from jaxpar.mesh import MeshError
    from jaxpar.sampling import SampleError

    if unknown := harness.unknown_tasks(args.tasks, args.include_path, key="--tasks"):
        raise command.UsageError("\n".join(unknown))
    try:
        lm = JaxparRunLM(args.workdir, args.checkpoint, args.step, args.from_hf, batch_size=args.batch_size,
                      max_length=args.max_length, max_gen_toks=args.max_gen_toks,
                      **{axis: getattr(args, axis) for axis in MESH_FLAGS})
    except (SampleError, CheckpointError, MeshError, ValueError) as e:
        return command.error(e)
    mesh = " ".join(f"{k}={v}" for k, v in lm.sampler.mesh.shape.items())
    print(f"evaluating {lm.loaded.source} on mesh {mesh}", flush=True)
    results = harness.evaluate(lm, args.tasks, args.include_path, args.limit, None if args.num_fewshot < 0 else args.num_fewshot,
                               log_samples=args.log_samples)
    print(make_table(results))
    if args.output:
        kept = {key: results[key] for key in ("results", "configs", "n-shot", "n-samples", "samples") if key in results}
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(kept, f, indent=1, default=_plain)
        print(f"wrote {args.output}")
    return 0


def _plain(value):
    """numpy scalars as numbers, anything else json cannot write as its text."""
    return value.item() if hasattr(value, "item") else str(value)


def run_lm_eval(args, _) -> int:
    _lm_eval("scripts/harness.py lm_eval")
    from lm_eval.__main__ import cli_evaluate

    import jaxpar.loading.lm_eval  # noqa: F401 (registers --model jaxpar)

    sys.argv = ["lm_eval", *args.rest]
    cli_evaluate()
    return 0


COMMANDS = (
    Command("run", "evaluate a model on lm-eval tasks", run_tasks, flags=FLAGS, checks=checks),
    Command("lm_eval", "lm-eval's command line with --model jaxpar registered (its words after --)", run_lm_eval, rest=True),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
