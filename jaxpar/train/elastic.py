"""Elastic starts: a run laid out for N devices that starts again on fewer (a lost host) or on
N again (it came back) keeps its global batch *and* each device's rows per microbatch.

The data-parallel replicas (mesh.data x mesh.expert) shrink with the devices when mesh.data is -1;
the microbatch count (`train.grad_accum`, or `parallel.num_microbatches` through a pipeline) grows
by the same factor, so a device holds the activations it held before and the step is the same
global batch, in the same data order (the batches are built from the step, not the mesh). The
full size comes from `scripts/train.py --elastic_devices=N`, which `scripts/launch_local.py
--elastic` sets for every process through ENV (a cluster's launcher can do the same).
"""

from __future__ import annotations

from jaxpar.axes import DATA, EXPERT, PIPELINE
from jaxpar.mesh import MeshError, resolve_mesh_shape

ENV = "JAXPAR_ELASTIC_DEVICES"


class ElasticError(ValueError):
    """No microbatch count keeps the rows of the full-size run on these devices."""


def _replicas(config, devices: int) -> int | None:
    try:
        mesh = resolve_mesh_shape(config.mesh, devices)
    except MeshError:
        return None  # preflight names the mesh problem in its own line
    return mesh[DATA] * mesh[EXPERT]


def microbatch_key(config) -> str:
    return "parallel.num_microbatches" if int(config.mesh[PIPELINE]) > 1 else "train.grad_accum"


def keep_rows(config, full_devices: int, devices: int, explicit: set[str] = frozenset()) -> str | None:
    """Sets the microbatch key so each device's rows on `devices` are those of the same config on
    `full_devices`; returns the line saying so, or None when nothing changes (the same size, a mesh
    preflight refuses, or the key given on the command line, which wins)."""
    full, now = _replicas(config, full_devices), _replicas(config, devices)
    key = microbatch_key(config)
    if full is None or now is None or full == now or key in explicit:
        return None
    section, name = key.split(".")
    counted = int(config[section][name]) or (int(config.mesh[PIPELINE]) if key == "parallel.num_microbatches" else 1)
    rows = config.train.global_batch_size // (full * counted)  # per replica per microbatch at full size
    if rows < 1 or config.train.global_batch_size % (now * rows):
        raise ElasticError(f"--elastic_devices={full_devices}: on {devices} devices ({now} data replicas) no {key} keeps "
                           f"{max(rows, 1)} rows per replica of train.global_batch_size={config.train.global_batch_size}")
    microbatches = config.train.global_batch_size // (now * rows)
    config[section][name] = microbatches
    return (f"elastic: {devices} of {full_devices} devices, {now} data replicas instead of {full}: {key}={microbatches} "
            f"keeps {rows} rows per replica per microbatch and the global batch of {config.train.global_batch_size}")
