"""LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT names each adapted module's two matrices `base_model.model.<module>.lora_A.weight` [r, in]
and `.lora_B.weight` [out, r] (torch's [out, in] layout), and scales their product by
lora_alpha / r, as `jaxpar.models.lora` does. The module names come from the family's
transformers adapter (`jaxpar.models.hf_adapter`: the HF tensor each jaxpar leaf is): plain linear
layers there (q/k/v/o, gate/up/down, MLA's latents) are PEFT modules (`target_modules`); experts,
fused 3-D parameters in transformers 5, are PEFT parameters (`target_parameters`,
`jaxpar.interop.peft_experts`); anything else (a router stored under two names, gpt-oss's
interleaved experts) is refused. jaxpar's A [*in, r] flattens its input dims in the order the
family's layout flattens them into HF's [out, in] (heads then head dim), so A_hf = A.reshape(in, r).T
and B_hf = B.reshape(r, out).T.

Every error names the file (and the tensor) at fault.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from jaxpar.interop import peft_experts as experts
from jaxpar.models import lora
from jaxpar.models.families import FAMILIES
from jaxpar.models.hf_adapter import HEADS_IN, HEADS_OUT, LINEAR, Weight

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
PLAIN = (LINEAR, HEADS_IN, HEADS_OUT)  # layouts that are a reshape + transpose of HF's [out, in]


def _modules(cfg, targets) -> dict:
    """{(stack key, layer path): (HF layer indices, HF module name under each layer)} of the targets."""
    adapter = FAMILIES[cfg.model_type].hf
    found = {}
    for stack in adapter.layer_stacks(cfg):
        for path, entry in stack.table.items():
            if path[-1] not in targets or experts.is_expert(entry):
                continue
            if not (isinstance(entry, Weight) and entry.layout in PLAIN and entry.hf.endswith(".weight")):
                raise ValueError(
                    f"train.lora.targets: {'.'.join(path)} of {cfg.model_type} has no PEFT module of its own in "
                    f"{adapter.hf_class} (PEFT export covers plain linear layers and fused expert parameters)"
                )
            found[(stack.key, path)] = (stack.indices, entry.hf[: -len(".weight")])
    return found


def _name(index: int, module: str, which: str) -> str:
    return f"{PREFIX}model.layers.{index}.{module}.lora_{which}.weight"


def export(directory: str, model_config, params, base_model: str = "") -> list[str]:
    """Writes `params`' adapters (natural layer order, numpy or fetchable arrays) as a PEFT adapter
    of the run's adapted `model_config`; returns the HF module names adapted."""
    settings = lora.settings(model_config)
    cfg = lora.base_config(model_config)
    from jaxpar.extras import require

    save_file = require("safetensors", "a PEFT export").numpy.save_file
    tensors, targets = {}, set(lora.targets(settings))
    modules = _modules(cfg, targets)
    short = {module.split(".")[-1] for _, module in modules.values()}
    clash = short & experts.per_expert_names(cfg)
    if clash:
        raise ValueError(
            f"train.lora.targets: {','.join(sorted(clash))} of {cfg.model_type}'s dense MLPs share their names with its "
            "experts' per-expert modules, which PEFT may map onto the fused experts (it does for Qwen3-MoE and DeepSeek-V3): "
            "it would not load them; export the merged model, or target the experts alone"
        )
    for (key, path), (indices, module) in modules.items():
        a, b = _pair(params, key, path)
        r = a.shape[-1]
        for i, index in enumerate(indices):
            tensors[_name(index, module, "A")] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            tensors[_name(index, module, "B")] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    fused, patterns = _export_experts(params, cfg, targets, tensors)
    os.makedirs(directory, exist_ok=True)
    r, alpha = int(settings.rank), float(settings.alpha)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
        "lora_dropout": float(settings.get("dropout", 0.0)), "target_modules": sorted(short) or None,
        "target_parameters": sorted(fused) or None, "rank_pattern": {p: 2 * r for p in patterns},
        "alpha_pattern": {p: 2 * alpha for p in patterns}, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": base_model or None,
    }
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    return sorted(short)


def _pair(params, key, path):
    holder = params[key]
    for part in path[:-1]:
        holder = holder[part]
    return tuple(np.asarray(holder[path[-1] + s], np.float32) for s in lora.SUFFIXES)


def _export_experts(params, cfg, targets, tensors) -> tuple[set, set]:
    """Adds the expert adapters to `tensors`; (their `target_parameters` names, the parameters
    written with rank 2r: a fused gate_up_proj holding both gate and up)."""
    names, doubled = set(), set()
    by_module = {}
    for (key, module, param), (indices, parts) in experts.fused(cfg, targets).items():
        by_module.setdefault((key, module), (indices, {}))[1][param] = parts
    for (key, module), (indices, params_of) in by_module.items():
        for i, index in enumerate(indices):
            names_of = experts.tensor_names(f"{PREFIX}model.layers.{index}.", module, experts.ordered(params_of))
            for param, parts in params_of.items():
                pairs = {part: tuple(x[i] for x in _pair(params, key, path)) for part, path in parts.items()}
                lora_a, lora_b, rank = experts.to_peft(param, pairs)
                tensors[names_of[param][0]], tensors[names_of[param][1]] = lora_a, lora_b
                if rank != pairs[next(iter(pairs))][0].shape[-1]:
                    doubled.add(param)
        names.update(f"{module}.{param}" for param in params_of)
    return names, doubled


def read_settings(directory: str) -> dict:
    """{rank, alpha, targets (HF short names)} of a PEFT adapter folder; ValueError naming the file."""
    file = os.path.join(directory, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a readable PEFT adapter config ({e})") from None
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (want LORA)")
    for key, want in (("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"), ("use_dora", False)):
        if config.get(key, want) != want:
            problems.append(f"{key}={config[key]!r} (jaxpar supports {want!r})")
    if config.get("modules_to_save"):
        problems.append("modules_to_save is not supported")
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    # The one pattern jaxpar writes: a fused gate_up_proj of rank 2r at the same scale (`peft_experts`).
    if (set(ranks) | set(alphas)) - {experts.GATE_UP} or set(ranks) != set(alphas) or any(
        alphas[k] * config["r"] != config["lora_alpha"] * ranks[k] for k in ranks
    ):
        problems.append(f"rank_pattern {ranks} / alpha_pattern {alphas} (jaxpar supports one scale, alpha / r, everywhere)")
    targets, parameters = config.get("target_modules") or [], config.get("target_parameters") or []
    if not isinstance(targets, list) or not isinstance(parameters, list) or not targets + parameters:
        problems.append(f"target_modules {targets!r} / target_parameters {parameters!r} (want lists of names)")
    if problems:
        raise ValueError(f"{file}: " + "; ".join(problems))
    return {"rank": int(config["r"]), "alpha": float(config["lora_alpha"]), "targets": targets, "parameters": parameters}


def jaxpar_targets(base_model_config, hf_targets, hf_parameters=()) -> list[str]:
    """The `train.lora.targets` names of PEFT's module names (q_proj -> q ...) and parameter names
    (mlp.experts.gate_up_proj -> gate, up) for this family."""
    adapter = FAMILIES[base_model_config.model_type].hf
    names = {}
    for stack in adapter.layer_stacks(base_model_config):
        for path, entry in stack.table.items():
            if isinstance(entry, Weight) and entry.hf.endswith(".weight"):
                names.setdefault(entry.hf[: -len(".weight")].split(".")[-1], path[-1])
    unknown = [t for t in hf_targets if t not in names]
    if unknown:
        raise ValueError(f"target_modules {unknown} are no modules of a {adapter.hf_class}")
    found = {names[t] for t in hf_targets}
    fused = experts.target_names(base_model_config)
    for t in hf_parameters:  # PEFT matches a parameter by its name's tail
        matched = [jaxpar for name, jaxpar in fused.items() if name == t or name.endswith("." + t)]
        if not matched:
            raise ValueError(f"target_parameters [{t!r}] are no expert parameters of a {adapter.hf_class}")
        found.update(*matched)
    return sorted(found)


def load(directory: str, model_config) -> dict:
    """{adapter path: float32 array} of a PEFT adapter for the run's adapted `model_config`
    (whose rank, alpha and targets must be the adapter's). ValueError naming the file and tensor."""
    settings = lora.settings(model_config)
    cfg = lora.base_config(model_config)
    found = read_settings(directory)
    file = os.path.join(directory, CONFIG_FILE)
    theirs = jaxpar_targets(cfg, found["targets"], found["parameters"])
    ours = sorted(lora.targets(settings))
    if (found["rank"], found["alpha"], theirs) != (int(settings.rank), float(settings.alpha), ours):
        raise ValueError(
            f"{file}: r={found['rank']}, lora_alpha={found['alpha']}, targets {','.join(theirs)}; the run has "
            f"train.lora.rank={settings.rank}, alpha={settings.alpha}, targets={','.join(ours)}"
        )
    from jaxpar.extras import require

    weights = os.path.join(directory, WEIGHTS_FILE)
    try:
        tensors = require("safetensors", "a PEFT import").numpy.load_file(weights)
    except OSError as e:
        raise ValueError(f"{weights}: {e}") from None
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in tensors.items()}
    shapes = {p: s.shape for p, s in lora.adapters_of(_shapes(model_config)).items()}
    out, used = {}, set()
    r = int(settings.rank)
    for (key, path), (indices, module) in _modules(cfg, set(ours)).items():
        for suffix, which in zip(lora.SUFFIXES, "AB"):
            full = (key, *path[:-1], path[-1] + suffix)
            shape = shapes[full]
            layers = []
            for index in indices:
                name = _name(index, module, which)
                if name not in tensors:
                    raise ValueError(f"{weights}: tensor {name} is missing")
                w = tensors[name].astype(np.float32)
                per_layer = shape[1:]
                want = (r, int(np.prod(per_layer[:-1]))) if which == "A" else (int(np.prod(per_layer[1:])), r)
                if w.shape != want:
                    raise ValueError(f"{weights}: tensor {name} {w.shape} does not fit the model (want {want})")
                layers.append(w.T.reshape(per_layer))
                used.add(name)
            out[full] = np.stack(layers)
    out.update(_load_experts(tensors, cfg, set(ours), shapes, weights, used))
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{weights}: tensor {extra[0]} is no adapter of this model ({len(extra)} such)")
    return out


def _load_experts(tensors, cfg, targets, shapes, weights, used) -> dict:
    """{adapter path: [layers, E, ...] array} of the expert adapters; the names read join `used`."""
    by_module, out = {}, {}
    for (key, module, param), (indices, parts) in experts.fused(cfg, targets).items():
        by_module.setdefault((key, module), (indices, {}))[1][param] = parts
    for (key, module), (indices, params_of) in by_module.items():
        layers = {}
        for index in indices:
            names_of = experts.tensor_names(f"{PREFIX}model.layers.{index}.", module, experts.ordered(params_of))
            for param, parts in params_of.items():
                missing = [n for n in names_of[param] if n not in tensors]
                if missing:
                    raise ValueError(f"{weights}: tensor {missing[0]} is missing")
                a, b = (tensors[n].astype(np.float32) for n in names_of[param])
                want = {part: tuple(shapes[(key, *path[:-1], path[-1] + s)][1:] for s in lora.SUFFIXES) for part, path in parts.items()}
                count, r = next(iter(want.values()))[0][0], next(iter(want.values()))[0][-1]
                where = f"{weights}: tensors {names_of[param][0]}, lora_B"
                for part, pair in experts.from_peft(param, a, b, count, r, where).items():
                    if part not in parts:
                        continue
                    if tuple(x.shape for x in pair) != want[part]:
                        raise ValueError(f"{where}: {part} adapter {[x.shape for x in pair]} does not fit the model (want {want[part]})")
                    layers.setdefault((key, *parts[part]), []).append(pair)
                used.update(names_of[param])
        for path, pairs in layers.items():
            for suffix, k in zip(lora.SUFFIXES, (0, 1)):
                out[(*path[:-1], path[-1] + suffix)] = np.stack([p[k] for p in pairs])
    return out


def _shapes(model_config):
    from jaxpar import models

    return models.param_shapes(model_config)


def with_adapters(params, adapters: dict):
    """`params` (natural order, numpy) with the adapter leaves replaced by `adapters`' arrays."""
    def put(tree, path, value):
        if len(path) == 1:
            return {**tree, path[0]: value.astype(np.asarray(tree[path[0]]).dtype)}
        return {**tree, path[0]: put(tree[path[0]], path[1:], value)}

    for path, value in adapters.items():
        params = put(params, path, value)
    return params


def initial_params(base_params, directory: str, model_config, seed: int):
    """A run's natural-order params from its base params and a PEFT adapter folder (on the host)."""
    from jaxpar import models

    settings = lora.settings(model_config)
    params = lora.with_init(base_params, lora.base_of(models.logical_axes(model_config)), settings, seed)
    return with_adapters(jax.device_get(params), load(directory, model_config))
