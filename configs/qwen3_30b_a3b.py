"""Qwen3-30B-A3B (30.5B parameters, 3.3B active per token: 128 experts of 768, top-8), full-parameter
AdamW training.

Laid out for 8 x h200 (one node, NVLink), the layout
`python scripts/plan.py --config=configs/qwen3_30b_a3b.py --hardware=h200 --devices=8` ranks
first: pipeline 4 (1F1B, 256 microbatches of one row) x tensor 2, remat none, 99.6 of the 126.9
GiB it lets a layout use (4.6 s per step predicted, MFU 67% at peak FLOP/s; pipeline 8 alone is
10% slower). Every device holds all 128 experts of its stage's layers: at 8 devices the state
(18 B per parameter, 0.55 TB) fits without expert parallelism, and the planner prices the
dispatch all-to-alls of `mesh.expert` above what they save. On more nodes, extend `data`, or
`expert` (128 experts divide any power of two up to 128) when the state no longer fits.
Dense layers among the MoE layers (`mlp_only_layers`) would not run with `mesh.pipeline` > 1.
"""

from jaxpar.config import base_config
from jaxpar.models import qwen3_moe


def get_config():
    c = base_config()
    c.model = qwen3_moe.model_config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        capacity_factor=0.0,  # dropless
    )
    c.mesh.update(data=-1, pipeline=4, tensor=2)
    c.parallel.update(zero_stage=0, remat="none", pipeline_schedule="1f1b", num_microbatches=256)
    c.train.update(
        global_batch_size=256, seq_len=4096, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=1e-4, warmup_steps=100,
    )
    return c
