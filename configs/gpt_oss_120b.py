"""gpt-oss-120b (116.8B parameters, 5.1B active per token: 36 layers alternating a 128-token sliding
window and full attention, 128 experts of 2880 with biases and the clamped SwiGLU, top-4, learned
attention sinks, YaRN to 131072 tokens), full-parameter AdamW training from its released weights
(`train.init_from_hf`: the MXFP4 experts are dequantized on load).

Laid out for 32 x h200 (four 8-GPU nodes, NVLink within, InfiniBand across), the layout
`python scripts/plan.py --config=configs/gpt_oss_120b.py --hardware=h200 --devices=32` ranks
first: pipeline 4 (interleaved 1F1B, 2 virtual stages, 64 microbatches; its 8 virtual stages cut the
36 layers' pattern unevenly) x expert 4 x tensor 2 with sequence parallelism within a node, remat
none; 109.5 of the 126.9 GiB it lets a layout use, 7.45 s per step predicted (MFU 15%: 2.2 s of
exposed expert all-to-alls; the sinks keep attention off cuDNN, so its [S, S] scores are priced).
expert 8 alone needs 152 GiB; the state alone (18 B per parameter, 2.1 TB) does not fit one node.
"""

from jaxpar.config import base_config
from jaxpar.models import gpt_oss


def get_config():
    c = base_config()
    c.model = gpt_oss.model_config(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096),
        max_position_embeddings=131072,
        sliding_window=128,
        num_local_experts=128,
        num_experts_per_tok=4,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        router_aux_loss_coef=0.9,  # the released config.json's
        capacity_factor=0.0,  # dropless
    )
    c.mesh.update(data=-1, pipeline=4, expert=4, tensor=2)
    c.parallel.update(zero_stage=0, remat="none", pipeline_schedule="interleaved_1f1b", virtual_stages=2,
                      num_microbatches=64, sequence_parallel=True)
    c.train.update(
        global_batch_size=256, seq_len=4096, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=1e-5, warmup_steps=100,
    )
    return c
