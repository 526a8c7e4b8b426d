"""A LoRA run through the scripts: scripts/train.py trains adapters on a transformers base
(train.init_from_hf), scripts/convert.py exports them to PEFT's format (--to_peft) and the merged
model to transformers (--to_hf): peft's logits of the export equal the merged export's. A second
run starts from the PEFT adapter (train.lora.init_from_peft): on the same first batch (same seed,
same data order) its first loss is below the first run's, which started from the bare base."""

import json

import numpy as np
import pytest

from tests.support.hf_models import llama_model, torch
from tests.train.probe import script

peft = pytest.importorskip("peft")

CONFIG = """
from tests.support import tiny
def get_config():
    c = tiny.llama(dict(steps=2, learning_rate=3e-2, weight_decay=0.0, init_from_hf={hf!r}))
    c.model.update(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)
    c.train.lora.update(rank=4, alpha=8.0, targets="q,v,down")
    c.data.max_corpus_bytes = 50_000
    c.checkpoint.every_steps = 0
    return c
"""


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.slow
def test_train_export_and_continue(tmp_path, monkeypatch):
    base = llama_model("gqa_untied")
    base.save_pretrained(tmp_path / "hf")
    (tmp_path / "config.py").write_text(CONFIG.format(hf=str(tmp_path / "hf")))
    train = script("train").main
    assert train([f"--config={tmp_path / 'config.py'}", f"--workdir={tmp_path / 'run'}"]) == 0
    convert = script("convert").main
    assert convert([f"--from_checkpoint={tmp_path / 'run'}", f"--to_peft={tmp_path / 'adapter'}", f"--to_hf={tmp_path / 'merged'}"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["down_proj", "q_proj", "v_proj"])
    tokens = np.random.default_rng(0).integers(0, 300, (2, 10))
    fresh = type(base).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with_adapter = _logits(peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval(), tokens)
    merged = _logits(type(base).from_pretrained(tmp_path / "merged", attn_implementation="eager").eval(), tokens)
    np.testing.assert_allclose(with_adapter, merged, atol=1e-4, rtol=0)
    assert np.max(np.abs(with_adapter - _logits(base, tokens))) > 1e-3  # the adapter moved the model
    # A second run continues from the PEFT adapter.
    assert train([f"--config={tmp_path / 'config.py'}", f"--workdir={tmp_path / 'run2'}",
                  f"--config.train.lora.init_from_peft={tmp_path / 'adapter'}", "--config.train.steps=1"]) == 0
    first = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["loss"] for run in ("run", "run2")]
    assert first[1] < first[0] - 1e-3, first
