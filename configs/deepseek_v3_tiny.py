"""A tiny DeepSeek-V3 that visibly learns the built-in corpus in about a minute on 2 CPU cores:
multi-head latent attention (a 64-wide query latent, a 32-wide key / value latent, a 16-wide shared
RoPE key), one dense layer then two routed ones with 16 experts of 64 in 4 groups (top-4 among the
experts of each token's 2 best groups, sigmoid scores, the selection bias moved by loss-free
balancing), one shared expert, and one multi-token prediction module trained at
`train.mtp_loss_weight` (its per-depth loss is logged as `mtp_loss`)."""

from jaxpar.config import base_config
from jaxpar.models import deepseek_v3


def get_config():
    c = base_config()
    c.model = deepseek_v3.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=256,  # the dense layer's MLP
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=1,
        n_routed_experts=16,
        n_shared_experts=1,
        moe_intermediate_size=64,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        router_bias_update_rate=1e-3,
        num_nextn_predict_layers=1,
    )
    c.train.steps = 120
    c.train.global_batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 12
    c.train.weight_decay = 0.01
    c.train.mtp_loss_weight = 0.3
    return c
