"""The environment preflight: which mesh axes cross process boundaries (a fake device grid with
process ids stands in for a cluster), the warning for a tensor axis across hosts, and the report."""

from types import SimpleNamespace

import jax
import numpy as np

from jaxpar.axes import MESH_AXES
from jaxpar.mesh import make_mesh
from jaxpar.train.environment import crossing_axes, report


def fake_mesh(shape: dict, processes: int):
    """A mesh-like object over 8 fake devices, numbered in mesh order, `8 / processes` per process."""
    sizes = tuple(shape.get(name, 1) for name in MESH_AXES)
    devices = np.empty(sizes, dtype=object)
    for i, index in enumerate(np.ndindex(sizes)):
        devices[index] = SimpleNamespace(id=i, process_index=i * processes // 8, platform="cpu")
    return SimpleNamespace(devices=devices, axis_names=MESH_AXES, shape=dict(zip(MESH_AXES, sizes)))


def test_crossing_axes():
    assert crossing_axes(fake_mesh({"data": 2, "tensor": 4}, processes=1)) == []
    # Devices are numbered tensor-fastest, so two processes split the outermost axis.
    assert crossing_axes(fake_mesh({"data": 2, "tensor": 4}, processes=2)) == ["data"]
    assert crossing_axes(fake_mesh({"data": 2, "tensor": 4}, processes=4)) == ["data", "tensor"]
    assert crossing_axes(fake_mesh({"tensor": 8}, processes=2)) == ["tensor"]


def test_report_warns_when_tensor_crosses_hosts():
    lines = report(fake_mesh({"tensor": 8}, processes=2))
    assert lines[-1].startswith("warning: mesh.tensor crosses process (host) boundaries")
    assert not any(line.startswith("warning") for line in report(fake_mesh({"data": 2, "tensor": 4}, processes=2)))


def test_report_on_the_real_mesh():
    lines = report(make_mesh({"data": 2, "pipeline": 1, "context": 1, "expert": 1, "tensor": 4}))
    assert lines[0].startswith("python ") and " jax " in lines[0] and "backend cpu" in lines[0]
    assert "  device 5 (process 0): data=1 tensor=1" in lines
    assert lines[-1] == "mesh axes across processes: none"
    assert lines[1] == "1 process, 8 devices; device -> mesh coordinates (axes of size 1 left out):"


def test_one_device_has_no_empty_coordinate_line():
    """One device has no coordinate to print: the count says so, and no `device 0 (process 0): ` line is left empty."""
    lines = report(make_mesh({"data": 1, "pipeline": 1, "context": 1, "expert": 1, "tensor": 1}, jax.devices()[:1]))
    assert lines[1] == "1 process, 1 device: every mesh axis has size 1, nothing is split"
    assert not [line for line in lines if line.rstrip().endswith(":")], lines
