"""Llama-2-7B in the source article's tensor-parallel setting (`scripts/experiments.py` §1)."""

from jaxpar.config import base_config
from jaxpar.models.llama import model_config


def get_config():
    c = base_config()
    c.model = model_config(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096,
    )
    # The article's setting: batch 16, 2 accumulation steps (its sequence length is not given:
    # Llama-2's 4096), fp16/bf16 mixed precision (fp32 master weights, AdamW).
    c.train.update(global_batch_size=16, grad_accum=2, seq_len=4096, compute_dtype="bfloat16", param_dtype="float32")
    c.parallel.update(remat="full")
    return c
