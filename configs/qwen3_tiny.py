"""A tiny Qwen3 (QK-norm, head_dim 64 while hidden / heads is 32) that visibly learns the built-in
corpus in about a minute on 2 CPU cores."""

from jaxpar.config import base_config
from jaxpar.models import qwen3


def get_config():
    c = base_config()
    c.model = qwen3.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    c.train.steps = 120
    c.train.global_batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 12
    c.train.weight_decay = 0.01
    return c
