"""Which JAX platforms the suite runs on: CPU devices for every test, and the GPU beside them on a host
that has one, so that the `gpu` tests find it while every other test keeps CPU as its default backend.

jax 0.10 reads `JAX_PLATFORMS` as a priority list: the first platform named is the default backend
(`jax._src.xla_bridge.backends` ranks them len..1 in order), the others stay reachable through
`jax.devices(platform)`. A listed "cuda" is passed over where no NVIDIA device is visible; a listed
platform whose plugin is missing, or fails to start, is an error at the first jax call. So the
suite lists "cuda" only where its plugin is installed, found by name without importing it (an
import would start nothing, but jax's plugin discovery runs at the first jax call, after the
variables below are set).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import pkgutil

CPU = "cpu"
CPU_THEN_GPU = "cpu,cuda"


def cuda_plugin_installed(plugin_dirs=None) -> bool:
    """A JAX CUDA plugin is installed (the jax-cuda12-pjrt or jax-cuda13-pjrt package that `pip install
    "jax[cuda12]"` brings): its module `xla_cuda<N>` in the `jax_plugins` namespace package (whose
    folders are `plugin_dirs` when given), or its entry point of the `jax_plugins` group (jax finds
    plugins both ways). Nothing is imported."""
    if plugin_dirs is None:
        if any("cuda" in entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")):
            return True
        spec = importlib.util.find_spec("jax_plugins")
        plugin_dirs = list(spec.submodule_search_locations or ()) if spec is not None else []
    return any(module.name.startswith("xla_cuda") for module in pkgutil.iter_modules(plugin_dirs))


def suite_platforms(environ) -> str:
    """`JAX_PLATFORMS` for the test processes: the user's when given; else CPU first (the default
    backend every test but the `gpu` ones runs on), with CUDA listed after it where its plugin is."""
    if environ.get("JAX_PLATFORMS"):
        return environ["JAX_PLATFORMS"]
    return CPU_THEN_GPU if cuda_plugin_installed() else CPU


@functools.cache
def gpu_devices() -> tuple:
    """The GPU devices jax can reach in this process (none on a CPU-only host)."""
    import jax

    try:
        return tuple(jax.devices("gpu"))
    except RuntimeError:  # "Unknown backend: 'gpu' requested, but no platforms ... are present"
        return ()
