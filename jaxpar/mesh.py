"""The five-axis device mesh (axis names and order: `jaxpar.axes`).

Devices are laid out by `mesh_utils.create_device_mesh` (topology-aware on GPUs/TPUs); every axis
is `Auto`, so the SPMD partitioner places whatever no explicit `shard_map` handles.
"""

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.axes import DATA, MESH_AXES


class MeshError(ValueError):
    """A mesh shape that cannot be built on the available devices."""


def resolve_mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
    """Axis sizes with a single `-1` filled in so the product equals `num_devices`."""
    sizes = {name: int(mesh_config[name]) for name in MESH_AXES}
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {fill}; set mesh.{fill[1]} to a size")
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{name}={size}: axis sizes must be positive (or -1 on one axis)")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise MeshError(
                f"mesh: the fixed axes multiply to {known}, which does not divide {num_devices} devices; "
                f"change mesh.{fill[0]}'s partners"
            )
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        shape = " x ".join(f"{n}={s}" for n, s in sizes.items())
        raise MeshError(f"mesh: {shape} = {known} devices but {num_devices} are available; set mesh.{DATA}=-1")
    return sizes


def make_mesh(mesh_config, devices=None) -> Mesh:
    """Builds the five-axis mesh with topology-aware device order and Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(mesh_config, len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    device_grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    return Mesh(device_grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    return " ".join(f"{name}={size}" for name, size in mesh.shape.items())
