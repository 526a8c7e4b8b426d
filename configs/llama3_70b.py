"""Llama 3.1 70B shapes (for mesh experiments and planning; real training needs accelerators)."""

from jaxpar.config import base_config, llama_model_config


def get_config():
    c = base_config()
    c.model = llama_model_config(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
    c.model.rope_scaling.update(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    c.mesh.update(data=-1, tensor=8)
    c.parallel.update(zero_stage=3, sequence_parallel=True, remat="full")
    c.train.update(global_batch_size=512, seq_len=8192, compute_dtype="bfloat16", learning_rate=1.5e-4, warmup_steps=2000)
    c.train.steps = 100_000
    return c
