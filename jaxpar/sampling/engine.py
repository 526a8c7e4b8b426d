"""The sampler: a KV cache, one prefill of the prompt batch, then one jitted decode step per token.

Prompts are LEFT-padded to a common length P: every row's last prompt token sits in slot P - 1,
so the prefill's last position is every row's next-token logits, and each decode step writes all
rows' new key / value at the same slot (one `dynamic_update_slice`, no per-row scatter). A row's
RoPE positions count from its first real token (slot - pad), as transformers' `generate` derives
them from the attention mask; the mask lets a query see the slots from its row's first real token
up to its own. The padding itself is never attended to.

The cache is the model's (`jaxpar.models.decoder.Decoder.cache_layout`): by default [layers, batch,
slots, KV heads, head dim] for k and for v: only the KV heads (GQA), after
`jaxpar.parallel.tensor.repeat_kv` when tensor has more ranks than KV heads (then each rank holds
the one KV head its query heads read); DeepSeek-V3's is one latent and RoPE key per slot. On a mesh
it is laid out like the activations: batch over the batch axes (`data`, `expert`), KV heads over
`tensor` (Megatron inference); the MoE dispatch runs as in training. Pipeline and context axes are
refused (`mesh_problems`).

Compiled once per shape bucket: rows rounded up to a multiple of the batch axes, P to a power of
two (>= 16), the slots to a power of two >= P + max_new_tokens. The decode step takes the slot and
step as traced scalars, so it compiles once per bucket, not per token. MoE layers run dropless:
`capacity_factor` is a per-sequence training budget that a one-token decode step would turn into a
capacity of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict, FrozenConfigDict

from jaxpar import models
from jaxpar.axes import CONTEXT, PIPELINE
from jaxpar.dtypes import DTYPES
from jaxpar.models.families import family
from jaxpar.models.options import RunOptions
from jaxpar.parallel import tensor
from jaxpar.parallel.plan import make_plan
from jaxpar.sampling.filters import SamplingParams, choose, problems
from jaxpar.sharding import param_rules

MIN_BUCKET = 16


class SampleError(ValueError):
    """Bad sampling input; one line per problem, naming the flag or argument."""


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _model_config(model_config) -> FrozenConfigDict:
    cfg = ConfigDict(models.frozen(model_config).as_configdict().to_dict())
    if "capacity_factor" in cfg:  # dropless at inference (module docstring)
        cfg.capacity_factor = 0.0
    return FrozenConfigDict(cfg)


def sampling_config(model_config, sizes: dict, compute_dtype: str = "float32") -> ConfigDict:
    """A run config for sampling on a mesh of `sizes`: no ZeRO, no sequence parallelism, no remat."""
    from jaxpar.config import base_config

    config = base_config()
    config.model = ConfigDict(models.frozen(model_config).as_configdict().to_dict())
    config.mesh = ConfigDict(dict(sizes))
    config.parallel.remat = "none"
    config.train.compute_dtype = compute_dtype
    return config


def mesh_problems(model_config, sizes: dict, prefix: str = "mesh.") -> list[str]:
    """One line per reason the sampler cannot run this model on a mesh of `sizes` (`prefix`: how
    the axis sizes are spelled where they came from: mesh.tensor, --tensor)."""
    errors = [
        f"{prefix}{axis}={sizes[axis]}: sampling does not split the model over {axis} (use tensor, data, expert)"
        for axis in (PIPELINE, CONTEXT)
        if sizes.get(axis, 1) > 1
    ]
    record = family(model_config.model_type)
    shared = record.ranges(model_config) or record.checks(model_config, sizes)
    if not errors and not shared:
        shared = tensor.checks(sampling_config(model_config, sizes), sizes)
    # The shared checks name the config's mesh keys; say them as the caller's user typed them.
    return errors + [line.replace("mesh.", prefix) for line in shared]


@dataclass
class Result:
    completions: list[list[int]]  # new token ids per prompt (through the first EOS, if any)
    logits: np.ndarray | None  # [prompts, steps, vocab] fp32 of every chosen token (return_logits)
    cache_bytes_per_device: int
    rows: int  # the batch bucket
    slots: int  # the cache length bucket


class Sampler:
    """Generation for one model on one mesh (None: one device, no sharding)."""

    def __init__(self, model_config, mesh=None, compute_dtype: str = "float32"):
        self.cfg = _model_config(model_config)
        self.mesh = mesh
        if mesh is None:
            self.opts, self.batch_divisor = RunOptions(compute_dtype=DTYPES[compute_dtype]), 1
        else:
            sizes = dict(mesh.shape)
            if errors := mesh_problems(self.cfg, sizes):
                raise SampleError("\n".join(errors))
            config = sampling_config(self.cfg, sizes, compute_dtype)
            plan = make_plan(config, sizes, models.facts(self.cfg), mesh.devices.flat[0].platform)
            self.opts = RunOptions(rules=param_rules(plan, mesh), plan=plan, compute_dtype=DTYPES[compute_dtype])
            self.batch_divisor = math.prod(plan.size(axis) for axis in plan.batch_axes)
        self._prefill = jax.jit(self._prefill_fn, static_argnames="sampling", donate_argnames="cache")
        self._step = jax.jit(self._step_fn, static_argnames="sampling", donate_argnames="cache")
        self._empty = {}

    # -- placement -------------------------------------------------------------------------

    def param_shardings(self):
        return None if self.mesh is None else self.opts.rules.tree_shardings(models.logical_axes(self.cfg))

    def place(self, params):
        """`params` (numpy or arrays on any layout) on this sampler's devices and layout."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, params)
        return jax.device_put(params, self.param_shardings())

    def _sharding(self, names):
        return None if self.mesh is None else self.opts.rules.sharding(names)

    def cache_layout(self, rows: int, slots: int) -> tuple:
        """Per cache array: (its shape, its logical names)."""
        return family(self.cfg.model_type).module.cache_shapes(self.cfg, self.opts.plan.tensor.kv_repeat, rows, slots)

    def cache_bytes_per_device(self, rows: int, slots: int) -> int:
        total = 0
        for shape, names in self.cache_layout(rows, slots):
            sharding = self._sharding(names)
            total += math.prod(shape if sharding is None else sharding.shard_shape(shape))
        return total * jnp.dtype(self.opts.compute_dtype).itemsize

    def cache_bytes_per_sequence(self, slots: int) -> tuple[int, int]:
        """(this model's decode cache, a cache of every layer over all `slots`) in bytes for one
        sequence on one device: a sliding layer's ring (`jaxpar.models.attention_cache`) keeps
        min(window, slots) slots, so the first is smaller for a model with sliding layers."""
        module, cfg = family(self.cfg.model_type).module, self.cfg
        kept = sum(math.prod(shape) for shape, _ in module.cache_shapes(cfg, 1, 1, slots))
        full = cfg.num_hidden_layers * slots * sum(math.prod(shape) for shape, _ in module.cache_layout(cfg, 1))
        itemsize = jnp.dtype(self.opts.compute_dtype).itemsize
        return kept * itemsize, full * itemsize

    def empty_cache(self, rows: int, slots: int):
        key = (rows, slots)
        if key not in self._empty:
            layout, dtype = self.cache_layout(rows, slots), self.opts.compute_dtype
            self._empty[key] = jax.jit(
                lambda: tuple(jnp.zeros(shape, dtype) for shape, _ in layout),
                out_shardings=None if self.mesh is None else tuple(self._sharding(names) for _, names in layout),
            )
        return self._empty[key]()

    # -- the two jitted programs -------------------------------------------------------------

    def _extend(self, params, tokens, positions, cache, write_at, mask):
        params = jax.tree.map(lambda p: p.astype(self.opts.compute_dtype), params)
        logits, cache = models.merge(self.cfg, params).extend(tokens, positions, cache, write_at, mask, self.opts)
        if self.mesh is not None:
            names = [n for _, n in self.cache_layout(*cache[0].shape[1:3])]
            cache = tuple(self.opts.rules.constrain(c, n) for c, n in zip(cache, names))
        return logits[:, 0, : self.cfg.vocab_size], cache

    def _prefill_fn(self, params, tokens, pad, cache, seed, sampling: SamplingParams):
        length, slots = tokens.shape[1], cache[0].shape[2]
        query = jnp.arange(length, dtype=jnp.int32)
        key = jnp.arange(slots, dtype=jnp.int32)
        positions = jnp.maximum(query[None, :] - pad[:, None], 0)
        mask = (key[None, None, :] <= query[None, :, None]) & (key[None, None, :] >= pad[:, None, None])
        logits, cache = self._extend(params, tokens, positions, cache, 0, mask)
        return choose(logits, sampling, seed, 0), logits, cache

    def _step_fn(self, params, token, slot, pad, cache, seed, step, sampling: SamplingParams):
        key = jnp.arange(cache[0].shape[2], dtype=jnp.int32)
        positions = (slot - pad)[:, None]
        mask = ((key[None, :] >= pad[:, None]) & (key[None, :] <= slot))[:, None, :]
        logits, cache = self._extend(params, token[:, None], positions, cache, slot, mask)
        return choose(logits, sampling, seed, step), logits, cache

    # -- the loop --------------------------------------------------------------------------

    def buckets(self, prompts, max_new_tokens: int) -> tuple[int, int, int]:
        """(rows, prompt length, slots) buckets for this batch."""
        rows = -(-len(prompts) // self.batch_divisor) * self.batch_divisor
        length = bucket(max(len(p) for p in prompts))
        return rows, length, bucket(length + max_new_tokens)

    def generate(
        self,
        params,
        prompts,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        eos_id: int | None = None,
        return_logits: bool = False,
    ) -> Result:
        """Continues each prompt (a list of token ids) by up to `max_new_tokens` tokens; `params`
        already placed (`place`). Stops once every row has produced `eos_id`."""
        if errors := self.input_problems(prompts, max_new_tokens, eos_id):
            raise SampleError("\n".join(errors))
        rows, length, slots = self.buckets(prompts, max_new_tokens)
        tokens, pad = left_pad(prompts, rows, length)
        tokens = jax.device_put(tokens, self._sharding(("batch", None)))
        pad = jax.device_put(pad, self._sharding(("batch",)))
        seed = jnp.asarray(seed, jnp.uint32)
        token, logits, cache = self._prefill(params, tokens, pad, self.empty_cache(rows, slots), seed, sampling=sampling)
        chosen, kept_logits = [token], [logits] if return_logits else None
        done = token == eos_id if eos_id is not None else None
        for step in range(1, max_new_tokens):
            # One host sync every 8 tokens: the steps before it are already queued.
            if done is not None and step % 8 == 0 and bool(np.all(np.asarray(done)[: len(prompts)])):
                break
            slot = jnp.asarray(length + step - 1, jnp.int32)
            token, logits, cache = self._step(params, token, slot, pad, cache, seed, jnp.asarray(step, jnp.int32), sampling=sampling)
            chosen.append(token)
            if return_logits:
                kept_logits.append(logits)
            if done is not None:
                done = done | (token == eos_id)
        ids = np.stack([np.asarray(t) for t in chosen], axis=1)[: len(prompts)]
        completions = [_through_eos(row, eos_id) for row in ids.tolist()]
        all_logits = None
        if return_logits:
            all_logits = np.stack([np.asarray(x) for x in kept_logits], axis=1)[: len(prompts)]
        return Result(completions, all_logits, self.cache_bytes_per_device(rows, slots), rows, slots)

    def input_problems(self, prompts, max_new_tokens: int, eos_id=None, names: dict | None = None) -> list[str]:
        """One line per bad input; `names` renames the arguments in the messages (flags)."""
        name = {"prompts": "prompts", "max_new_tokens": "max_new_tokens", "eos_id": "eos_id", **(names or {})}
        vocab, limit = self.cfg.vocab_size, self.cfg.max_position_embeddings
        errors = []
        if not prompts:
            return [f"{name['prompts']}: no prompt given"]
        if max_new_tokens < 1:
            errors.append(f"{name['max_new_tokens']}={max_new_tokens} must be >= 1")
        for i, prompt in enumerate(prompts):
            if not len(prompt):
                errors.append(f"{name['prompts']}: prompt {i} is empty")
            elif min(prompt) < 0 or max(prompt) >= vocab:
                errors.append(f"{name['prompts']}: prompt {i} has token ids outside [0, {vocab}) (model.vocab_size)")
        longest = max(len(p) for p in prompts)
        if longest > limit:
            errors.append(f"{name['prompts']}: a prompt of {longest} tokens is longer than model.max_position_embeddings={limit}")
        elif longest + max_new_tokens > limit:
            errors.append(
                f"{name['max_new_tokens']}={max_new_tokens}: the longest prompt ({longest} tokens) plus the new tokens "
                f"exceed model.max_position_embeddings={limit}; ask for at most {limit - longest}"
            )
        if eos_id is not None and not 0 <= eos_id < vocab:
            errors.append(f"{name['eos_id']}={eos_id} is outside [0, {vocab}) (model.vocab_size)")
        return errors


def left_pad(prompts, rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, length] int32, pad [rows] int32): each prompt right-aligned, padded with 0 on
    the left; rows past the prompts repeat the first prompt (their output is dropped)."""
    tokens, pad = np.zeros((rows, length), np.int32), np.zeros((rows,), np.int32)
    for row in range(rows):
        prompt = np.asarray(prompts[row] if row < len(prompts) else prompts[0], np.int32)
        pad[row] = length - len(prompt)
        tokens[row, pad[row] :] = prompt
    return tokens, pad


def _through_eos(row: list[int], eos_id) -> list[int]:
    if eos_id is not None and eos_id in row:
        return row[: row.index(eos_id) + 1]
    return row


def generate(model_config, params, prompts, *, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, mesh=None, compute_dtype: str = "float32"):
    """Token ids continuing each prompt (lists of ints): greedy by default, else sampled with
    temperature / top-k / top-p from `seed`. `mesh`: a jaxpar mesh (`jaxpar.mesh.make_mesh`) to
    split heads + cache over `tensor` and the prompts over `data`; None: one device."""
    sampler = Sampler(model_config, mesh, compute_dtype)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if errors := problems(sampling, model_config.vocab_size, prefix=""):
        raise SampleError("\n".join(errors))
    result = sampler.generate(sampler.place(params), prompts, max_new_tokens, sampling, seed, eos_id)
    return result.completions
