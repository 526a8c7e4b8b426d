"""Rank the layouts of a config on N devices of given hardware, analytically (seconds, no compile).

    python scripts/plan.py --config=configs/llama3_70b.py --hardware=a100-80g --devices=8 \
        [--global_batch_size=512 --seq_len=8192] [--compare=tensor=4,pipeline=2] [--top=5] \
        [--config.mesh.tensor=8 ...]

Prints the top meshes that fit with their predicted step time, tokens/s per device and MFU (at
achieved rates, `jaxpar.analysis.cost.efficiency`; `--efficiency=1` for the peak bound), their memory /
compute / communication split, which vertex of the memory–compute–communication triangle binds and
why the winner wins. When nothing fits,
one line starting `no mesh fits` says which memory term overflows and the smallest device count
that fits, then the ranking for that count. `--compare` discusses a given mesh (e.g. the source
article's TP 4 x PP 2) on every hardware profile and on the device count that fits. Keys given
as `--config.X=...` stay fixed. See `jaxpar.analysis.planner`.
"""

import sys

from jaxpar import command
from jaxpar.command import Command, Flag, UsageError

FLAGS = (
    Flag("hardware", str, "a100-80g", "hardware profile (jaxpar.analysis.cost.hardware.PROFILES)"),
    Flag("devices", int, 8, "number of devices", at_least=1),
    Flag("global_batch_size", int, None, "override train.global_batch_size", at_least=1),
    Flag("seq_len", int, None, "override train.seq_len", at_least=1),
    Flag("top", int, 5, "meshes to show", at_least=1),
    Flag("compare", str, "", "a mesh to discuss, e.g. tensor=4,pipeline=2"),
    Flag("efficiency", str, "achieved", "achieved: each matmul at its shape's efficiency, attention at its kernel's, ZeRO-3 "
         "gathers hidden behind compute (jaxpar.analysis.cost.efficiency); or a number: every matmul at that fraction of peak, "
         "nothing overlapped (1: the peak bound)"),
)


def parse_mesh(text: str) -> dict:
    from jaxpar.axes import MESH_AXES

    mesh = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1:
            raise UsageError(f"--compare: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)} and SIZE >= 1")
        if name in mesh:
            raise UsageError(f"--compare: {name} is given twice ({name}={mesh[name]}, {part}); give each axis once")
        mesh[name] = int(size)
    if text and not mesh:
        raise UsageError(f"--compare={text!r} names no axis; write it as tensor=4,pipeline=2")
    return mesh


def efficiency_of(text: str) -> float | None:
    if text == "achieved":
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--efficiency={text!r} is neither 'achieved' nor a number") from None
    if not 0 < value <= 1:  # a fraction of peak FLOP/s (nan fails this too)
        raise UsageError(f"--efficiency={text} must be 'achieved' or a fraction of peak in (0, 1]")
    return value


def checks(args) -> list[str]:
    from jaxpar.analysis.cost.hardware import PROFILES

    problems = [] if args.hardware in PROFILES else [f"--hardware: unknown hardware {args.hardware!r}; known: {', '.join(PROFILES)}"]
    for check, value in ((parse_mesh, args.compare), (efficiency_of, args.efficiency)):
        try:
            check(value)
        except UsageError as e:
            problems.append(str(e))
    return problems


def run(args, config) -> None:
    from jaxpar.analysis.cost.hardware import HardwareError
    from jaxpar.analysis.planner import report
    from jaxpar.train.preflight import ConfigError

    if args.global_batch_size:
        config.train.global_batch_size = args.global_batch_size
    if args.seq_len:
        config.train.seq_len = args.seq_len
    try:
        text = report(
            config, args.hardware, args.devices, top=args.top, compare=parse_mesh(args.compare),
            fixed={key for key, _ in args.overrides}, efficiency=efficiency_of(args.efficiency),
        )
    except HardwareError as e:
        raise UsageError(f"--hardware: {e}") from None
    except ConfigError as e:  # no layout could pass preflight: the config's own problems, one line each
        raise UsageError(str(e)) from None
    print(text)


COMMANDS = (Command(None, "rank the layouts of a config on N devices of given hardware", run, flags=FLAGS, config="required",
                    devices=False, checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
