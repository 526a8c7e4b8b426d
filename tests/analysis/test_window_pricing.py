"""Sliding windows in the model's facts and the cost model (issue 37 item 8), against what is counted
independently: the visible (query, key) pairs of each layer's mask, counted here with numpy; and the
matmul FLOPs XLA compiles for the band kernel (`jaxpar.kernels.local_attention`), read from its HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis.cost.cost_model import computed_keys
from jaxpar.analysis.cost.layout import Layout
from jaxpar.analysis.program.hlo_flops import matmul_flops
from jaxpar.kernels.local_attention import banded_attention
from jaxpar.models import facts
from jaxpar.models.attention_pattern import layer_windows
from tests.support import tiny

SEQ, WINDOW = 256, 24


def _config(attention="jaxpar_xla"):
    config = tiny.gemma3_text()
    config.model.update(sliding_window=WINDOW, num_hidden_layers=6)
    config.train.seq_len = SEQ
    config.parallel.attention_impl = attention
    return config


def _visible_pairs(window: int, seq: int) -> int:
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    visible = j <= i
    if window:
        visible &= i - j < window
    return int(visible.sum())


def test_visible_keys_count_each_layers_mask():
    config = _config()
    f = facts(config.model)
    windows = layer_windows(config.model)
    assert (f.sliding_layers, f.sliding_window) == (int((windows > 0).sum()), WINDOW) and 0 < f.sliding_layers < 6
    sliding = sum(_visible_pairs(int(w), SEQ) / SEQ for w in windows if w)
    full = (windows == 0).sum() * SEQ / 2  # causal layers: half of all pairs, as model FLOPs always counted them
    assert f.visible_keys(SEQ) == pytest.approx(sliding + full, rel=1e-12)


def test_the_band_is_priced_as_the_kernel_compiles_it():
    """One sliding layer's forward attention FLOPs per token in the cost model equal the band kernel's
    compiled matmul FLOPs over the sequence; a full layer's stay the whole sequence's."""
    config = _config()
    m = config.model
    layout = Layout.from_config(config, 1, target="cpu")
    f = layout.facts
    q = jnp.zeros((1, SEQ, m.num_attention_heads, m.head_dim or m.hidden_size // m.num_attention_heads))
    k = v = jnp.zeros(q.shape[:2] + (m.num_key_value_heads, q.shape[3]))
    compiled = jax.jit(lambda q, k, v: banded_attention(q, k, v, None, WINDOW, WINDOW)).lower(q, k, v).compile()
    band_flops, _ = matmul_flops(compiled.as_text())
    full = SEQ * 1.0  # jaxpar_xla computes every (query, key) pair of a full layer
    priced = computed_keys(layout) * f.layers
    sliding_keys = (priced - (f.layers - f.sliding_layers) * full) / f.sliding_layers
    assert f.flops_attention_per_key * sliding_keys * SEQ == pytest.approx(band_flops, rel=1e-9)
    assert computed_keys(Layout.from_config(_config("xla"), 1, target="cpu")) == full, "XLA masks the window: no band"
