"""Gemma 3 27B (text model, 27.0B parameters with its 1.4B-parameter tied embedding), full-parameter
AdamW training, 62 layers: five 1024-token sliding-window layers per full one.

Laid out for 32 x h100-80g (4 nodes of 8, NVLink within a node), the layout
`python scripts/plan.py --config=configs/gemma3_27b.py --hardware=h100-80g --devices=32` ranks first
of 26 that fit: data 8 with ZeRO-3 x tensor 4 (NVLink) with sequence parallelism, remat save_dots,
16 accumulation steps (62.6 of the 72 GiB it lets a layout use; 27.8 s per step predicted, MFU
40% with model FLOPs counting only the pairs a window leaves visible; data 4 x tensor 8 is 8%
slower). fp32 parameters with AdamW: 18 B per parameter, 0.49 TB over 32 devices. The step time
prices the sliding layers' attention as full layers' on the XLA path (only jaxpar_xla's band
skips keys), so it is an upper bound there.
"""

from jaxpar.config import base_config
from jaxpar.models import gemma3_text


def get_config():
    c = base_config()
    c.model = gemma3_text.model_config(
        vocab_size=262208,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168.0,
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        rope_local_base_freq=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    )
    c.mesh.update(data=-1, tensor=4)
    c.parallel.update(zero_stage=3, sequence_parallel=True, remat="save_dots")
    c.train.update(
        global_batch_size=256, seq_len=8192, grad_accum=16, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=1e-4, warmup_steps=2000,
    )
    c.train.steps = 100_000
    return c
