"""XLA:CPU flags that make the suite's many tiny compiles cheap without changing any program's graph.

The suite compiles a few hundred tiny programs and runs each for a few steps, so compile time is
the suite's time. These flags change only how XLA:CPU turns the optimised graph into machine code
(fusion, sharding and collectives are decided before): LLVM at -O0 without its expensive passes,
in one module, and the elemental fusion emitter instead of the MLIR one. Measured on the tiny
Llama's train step over data 2 x tensor 4 with SP (process CPU seconds, one compile each): step
5.9 -> 1.4 s, init 3.5 -> 1.8 s with the first three; -O0 alone had halved the default's time.

One visible difference: under the elemental emitter the random initialisation of a vocab-sharded
table can differ from one device's by one ulp (measured 7.5e-9 on the embedding under tensor 4),
so the proof that initialisation never depends on the mesh runs in a subprocess with the default
emitter (`tests/models/test_init_independence.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.platforms import CPU, CPU_THEN_GPU

DEVICE_COUNT = "--xla_force_host_platform_device_count=8"
# Every flag here exists in jaxlib 0.10 to 0.12 (an unknown flag aborts XLA at start-up).
LLVM_O0 = "--xla_backend_optimization_level=0"
# One LLVM module, not the default split for parallel codegen: the suite's two workers keep both
# cores busy, so the split only adds its own cost (SplitModule + clones: 1.7 s of a 15 s compile).
# Compile CPU seconds, dualpipev p2 x data 2 x tensor 2 ZeRO-3 SP: 14.8, 13.7 -> 10.9; the tiny
# Llama's step: 1.09, 1.05 -> 0.74.
ONE_CODEGEN_MODULE = "--xla_cpu_parallel_codegen_split_count=1"
FAST_COMPILE = (
    LLVM_O0,
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    ONE_CODEGEN_MODULE,
)


# A folder whose sitecustomize.py every child Python imports first (the collector's thresholds).
CHILD_SITE = str(Path(__file__).parent / "child_site")


def with_child_site(python_path: str) -> str:
    """`python_path` led by CHILD_SITE (once)."""
    rest = [p for p in python_path.split(os.pathsep) if p and p != CHILD_SITE]
    return os.pathsep.join([CHILD_SITE, *rest])


def subprocess_environment(**extra) -> dict:
    """os.environ for a child process: the fast-compile flags and no forced device count (the child
    chooses its own devices), CPU alone where the suite also lists the GPU (a child is a CPU run: it
    need not start CUDA), then `extra`, with CHILD_SITE leading PYTHONPATH."""
    environment = os.environ | {"XLA_FLAGS": " ".join(FAST_COMPILE)}
    if environment.get("JAX_PLATFORMS") == CPU_THEN_GPU:
        environment["JAX_PLATFORMS"] = CPU
    environment |= extra
    environment["PYTHONPATH"] = with_child_site(environment.get("PYTHONPATH", ""))
    return environment
