"""Subprocess side of tests/models/test_init_independence.py: every layout's initial parameters against
one device's, printed as one JSON line (leaf paths that differ, and the number of leaves compared).

It runs in its own process so that it can compile with XLA:CPU's default fusion emitter, not the
suite's fast-compile flags (the test says why).
"""

import json
import math

# name: (tiny config maker, model overrides, mesh, parallel)
LAYOUTS = {
    "llama_zero3_data8": ("llama", {}, {"data": 8}, {"zero_stage": 3}),
    "llama_tied_tensor8": ("llama", {"tie_word_embeddings": True}, {"tensor": 8}, {}),
    "llama_zero3_data2_context2_tensor2": ("llama", {}, {"data": 2, "context": 2, "tensor": 2}, {"zero_stage": 3}),
    "llama_interleaved_p2_v2_data2_tensor2": (
        "llama", {"num_hidden_layers": 4}, {"pipeline": 2, "data": 2, "tensor": 2},
        {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2, "num_microbatches": 4},
    ),
    "mixtral_zb_v_p2_expert2_data2": (
        "mixtral", {"num_hidden_layers": 4}, {"pipeline": 2, "data": 2, "expert": 2},
        {"pipeline_schedule": "zb_v", "virtual_stages": 2, "num_microbatches": 4},
    ),
    "qwen3_moe_loss_free_expert4_tensor2_zero1": (
        "qwen3_moe", {"scoring_func": "sigmoid", "router_bias_update_rate": 0.05}, {"expert": 4, "tensor": 2}, {"zero_stage": 1},
    ),
    "qwen2_moe_shared_expert_expert2_tensor4": ("qwen2_moe", {}, {"expert": 2, "tensor": 4}, {}),
}


def params(config, devices):
    import jax

    from jaxpar.train.setup import build

    program = build(config, jax.devices()[:devices])
    return jax.device_get(program.to_natural(program.init()).params)


def main():
    import jax
    import numpy as np

    from tests.support import tiny

    found, references = {}, {}
    for name, (family, model, mesh, parallel) in LAYOUTS.items():
        base = getattr(tiny, family)(**model)
        key = (family, json.dumps(model, sort_keys=True))
        if key not in references:
            references[key] = params(base, 1)
        got = params(tiny.with_overrides(base, mesh, parallel=parallel), math.prod(mesh.values()))
        paths = jax.tree_util.tree_leaves_with_path(got)
        found[name] = [jax.tree_util.keystr(path) for (path, a), b in zip(paths, jax.tree.leaves(references[key]))
                       if a.shape != b.shape or not np.array_equal(a, b)]
        found[name + ":leaves"] = len(paths)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
