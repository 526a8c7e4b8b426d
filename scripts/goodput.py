"""Where a run's wall time went: its goodput per start and over every restart, as a table and a plot.

  python scripts/goodput.py runs/llama_tiny [--out=runs/llama_tiny/goodput.png]

Reads WORKDIR/goodput.json, the ledger every start of scripts/train.py keeps (`jaxpar.train.goodput`:
productive steps, compilation, data, checkpoint saves, restores, evaluations, work lost to faults,
the rest, and the restarts between starts) — also while the run goes on. Prints one row per start
and one for the whole run, and plots the timeline and the seconds of each kind over the wall time.
Bad input (no such workdir, no ledger there, an --out folder that does not exist) is one line on
stderr, exit 2, before anything is written.
"""

from __future__ import annotations

import os
import sys

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError


def run(args, config) -> int:
    from jaxpar.train.goodput import LEDGER_FILE, describe, read, totals
    from jaxpar.train.goodput_report import plot, table

    workdir = args.workdir
    if not os.path.isdir(workdir):
        raise UsageError(f"WORKDIR {workdir!r} is not a directory")
    attempts = read(workdir)
    if not attempts:
        raise UsageError(f"WORKDIR {workdir!r} holds no readable {LEDGER_FILE} (is it a scripts/train.py workdir that started?)")
    out = args.out or os.path.join(workdir, "goodput.png")
    if os.path.dirname(out) and not os.path.isdir(os.path.dirname(out)):
        raise UsageError(f"--out={out}: the folder {os.path.dirname(out)!r} does not exist")
    print(table(attempts))
    summary = describe(totals(attempts))
    print(f"goodput over {len(attempts)} start{'s' * (len(attempts) > 1)}: {summary}")
    plot(attempts, out, title=f"{os.path.normpath(workdir)}: {summary.split(':')[0]}")
    print(f"wrote {out}")
    return 0


COMMANDS = (
    Command(None, "print and plot where a run's wall time went, per start and over its restarts", run, devices=False, flags=(
        Flag("workdir", str, "", "a workdir of scripts/train.py (it holds goodput.json)", positional=True, required=True),
        Flag("out", str, "", "the PNG to write (default: WORKDIR/goodput.png)"),
    )),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
