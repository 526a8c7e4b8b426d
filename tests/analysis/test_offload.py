"""parallel.remat=offload (issue 39 item 5): save_dots' projection outputs kept in host memory
(`pinned_host`) between the forward and the backward. Held to: training exactly as save_dots (the
same names saved, only where they wait differs); the lowered program placing those residuals while
save_dots' places none; the cost model keeping on the device what remat full keeps, and
pricing the transfers the projection outputs make, both ways, at the host link's bandwidth."""

import jax
import numpy as np
import pytest

from jaxpar.analysis.cost import hardware as hw
from jaxpar.analysis.cost.cost_model import estimate
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.cost.memory import saved_per_token_layer
from jaxpar.train.harness import prepare
from tests.support import tiny


def _run(remat):
    config = tiny.llama(vocab_size=256)
    config.parallel.remat = remat
    run = prepare(config, jax.devices()[:1])
    lowered = run.program.step_with_grads.lower(run.state, run.batch)
    _, metrics, grads = lowered.compile()(run.state, run.batch)
    return lowered.as_text(), metrics, grads


@pytest.fixture(scope="module")
def runs():
    return {remat: _run(remat) for remat in ("save_dots", "offload")}


def test_offload_trains_exactly_as_save_dots(runs):
    (_, m_dots, g_dots), (_, m_off, g_off) = runs["save_dots"], runs["offload"]
    assert float(m_off["loss"]) == float(m_dots["loss"]) and float(m_off["grad_norm"]) == float(m_dots["grad_norm"])
    for a, b in zip(jax.tree.leaves(g_dots), jax.tree.leaves(g_off)):
        np.testing.assert_array_equal(a, b)


def test_the_lowered_program_places_the_saved_dots(runs):
    """The offloaded residuals carry buffer placements in the lowered program; save_dots' has none.
    (On a CPU, JAX lowers both ends of the move to the device's own memory, which is host memory, and
    XLA:CPU compiles them away: both policies compile to the same temp bytes there. On a GPU they are
    the copies to pinned host memory and back.)"""
    offload, dots = runs["offload"][0], runs["save_dots"][0]
    assert offload.count("@annotate_device_placement") > 0 and "annotate_device_placement" not in dots


def test_the_cost_model_keeps_full_on_the_device_and_prices_the_transfers():
    from configs.llama3_8b import get_config

    config = get_config()
    config.mesh.update(data=8, tensor=1)
    config.parallel.zero_stage = 3
    priced = {}
    for remat in ("save_dots", "offload", "full"):
        config.parallel.remat = remat
        priced[remat] = (estimate(config, "h100-80g", num_devices=8), Layout.from_config(config, 8))
    (off, layout), (full, _), (dots, _) = priced["offload"], priced["full"], priced["save_dots"]
    assert off.memory.stash == full.memory.stash < dots.memory.stash
    moved = layout.layers * layout.tokens * (saved_per_token_layer(layout, "save_dots") - saved_per_token_layer(layout, "full"))
    assert off.time.host == pytest.approx(2 * moved / hw.H100_80G.host_bandwidth, rel=1e-12)
    assert off.time.compute == pytest.approx(dots.time.compute, rel=1e-12), "recomputes what save_dots recomputes"
    assert off.time.seconds == pytest.approx(dots.time.seconds + off.time.exposed_host, rel=1e-12)
