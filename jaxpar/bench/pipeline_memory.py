"""`scripts/pipeline.py memory`: per-device parameter + optimizer-state bytes by part of the model, with
the vocab tables on every pipeline rank ("ends", the layout before vocab parallelism) and split over
them ("spread").

Read from the train state's shardings (`jax.eval_shape` of the jitted init: nothing is allocated), on
the devices given: mesh = the config's, with `mesh.pipeline` set (0: the config's) and `-1` taking the rest.
"""

from __future__ import annotations

import jax

PARTS = ("embed", "lm_head", "final_norm", "layers")
PLACEMENTS = ("ends", "spread")


def part_bytes(config, devices) -> dict:
    """{part: (param bytes, optimizer-state bytes)} per device."""
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


def by_placement(base, pipeline: int, devices) -> tuple[dict, dict]:
    """({placement: part_bytes}, the mesh preflight resolved) for both vocab placements."""
    from jaxpar.train import preflight

    base = base.copy_and_resolve_references()
    base.mesh.pipeline = pipeline or base.mesh.pipeline
    results, mesh = {}, None
    for vocab in PLACEMENTS:
        config = base.copy_and_resolve_references()
        config.parallel.pipeline_vocab = vocab
        mesh = preflight.check(config, len(devices))
        results[vocab] = part_bytes(config, devices)
    return results, mesh


def report(base, pipeline: int, devices) -> dict:
    """Prints the table; returns {placement: {part: (params, moments)}}."""
    results, mesh = by_placement(base, pipeline, devices)
    gib = 2**30
    print(f"per-device bytes, mesh {mesh}, zero_stage {base.parallel.zero_stage}, params {base.train.param_dtype}")
    print(f"{'part':<12}{'ends: params':>14}{'+ Adam':>10}{'spread: params':>16}{'+ Adam':>10}{'ratio':>8}  (GiB)")
    totals = {v: 0 for v in results}
    for part in PARTS:
        if part not in results["ends"]:
            continue
        row = f"{part:<12}"
        for vocab in PLACEMENTS:
            params, moments = results[vocab][part]
            totals[vocab] += params + moments
            row += f"{params / gib:>{14 if vocab == 'ends' else 16}.3f}{moments / gib:>10.3f}"
        ends, spread = (sum(results[v][part]) for v in PLACEMENTS)
        print(row + f"{spread / ends:>8.3f}")
    vocab_parts = [p for p in ("embed", "lm_head", "final_norm") if p in results["ends"]]
    ends, spread = (sum(sum(results[v][p]) for p in vocab_parts) for v in PLACEMENTS)
    print(f"vocab tables + Adam: {ends / gib:.3f} → {spread / gib:.3f} GiB ({spread / ends:.3f}×); "
          f"all params + Adam: {totals['ends'] / gib:.3f} → {totals['spread'] / gib:.3f} GiB")
    return results
