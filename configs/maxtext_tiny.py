"""The tiny Llama jaxpar and MaxText both train in `scripts/bench.py mesh` (benchmarks/peers/maxtext/).

Llama-2 style: embedding 256, 4 layers, 4 query / 2 KV heads of dim 64, MLP 688, vocab 256, untied
LM head, sequence 256, global batch 8 (MaxText's per_device_batch_size=1 on 8 devices), fp32.
`scripts/bench.py mesh` sets the mesh to match MaxText's (fsdp8, dp8, tp2dp4, pp2dp4, ...) and derives
MaxText's keys from this config (`jaxpar.bench.mesh.maxtext_overrides`); the runner's own defaults
(`TINY_LLAMA` in benchmarks/peers/maxtext/run_tiny.py) are held equal to them by tests/scripts/test_peers.py.
"""

from jaxpar.config import base_config
from jaxpar.models import llama


def get_config():
    c = base_config()
    c.model = llama.model_config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    c.train.update(steps=10, global_batch_size=8, seq_len=256, learning_rate=1e-3, warmup_steps=1, weight_decay=0.0)
    c.train.update(compute_dtype="float32", param_dtype="float32")
    return c
