"""Plot a run's loss, eval loss and learning rate against step, as a PNG.

  python scripts/plot_run.py runs/llama_tiny --out=runs/llama_tiny/loss.png

Reads RUN_DIR/metrics.jsonl (one JSON object per step, as scripts/train.py writes it; evaluation
records add eval_loss). Bad input (no such run, no records) is one line on stderr, exit 2, before
anything is written. Needs matplotlib.
"""

from __future__ import annotations

import os
import sys

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError


def run(args, config) -> int:
    from jaxpar.analysis.reports.plots import RunError, plot_run, read_run

    try:
        records, title = read_run(args.run_dir)
    except RunError as e:
        raise UsageError(f"RUN_DIR {e}") from None
    out = args.out or os.path.join(args.run_dir, "loss.png")
    if os.path.dirname(out) and not os.path.isdir(os.path.dirname(out)):
        raise UsageError(f"--out={out}: the folder {os.path.dirname(out)!r} does not exist")
    plot_run(records, out, title=title)
    print(f"wrote {out}")
    return 0


COMMANDS = (
    Command(None, "plot a run's loss, eval loss and learning rate against step", run, devices=False, flags=(
        Flag("run_dir", str, "", "a workdir of scripts/train.py (it holds metrics.jsonl)", positional=True, required=True),
        Flag("out", str, "", "the PNG to write (default: RUN_DIR/loss.png)"),
    )),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
