"""A tiny Llama that visibly learns the built-in corpus in about a minute on 2 CPU cores."""

from jaxpar.config import base_config
from jaxpar.models import llama


def get_config():
    c = base_config()
    c.model = llama.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    c.train.steps = 200
    c.train.global_batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 20
    c.train.weight_decay = 0.01
    return c
