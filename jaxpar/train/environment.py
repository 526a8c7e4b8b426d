"""The environment preflight: versions, where every device sits in the mesh, and which mesh axes
cross process (host) boundaries — an axis whose collectives run every layer (tensor) should not."""

from __future__ import annotations

import importlib.metadata
import platform

import jax
import jaxlib
import numpy as np
from jax.sharding import Mesh

from jaxpar.axes import TENSOR

# pip packages that carry the CUDA libraries jax's CUDA plugin loads (name: the library they hold).
GPU_PACKAGES = {
    "CUDA runtime": ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12"),
    "cuDNN": ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
    "NCCL": ("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
}


def _installed(names) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not from pip (system install)"


def versions(backend: str) -> str:
    text = f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {backend}"
    if backend == "gpu":
        text += ", " + ", ".join(f"{lib} {_installed(names)}" for lib, names in GPU_PACKAGES.items())
    return text


def crossing_axes(mesh: Mesh) -> list[str]:
    """Mesh axes along which devices of different processes meet (their collectives cross hosts)."""
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    crossing = []
    for i, name in enumerate(mesh.axis_names):
        if mesh.devices.shape[i] > 1 and np.any(np.diff(processes, axis=i) != 0):
            crossing.append(name)
    return crossing


def device_lines(mesh: Mesh, limit: int = 64) -> list[str]:
    """One line per device (process, id, mesh coordinates); per process beyond `limit` devices."""
    shape = dict(mesh.shape)
    coords = [(idx, d) for idx, d in np.ndenumerate(mesh.devices)]
    if len(coords) <= limit:
        return [
            f"  device {d.id} (process {d.process_index}): "
            + " ".join(f"{n}={i}" for n, i in zip(mesh.axis_names, idx) if shape[n] > 1)
            for idx, d in coords
        ]
    lines = []
    for p in sorted({d.process_index for _, d in coords}):
        ids = [d.id for _, d in coords if d.process_index == p]
        lines.append(f"  process {p}: {len(ids)} devices, ids {min(ids)}..{max(ids)}")
    return lines


def report(mesh: Mesh) -> list[str]:
    """Lines to print at start; a line starting with "warning:" for a tensor axis across hosts."""
    backend = mesh.devices.flat[0].platform
    lines = [versions("gpu" if backend in ("gpu", "cuda", "rocm") else backend)]
    processes, devices = jax.process_count(), mesh.devices.size
    counts = f"{processes} {'process' if processes == 1 else 'processes'}, {devices} {'device' if devices == 1 else 'devices'}"
    if all(size == 1 for size in dict(mesh.shape).values()):  # no coordinate to show
        lines.append(f"{counts}: every mesh axis has size 1, nothing is split")
    else:
        lines.append(f"{counts}; device -> mesh coordinates (axes of size 1 left out):")
        lines += device_lines(mesh)
    crossing = crossing_axes(mesh)
    lines.append(f"mesh axes across processes: {', '.join(crossing) if crossing else 'none'}")
    if TENSOR in crossing:
        lines.append(
            f"warning: mesh.{TENSOR} crosses process (host) boundaries: its collectives run every layer over the "
            f"slower inter-host network; make mesh.{TENSOR} at most the devices per host"
        )
    return lines
