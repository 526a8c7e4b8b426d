"""Train a model from a config file.

  python scripts/train.py --config=configs/llama_tiny.py --workdir=/tmp/run \
      [--config.train.steps=50 ...] [--cpu_devices=8]
"""

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json and metrics.jsonl.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Emulate this many CPU devices (0: the real devices).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    import jax

    if _CPU_DEVICES.value:
        # Must happen before the first jax call creates the backends.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    from jaxpar.preflight import ConfigError
    from jaxpar.train.loop import train

    try:
        history = train(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        raise app.UsageError(f"config error:\n{e}") from None
    if history:
        print(f"done: {len(history)} steps, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")


if __name__ == "__main__":
    app.run(main)
