"""Expert adapters in PEFT's format: LoRA on transformers' fused expert parameters (`target_parameters`).

transformers 5 keeps a layer's experts as two 3-D parameters of one module (`mlp.experts`):
`gate_up_proj` [E, 2F, D] (gate rows first) and `down_proj` [E, D, F]. PEFT (>= 0.17) adapts such a
parameter with a `ParamWrapper`: one `lora_A.weight` [E·R, in] (expert-major rows: expert e's
A_e [R, in] is rows e·R ..) and one `lora_B.weight` [out, R·E] (rank-major columns: B_e[:, j] is
column j·E + e), the delta of expert e being scale · B_e·A_e in torch's [out, in] layout.

jaxpar adapts gate and up separately (rank r each), so their fused matrix has rank 2r:
A_e = [A_gate; A_up]ᵀ and B_e = blockdiag(B_gate, B_up)ᵀ, written with PEFT's `rank_pattern`
{gate_up_proj: 2r} and `alpha_pattern` {gate_up_proj: 2·alpha} (the same scale alpha / r). Importing
takes that block form back exactly, or a rank-r gate_up_proj (what PEFT itself trains) as gate and
up adapters sharing A_e, each with its half of B_e.

Several wrapped parameters of one module nest: each wraps the module already wrapped, in the
module's registration order (gate_up_proj, then down_proj), so the first one's tensors sit one
`base_layer.` deeper per parameter wrapped after it.
"""

from __future__ import annotations

import numpy as np

from jaxpar.models.families import FAMILIES
from jaxpar.models.hf_adapter import ExpertStack

GATE_UP, DOWN = "gate_up_proj", "down_proj"


def fused(cfg, targets) -> dict:
    """{(stack key, module, parameter): (HF layer indices, {part: jaxpar path})} of the targeted
    expert matrices, module e.g. "mlp.experts", parameter "gate_up_proj" or "down_proj"."""
    found = {}
    for stack in FAMILIES[cfg.model_type].hf.layer_stacks(cfg):
        for path, entry in stack.table.items():
            if isinstance(entry, ExpertStack) and path[-1] in targets:
                name = entry.fused_down if entry.part == "down" else entry.fused_gate_up
                module, _, param = name.rpartition(".")
                found.setdefault((stack.key, module, param), (stack.indices, {}))[1][entry.part] = path
    return found


def is_expert(entry) -> bool:
    return isinstance(entry, ExpertStack)


def target_names(cfg) -> dict:
    """{PEFT target_parameters name: jaxpar target names} of this family's expert parameters."""
    names = {}
    for stack in FAMILIES[cfg.model_type].hf.layer_stacks(cfg):
        for path, entry in stack.table.items():
            if isinstance(entry, ExpertStack):
                names.setdefault(entry.fused_down if entry.part == "down" else entry.fused_gate_up, set()).add(path[-1])
    return names


def per_expert_names(cfg) -> set[str]:
    """The family's per-expert module names (transformers 4's: gate_proj, w1 ...). PEFT (0.21.2)
    renames such names in `target_modules` onto the fused expert parameters for most MoE families
    (Qwen3-MoE, DeepSeek-V3: `convert_peft_config_for_transformers`), so a dense MLP or shared
    expert whose module has one of these names cannot be named in an adapter's target_modules."""
    names = set()
    for stack in FAMILIES[cfg.model_type].hf.layer_stacks(cfg):
        for entry in stack.table.values():
            if isinstance(entry, ExpertStack):
                names.add(entry.per_expert.split(".")[-2])
    return names


def tensor_names(prefix: str, module: str, params: list[str]) -> dict:
    """{parameter: (lora_A name, lora_B name)} of one layer's wrapped parameters of `module`."""
    out = {}
    for i, param in enumerate(params):
        stem = f"{prefix}{module}" + ".base_layer" * (len(params) - 1 - i)
        out[param] = (f"{stem}.lora_A.weight", f"{stem}.lora_B.weight")
    return out


def ordered(params) -> list[str]:
    """The module's wrapped parameters in the order PEFT wraps them (its registration order)."""
    return [p for p in (GATE_UP, DOWN) if p in params]


def to_peft(param: str, parts: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """(lora_A [E·R, in], lora_B [out, R·E], R) of one layer's fused parameter from jaxpar's
    {part: (A [E, in, r], B [E, r, out])}."""
    if param == DOWN:
        a, b = parts["down"]
        a_e, b_e = a.transpose(0, 2, 1), b.transpose(0, 2, 1)  # [E, r, F], [E, D, r]
    else:
        some = next(iter(parts.values()))
        experts, r, f = some[1].shape
        present = [p for p in ("gate", "up") if p in parts]
        a_e = np.concatenate([parts[p][0].transpose(0, 2, 1) for p in present], axis=1)  # [E, R, D]
        b_e = np.zeros((experts, 2 * f, r * len(present)), np.float32)
        for k, p in enumerate(present):
            rows = slice(0, f) if p == "gate" else slice(f, 2 * f)
            b_e[:, rows, k * r : (k + 1) * r] = parts[p][1].transpose(0, 2, 1)
    experts, rank, d_in = a_e.shape
    lora_a = a_e.reshape(experts * rank, d_in)
    lora_b = b_e.transpose(1, 2, 0).reshape(b_e.shape[1], rank * experts)
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b), rank


def from_peft(param: str, lora_a, lora_b, experts: int, r: int, where: str) -> dict:
    """jaxpar's {part: (A [E, in, r], B [E, r, out])} of one layer's fused parameter; ValueError
    (prefixed by `where`) when the tensors do not fit rank r."""
    if lora_a.shape[0] % experts or lora_b.shape[1] % experts or lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(f"{where}: lora_A {lora_a.shape} / lora_B {lora_b.shape} do not split into {experts} experts")
    rank = lora_a.shape[0] // experts
    a_e = lora_a.reshape(experts, rank, lora_a.shape[1])  # [E, R, in]
    b_e = lora_b.reshape(lora_b.shape[0], rank, experts).transpose(2, 0, 1)  # [E, out, R]
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1))  # noqa: E731
    if param == DOWN:
        if rank != r:
            raise ValueError(f"{where}: rank {rank}, want train.lora.rank={r}")
        return {"down": (t(a_e), t(b_e))}
    f = b_e.shape[1] // 2
    gate, up = b_e[:, :f], b_e[:, f:]
    if rank == r:  # PEFT's own: one A for both halves
        return {"gate": (t(a_e), t(gate)), "up": (t(a_e), t(up))}
    if rank == 2 * r and not np.any(gate[:, :, r:]) and not np.any(up[:, :, :r]):  # jaxpar's block form
        return {"gate": (t(a_e[:, :r]), t(gate[:, :, :r])), "up": (t(a_e[:, r:]), t(up[:, :, r:]))}
    raise ValueError(f"{where}: rank {rank}, want train.lora.rank={r} (or {2 * r} with gate and up in separate blocks)")
