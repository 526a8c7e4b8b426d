"""transformers checkpoints at scale: read straight onto a mesh in slices, written in shards, converted
to and from training checkpoints, and every error naming the file and tensor.

The reference is `hf.load` (whole tensors, checked against transformers in tests/test_hf_*.py): the
sharded import must give the same bits on the mesh's shardings while reading only per-device blocks.
"""

import importlib.util
import json
import os
import shlex

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpar import models
from jaxpar.checkpoint.listing import finished_steps
from jaxpar.data.batches import DocumentBatches
from jaxpar.data.corpus import training_stream
from jaxpar.data.packing import Packer
from jaxpar.interop import hf, sharded
from jaxpar.models import hf_adapter
from jaxpar.train.loop import train
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.files import write
from tests.support.paths import ROOT
from tests.support.tiers import slow_except

FAMILIES = {
    # vocab 250: padded to 256 inside the params, so the embedding / head blocks cross the padding.
    "llama": (tiny.llama, {"data": 2, "tensor": 4}),
    "mixtral": (tiny.mixtral, {"data": 2, "expert": 2, "tensor": 2}),
}


def random_params(model, seed: int):
    """Distinct random values in every leaf (numpy: no compile), vocab padding rows zero as jaxpar keeps them."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), models.param_shapes(model))
    params["embed"]["weight"][model.vocab_size :] = 0
    if "lm_head" in params:
        params["lm_head"]["weight"][:, model.vocab_size :] = 0
    return params


def saved_checkpoint(directory, family: str, seed: int = 0, max_shard_bytes=150_000, **model_overrides):
    make, _ = FAMILIES[family]
    model = make(**model_overrides).model
    hf.save(directory, model, random_params(model, seed), max_shard_bytes=max_shard_bytes)
    return model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_import_equals_whole_tensor_load_and_reads_only_blocks(family, tmp_path, monkeypatch):
    model = saved_checkpoint(tmp_path, family)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json"), "expected a sharded checkpoint"
    reads = []
    read_block = hf_adapter.rows_cols  # every layer entry reads its blocks through it
    monkeypatch.setattr(hf_adapter, "rows_cols",
                        lambda get, name, rows, cols: reads.append((name, rows, cols)) or read_block(get, name, rows, cols))
    make, mesh = FAMILIES[family]
    config = tiny.with_overrides(make(), mesh, parallel={"zero_stage": 3})
    program = build(config)
    loaded = sharded.load_params_onto(str(tmp_path), model, program.state_shardings.params)
    _, reference = hf.load(tmp_path)
    for (path, got), want, sharding in zip(
        jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(reference), jax.tree.leaves(program.state_shardings.params)
    ):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
        assert got.sharding == sharding
    # q_proj of layer 0 is [8 heads x 16, 64]; heads split over tensor and (ZeRO-3) rows of D over data.
    q = [(rows, cols) for name, rows, cols in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    t = mesh["tensor"]
    assert len(set(q)) == t * 2 and {r[1] - r[0] for r, _ in q} == {128 // t} and {c[1] - c[0] for _, c in q} == {32}
    assert all(rows != (0, 128) for rows, _ in q), "a whole tensor was read"


def test_save_refuses_a_non_empty_directory_and_overwrite_removes_stale_shards(tmp_path):
    model = saved_checkpoint(tmp_path, "llama")
    shards = sorted(f for f in os.listdir(tmp_path) if f.startswith("model-"))
    assert len(shards) > 1
    (tmp_path / "tokenizer.json").write_text("{}")
    params = random_params(model, 1)
    with pytest.raises(FileExistsError, match=f"{tmp_path} is not empty; pass overwrite=True"):
        hf.save(tmp_path, model, params)
    hf.save(tmp_path, model, params, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    _, again = hf.load(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_load_errors_name_the_file_and_tensor(tmp_path):
    saved_checkpoint(tmp_path, "llama", max_shard_bytes=10**9)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((30, 64), np.float32)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        hf.load(tmp_path)
    assert str(error.value).startswith(f"{weights}: tensor model.layers.1.self_attn.k_proj.weight (30, 64) does not fit")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=f"^{weights} is not a readable safetensors file"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'} is not valid JSON"):
        hf.load(tmp_path)


def convert_script():
    spec = importlib.util.spec_from_file_location("convert_script", os.path.join(ROOT, "scripts", "convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONVERT_CONFIG = """
from tests.support import tiny
def get_config():
    return tiny.with_overrides(tiny.{family}(vocab_size=256), {mesh})  # byte-level corpus: vocab >= 256
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", slow_except(sorted(FAMILIES), "llama"))
def test_convert_hf_to_checkpoint_and_back_is_exact(family, tmp_path, capsys):
    saved_checkpoint(tmp_path / "hf", family, vocab_size=256)
    config = write(tmp_path / "config.py", CONVERT_CONFIG.format(family=family, mesh=FAMILIES[family][1]))
    convert = convert_script()
    assert convert.main([f"--from_hf={tmp_path / 'hf'}", f"--to_checkpoint={tmp_path / 'ckpt'}", f"--config={config}"]) == 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["0"]
    out = tmp_path / "back"
    assert convert.main([f"--from_checkpoint={tmp_path / 'ckpt'}", f"--to_hf={out}", "--max_shard_bytes=200000"]) == 0
    assert convert.main([f"--from_checkpoint={tmp_path / 'ckpt'}", f"--to_hf={out}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --to_hf={out} is not empty; pass --overwrite to replace the checkpoint in it"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg_a, params_a = hf.load(tmp_path / "hf")
    cfg_b, params_b = hf.load(out)
    assert cfg_a == cfg_b
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_from_a_transformers_checkpoint_starts_from_its_weights(tmp_path):
    """HF weights other than the run's own init (seed 7; the run's seed is 0): the first step's loss
    and gradient norm are transformers' (`loss.backward()`) for those weights on the run's first
    batch, and not the seed-0 run's."""
    import torch
    import transformers

    # A token file without offsets: every row is one window of seq_len + 1 tokens (one segment), so
    # transformers' plain loss over the row is the reference.
    ids = np.random.default_rng(3).integers(0, 256, 20_000).astype(np.uint16)
    ids.tofile(tmp_path / "corpus.bin")
    with open(tmp_path / "corpus.bin.json", "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": 256, "num_tokens": len(ids)}, f)
    data = {"source": "tokens", "path": str(tmp_path / "corpus.bin"), "token_dtype": "uint16"}
    config = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 2, "tensor": 4}, train={"steps": 1}, data=data)
    hf.save(tmp_path / "hf", config.model, jax.device_get(models.init_params(config.model, 7)), max_shard_bytes=100_000)
    from_hf = tiny.with_overrides(config, {"data": 2, "tensor": 4}, train={"init_from_hf": str(tmp_path / "hf"), "seed": 0})
    (first,) = train(from_hf, str(tmp_path / "a"), progress=False)
    (own,) = train(config, str(tmp_path / "b"), progress=False)

    train_cfg = config.train
    batch = next(DocumentBatches(Packer(training_stream(config), train_cfg.global_batch_size, train_cfg.seq_len + 1,
                                        bool(config.data.packing)), prefetch=False))
    assert (batch[:, 1] == batch[:, 1, :1]).all()  # one segment per row
    rows = torch.as_tensor(batch[:, 0].astype(np.int64), dtype=torch.long)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
    loss = reference(input_ids=rows[:, :-1], labels=rows[:, :-1], shift_labels=rows[:, 1:].contiguous()).loss
    loss.backward()
    want = float(loss.detach())
    want_norm = float(torch.sqrt(sum(torch.sum(p.grad**2) for p in reference.parameters())))
    print(f"loss {first['loss']} vs transformers {want} (own init {own['loss']}); grad norm {first['grad_norm']} vs {want_norm}")
    assert abs(first["loss"] - want) <= 1e-5 * want, (first["loss"], want)
    assert abs(first["grad_norm"] - want_norm) <= 1e-4 * want_norm, (first["grad_norm"], want_norm)
    # Positive control: the run's own init is told apart (measured: its loss 5.5e-4 relative away, the
    # run's 2.5e-7, its gradient norm equal to all printed digits; random inits' losses all lie near ln 256).
    assert abs(own["loss"] - want) > 10 * 1e-5 * want, (own["loss"], want)
    assert abs(own["grad_norm"] - want_norm) > 10 * 1e-4 * want_norm, (own["grad_norm"], want_norm)
    assert sharded.problems(str(tmp_path / "hf"), config.model) == []


CONVERT_THEN_TRAIN_CONFIG = """
from tests.support import tiny
def get_config():
    # head_dim None (derived: 64 / 8 heads = 8), which config.json writes out as 8; Mixtral's
    # router_z_loss_coef (0.01 here) is not in config.json at all.
    return tiny.with_overrides(
        tiny.{family}(vocab_size=256, head_dim=None), {mesh}, data={{"max_corpus_bytes": 100_000}}, train={{"steps": 1}}
    )
"""


def train_script():
    spec = importlib.util.spec_from_file_location("train_script", os.path.join(ROOT, "scripts", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_converted_checkpoint_trains_exactly_as_convert_prints(family, tmp_path, capsys):
    from jaxpar.command.config_file import load_config

    config_file = write(tmp_path / "config.py", CONVERT_THEN_TRAIN_CONFIG.format(family=family, mesh=FAMILIES[family][1]))
    model = load_config(config_file).model
    hf.save(tmp_path / "hf", model, random_params(model, 0))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["head_dim"] == 8 and model.head_dim is None
    assert sharded.problems(str(tmp_path / "hf"), model) == [], "train.init_from_hf takes it as it is"
    convert, script, ckpt = convert_script(), train_script(), tmp_path / "ckpt"

    # A workdir's root is not a checkpoint directory: refused, nothing written into it.
    workdir = tmp_path / "workdir"
    write(workdir / "metrics.jsonl", "")
    assert convert.main([f"--from_hf={tmp_path / 'hf'}", f"--to_checkpoint={workdir}", f"--config={config_file}"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: --to_checkpoint={workdir} is a training workdir") and len(error.splitlines()) == 1, error
    assert os.listdir(workdir) == ["metrics.jsonl"]

    argv = [f"--from_hf={tmp_path / 'hf'}", f"--to_checkpoint={ckpt}", f"--config={config_file}", "--config.train.seed=3"]
    assert convert.main(argv) == 0
    printed = capsys.readouterr().out
    (command,) = [line.strip() for line in printed.splitlines() if "scripts/train.py" in line]
    args = [arg.replace("WORKDIR", str(tmp_path / "run")) for arg in shlex.split(command)[2:]]

    # Another model against the converted checkpoint: refused without blaming an earlier run or
    # offering --overwrite; and --overwrite never deletes converted weights.
    for extra, expected in [([], "was converted from"), (["--overwrite"], "--overwrite never deletes a converted checkpoint")]:
        assert script.main(args + ["--config.model.intermediate_size=192", *extra]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and expected in error and "earlier run" not in error, error
        assert "pass --overwrite" not in error and finished_steps(str(ckpt)) == [0]

    assert script.main(args) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    assert f"resumed from checkpoint {ckpt}/0 (step 0)" in out, out[-3000:]
    assert finished_steps(str(ckpt)) == [0, 1]
