"""DeepSeek-V3 (671B parameters, 37B active per token; one multi-token prediction module), full-parameter
AdamW pretraining: 61 layers (three dense, then 58 routed), hidden 7168, 128 heads with MLA (a 1536
query latent, a 512 key / value latent), 256 routed experts of 2048 in 8 groups (top-8 within each
token's 4 best groups) and one shared expert, YaRN to 160K positions.

Laid out for 1024 x h100-80g (8-GPU NVLink nodes, InfiniBand between) as
`python scripts/plan.py --config=configs/deepseek_v3_671b.py --hardware=h100-80g --devices=1024` ranks
first: data 128 x tensor 8 (MLA's heads over the node), ZeRO-3, sequence parallelism, remat full, 4
accumulated microbatches; 58.5 of the 72.0 GiB it lets a layout use, 57.4 s per step predicted (4096
sequences of 4096 tokens; MFU 8%: 39 s of ZeRO-3's per-layer traffic over InfiniBand stays exposed).
Expert parallelism ranks second (data 128 x expert 2 x tensor 4, +29%): jaxpar's dispatch
all-to-alls cost more than they save at this size.

Beside it, the layout Megatron-Core publishes for this model: tensor 2, pipeline 8 (4 virtual stages
each), expert 64. The pipeline runs this model's shape (the three dense layers on the first stage,
the multi-token prediction module on the last: docs/parallelism/pipeline.md), with the whole LM head
on the last stage: preflight passes that layout with `parallel.pipeline_vocab="ends"` (and refuses it,
in one line, with the default "spread"). It has not been ranked against the layout above since.
"""

from jaxpar.config import base_config
from jaxpar.models import deepseek_v3


def get_config():
    c = base_config()
    c.model = deepseek_v3.model_config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(
            rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0,
        ),
        max_position_embeddings=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        first_k_dense_replace=3,
        n_routed_experts=256,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        router_bias_update_rate=1e-3,
        num_nextn_predict_layers=1,
    )
    c.mesh.update(data=-1, tensor=8)
    c.parallel.update(zero_stage=3, sequence_parallel=True, remat="full")
    c.train.update(
        global_batch_size=4096, seq_len=4096, grad_accum=4, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=2.2e-4, warmup_steps=2000, mtp_loss_weight=0.3,
    )
    return c
