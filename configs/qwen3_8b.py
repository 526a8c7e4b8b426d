"""Qwen3-8B (8.2B parameters), full-parameter AdamW training.

Laid out for 8 x h100-80g (one node, NVLink), the layout
`python scripts/plan.py --config=configs/qwen3_8b.py --hardware=h100-80g --devices=8` ranks first:
data 4 with ZeRO-1 x tensor 2 (NVLink) with sequence parallelism, remat save_dots, 64
accumulation steps of one row per data replica (71.0 of the 72 GiB it lets a layout use; 7.6 s
per step predicted, MFU 86% at peak FLOP/s; data 2 x pipeline 4 with zb_h1 is 9% slower). fp32
parameters with AdamW: 18 B per parameter with the gradients and a bf16 copy, 0.15 TB over 8
devices. More devices extend `data` (keep train.global_batch_size / mesh.data divisible by
train.grad_accum).
"""

from jaxpar.config import base_config
from jaxpar.models import qwen3


def get_config():
    c = base_config()
    c.model = qwen3.model_config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    )
    c.mesh.update(data=-1, tensor=2)
    c.parallel.update(zero_stage=1, sequence_parallel=True, remat="save_dots")
    c.train.update(
        global_batch_size=256, seq_len=4096, grad_accum=64, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=3e-4, warmup_steps=2000,
    )
    c.train.steps = 100_000
    return c
