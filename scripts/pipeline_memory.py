"""Per-device parameter + optimizer-state bytes by part of the model, with the vocab tables on
every pipeline rank ("ends", the layout before vocab parallelism) and split over them ("spread").

    python scripts/pipeline_memory.py [--config=configs/llama3_70b.py --pipeline=4 --devices=32]

Read from the train state's shardings (`jax.eval_shape` of the jitted init: nothing is allocated),
on emulated CPU devices: mesh = the config's, with `mesh.pipeline` set and `-1` taking the rest.
"""

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama3_70b.py", "A configs/*.py file.")
_PIPELINE = flags.DEFINE_integer("pipeline", 4, "mesh.pipeline.")
_DEVICES = flags.DEFINE_integer("devices", 32, "Emulated CPU devices.")

PARTS = ("embed", "lm_head", "final_norm", "layers")


def part_bytes(config, devices) -> dict:
    """{part: (param bytes, optimizer-state bytes)} per device."""
    import jax

    from jaxpar.train.setup import build, bytes_per_device

    program = build(config, devices)
    state, shardings = jax.eval_shape(program.init), program.state_shardings
    adam, adam_shardings = state.opt_state[1][0], shardings.opt_state[1][0]
    out = {}
    for part in PARTS:
        if part not in state.params:
            continue
        params = bytes_per_device(state.params[part], shardings.params[part])
        moments = sum(bytes_per_device(t[part], s[part]) for t, s in ((adam.mu, adam_shardings.mu), (adam.nu, adam_shardings.nu)))
        out[part] = (params, moments)
    return out


def main(argv):
    del argv
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
    from jaxpar.train import preflight

    base = _CONFIG.value
    base.mesh.pipeline = _PIPELINE.value
    results = {}
    for vocab in ("ends", "spread"):
        config = base.copy_and_resolve_references()
        config.parallel.pipeline_vocab = vocab
        mesh = preflight.check(config, _DEVICES.value)
        results[vocab] = part_bytes(config, jax.devices())
    gib = 2**30
    print(f"per-device bytes, mesh {mesh}, zero_stage {base.parallel.zero_stage}, params {base.train.param_dtype}")
    print(f"{'part':<12}{'ends: params':>14}{'+ Adam':>10}{'spread: params':>16}{'+ Adam':>10}{'ratio':>8}  (GiB)")
    totals = {v: 0 for v in results}
    for part in PARTS:
        if part not in results["ends"]:
            continue
        row = f"{part:<12}"
        for vocab in ("ends", "spread"):
            params, moments = results[vocab][part]
            totals[vocab] += params + moments
            row += f"{params / gib:>{14 if vocab == 'ends' else 16}.3f}{moments / gib:>10.3f}"
        ends, spread = (sum(results[v][part]) for v in ("ends", "spread"))
        print(row + f"{spread / ends:>8.3f}")
    vocab_parts = [p for p in ("embed", "lm_head", "final_norm") if p in results["ends"]]
    ends, spread = (sum(sum(results[v][p]) for p in vocab_parts) for v in ("ends", "spread"))
    print(f"vocab tables + Adam: {ends / gib:.3f} → {spread / gib:.3f} GiB ({spread / ends:.3f}×); "
          f"all params + Adam: {totals['ends'] / gib:.3f} → {totals['spread'] / gib:.3f} GiB")


if __name__ == "__main__":
    app.run(main)
