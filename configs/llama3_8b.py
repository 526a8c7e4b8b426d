"""Llama 3.1 8B (8.0B parameters), full-parameter AdamW training.

Laid out for 8 x a100-80g (one node, NVLink), the layout
`python scripts/plan.py --config=configs/llama3_8b.py --hardware=a100-80g --devices=8` ranks
first: data 4 x tensor 2 (NVLink) with ZeRO-3, no remat (cuDNN flash attention keeps no [S, S]
scores), 64 accumulation steps of one row per data replica (about 68 of the 72 GiB it lets a
layout use; data 8 with ZeRO-3 and remat save_dots is 1% slower). fp32 parameters with AdamW:
16 B per parameter + a bf16 copy, 144 GB of state sharded over the 8 devices. More devices extend
`data` (keep train.global_batch_size / mesh.data divisible by train.grad_accum).
"""

from jaxpar.config import base_config
from jaxpar.models import llama


def get_config():
    c = base_config()
    c.model = llama.model_config(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
    c.model.rope_scaling.update(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    c.mesh.update(data=-1, tensor=2)
    c.parallel.update(zero_stage=3, sequence_parallel=False, remat="none")
    c.train.update(
        global_batch_size=256, seq_len=8192, grad_accum=64, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=3e-4, warmup_steps=2000,
    )
    c.train.steps = 100_000
    return c
