"""The command line of every script: flags, subcommands, config files and overrides, exit codes.

`jaxpar.command.script` says how a script declares its commands; `flags` parses them and
`config_file` reads `--config=FILE` with its `--config.KEY=VALUE` overrides. Nothing here imports JAX.
"""

from jaxpar.command.flags import Flag, UsageError
from jaxpar.command.script import EXIT_USAGE, Command, error, main, use_cpu_devices

__all__ = ["EXIT_USAGE", "Command", "Flag", "UsageError", "error", "main", "use_cpu_devices"]
