"""The fit check (`jaxpar.train.fit`): a step too big for the devices stops before anything is allocated.

- A model whose step needs more than this machine's whole memory on every one of 8 emulated devices
  (2.8B fp32 parameters replicated over data 8 with AdamW: ~63 GiB per device): the training
  loop raises `DoesNotFit` naming needed vs available per
  device and the largest term, before the corpus is read or the state initialised, and without a
  single new array on the devices (the compile is abstract).
- A tiny model fits: the loop's check passes, and the bytes it counts are XLA's own
  (`memory_analysis()`: arguments + outputs + temporaries - aliased), split into terms whose sum is
  that total; a budget one byte short of it fails (the boundary), naming the term that dominates.
- `train.skip_fit_check` compiles without comparing; the planner's advice names a layout that fits.
- The accelerator path, on CPU: fake GPU devices whose `memory_stats()` is simulated stand in for the
  real ones (the compiled step is the CPU mesh's). A limit that leaves room passes; a limit one byte
  short once the bytes already in use are counted stops with the one line, needed against
  available = bytes_limit - bytes_in_use; a device that reports no statistics, or none with a
  `bytes_limit`, gets one line saying the check could not run there, on stderr — never a silent skip.
"""

from __future__ import annotations

import os

import jax
import pytest

from jaxpar.train import fit, loop
from jaxpar.train.preflight import ConfigError
from jaxpar.train.setup import build
from tests.support import tiny

GIB = 2**30


class FakeAccelerator:
    """What `fit.available_per_device` reads of a jax device, for a GPU this host does not have."""

    platform, device_kind, process_index = "gpu", "NVIDIA H100 80GB HBM3", 0

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def huge():
    """2 layers of hidden 16384 (2.8B parameters, vocab 256): fp32 parameters, two moments, replicated."""
    return tiny.with_overrides(
        tiny.llama({"global_batch_size": 8, "seq_len": 16}, vocab_size=256, hidden_size=16384, intermediate_size=16384,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=256),
        {"data": 8},
    )


@pytest.mark.timeout(300)
def test_a_step_that_cannot_fit_stops_before_data_or_state(tmp_path, monkeypatch):
    touched = []
    monkeypatch.setattr(loop, "training_stream", lambda *a, **k: touched.append("data"))
    monkeypatch.setattr(loop, "_initial_state", lambda *a, **k: touched.append("state"))
    before = {id(a) for a in jax.live_arrays()}
    with pytest.raises(fit.DoesNotFit) as info:
        loop.train(huge(), str(tmp_path / "run"), progress=False)
    error = info.value
    assert isinstance(error, ConfigError)  # scripts/train.py: exit 2
    # Nothing read, nothing allocated: the only new arrays are the loss scale's scalars `build` makes.
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert touched == [] and sum(a.nbytes for a in new) <= 64, [(a.shape, a.dtype) for a in new]
    line = str(error)
    assert "\n" not in line and line.startswith("the step does not fit 8 cpu devices")
    # 2.8B fp32 parameters (10.5 GiB), two moments (21 GiB), and while AdamW updates three fp32
    # gradient-sized buffers (`analysis.cost.memory.OPTIMIZER_GRAD_BUFFERS`): the temporaries dominate.
    params = 2 * (2 * 16384 * 16384 + 2 * 16384 * 2048 + 3 * 16384 * 16384) * 4
    assert error.needed > 6 * params > host_memory() > error.available
    assert f"{error.needed / GIB:.1f} GiB per device" in line and f"{error.available / GIB:.1f} GiB available" in line
    assert error.dominant.startswith("temporaries") and f"the largest term is {error.dominant}" in line

def test_a_step_that_fits_passes_and_counts_xla_bytes():
    config = tiny.with_overrides(tiny.llama(), {"data": 2, "tensor": 4})
    program = build(config, jax.devices())
    compiled, seconds = fit.compile_fitting(program, config, jax.devices())
    assert seconds > 0
    state, batch = fit.abstract_inputs(program, config)
    memory = fit.step_memory(compiled, state, batch)
    stats = compiled.memory_analysis()
    live = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    assert memory.needed == live and sum(size for _, size in memory.terms()) == live
    assert memory.parameters > 0 and memory.optimizer > memory.parameters  # two moments per parameter
    fit.check(memory, memory.needed, jax.devices(), "test")  # exactly enough: fits
    with pytest.raises(fit.DoesNotFit) as info:
        fit.check(memory, memory.needed - 1, jax.devices(), "test")
    assert info.value.dominant == memory.dominant[0] and f"the largest term is {memory.dominant[0]}" in str(info.value)


def test_skip_fit_check_compiles_without_comparing(monkeypatch):
    config = tiny.with_overrides(tiny.llama(), {"data": 8})
    program = build(config, jax.devices())
    monkeypatch.setattr(fit, "available_per_device", lambda devices: (1, "a budget of one byte"))
    with pytest.raises(fit.DoesNotFit):  # positive control: the budget really is too small
        fit.compile_fitting(program, config, jax.devices())
    config.train.skip_fit_check = True
    compiled, _ = fit.compile_fitting(program, config, jax.devices())
    assert compiled.memory_analysis().temp_size_in_bytes > 1


@pytest.mark.timeout(300)
def test_planner_advice_names_a_layout_that_fits_these_devices():
    from jaxpar.analysis.planner.fit_advice import advice

    config = tiny.llama({"global_batch_size": 64, "seq_len": 64}, vocab_size=256, num_hidden_layers=8, num_key_value_heads=8,
                        hidden_size=128, intermediate_size=256)
    text = advice(config, jax.devices(), 64 * 2**20)
    assert text.startswith("the planner's best layout that fits 8 x cpu devices:") and "--config.mesh.data=" in text
    assert advice(config, jax.devices(), 2**10).startswith("no layout fits 8 devices")


@pytest.fixture(scope="module")
def fitted_program():
    """(config, program, the step's bytes per device as XLA counts them) of a tiny Llama on data 2 x tensor 4."""
    config = tiny.with_overrides(tiny.llama(), {"data": 2, "tensor": 4})
    program = build(config, jax.devices())
    state, batch = fit.abstract_inputs(program, config)
    stats = program.step.lower(state, batch).compile().memory_analysis()
    needed = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    return config, program, needed


IN_USE = 3 * GIB  # already allocated (another process's arrays): the limit alone would hold the step many times


def fake_gpus(stats):
    return [FakeAccelerator(stats) for _ in jax.devices()]


def test_a_gpu_limit_with_room_passes(fitted_program):
    config, program, needed = fitted_program
    said = []
    compiled, _ = fit.compile_fitting(program, config, fake_gpus({"bytes_limit": IN_USE + needed, "bytes_in_use": IN_USE}), said.append)
    assert said == [] and compiled.memory_analysis().temp_size_in_bytes > 0


def test_a_gpu_limit_one_byte_short_stops_with_needed_and_available(fitted_program):
    config, program, needed = fitted_program
    with pytest.raises(fit.DoesNotFit) as info:
        fit.compile_fitting(program, config, fake_gpus({"bytes_limit": IN_USE + needed - 1, "bytes_in_use": IN_USE}))
    error, line = info.value, str(info.value)
    assert (error.needed, error.available) == (needed, needed - 1)
    assert "\n" not in line and line.startswith("the step does not fit 8 gpu devices: it needs ")
    assert f"{needed / GIB:.1f} GiB per device" in line and "(NVIDIA H100 80GB HBM3 allocator limit less bytes in use)" in line


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": IN_USE, "peak_bytes_in_use": IN_USE}], ids=["none", "empty", "no_limit"])
def test_a_gpu_without_a_memory_limit_says_the_check_could_not_run(fitted_program, stats, capsys):
    config, program, needed = fitted_program
    compiled, _ = fit.compile_fitting(program, config, fake_gpus(stats))  # the default notice: stderr
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and compiled is not None
    assert err.strip() == (
        "warning: the fit check could not run: NVIDIA H100 80GB HBM3 (gpu) reports no memory limit (device.memory_stats() "
        f"has no bytes_limit); the step needs {needed / GIB:.1f} GiB per device and was not compared with anything"
    )
