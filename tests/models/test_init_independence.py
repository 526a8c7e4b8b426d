"""Initialisation never depends on the mesh: the state `build(...).init()` creates on each sharding
pattern holds bitwise the one-device parameters (and model state, such as the router bias), in
the natural layer order.

The degeneracy tests start every layout from the one-device reference's parameters
(`tests/reference.run`), so this is where the rule is proven, once per way a parameter can be cut:
over data (ZeRO-3, over data x context too), over tensor (vocab-parallel tables, heads, a tied
table), over expert (experts per rank, a shared expert, the router bias), and
over pipeline in the schedule's storage order (interleaved and V). It runs in a child process with
XLA:CPU's default fusion emitter, which users run with: under the suite's elemental one
(`tests/support/compile_flags.py`) the vocab-sharded tables differ from one device's by one ulp. LLVM stays
at -O0 and in one module (`tests/support/compile_flags.py`: neither changes the values; at -O2 this test
took 150 CPU-s instead of 40).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.support.compile_flags import DEVICE_COUNT, LLVM_O0, ONE_CODEGEN_MODULE, subprocess_environment
from tests.support.paths import ROOT

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

WORKER = """
import json, math, sys
import jax, numpy as np
from jaxpar.train.setup import build
from tests.support import tiny
from tests.models.test_init_independence import LAYOUTS

def params(config, devices):
    program = build(config, jax.devices()[:devices])
    return jax.device_get(program.to_natural(program.init()).params)

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
"""


@pytest.mark.timeout(600)
def test_init_is_bitwise_the_one_device_init_on_every_sharding_pattern():
    # JAXPAR_INIT_FLAGS: other flags for the child (with the fast-compile ones it fails on tensor layouts).
    flags = os.environ.get("JAXPAR_INIT_FLAGS", f"{DEVICE_COUNT} {LLVM_O0} {ONE_CODEGEN_MODULE}")  # the default emitter
    environment = subprocess_environment(XLA_FLAGS=flags, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", WORKER], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for name in LAYOUTS:
        assert found[name + ":leaves"] >= 9, f"{name}: too few parameter leaves compared"
        assert found[name] == [], f"{name}: initial parameters differ from one device's in {found[name]}"
