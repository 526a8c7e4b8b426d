"""Step-time breakdown of a profiled run, per named scope, with the collectives' share.

  python scripts/profile_report.py WORKDIR/profile [--module=SUBSTRING]

Reads the latest `jax.profiler` trace under the folder (written with
`--config.train.profile_steps=N`, or `scripts/bench.py step --profile=DIR`) and the train step's HLO text
saved beside it (`hlo/`), and prints per scope: device time per step, share of all op time,
and how it splits into forward, backward and remat recompute (`jaxpar.analysis.program.profile`).
"""

import sys

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError

FLAGS = (
    Flag("folder", str, None, "the profile folder (WORKDIR/profile, or the folder of scripts/bench.py step --profile)",
         positional=True, required=True),
    Flag("module", str, "", "only HLO modules whose name contains this (default: all)"),
    Flag("top", int, 0, "also list this many costliest ops of each scope", at_least=0),
)


def run(args, _) -> None:
    from jaxpar.analysis.program import profile

    try:
        trace = profile.load(args.folder)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    print(profile.format_report(trace, args.module))
    if args.top:
        scopes, _, _ = profile.breakdown(trace, args.module)
        for row in scopes:
            print(f"\n{row.name}:")
            for ns, op, op_name in profile.top_ops(trace, row.name, args.top, args.module):
                print(f"  {ns / 1e6:8.2f} ms  {op:<40} {op_name[:110]}")


COMMANDS = (Command(None, "step-time breakdown of a profiled run, per named scope", run, flags=FLAGS, devices=False),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
