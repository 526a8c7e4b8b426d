"""A tiny Qwen2-MoE (8 experts, top-2, a shared expert with its sigmoid gate, q/k/v biases) that
visibly learns the built-in corpus in about a minute on 2 CPU cores."""

from jaxpar.config import base_config
from jaxpar.models import qwen2_moe


def get_config():
    c = base_config()
    c.model = qwen2_moe.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=256,  # dense layers' MLP (none here: every layer routes)
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=10000.0,
        max_position_embeddings=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=192,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=0.001,
    )
    c.train.steps = 120
    c.train.global_batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 12
    c.train.weight_decay = 0.01
    return c
