"""Training math against an oracle jaxpar did not write: transformers + PyTorch, and optax by hand.

- Step-1 gradients of every parameter from jaxpar's production train step (one device, fp32)
  against transformers' `loss.backward()` from the same weights and batch, for every family
  (`tests/support/hf_oracle.py` MODELS; a family without a model there fails): Llama with GQA,
  untied and tied; Mixtral; Qwen3 with QK-norm, untied and tied; Qwen3-MoE with a dense layer among
  its MoE layers (`mlp_only_layers`); Qwen2-MoE with its gated shared expert, q/k/v biases and
  `decoder_sparse_step`. The MoE families' loss is transformers' `labels=` loss with
  `output_router_logits=True`: cross-entropy + `router_aux_loss_coef` × `load_balancing_loss_func`
  over the MoE layers (jaxpar's z-loss coefficient is 0 after `hf.load`; transformers has none).
- Five AdamW steps with clipping active at every step, warmup + cosine and the decay mask (none on
  norm scales) against `torch.optim.AdamW` with the same schedule (`LambdaLR` over a closed form
  written here), and the same for `torch.optim.SGD` with momentum, plain and Nesterov: every
  parameter after every step. torch computes its own gradients from its own model.
- Lion, Adafactor, Muon (torch has none): five steps against optax's own `lion`, `adafactor` and
  `contrib.muon` applied by hand in a plain loop to the gradients the step computed, with
  clipping, schedule and decay mask written here, and the stacked layers (and experts) taken apart
  into one parameter per matrix, as those optimizers define them.

Weights are drawn with a large std and norm weights away from 1, as in tests/interop/test_hf_llama.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from jaxpar.interop import hf  # noqa: E402
from jaxpar.models.families import FAMILIES  # noqa: E402
from jaxpar.train.setup import build  # noqa: E402
from tests.support import tiny  # noqa: E402
from tests.support.hf_oracle import MODELS, as_jaxpar, gradients, hf_model, routes, weights  # noqa: E402
from tests.support.reference import max_relative_error  # noqa: E402
from tests.support.tiers import slow_except  # noqa: E402

ROWS, SEQ, STEPS = 4, 16, 5
# fp32 (measured, see test output): gradients agree to ~1e-6 of each leaf's largest element.
GRAD_RTOL = PARAM_RTOL = 1e-5
# Clipping active at every step (the gradient norms of these models are ~2–5).
TRAIN = dict(learning_rate=3e-3, warmup_steps=2, steps=STEPS, final_learning_rate_fraction=0.1, weight_decay=0.1,
             max_grad_norm=0.5)


def batches(model, count: int):
    rng = np.random.default_rng(1)
    return [rng.integers(0, model.config.vocab_size, (ROWS, SEQ + 1)).astype(np.int32) for _ in range(count)]


def torch_loss(model, rows):
    rows = torch.as_tensor(rows, dtype=torch.long)
    extra = {"output_router_logits": True} if routes(model) else {}
    return model(input_ids=rows[:, :-1], labels=rows[:, :-1], shift_labels=rows[:, 1:].contiguous(), **extra).loss


def jaxpar_program(model, tmp_path, **train):
    cfg, params = as_jaxpar(model, weights(model), tmp_path / "weights")
    config = tiny.llama({**TRAIN, "global_batch_size": ROWS, "seq_len": SEQ, **train})
    config.model = cfg
    config = tiny.with_overrides(config, {})
    program = build(config, jax.devices()[:1])
    return program, program.init_from_params(params)


def cosine(step: int) -> float:
    """warmup + cosine as written in the README, for LambdaLR and the by-hand loops."""
    lr, warmup, steps, end = TRAIN["learning_rate"], TRAIN["warmup_steps"], TRAIN["steps"], TRAIN["final_learning_rate_fraction"]
    if step < warmup:
        return lr * step / warmup
    progress = min((step - warmup) / (steps - warmup), 1.0)
    return lr * (end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_every_family_has_an_oracle_model():
    covered = {MODELS[name]().model_type for name in MODELS}
    assert covered == set(FAMILIES), f"no transformers oracle model for {sorted(set(FAMILIES) - covered)}"


FAST_ORACLE = ("llama_gqa_untied", "mixtral_aux", "qwen3_gqa_head_dim", "qwen3_moe_dense_layer_tied", "qwen2_moe_shared_qkv_bias",
               "deepseek_v3_q_lora_yarn_groups")


@pytest.mark.parametrize("name", slow_except(sorted(MODELS), *FAST_ORACLE))
def test_step1_gradients_match_transformers(name, tmp_path):
    model = hf_model(name)
    (rows,) = batches(model, 1)
    loss = torch_loss(model, rows)
    loss.backward()
    expected = as_jaxpar(model, gradients(model), tmp_path / "grads")[1]
    program, state = jaxpar_program(model, tmp_path)
    _, metrics, grads = program.step_with_grads(state, rows)
    grads = jax.device_get(grads)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)  # every parameter, nothing left out
    errors = jax.tree.map(lambda x, r: float(np.max(np.abs(x - r)) / max(np.max(np.abs(r)), 1e-30)), grads, expected)
    # Model state has no gradient; a state leaf the checkpoint does not store (a layer's attention
    # window) reads as its config value.
    _, state = program_state_free(program, expected)
    errors = {path: error for path, error in flat(errors).items() if path not in state}
    worst = max(errors.values())
    print(f"{name}: loss {float(metrics['loss']):.6f} vs transformers {float(loss.detach()):.6f}; worst gradient {worst:.1e}")
    assert abs(float(metrics["loss"]) - float(loss.detach())) <= 1e-6 * float(loss.detach())
    assert worst <= GRAD_RTOL, {k: v for k, v in errors.items() if v > GRAD_RTOL}
    # Not vacuous: every trained leaf's gradient is nonzero (a stopped gradient would compare 0 with 0);
    # model state (selection biases) has none.
    trained, _ = program_state_free(program, expected)
    assert all(np.max(np.abs(r)) > 0 for r in jax.tree.leaves(trained))
    if routes(model):
        # Nor is the aux loss: without it the router's gradient is another one.
        model.zero_grad()
        model.config.router_aux_loss_coef = model.router_aux_loss_coef = 0.0
        torch_loss(model, rows).backward()
        no_aux = as_jaxpar(model, {n: p.grad.numpy() for n, p in model.named_parameters()}, tmp_path / "no_aux")[1]
        assert max_relative_error(no_aux["layers"]["mlp"]["router"], expected["layers"]["mlp"]["router"]) > 1e-2


def program_state_free(program, tree):
    """(tree without its model-state leaves, their paths)."""
    from jaxpar import models

    _, observed = models.take_observations(program.config.model, tree)
    flat = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return [x for path, x in flat.items() if path not in observed], set(observed)


def torch_parameter_groups(model):
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    return [{"params": decay}, {"params": [p for n, p in model.named_parameters() if "norm" in n], "weight_decay": 0.0}]


TORCH_OPTIMIZERS = {
    "adamw": (
        {"optimizer": "adamw"},
        lambda groups: torch.optim.AdamW(groups, lr=TRAIN["learning_rate"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    ),
    "sgd_momentum": (
        {"optimizer": "sgd", "sgd": {"momentum": 0.9}},
        lambda groups: torch.optim.SGD(groups, lr=TRAIN["learning_rate"], momentum=0.9, weight_decay=0.1),
    ),
    "sgd_nesterov": (
        {"optimizer": "sgd", "sgd": {"momentum": 0.8, "nesterov": True}},
        lambda groups: torch.optim.SGD(groups, lr=TRAIN["learning_rate"], momentum=0.8, nesterov=True, weight_decay=0.1),
    ),
}


def hf_named(model_config, tree, directory) -> dict:
    """A jaxpar-layout tree (params or gradients) as HF-named numpy tensors, by jaxpar's own writer."""
    hf.save(directory, model_config, tree)
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("name", slow_except(sorted(TORCH_OPTIMIZERS), "adamw"))
def test_five_steps_match_torch(name, tmp_path):
    """Each step: torch's own gradients equal the step's (1e-5), then torch's optimizer steps from the
    step's gradients. Feeding it torch's own instead compounds the two fp32 errors through Adam's
    per-element normalisation: gradients 2.6e-6 apart (relative to each leaf's largest) moved
    rarely-seen embedding rows 5.4e-5 apart after 5 steps (3.0e-5 with eps 1e-7, 5.0e-6 with
    eps 1e-6); from the same gradients torch and jaxpar agree to 3e-7. SGD does not normalise:
    from its own gradients it stayed within 8e-8."""
    train, make = TORCH_OPTIMIZERS[name]
    model = hf_model("llama_gqa_untied")
    program, state = jaxpar_program(model, tmp_path, **train)
    optimizer = make(torch_parameter_groups(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine(step) / TRAIN["learning_rate"])
    grad_errors, errors = [], []
    for step, rows in enumerate(batches(model, STEPS)):
        lr = optimizer.param_groups[0]["lr"]
        optimizer.zero_grad()
        torch_loss(model, rows).backward()
        own = as_jaxpar(model, {n: p.grad.numpy() for n, p in model.named_parameters()}, tmp_path / f"grads{step}")[1]
        state, metrics, grads = program.step_with_grads(state, rows)
        grads = jax.device_get(grads)
        grad_errors.append(max_relative_error(grads, own))
        for n, g in hf_named(program.config.model, grads, tmp_path / f"fed{step}").items():
            dict(model.named_parameters())[n].grad = torch.as_tensor(g)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["max_grad_norm"]))
        optimizer.step()
        scheduler.step()
        assert float(metrics["grad_norm"]) > 2 * TRAIN["max_grad_norm"] and norm > 2 * TRAIN["max_grad_norm"], "clipping must be active"
        assert abs(float(metrics["learning_rate"]) - lr) <= 1e-9
        expected = as_jaxpar(model, weights(model), tmp_path / f"step{step}")[1]
        errors.append(max_relative_error(jax.device_get(state.params), expected))
    print(f"{name}: gradients {max(grad_errors):.1e}; parameters after each step {[f'{e:.1e}' for e in errors]}")
    assert max(grad_errors) <= GRAD_RTOL
    assert max(errors) <= PARAM_RTOL


# Optimizers torch lacks: optax's own, applied by hand.


def flat(tree) -> dict:
    return {tuple(k.key for k in p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def per_matrix(tree) -> dict:
    """One leaf per matrix: stacked layers (axis 0) and experts (axis 1) taken apart."""
    out = {}
    for path, x in flat(tree).items():
        if path[0] != "layers":
            out[path] = x
            continue
        for layer in range(x.shape[0]):
            if "experts" in path:
                out.update({path + (layer, e): x[layer, e] for e in range(x.shape[1])})
            else:
                out[path + (layer,)] = x[layer]
    return out


def restacked(matrices: dict, like) -> dict:
    def leaf(path, x):
        key = tuple(k.key for k in path)
        if key[0] != "layers":
            return matrices[key]
        if "experts" in key:
            return np.stack([np.stack([matrices[key + (l, e)] for e in range(x.shape[1])]) for l in range(x.shape[0])])
        return np.stack([matrices[key + (l,)] for l in range(x.shape[0])])

    return jax.tree_util.tree_map_with_path(leaf, like)


def clipped(grads: dict) -> dict:
    norm = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in grads.values()))
    return {k: g * np.float32(min(1.0, TRAIN["max_grad_norm"] / norm)) for k, g in grads.items()}


def decays(path) -> bool:
    return not any("norm" in str(k) for k in path)


LR_TABLE = jnp.asarray([cosine(step) for step in range(STEPS + 1)], jnp.float32)
schedule = lambda count: LR_TABLE[count]  # noqa: E731
MATRIX_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def is_matrix(path) -> bool:
    return path[0] == "layers" and path[-1 if isinstance(path[-1], str) else -2 if "experts" not in path else -3] in MATRIX_NAMES


def as_2d(path, x):
    """q, k, v: [D, H, Hd] -> [D, H·Hd]; o: [H, Hd, D] -> [H·Hd, D]; MLP / expert matrices already 2-D."""
    return x.reshape(x.shape[0], -1) if "o" not in path else x.reshape(-1, x.shape[-1])


def by_hand(name):
    """(per-matrix params, per-matrix clipped grads, step index) -> new per-matrix params."""
    wd = TRAIN["weight_decay"]
    if name == "lion":
        tx = optax.lion(schedule, b1=0.9, b2=0.99, weight_decay=wd, mask=lambda p: {k: decays(k) for k in p})
        return tx, lambda params, updates, step: optax.apply_updates(params, updates)
    if name == "adafactor":
        # optax.adafactor applies the learning rate before its own (here absent) weight decay; jaxpar
        # decays decoupled, times the learning rate, as AdamW does: added here by hand.
        tx = optax.adafactor(schedule, min_dim_size_to_factor=16, decay_rate=0.8, clipping_threshold=1.0)
        return tx, lambda params, updates, step: {
            k: params[k] + updates[k] - cosine(step) * wd * decays(k) * params[k] for k in params
        }
    muon = optax.contrib.muon(schedule, ns_steps=5, beta=0.95, nesterov=True, weight_decay=wd, consistent_rms=0.2)
    adam = optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, mask=lambda p: {k: decays(k) for k in p})

    class Split(optax.GradientTransformation):
        pass

    def split(tree):
        return {k: as_2d(k, x) for k, x in tree.items() if is_matrix(k)}, {k: x for k, x in tree.items() if not is_matrix(k)}

    def init(params):
        matrices, rest = split(params)
        return muon.init(matrices), adam.init(rest)

    def update(grads, state, params):
        (gm, gr), (pm, pr) = split(grads), split(params)
        um, sm = muon.update(gm, state[0], pm)
        ur, sr = adam.update(gr, state[1], pr)
        return {**{k: u.reshape(params[k].shape) for k, u in um.items()}, **ur}, (sm, sr)

    return Split(init, update), lambda params, updates, step: optax.apply_updates(params, updates)


BY_HAND = {
    "lion": ("llama_gqa_untied", {"optimizer": "lion"}),
    "adafactor": ("llama_gqa_untied", {"optimizer": "adafactor", "adafactor": {"min_dim_to_factor": 16}}),
    "muon": ("mixtral_aux", {"optimizer": "muon"}),
}


@pytest.mark.parametrize("name", slow_except(sorted(BY_HAND), "lion"))
def test_five_steps_match_optax_by_hand(name, tmp_path):
    model_name, train = BY_HAND[name]
    program, state = jaxpar_program(hf_model(model_name), tmp_path, **train)
    start = jax.device_get(state.params)
    expected = {k: jnp.asarray(x) for k, x in per_matrix(start).items()}
    tx, apply = by_hand(name)
    hand_state, hand_update = tx.init(expected), jax.jit(tx.update)
    errors, update_errors = [], []
    for step, rows in enumerate(batches(hf_model(model_name), STEPS)):
        state, _, grads = program.step_with_grads(state, rows)
        updates, hand_state = hand_update(clipped(per_matrix(jax.device_get(grads))), hand_state, expected)
        expected = apply(expected, updates, step)
        got, want = jax.device_get(state.params), restacked({k: np.asarray(x) for k, x in expected.items()}, start)
        errors.append(max_relative_error(got, want))
        moved = jax.tree.map(lambda a, b: a - b, want, start)
        if step > 0:  # step 1 has learning rate 0 (warmup)
            update_errors.append(max_relative_error(jax.tree.map(lambda a, b: a - b, got, start), moved))
    print(f"{name}: parameters after each step {[f'{e:.1e}' for e in errors]}; total update {max(update_errors):.1e}")
    assert max(errors) <= PARAM_RTOL
    # Also on the scale of the updates (a few lr): within 1e-3 of the largest one (measured 1.2e-4
    # at most, from fp32 rounding of the parameters the updates are added to).
    assert max(update_errors) <= 1e-3
