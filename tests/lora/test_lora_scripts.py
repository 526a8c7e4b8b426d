"""A LoRA chat fine-tune through the scripts, every command as a user types it: scripts/train.py
trains adapters on a transformers base (train.init_from_hf) on local chat records (data.format=chat,
assistant-only loss); scripts/convert.py exports them to PEFT's format (--to_peft) and the merged
model to transformers (--to_hf): peft's logits of the export on the base equal the merged export's;
scripts/sample.py --chat on the run (adapters folded in) decodes greedily what transformers'
`generate` decodes from the PEFT model on the chat-rendered prompt. A second run starts from the
PEFT adapter (train.lora.init_from_peft): on the same first batch (same seed, same data order) its
first loss is below the first run's, which started from the bare base."""

import json

import numpy as np
import pytest

from tests.support.chat import conversations, make_chat_tokenizer, write_records
from tests.support.hf_models import llama_model, torch
from tests.train.probe import script

peft = pytest.importorskip("peft")

CONFIG = """
from tests.support import tiny
def get_config():
    c = tiny.llama(dict(steps=3, learning_rate=3e-2, weight_decay=0.0, init_from_hf={hf!r}, global_batch_size=8, seq_len=32))
    c.model.update(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)
    c.train.lora.update(rank=4, alpha=8.0, targets="q,v,down")
    c.data.update(source="text", path={records!r}, format="chat", tokenizer={tokenizer!r})
    c.checkpoint.every_steps = 0
    return c
"""
QUESTION = "the cat sat on"


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.slow
def test_chat_lora_train_export_sample_continue(tmp_path):
    base = llama_model("gqa_untied")
    base.save_pretrained(tmp_path / "hf")
    tokenizer = make_chat_tokenizer(tmp_path / "tokenizer", vocab_size=300)
    records = write_records(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(64, high=6)])
    (tmp_path / "config.py").write_text(CONFIG.format(hf=str(tmp_path / "hf"), records=records, tokenizer=tokenizer))
    train, convert, sample = script("train").main, script("convert").main, script("sample").main
    assert train([f"--config={tmp_path / 'config.py'}", f"--workdir={tmp_path / 'run'}"]) == 0
    assert convert([f"--from_checkpoint={tmp_path / 'run'}", f"--to_peft={tmp_path / 'adapter'}",
                    f"--to_hf={tmp_path / 'merged'}"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["down_proj", "q_proj", "v_proj"])
    tokens = np.random.default_rng(0).integers(0, 300, (2, 10))
    fresh = type(base).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    adapted = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    merged = type(base).from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    np.testing.assert_allclose(_logits(adapted, tokens), _logits(merged, tokens), atol=1e-4, rtol=0)
    assert np.max(np.abs(_logits(adapted, tokens) - _logits(base, tokens))) > 1e-3  # the adapter moved the model
    # Sampling the run with --chat: greedy, as transformers' generate on the PEFT model.
    out = tmp_path / "samples.jsonl"
    assert sample([f"--workdir={tmp_path / 'run'}", "--chat", f"--prompt={QUESTION}", "--max_new_tokens=8", "--eos_id=299",
                   f"--output={out}"]) == 0
    got = json.loads(out.read_text().splitlines()[0])
    hf_tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tokenizer)
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    prompt = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert got["prompt_ids"] == prompt
    with torch.no_grad():
        want = adapted.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=299,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert got["completion_ids"] == want
    # A second run continues from the PEFT adapter.
    assert train([f"--config={tmp_path / 'config.py'}", f"--workdir={tmp_path / 'run2'}",
                  f"--config.train.lora.init_from_peft={tmp_path / 'adapter'}", "--config.train.steps=1"]) == 0
    first = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["loss"] for run in ("run", "run2")]
    assert first[1] < first[0] - 1e-3, first
