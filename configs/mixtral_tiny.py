"""A tiny Mixtral (4 experts, top-2) that visibly learns the built-in corpus in about a minute on
2 CPU cores."""

from jaxpar.config import base_config
from jaxpar.models import mixtral


def get_config():
    c = base_config()
    c.model = mixtral.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=256,
        num_local_experts=4,
        num_experts_per_tok=2,
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
