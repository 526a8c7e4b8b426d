"""parallel.remat=auto on an accelerator (issue 39 item 5): the fastest policy the cost model says fits
the devices' memory, priced policy by policy here; on a CPU, or a device that reports no memory limit,
"auto" is left to the measured backend table."""

import importlib.util
from types import SimpleNamespace

import jax
import pytest

from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.planner import remat
from jaxpar.analysis.planner.fit_advice import profile_for
from tests.support.paths import REPO

GIB = 2**30


def _h100s(n=8, stats=None):
    return [SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", process_index=0,
                            memory_stats=lambda: stats) for _ in range(n)]


def _config():
    from configs.llama3_8b import get_config

    config = get_config()
    config.mesh.update(data=8, tensor=1)
    config.parallel.zero_stage = 3
    return config


@pytest.mark.parametrize("order", ["listed", "reversed"])
@pytest.mark.parametrize("available_gib", [80, 40, 20])
def test_auto_is_the_fastest_policy_that_fits(available_gib, order, monkeypatch):
    if order == "reversed":  # the answer must not depend on the order the policies are tried in
        monkeypatch.setattr(remat, "POLICIES", remat.POLICIES[::-1])
    config, devices, available = _config(), _h100s(), available_gib * GIB
    priced = {}
    for name in ("none", "save_dots", "offload", "full"):
        c = config.copy_and_resolve_references()
        c.parallel.remat = name
        est = estimate(c, profile_for(devices, available), num_devices=8)
        priced[name] = (est.time.seconds, est.memory.peak)
    fits = {n: s for n, (s, peak) in priced.items() if peak <= 0.9 * available}
    chosen, line = remat.choose(config, devices, available)
    assert chosen == (min(fits, key=fits.get) if fits else "full"), priced
    assert line.startswith(f"parallel.remat=auto: {chosen}")
    # The three budgets reach three different answers: nothing is decided by a fixed table.
    assert {80: "none", 40: "offload", 20: "full"}[available_gib] == chosen


def test_train_py_leaves_auto_to_the_table_on_a_cpu_or_an_unknown_limit():
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = _config()
    config.parallel.remat = "auto"
    script.choose_remat(config, jax.devices())
    assert config.parallel.remat == "auto"
    script.choose_remat(config, _h100s(stats={}))  # no bytes_limit: nothing to fit against
    assert config.parallel.remat == "auto"
    script.choose_remat(config, _h100s(stats={"bytes_limit": 40 * GIB, "bytes_in_use": 0}))
    assert config.parallel.remat == "offload"
