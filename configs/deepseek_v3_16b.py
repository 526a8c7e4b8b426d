"""A ~16B model of DeepSeek-V3's architecture (16.0B parameters, 2.6B active per token), full-parameter
AdamW training: 27 layers (one dense, then 26 routed), hidden 2048, 16 heads with MLA (no query
latent, a 512 key / value latent, q / k heads of 128 + 64, values of 128), 64 routed experts of 1408
(top-6, no group limit) and 2 shared ones: the shape of Moonlight-16B-A3B and DeepSeek-V2-Lite
(vocabulary 163840 and dense MLP 11264 here).

Laid out for 8 x h100-80g (one node, NVLink), the layout
`python scripts/plan.py --config=configs/deepseek_v3_16b.py --hardware=h100-80g --devices=8` ranks
first: data 4 x tensor 2 (MLA's heads over tensor, its latents gathered under sequence parallelism),
ZeRO-3, remat save_dots, 32 accumulated microbatches; 61.3 of the 72.0 GiB it lets a layout use,
7.65 s per step predicted (MFU 30%). data 8 with ZeRO-3 and remat full ties (+0%); every layout with
less recomputation needs more memory than fits. The dense first layer keeps the pipeline out
(`model.first_k_dense_replace` > 0 with `mesh.pipeline` > 1 is refused: the engine stages one layer
stack).
"""

from jaxpar.config import base_config
from jaxpar.models import deepseek_v3


def get_config():
    c = base_config()
    c.model = deepseek_v3.model_config(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=8192,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        first_k_dense_replace=1,
        n_routed_experts=64,
        n_shared_experts=2,
        moe_intermediate_size=1408,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        router_bias_update_rate=1e-3,
    )
    c.mesh.update(data=-1, tensor=2)
    c.parallel.update(zero_stage=3, sequence_parallel=True, remat="save_dots")
    c.train.update(
        global_batch_size=256, seq_len=4096, grad_accum=32, compute_dtype="bfloat16", param_dtype="float32",
        learning_rate=3e-4, warmup_steps=100,
    )
    return c
