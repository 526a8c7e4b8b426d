"""FP8 training on CPU: each recipe's loss curve against bf16's, and the emulated step time beside bf16's.

  python scripts/fp8.py curves [--train_config=configs/llama_tiny.py] [--steps=200] [--out=docs/figures/fp8_loss.png]
  python scripts/fp8.py step [--train_config=configs/llama_tiny.py] [--steps=3] [--repeats=3]
  (both: [--recipes=tensorwise,rowwise,delayed])

`curves` trains the config in fp32, bf16 and bf16 with each `train.fp8` recipe (same seed, same
data), writes the plot and prints each curve's gap to bf16 (means over 20-step windows). `step`
times the train step in bf16 and each recipe, alternated within this one invocation. On CPU the FP8
matmuls are emulated (XLA converts the FP8 operands back and runs fp32 dots): those times say what
the quantization passes cost here, nothing of a GPU's FP8 GEMMs. What it does: `jaxpar.bench.fp8`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(path: str, steps: int | None = None):
    from jaxpar.command.config_file import load_config

    if not os.path.isfile(path):
        raise UsageError(f"--train_config={path} is not a file")
    config = load_config(path)
    if steps is not None:
        config.train.steps = steps
    return config


def run_curves(args, _):
    from jaxpar.bench import fp8

    if os.path.dirname(args.out) and not os.path.isdir(os.path.dirname(args.out)):
        raise UsageError(f"--out={args.out}: the folder {os.path.dirname(args.out)!r} does not exist")
    config = _config(args.train_config, args.steps)
    with tempfile.TemporaryDirectory(prefix="jaxpar_fp8_") as root:
        result = fp8.curves(config, root, tuple(args.recipes))
    fp8.plot(result, args.out)
    for precision, gap in result["gaps_to_bf16"].items():
        print(f"{precision:>10}: final loss {result['losses'][precision][-1]:.4f}; gap to bf16 over "
              f"{result['window']}-step means: max {gap['max_window_gap']:.4f} "
              f"({100 * gap['max_window_gap_relative']:.2f}%), last window {gap['final_window_gap']:+.4f}")
    print(f"{'bf16':>10}: final loss {result['losses']['bf16'][-1]:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    print(f"wrote {args.out}")


def run_step(args, _):
    from jaxpar.bench import fp8

    times = fp8.step_times(_config(args.train_config), args.steps, args.repeats, tuple(args.recipes))
    base = times["bf16"]
    print("precision   step_s   vs bf16   (CPU: FP8 emulated)")
    for precision, t in times.items():
        print(f"{precision:>10}   {t:.3f}   {t / base:.2f}x")


RECIPES_FLAG = Flag("recipes", list, "tensorwise,rowwise,delayed", "the train.fp8 recipes run beside bf16 (and fp32)",
                    choices=("tensorwise", "rowwise", "delayed"))

COMMANDS = (
    Command("curves", "each FP8 recipe's loss curve beside bf16's and fp32's, and a plot", run_curves, flags=(
        Flag("train_config", str, os.path.join(ROOT, "configs", "llama_tiny.py"), "the config file trained"),
        Flag("steps", int, 200, "steps of each run", at_least=1),
        Flag("out", str, os.path.join(ROOT, "docs", "figures", "fp8_loss.png"), "the PNG to write"),
        Flag("json", str, "", "also write the losses and gaps here"),
        RECIPES_FLAG,
    )),
    Command("step", "the train step's time in bf16 and each FP8 recipe, alternated", run_step, flags=(
        Flag("train_config", str, os.path.join(ROOT, "configs", "llama_tiny.py"), "the config file timed"),
        Flag("steps", int, 3, "timed steps per round", at_least=1),
        Flag("repeats", int, 3, "rounds over the precisions", at_least=1),
        RECIPES_FLAG,
    )),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
