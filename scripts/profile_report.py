"""Step-time breakdown of a profiled run, per named scope, with the collectives' share.

  python scripts/profile_report.py WORKDIR/profile [--module=SUBSTRING]

Reads the latest `jax.profiler` trace under the folder (written with
`--config.train.profile_steps=N`, or `scripts/bench.py --profile`) and the train step's HLO text
saved beside it (`hlo/`), and prints per scope: device time per step, share of all op time,
and how it splits into forward, backward and remat recompute (`jaxpar.analysis.program.profile`).
"""

import sys

from absl import app, flags

_MODULE = flags.DEFINE_string("module", "", "Only HLO modules whose name contains this (default: all).")
_TOP = flags.DEFINE_integer("top", 0, "Also list this many costliest ops of each scope.")


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: profile_report.py WORKDIR/profile")
    from jaxpar.analysis.program import profile

    try:
        trace = profile.load(argv[1])
    except FileNotFoundError as e:
        sys.exit(str(e))
    print(profile.format_report(trace, _MODULE.value))
    if _TOP.value:
        scopes, _, _ = profile.breakdown(trace, _MODULE.value)
        for row in scopes:
            print(f"\n{row.name}:")
            for ns, op, op_name in profile.top_ops(trace, row.name, _TOP.value, _MODULE.value):
                print(f"  {ns / 1e6:8.2f} ms  {op:<40} {op_name[:110]}")


if __name__ == "__main__":
    app.run(main)
