"""`scripts/bench.py generate`: decode speed side by side in one process: jaxpar with its KV cache,
jaxpar recomputing the whole sequence for every token, and transformers' `generate` (its own cache)
on the same weights and prompts, all greedy.

A random Llama (transformers' LlamaForCausalLM, GQA) is saved and read back with
`jaxpar.interop.hf.load`. Each contender is warmed up (compiled: the whole cached generate, one
full forward, a 2-token transformers generate), then runs `repeats` times, alternating, and the
fastest run counts. "recompute": one jitted full forward over the fixed-size [batch, prompt + new]
buffer per token (causal, so the padding after the current token changes nothing; compiled once),
the next token taken at the current position. Wall seconds and this process's CPU seconds are
printed for each; greedy tokens are checked equal across the three. The last line:
`cached_tok_s=... recompute_tok_s=... hf_tok_s=... cached_vs_recompute=...x cached_vs_hf=...x`.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.train.harness import timed


@dataclass(frozen=True)
class Shape:
    """The random Llama and the prompts."""

    new_tokens: int = 256
    batch: int = 4
    prompt_len: int = 32
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 2048


def transformers_llama(shape: Shape):
    """A random LlamaForCausalLM with large weights: decisive argmaxes, so the three contenders can be
    compared token by token."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.hidden * 3,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(512, shape.prompt_len + shape.new_tokens), attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def contenders(shape: Shape, hf_model, prompts: np.ndarray) -> tuple[dict, dict]:
    """({name: warm-up}, {name: run}) for cached, recompute and hf; each run returns [batch, new] ids."""
    import torch

    from jaxpar import models
    from jaxpar.interop import hf
    from jaxpar.sampling import Sampler

    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        cfg, params = hf.load(path)
    sampler = Sampler(cfg)
    placed = sampler.place(params)
    batch, length, new = shape.batch, shape.prompt_len, shape.new_tokens
    total = length + new

    def cached():
        return np.asarray(sampler.generate(placed, prompts.tolist(), new).completions)

    forward = jax.jit(lambda p, t, i: jnp.argmax(models.apply(cfg, p, t)[0][:, i, : cfg.vocab_size], axis=-1).astype(jnp.int32))

    def recompute():
        buffer = jnp.zeros((batch, total), jnp.int32).at[:, :length].set(jnp.asarray(prompts))
        for i in range(length - 1, total - 1):
            buffer = buffer.at[:, i + 1].set(forward(placed, buffer, i))
        return np.asarray(buffer[:, length:])

    def with_transformers(tokens: int = new):
        with torch.no_grad():
            out = hf_model.generate(torch.as_tensor(prompts), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                                    use_cache=True, pad_token_id=0, attention_mask=torch.ones(batch, length, dtype=torch.long))
        return out[:, length:].numpy()

    warm_ups = {"cached": cached, "recompute": lambda: forward(placed, jnp.zeros((batch, total), jnp.int32), 0),
                "hf": lambda: with_transformers(2)}
    return warm_ups, {"cached": cached, "recompute": recompute, "hf": with_transformers}


def bench(shape: Shape, threads: int, repeats: int) -> int:
    """Prints the comparison; 0 when all three gave the same greedy tokens, else 1."""
    import torch

    torch.set_num_threads(threads)
    hf_model = transformers_llama(shape)
    prompts = np.random.default_rng(0).integers(0, shape.vocab, (shape.batch, shape.prompt_len))
    warm_ups, runs = contenders(shape, hf_model, prompts)
    for name, fn in warm_ups.items():
        print(f"{name}: warm-up {timed(fn)[1]:.2f} s", flush=True)
    results, best = {}, {name: (float("inf"), 0.0) for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            results[name], wall, cpu = timed(fn)
            best[name] = min(best[name], (wall, cpu))
            print(f"{name}: {wall:.2f} s", flush=True)
    tokens = shape.batch * shape.new_tokens
    for name, (wall, cpu) in best.items():
        print(f"{name}: {wall:.3f} s wall, {cpu:.3f} s CPU, {tokens / wall:.1f} tokens/s")
    same = {name: bool(np.array_equal(results[name], results["hf"])) for name in ("cached", "recompute")}
    print(f"greedy tokens equal to transformers: {same}")
    rate = {name: tokens / wall for name, (wall, _) in best.items()}
    print(
        f"cached_tok_s={rate['cached']:.1f} recompute_tok_s={rate['recompute']:.1f} hf_tok_s={rate['hf']:.1f} "
        f"cached_vs_recompute={rate['cached'] / rate['recompute']:.1f}x cached_vs_hf={rate['cached'] / rate['hf']:.2f}x "
        f"backend={jax.default_backend()} batch={shape.batch} prompt={shape.prompt_len} new={shape.new_tokens}"
    )
    return 0 if all(same.values()) else 1
