"""Measurements of jaxpar's real train step beside what it is compared with: the bodies of the
subcommands of `scripts/bench.py` (step, generate, mesh, moe, packing) and the measured half of
`scripts/pipeline.py` (report, balance).

Every step is timed through `jaxpar.train.harness` (checked, built, compiled ahead of time, waited
for). The peers a benchmark runs beside jaxpar (transformers + PyTorch, MaxText) are programs in
`benchmarks/peers/` with environments of their own; these modules start them as processes and read
the one line each prints. Results are printed, not asserted: the numbers belong in docs/performance.md
and docs/peers.md, with their date and machine.
"""


def refusing_bad_configs(run):
    """A script command's `run` whose config errors (`ConfigError`, from preflight, for a config its
    flags built) end as bad input: one `error:` line per problem, exit code 2."""

    def checked(args, config):
        from jaxpar.command import UsageError
        from jaxpar.train.preflight import ConfigError

        try:
            return run(args, config)
        except ConfigError as e:
            raise UsageError(str(e)) from None

    return checked
