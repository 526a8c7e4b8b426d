"""gpt-oss-20b (20.9B parameters, 3.6B active per token: 24 layers alternating a 128-token sliding
window and full attention, 32 experts of 2880 with biases and the clamped SwiGLU, top-4, learned
attention sinks, YaRN to 131072 tokens), full-parameter AdamW training from its released weights
(`train.init_from_hf`: the MXFP4 experts are dequantized on load).

Laid out for 8 x h100-80g (one node, NVLink), the layout
`python scripts/plan.py --config=configs/gpt_oss_20b.py --hardware=h100-80g --devices=8` ranks
first: data 4 x tensor 2, ZeRO-3, remat save_dots, 64 accumulated microbatches; 69.0 of the 72.0
GiB it lets a layout use, 13.9 s per step predicted (MFU 22%: the sinks keep attention off cuDNN, so
its [S, S] scores are computed whole and saved). data 2 x tensor 4 is 2% slower.
"""

from jaxpar.config import base_config
from jaxpar.models import gpt_oss


def get_config():
    c = base_config()
    c.model = gpt_oss.model_config(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096),
        max_position_embeddings=131072,
        sliding_window=128,
        num_local_experts=32,
        num_experts_per_tok=4,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        router_aux_loss_coef=0.9,  # the released config.json's
        capacity_factor=0.0,  # dropless
    )
    c.mesh.update(data=-1, tensor=2)
    c.parallel.update(zero_stage=3, remat="save_dots")
    c.train.update(
        global_batch_size=256, seq_len=4096, grad_accum=64, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=1e-5, warmup_steps=100,
    )
    return c
