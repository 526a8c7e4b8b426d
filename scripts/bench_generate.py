"""Decode speed side by side in one process: jaxpar with its KV cache, jaxpar recomputing the whole
sequence for every token, and transformers' `generate` (its own cache) on the same weights and
prompts, all greedy.

  python scripts/bench_generate.py [--new_tokens=256] [--batch=4] [--prompt_len=32] [--hidden=256]
      [--layers=4] [--heads=8] [--kv_heads=2] [--vocab=2048] [--threads=2] [--repeats=1]

A random Llama (transformers' LlamaForCausalLM, GQA) is saved and read back with
`jaxpar.interop.hf.load`. Each contender is warmed up (compiled: the whole cached generate, one
full forward, a 2-token transformers generate), then runs `repeats` times, alternating, and the
fastest run counts. "recompute": one jitted full forward over the fixed-size
[batch, prompt + new] buffer per token (causal, so the padding after the current token changes
nothing; compiled once), the next token taken at the current position. Wall seconds and this
process's CPU seconds are printed for each; greedy tokens are checked equal across the three.
The last line: `cached_tok_s=... recompute_tok_s=... hf_tok_s=... cached_vs_recompute=...x cached_vs_hf=...x`.
"""

from __future__ import annotations

import sys
import tempfile
import time

from absl import app, flags

_NEW = flags.DEFINE_integer("new_tokens", 256, "New tokens per prompt.")
_BATCH = flags.DEFINE_integer("batch", 4, "Prompts.")
_PROMPT = flags.DEFINE_integer("prompt_len", 32, "Tokens per prompt.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "hidden_size.")
_LAYERS = flags.DEFINE_integer("layers", 4, "num_hidden_layers.")
_HEADS = flags.DEFINE_integer("heads", 8, "num_attention_heads.")
_KV = flags.DEFINE_integer("kv_heads", 2, "num_key_value_heads.")
_VOCAB = flags.DEFINE_integer("vocab", 2048, "vocab_size.")
_THREADS = flags.DEFINE_integer("threads", 2, "torch.set_num_threads for transformers.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed runs of each contender.")


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(_):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from jaxpar import models
    from jaxpar.interop import hf
    from jaxpar.sampling import Sampler

    torch.set_num_threads(_THREADS.value)
    new, batch, length = _NEW.value, _BATCH.value, _PROMPT.value
    config = transformers.LlamaConfig(
        vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value, intermediate_size=_HIDDEN.value * 3,
        num_hidden_layers=_LAYERS.value, num_attention_heads=_HEADS.value, num_key_value_heads=_KV.value,
        max_position_embeddings=max(512, length + new), attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # large weights: decisive argmaxes, so the three can be compared token by token
        for name, p in hf_model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    hf_model.eval()
    hf_model.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        cfg, params = hf.load(path)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (batch, length))

    sampler = Sampler(cfg)
    placed = sampler.place(params)

    def cached():
        return np.asarray(sampler.generate(placed, prompts.tolist(), new).completions)

    total = length + new
    forward = jax.jit(lambda p, t, i: jnp.argmax(models.apply(cfg, p, t)[0][:, i, : cfg.vocab_size], axis=-1).astype(jnp.int32))

    def recompute():
        buffer = jnp.zeros((batch, total), jnp.int32).at[:, :length].set(jnp.asarray(prompts))
        for i in range(length - 1, total - 1):
            token = forward(placed, buffer, i)
            buffer = buffer.at[:, i + 1].set(token)
        return np.asarray(buffer[:, length:])

    def with_transformers():
        with torch.no_grad():
            out = hf_model.generate(torch.as_tensor(prompts), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                    use_cache=True, pad_token_id=0, attention_mask=torch.ones(batch, length, dtype=torch.long))
        return out[:, length:].numpy()

    def warm_hf():
        with torch.no_grad():
            hf_model.generate(torch.as_tensor(prompts), do_sample=False, max_new_tokens=2, pad_token_id=0)

    warm_ups = {"cached": cached, "recompute": lambda: forward(placed, jnp.zeros((batch, total), jnp.int32), 0), "hf": warm_hf}
    contenders = {"cached": cached, "recompute": recompute, "hf": with_transformers}
    results, best = {}, {name: (float("inf"), 0.0) for name in contenders}
    for name, fn in warm_ups.items():
        _, wall, _ = timed(lambda: jax.block_until_ready(fn()))  # noqa: B023 (called here)
        print(f"{name}: warm-up {wall:.2f} s", flush=True)
    for _ in range(_REPEATS.value):
        for name, fn in contenders.items():
            results[name], wall, cpu = timed(fn)
            best[name] = min(best[name], (wall, cpu))
            print(f"{name}: {wall:.2f} s", flush=True)
    tokens = batch * new
    for name, (wall, cpu) in best.items():
        print(f"{name}: {wall:.3f} s wall, {cpu:.3f} s CPU, {tokens / wall:.1f} tokens/s")
    same = {name: bool(np.array_equal(results[name], results["hf"])) for name in ("cached", "recompute")}
    print(f"greedy tokens equal to transformers: {same}")
    rate = {name: tokens / wall for name, (wall, _) in best.items()}
    print(
        f"cached_tok_s={rate['cached']:.1f} recompute_tok_s={rate['recompute']:.1f} hf_tok_s={rate['hf']:.1f} "
        f"cached_vs_recompute={rate['cached'] / rate['recompute']:.1f}x cached_vs_hf={rate['cached'] / rate['hf']:.2f}x "
        f"backend={jax.default_backend()} batch={batch} prompt={length} new={new}"
    )
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(app.run(main))
