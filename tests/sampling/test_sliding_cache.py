"""The decode cache of a model with sliding-window layers (`jaxpar.models.attention_cache`): each
sliding layer keeps a ring of min(window, slots) slots, each full layer every slot. Checked against
the closed form (layers × slots × 2 × KV heads × head dim × bytes, the sliding layers' slots cut
to the window) on the tiny Gemma 3 (sliding, sliding, full; window 4) and Gemma 3 27B's shape (52
of 62 layers sliding over 1024 tokens), and a model without sliding layers is unchanged. That the
rings decode exactly: tests/sampling/test_sampling_hf.py (Gemma 3 against transformers' generate
far past the window)."""

import importlib.util

import pytest

from jaxpar.models.attention_pattern import layer_windows
from jaxpar.sampling import Sampler
from tests.support import tiny
from tests.support.paths import REPO


def per_slot_bytes(cfg, itemsize: int) -> int:
    return 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize  # k and v


@pytest.mark.parametrize("slots", [2, 64])
def test_sliding_layers_keep_only_their_window(slots):
    cfg = tiny.gemma3_text().model
    sampler = Sampler(cfg)
    kept, full = sampler.cache_bytes_per_sequence(slots)
    ring = min(cfg.sliding_window, slots)
    assert full == 3 * slots * per_slot_bytes(cfg, 4)
    assert kept == (1 * slots + 2 * ring) * per_slot_bytes(cfg, 4)
    shapes = [shape for shape, _ in sampler.cache_layout(5, slots)]
    assert shapes == [(1, 5, slots, 2, 16)] * 2 + [(2, 5, ring, 2, 16)] * 2  # full layers' k, v, then the rings'


def test_a_model_without_sliding_layers_keeps_every_slot():
    cfg = tiny.gemma3_text(sliding_window_pattern=1).model  # every layer full
    kept, full = Sampler(cfg).cache_bytes_per_sequence(64)
    assert kept == full == 3 * 64 * per_slot_bytes(cfg, 4)
    cfg = tiny.llama().model
    assert Sampler(cfg).cache_bytes_per_sequence(64)[0] == 2 * 64 * per_slot_bytes(cfg, 4)


def test_gemma3_27b_at_8192_tokens():
    spec = importlib.util.spec_from_file_location("gemma3_27b", REPO / "configs" / "gemma3_27b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config().model
    assert int((layer_windows(cfg) > 0).sum()) == 52
    kept, full = Sampler(cfg, compute_dtype="bfloat16").cache_bytes_per_sequence(8192)
    per_slot = per_slot_bytes(cfg, 2)  # 8 KiB per layer and token
    assert full == 62 * 8192 * per_slot  # 3.875 GiB
    assert kept == (10 * 8192 + 52 * 1024) * per_slot  # 1.03 GiB: 3.76 times less
