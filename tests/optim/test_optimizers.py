"""The optimizer and schedule records (`jaxpar/optim`), checked without training.

- Each record's state description equals the state optax actually builds (every leaf's field and
  shape, and the bytes), on Llama and Mixtral; a record that describes another optimizer's state
  is caught (positive control).
- ZeRO-1 divides every optimizer's state over `data`: bytes per device shrink, and every state leaf
  that spans a parameter's `embed` dim is split over `data`, Adafactor's factored moments included
  (sharded like the dims they keep, not replicated).
- Every schedule against its closed form written here.
- Muon's matrices, their whole-matrix layout and the bytes its gather moves.
- Bad optimizer / schedule keys: one line each, naming the key, before anything compiles.
- Each record owns its section (`train.<record>`): the config's sections are the records' keys and
  defaults, the flat keys they replace are listed here and map to them, and a key of an optimizer
  that is not selected may be set.
"""

import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import models, optim
from jaxpar.analysis.program import hlo
from jaxpar.axes import DATA, EXPERT, PIPELINE, TENSOR
from jaxpar.config import MOVED_KEYS, base_config
from jaxpar.optim.matrices import MatrixDims, gathered_bytes, matrix_dims, newton_schulz_flops, whole_matrix_spec
from jaxpar.optim.muon import Matrix
from jaxpar.optim.state import StateLayoutError
from jaxpar.sharding import is_logical_names
from jaxpar.train.preflight import ConfigError, check
from jaxpar.train.setup import build, bytes_per_device
from tests.support import tiny

# min dim 16: the tiny models' matrices are factored; momentum: Adafactor's optional EMA leaf too.
TRAIN = {"adafactor": {"min_dim_to_factor": 16, "momentum": 0.5}}
FAMILIES = {"llama": tiny.llama, "mixtral": tiny.mixtral}


def leaves_with_names(config):
    shapes = models.param_shapes(config.model)
    names = jax.tree.leaves(models.logical_axes(config.model), is_leaf=is_logical_names)
    return [(jax.tree_util.keystr(p), x.shape, n) for (p, x), n in zip(jax.tree_util.tree_flatten_with_path(shapes)[0], names)]


def test_param_names_are_the_models():
    # DeepSeek-V3 adds MLA's latents and the stacked prediction modules (`latent`, `depth`).
    makes = (*FAMILIES.values(), tiny.deepseek_v3)
    used = {n for make in makes for _, _, names in leaves_with_names(make()) for n in names if n}
    assert used == set(optim.PARAM_NAMES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", optim.OPTIMIZER_NAMES)
def test_record_describes_the_state_optax_builds(name, family):
    config = tiny.with_overrides(FAMILIES[family]({"optimizer": name, **TRAIN}), {})
    program = build(config, jax.devices()[:1])  # derives every state leaf's sharding from the record
    abstract = jax.eval_shape(program.init)
    record = optim.optimizer(name)
    described = optim.tree_state_bytes(record, config.train, abstract.params, models.logical_axes(config.model))
    actual = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.opt_state) if x.ndim)  # scalars: counts
    assert described == actual
    per_param = {"adamw": 8, "lion": 4, "sgd": 4}  # fp32 bytes per parameter element
    if name in per_param:
        count = sum(x.size for x in jax.tree.leaves(abstract.params))
        assert described == per_param[name] * count


def test_a_record_that_describes_other_state_is_caught():
    adamw = optim.optimizer("adamw")
    wrong = optim.Optimizer("adamw", adamw.build, adamw.hyperparameters, optim.optimizer("lion").state, adamw.checks)
    config = tiny.with_overrides(tiny.llama(), {})
    tx, _ = optim.make_optimizer(config.train, models.logical_axes(config.model))
    program = build(config, jax.devices()[:1])
    args = (tx, models.param_shapes(config.model), models.logical_axes(config.model), program.opt_rules.tree_shardings(
        models.logical_axes(config.model)), program.mesh)
    optim.state_shardings(adamw, config.train, *args)
    with pytest.raises(StateLayoutError, match="field 'nu' is not in the record"):
        optim.state_shardings(wrong, config.train, *args)


def param_key_and_field(path):
    """A state leaf's parameter (its trailing dict keys) and the optax state attribute above them."""
    i = len(path)
    while i and isinstance(path[i - 1], jax.tree_util.DictKey):
        i -= 1
    return tuple(k.key for k in path[i:]), path[i - 1].name if i else None


def padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("name", optim.OPTIMIZER_NAMES)
def test_zero1_splits_every_optimizer_state_over_data(name):
    config = tiny.llama({"optimizer": name, **TRAIN})
    replicated = build(tiny.with_overrides(config, {"data": 4, "tensor": 2}))
    sharded = build(tiny.with_overrides(config, {"data": 4, "tensor": 2}, parallel={"zero_stage": 1}))
    abstract = jax.eval_shape(sharded.init)
    before = bytes_per_device(abstract.opt_state, replicated.state_shardings.opt_state)
    after = bytes_per_device(abstract.opt_state, sharded.state_shardings.opt_state)
    print(f"{name}: optimizer state per device {before} -> {after} bytes under ZeRO-1 over data 4")
    assert after < before
    # Every state leaf is laid out as the rules table lays out the parameter dims it keeps: `embed`
    # over data (ZeRO), heads / mlp / vocab over tensor — none silently replicated.
    record = optim.optimizer(name)
    shapes = {tuple(k.key for k in p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
    logical = models.logical_axes(config.model)
    names = {tuple(k.key for k in p): n for p, n in jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_logical_names)[0]}
    placed = jax.tree_util.tree_flatten_with_path(sharded.state_shardings.opt_state)[0]
    checked = 0
    for (path, leaf), (_, sharding) in zip(jax.tree_util.tree_flatten_with_path(abstract.opt_state)[0], placed):
        key, field = param_key_and_field(path)
        if key not in shapes:
            assert sharding.spec == P(), path  # step counts
            continue
        (layout,) = [s for s in record.state(config.train, shapes[key], names[key]) if s.field == field]
        kept = tuple(None if d is None else names[key][d] for d in layout.dims)
        assert padded(sharding.spec, leaf.ndim) == padded(sharded.opt_rules.spec(kept), leaf.ndim), (path, kept)
        checked += "embed" in kept
    assert checked >= 5  # embed-spanning leaves seen (and so split over data)


def test_adafactor_factored_moments_keep_their_dims_shards():
    config = tiny.with_overrides(tiny.llama({"optimizer": "adafactor", **TRAIN}), {"data": 4, "tensor": 2}, parallel={"zero_stage": 1})
    factored = build(config).state_shardings.opt_state[1][0]  # after clipping: optax's FactoredState
    # optax: v_row averages the largest dim away, v_col the second largest.
    # mlp.up [layers 2, embed 64, mlp 128]: v_row keeps embed (data), v_col keeps mlp (tensor).
    assert factored.v_row["layers"]["mlp"]["up"].spec == P(None, DATA)
    assert factored.v_col["layers"]["mlp"]["up"].spec == P(None, TENSOR)
    assert factored.v["layers"]["mlp"]["up"].spec == P(None)
    # The embedding [vocab 256, embed 64]: v_row keeps embed (data), v_col keeps vocab (tensor).
    assert factored.v_row["embed"]["weight"].spec == P(DATA)
    assert factored.v_col["embed"]["weight"].spec == P(TENSOR)


# Schedules against closed forms: peak 1, end fraction 0.1, 20 steps, warmup 4.
PEAK, END, STEPS, WARMUP = 1.0, 0.1, 20, 4


def closed_form(schedule, step, warmup=WARMUP, fraction=0.25, shape="linear"):
    if step < warmup:
        return PEAK * step / warmup
    if schedule == "constant":
        return PEAK
    if schedule == "cosine":
        return END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * min((step - warmup) / (STEPS - warmup), 1)))
    if schedule == "linear":
        return PEAK + (END - PEAK) * min((step - warmup) / (STEPS - warmup), 1)
    start = STEPS - round(fraction * STEPS)
    if step < start:
        return PEAK
    progress = min((step - start) / (STEPS - start), 1)
    decayed = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)), "1-sqrt": 1 - math.sqrt(progress)}
    return END + (PEAK - END) * decayed[shape]


@pytest.mark.parametrize(
    "schedule, warmup, shape",
    [("cosine", WARMUP, None), ("cosine", 0, None), ("linear", WARMUP, None), ("linear", 0, None), ("constant", WARMUP, None),
     ("wsd", WARMUP, "linear"), ("wsd", WARMUP, "cosine"), ("wsd", WARMUP, "1-sqrt"), ("wsd", 0, "1-sqrt")],
)
def test_schedule_follows_its_closed_form(schedule, warmup, shape):
    train = tiny.llama({
        "lr_schedule": schedule, "learning_rate": PEAK, "final_learning_rate_fraction": END, "steps": STEPS,
        "warmup_steps": warmup, "wsd": {"decay_fraction": 0.25, "decay_shape": shape or "linear"},
    }).train
    fn = optim.learning_rate_schedule(train)
    got = [float(fn(step)) for step in range(STEPS + 3)]
    want = [closed_form(schedule, step, warmup, 0.25, shape) for step in range(STEPS + 3)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_decay_mask():
    for tied in (False, True):
        logical = models.logical_axes(tiny.llama(tie_word_embeddings=tied).model)
        default = optim.decay_mask(logical)
        assert default["embed"]["weight"] and not default["final_norm"]["weight"] and not default["layers"]["input_norm"]["weight"]
        assert default["layers"]["attention"]["q"] and ("lm_head" in default) != tied
        spared = optim.decay_mask(logical, ("norm", "vocab"))
        assert not spared["embed"]["weight"] and spared["layers"]["mlp"]["up"]
        if not tied:
            assert default["lm_head"]["weight"] and not spared["lm_head"]["weight"]


def test_muon_matrices_and_their_whole_layout():
    by_leaf = {k: matrix_dims(n) for k, _, n in leaves_with_names(tiny.mixtral())}
    assert by_leaf["['layers']['attention']['q']"] == MatrixDims(1, (1,), (2, 3))  # embed -> heads × head_dim
    assert by_leaf["['layers']['attention']['o']"] == MatrixDims(1, (1, 2), (3,))  # heads × head_dim -> embed
    assert by_leaf["['layers']['mlp']['experts']['down']"] == MatrixDims(2, (2,), (3,))  # per layer and expert
    for leaf in ("['embed']['weight']", "['lm_head']['weight']", "['final_norm']['weight']", "['layers']['input_norm']['weight']",
                 "['layers']['mlp']['router']"):
        assert by_leaf[leaf] is None, leaf  # AdamW's
    # Experts [L, E, D, F] under pipeline x expert x ZeRO (data) x tensor: the gather removes data and
    # tensor from the matrix dims, the layers stay on pipeline and the experts on expert.
    experts = by_leaf["['layers']['mlp']['experts']['up']"]
    spec = P(PIPELINE, EXPERT, DATA, TENSOR)
    assert whole_matrix_spec(spec, experts, 4) == P(PIPELINE, EXPERT, None, None)
    sizes = {DATA: 2, PIPELINE: 2, EXPERT: 2, TENSOR: 2}
    # Each device holds 1 layer x 4 experts of whole 64 x 64 fp32 matrices and already has a quarter.
    assert gathered_bytes((2, 8, 64, 64), ("layers", "experts", "embed", "mlp"), spec, sizes) == 1 * 4 * 64 * 64 * 4 * 3 // 4
    assert gathered_bytes((2, 8, 64, 64), ("layers", "experts", "embed", "mlp"), P(PIPELINE, EXPERT), sizes) == 0
    assert optim.optimizer("adamw").gathered_bytes((2, 64, 128), ("layers", "embed", "mlp"), P(None, DATA, TENSOR), sizes) == 0


def test_newton_schulz_flops_are_what_xla_counts():
    # One layer's [embed 128, mlp 192] matrix, 5 iterations, as XLA's cost analysis counts them
    # (the matmuls; the elementwise rest adds 2.2% here, 8.7% at 32 x 48).
    matrix = Matrix(matrix_dims(("layers", "embed", "mlp")))
    x = jax.ShapeDtypeStruct((1, 128, 192), np.float32)
    counted = jax.jit(lambda m: matrix.orthogonalize(m, 5, 0.2)).lower(x).compile().cost_analysis()["flops"]
    priced = newton_schulz_flops((1, 128, 192), ("layers", "embed", "mlp"), P(), {}, 5)
    print(f"Newton-Schulz: {priced} FLOPs priced, {counted:.0f} counted")
    assert priced <= counted <= 1.03 * priced, (priced, counted)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_muon_gathers_what_its_record_prices():
    """The compiled step's all-gathers, in bytes each device receives, minus AdamW's on the same
    layout, are exactly the record's `gathered_bytes` summed over the parameters: the whole-matrix
    gather happens once per step and Newton–Schulz runs on the gathered matrices (unpinned, the
    partitioner split the iteration and gathered at each matmul: 119 all-gathers, 10x the bytes)."""
    received = {}
    for name in ("adamw", "muon"):
        config = tiny.with_overrides(tiny.mixtral({"optimizer": name}), {"data": 2, "expert": 2, "tensor": 2}, parallel={"zero_stage": 1})
        program = build(config)
        batch = jax.ShapeDtypeStruct((config.train.global_batch_size, config.train.seq_len + 1), np.int32)
        text = program.step.lower(jax.eval_shape(program.init), batch).compile().as_text()
        gathers = [c for c in hlo.collectives(text) if c.kind == hlo.ALL_GATHER]
        received[name] = sum(c.result_bytes * (c.group_size(8) - 1) // c.group_size(8) * c.executions for c in gathers)
    record, sizes = optim.optimizer("muon"), dict(program.mesh.shape)
    logical = models.logical_axes(config.model)
    specs = jax.tree.leaves(program.opt_rules.tree_shardings(logical))
    priced = sum(
        record.gathered_bytes(x.shape, names, sharding.spec, sizes)
        for x, names, sharding in zip(jax.tree.leaves(models.param_shapes(config.model)),
                                      jax.tree.leaves(logical, is_leaf=is_logical_names), specs)
    )
    print(f"muon gathers {received['muon'] - received['adamw']} bytes per device per step, the record prices {priced}")
    assert priced > 0 and received["muon"] - received["adamw"] == priced


def bad(**train) -> list[str]:
    config = tiny.llama({"seq_len": 32, **train}, vocab_size=256, max_position_embeddings=128)
    with pytest.raises(ConfigError) as info:
        check(config, 8)
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    "train, line",
    [
        ({"optimizer": "adam"}, "train.optimizer='adam' is not one of ('adamw', 'adafactor', 'lion', 'muon', 'sgd')"),
        ({"lr_schedule": "step"}, "train.lr_schedule='step' is not one of ('cosine', 'wsd', 'linear', 'constant')"),
        ({"wsd": {"decay_shape": "sqrt"}}, "train.wsd.decay_shape='sqrt' is not one of ('linear', 'cosine', '1-sqrt')"),
        ({"wsd": {"decay_fraction": 1.5}}, "train.wsd.decay_fraction=1.5 must be in [0.0, 1.0]"),
        ({"weight_decay_exclude": "norm,embeddings"}, "train.weight_decay_exclude='norm,embeddings' names ['embeddings']"),
        ({"optimizer": "lion", "lion": {"b2": 1.0}}, "train.lion.b2=1.0 must be in [0.0, 1.0)"),
        ({"optimizer": "sgd", "sgd": {"momentum": -0.5}}, "train.sgd.momentum=-0.5 must be in [0.0, 1.0)"),
        ({"optimizer": "muon", "muon": {"ns_steps": 0}}, "train.muon.ns_steps=0 must be >= 1"),
        ({"optimizer": "adafactor", "adafactor": {"min_dim_to_factor": 2}}, "train.adafactor.min_dim_to_factor=2 must exceed"),
    ],
)
def test_bad_keys_are_one_line_naming_the_key(train, line):
    (error,) = bad(**train)
    assert error.startswith(line), error


# The flat `train.` keys before records had sections (jaxpar/config.py at 926fd48), and where each went.
FLAT_KEYS = {
    "adam_b1": "adamw.b1", "adam_b2": "adamw.b2", "adam_eps": "adamw.eps", "adafactor_decay_rate": "adafactor.decay_rate",
    "adafactor_min_dim_to_factor": "adafactor.min_dim_to_factor", "adafactor_clipping_threshold": "adafactor.clipping_threshold",
    "adafactor_momentum": "adafactor.momentum", "lion_b1": "lion.b1", "lion_b2": "lion.b2", "muon_beta": "muon.beta",
    "muon_ns_steps": "muon.ns_steps", "muon_nesterov": "muon.nesterov", "muon_consistent_rms": "muon.consistent_rms",
    "sgd_momentum": "sgd.momentum", "sgd_nesterov": "sgd.nesterov", "wsd_decay_fraction": "wsd.decay_fraction",
    "wsd_decay_shape": "wsd.decay_shape",
}


def test_each_record_owns_its_section():
    train = base_config().train
    assert set(optim.SECTIONS) == {"adamw", "adafactor", "lion", "muon", "sgd", "wsd"}
    for name, keys in optim.SECTIONS.items():
        assert train[name].to_dict() == {h.name: h.default for h in keys}
        assert all(h.meaning and "\n" not in h.meaning for h in keys)
    assert MOVED_KEYS == {f"train.{old}": f"train.{new}" for old, new in FLAT_KEYS.items()}
    assert not set(FLAT_KEYS) & set(train.keys())
    assert optim.hyperparameter_problems(train) == []  # every default in its own range
    # Muon's saved state means what its keys and AdamW's (for its AdamW part) say.
    assert optim.resume_keys("muon") == (
        "optimizer", "muon.beta", "muon.ns_steps", "muon.nesterov", "muon.consistent_rms", "adamw.b1", "adamw.b2", "adamw.eps",
    )
    assert optim.resume_keys("sgd") == ("optimizer", "sgd.momentum", "sgd.nesterov")
    # Another optimizer's key set and unused: fine.
    check(tiny.llama({"lion": {"b1": 0.5}, "muon": {"ns_steps": 3}}, vocab_size=256), 8)
