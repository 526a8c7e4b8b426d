"""Bad LoRA input through scripts/train.py's `main`: one `error:` line naming the key (or the PEFT
adapter's file), exit 2, nothing written or compiled (`tests/train/probe.py` checks the contract)."""

import json

import pytest

from tests.train.probe import Probe

CASES = {
    "negative_rank": (["--config.train.lora.rank=-1"], "train.lora.rank=-1"),
    "alpha_zero": (["--config.train.lora.rank=4", "--config.train.lora.alpha=0.0"], "train.lora.alpha=0.0"),
    "unknown_target": (["--config.train.lora.rank=4", "--config.train.lora.targets=q,qkv"], "unknown ['qkv']"),
    "dropout_one": (["--config.train.lora.rank=4", "--config.train.lora.dropout=1.0"], "train.lora.dropout=1.0 must be in [0, 1)"),
    "dropout_accum": (["--config.train.lora.rank=4", "--config.train.lora.dropout=0.1", "--config.train.grad_accum=2"],
                      "train.lora.dropout=0.1 needs train.grad_accum=1"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_lora_key(name, tmp_path, capsys, monkeypatch):
    t = Probe(tmp_path, capsys, monkeypatch)
    flags, expected = CASES[name]
    t.refused("train", t.train(*flags), expected)


def test_mismatched_peft_adapter(tmp_path, capsys, monkeypatch):
    """An adapter of another rank, and one whose tensor has the wrong shape: the file is named."""
    t = Probe(tmp_path, capsys, monkeypatch)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    folder = t.write("adapter/adapter_config.json", json.dumps(config))[: -len("/adapter_config.json")]
    flags = ["--config.train.lora.rank=4", "--config.train.lora.targets=q,v", f"--config.train.lora.init_from_peft={folder}"]
    t.refused("train", t.train(*flags), "adapter_config.json: r=8")
    from safetensors.numpy import save_file

    config["r"] = 4
    t.write("adapter/adapter_config.json", json.dumps(config))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": __import__("numpy").zeros((4, 3), "float32")},
              f"{folder}/adapter_model.safetensors")
    t.refused("train", t.train(*flags), "adapter_model.safetensors: tensor base_model.model.model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize("key, value", [("rank", 8), ("alpha", 32.0), ("targets", "q,v")])
def test_resuming_with_other_adapters_is_refused(key, value):
    """A run resuming a LoRA checkpoint with another rank, alpha or targets (shapes or meaning of the
    saved adapters) is refused in one line naming the key; init_from_peft may change (unused on resume)."""
    from jaxpar.checkpoint import CheckpointError, compare_configs
    from tests.support import tiny

    saved = tiny.llama(dict(lora=dict(rank=4, alpha=8.0)))
    current = tiny.llama(dict(lora=dict(rank=4, alpha=8.0, init_from_peft="elsewhere")))
    assert compare_configs(saved.to_json_best_effort(), current.to_json_best_effort(), checkpoint="ckpt") == []
    current.train.lora[key] = value
    with pytest.raises(CheckpointError, match=rf"other LoRA adapters: train\.lora\.{key} \(saved"):
        compare_configs(saved.to_json_best_effort(), current.to_json_best_effort(), checkpoint="ckpt")
