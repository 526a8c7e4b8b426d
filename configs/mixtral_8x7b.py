"""Mixtral 8x7B's real shape (46.7B parameters, 12.9B active per token), for mesh experiments:
memory and collectives of compiled steps, not for training on this machine.

Default mesh: 8-way expert (one expert per device group) × 8-way tensor, data filling the rest
(64 devices or a multiple). Override with --config.mesh.expert=... etc.
"""

from jaxpar.config import base_config, mixtral_model_config


def get_config():
    c = base_config()
    c.model = mixtral_model_config(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        max_position_embeddings=32768,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        capacity_factor=0.0,  # dropless, as Mixtral was trained
    )
    c.mesh.update(data=-1, expert=8, tensor=8)
    c.parallel.update(zero_stage=1, remat="full", sequence_parallel=True)
    c.train.update(
        global_batch_size=256,
        seq_len=4096,
        learning_rate=1e-4,
        warmup_steps=100,
        compute_dtype="bfloat16",
        param_dtype="float32",
    )
    return c
