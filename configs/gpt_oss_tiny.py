"""A tiny gpt-oss (4 experts, top-2, sinks, biases, YaRN; a 32-token window on layers 0 and 2 of 128-token
sequences) that visibly learns the built-in corpus in under a minute on 2 CPU cores."""

from jaxpar.config import base_config
from jaxpar.models import gpt_oss


def get_config():
    c = base_config()
    c.model = gpt_oss.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
        router_z_loss_coef=0.001,
    )
    c.train.steps = 100
    c.train.global_batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 12
    c.train.weight_decay = 0.01
    return c
