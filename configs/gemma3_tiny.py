"""A tiny Gemma 3 (five 32-token sliding-window layers then a full one over 128-token sequences, two
RoPE bases, QK-norm, sandwich norms, GeGLU, √hidden embedding scale, tied embeddings) that visibly
learns the built-in corpus in under a minute on 2 CPU cores."""

from jaxpar.config import base_config
from jaxpar.models import gemma3_text


def get_config():
    c = base_config()
    c.model = gemma3_text.model_config(
        vocab_size=256,  # byte-level tokenizer
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32.0,
        sliding_window=32,
        max_position_embeddings=256,
    )
    c.train.steps = 120
    c.train.global_batch_size = 16
    c.train.seq_len = 128
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 12
    c.train.weight_decay = 0.01
    return c
