"""The bench config of `scripts/bench.py step` and `packing`. With `step --peer`, the transformers +
PyTorch peer (benchmarks/peers/hf_torch/) builds its model from this config's model section."""

from jaxpar.config import base_config
from jaxpar.models import llama


def get_config():
    c = base_config()
    c.model = llama.model_config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=500000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    c.mesh.data = 1
    c.train.update(global_batch_size=8, seq_len=256, learning_rate=1e-3, warmup_steps=0, weight_decay=0.01)
    c.train.update(compute_dtype="float32", param_dtype="float32")
    return c
