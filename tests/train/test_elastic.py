"""`jaxpar.train.elastic.keep_rows` in closed form: on fewer devices the microbatch count grows by
the factor the data replicas shrank, so rows per replica per microbatch and the global batch stay
(the multi-process run that loses a host and grows back: tests/distributed/test_restarts.py)."""

from __future__ import annotations

import pytest

from jaxpar.mesh import resolve_mesh_shape
from jaxpar.parallel import data
from jaxpar.train.elastic import ElasticError, keep_rows
from tests.support import tiny
from tests.support.scripts import run_script
from tests.train.probe import script


def rows(config, devices: int) -> int:
    mesh = resolve_mesh_shape(config.mesh, devices)
    micro = config.train.grad_accum if mesh["pipeline"] == 1 else (config.parallel.num_microbatches or mesh["pipeline"])
    return config.train.global_batch_size // (mesh["data"] * mesh["expert"] * micro)


@pytest.mark.parametrize("mesh, accum, full, now, want", [
    ({"data": -1, "tensor": 2}, 1, 8, 4, 2),  # data 4 -> 2
    ({"data": -1, "tensor": 2}, 1, 8, 2, 4),  # data 4 -> 1
    ({"data": -1}, 2, 8, 2, 8),  # data 8 -> 2, already accumulating 2
    ({"data": -1, "expert": 2}, 1, 8, 4, 2),  # replicas are data x expert: 8 -> 4
])
def test_fewer_devices_accumulate_more_with_the_same_rows(mesh, accum, full, now, want):
    config = tiny.with_overrides(tiny.llama(train={"grad_accum": accum}), mesh)
    before = rows(config, full)
    line = keep_rows(config, full, now)
    assert config.train.grad_accum == want and rows(config, now) == before and config.train.global_batch_size == 16
    assert f"train.grad_accum={want} keeps {before} rows" in line
    assert data.checks(config, resolve_mesh_shape(config.mesh, now)) == [], "preflight takes the new count"
    assert keep_rows(config, now, now) is None, "the full size again: nothing changes"


def test_a_pipeline_scales_its_microbatches_from_the_default():
    config = tiny.with_overrides(tiny.llama(num_hidden_layers=4), {"data": -1, "pipeline": 2})
    keep_rows(config, 8, 4)  # data 4 -> 2; microbatches default to mesh.pipeline = 2
    assert config.parallel.num_microbatches == 4 and config.train.grad_accum == 1


def test_what_it_leaves_alone_and_what_it_refuses():
    config = tiny.with_overrides(tiny.llama(), {"data": -1})
    assert keep_rows(config, 8, 4, explicit={"train.grad_accum"}) is None and config.train.grad_accum == 1
    fixed = tiny.with_overrides(tiny.llama(), {"data": 4})
    assert keep_rows(fixed, 4, 2) is None, "a fixed data axis that no longer fits is preflight's line"
    odd = tiny.with_overrides(tiny.llama(train={"global_batch_size": 12}), {"data": -1})
    with pytest.raises(ElasticError, match=r"--elastic_devices=4: on 3 devices \(3 data replicas\) no train.grad_accum keeps 3 rows"):
        keep_rows(odd, 4, 3)


def test_train_takes_the_size_from_its_flag_or_the_launchers_environment(tmp_path, capsys, monkeypatch):
    """scripts/train.py: the launcher's JAXPAR_ELASTIC_DEVICES stands for --elastic_devices; a value
    that is not a count is one line; a size whose rows cannot be kept is one line, exit 2, before a
    workdir exists (a subprocess: the run's own device count)."""
    train = script("train")
    config = tiny.with_overrides(tiny.llama(), {"data": -1})
    monkeypatch.setenv("JAXPAR_ELASTIC_DEVICES", "8")
    train.keep_elastic_rows(config, 0, 4, set())
    assert config.train.grad_accum == 2 and "train.grad_accum=2 keeps 2 rows per replica" in capsys.readouterr().out
    monkeypatch.setenv("JAXPAR_ELASTIC_DEVICES", "eight")
    with pytest.raises(ElasticError, match=r"^\$JAXPAR_ELASTIC_DEVICES='eight': must be a device count$"):
        train.keep_elastic_rows(config, 0, 4, set())
    workdir = tmp_path / "run"
    done = run_script("train.py", "--config=configs/llama_tiny.py", f"--workdir={workdir}", "--cpu_devices=4",
                      "--config.train.global_batch_size=12", "--elastic_devices=3")
    assert (done.returncode, done.stderr) == (2, "error: --elastic_devices=3: on 4 devices (4 data replicas) no "
                                                  "train.grad_accum keeps 4 rows per replica of train.global_batch_size=12\n")
    assert not workdir.exists()
