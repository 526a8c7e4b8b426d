"""One script for a GPU's few minutes: the train step in bf16 and each FP8 recipe, the fit check's and the
planner's predictions against what the device measured, and cuDNN against XLA attention.

  python scripts/gpu_check.py [--size=8b] [--layers=4] [--precisions=bf16,tensorwise] [--steps=5] [--budget_s=420] [--out=gpu_check]

`--size=8b` is Llama 3.1 8B's shape cut to `--layers` layers so that it fits one 80 GB device with its
AdamW state; `--size=tiny` runs the same sections on a CPU in seconds (the suite does). Each section
is skipped with a note once `--budget_s` is spent, so the run ends inside a lent machine's minutes.
Writes OUT/gpu_check.json and OUT/gpu_check.md and prints the markdown. What each section measures
is in `jaxpar.bench.gpu_check`; how to run it on a machine whose image has JAX with CUDA is in
docs/gpu_check.md.
"""

from __future__ import annotations

import os
import sys

from jaxpar import command
from jaxpar.bench import refusing_bad_configs
from jaxpar.command import Command, Flag, UsageError


@refusing_bad_configs
def run(args, _):
    from jaxpar.bench import gpu_check

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out={args.out} is a file; name a folder (it is made if missing)")
    known = ["bf16", *gpu_check.fp8_recipes(gpu_check.model_config("tiny"))]
    unknown = [p for p in args.precisions if p not in known]
    if unknown:
        raise UsageError(f"--precisions: {unknown[0]!r} is not one of {', '.join(known)}")
    result = gpu_check.check(args.size, args.steps, args.budget_s, layers=args.layers or None, seq=args.seq or None,
                             precisions=args.precisions or None)
    json_path, md_path = gpu_check.write(result, args.out)
    print(gpu_check.markdown(result), end="")
    print(f"wrote {json_path} and {md_path}")
    return 0


COMMANDS = (
    Command(None, "measure one GPU: step time and MFU per precision, predicted vs measured memory and time, attention",
            run, devices=False, flags=(
        Flag("size", str, "8b", "the model: 8b (Llama 3.1 8B's widths) or tiny (the CPU path)", choices=("8b", "tiny")),
        Flag("layers", int, 0, "layers of the model (0: the size's own, 4 for 8b)", at_least=0),
        Flag("seq", int, 0, "tokens per row (0: the size's own, 4096 for 8b)", at_least=0),
        Flag("precisions", list, "", "bf16 and FP8 recipes (train.fp8) to time (default: bf16 and every recipe)"),
        Flag("steps", int, 5, "timed steps per precision, after one warm-up step", at_least=1),
        Flag("budget_s", float, 420.0, "seconds after which the remaining sections are skipped", at_least=1),
        Flag("out", str, "gpu_check", "folder for gpu_check.json and gpu_check.md"),
    )),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
