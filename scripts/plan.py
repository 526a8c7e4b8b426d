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

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
_HARDWARE = flags.DEFINE_string("hardware", "a100-80g", "Hardware profile (jaxpar.analysis.cost.hardware.PROFILES).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Number of devices.")
_BATCH = flags.DEFINE_integer("global_batch_size", None, "Override train.global_batch_size.")
_SEQ = flags.DEFINE_integer("seq_len", None, "Override train.seq_len.")
_TOP = flags.DEFINE_integer("top", 5, "Meshes to show.")
_COMPARE = flags.DEFINE_string("compare", "", "A mesh to discuss, e.g. tensor=4,pipeline=2.")
_EFFICIENCY = flags.DEFINE_string(
    "efficiency", "achieved", "achieved: each matmul at its shape's efficiency, attention at its kernel's, ZeRO-3 "
    "gathers hidden behind compute (jaxpar.analysis.cost.efficiency); or a number: every matmul at that fraction of peak, "
    "nothing overlapped (1: the peak bound)."
)
flags.mark_flags_as_required(["config"])


def parse_mesh(text: str) -> dict:
    from jaxpar.axes import MESH_AXES

    mesh = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if name not in MESH_AXES or not size.isdigit():
            raise app.UsageError(f"--compare: {part!r} is not AXIS=SIZE with AXIS one of {MESH_AXES}")
        mesh[name] = int(size)
    return mesh


def main(argv):
    del argv
    from jaxpar.analysis.cost.hardware import HardwareError
    from jaxpar.analysis.planner import command_line_keys, report

    config = _CONFIG.value
    if _BATCH.value:
        config.train.global_batch_size = _BATCH.value
    if _SEQ.value:
        config.train.seq_len = _SEQ.value
    fixed = command_line_keys(sys.argv)
    try:
        efficiency = None if _EFFICIENCY.value == "achieved" else float(_EFFICIENCY.value)
    except ValueError:
        raise app.UsageError(f"--efficiency={_EFFICIENCY.value!r} is neither 'achieved' nor a number") from None
    try:
        text = report(
            config, _HARDWARE.value, _DEVICES.value, top=_TOP.value, compare=parse_mesh(_COMPARE.value),
            fixed=fixed, efficiency=efficiency,
        )
    except HardwareError as e:
        raise app.UsageError(f"--hardware: {e}") from None
    print(text)


if __name__ == "__main__":
    app.run(main)
