"""scripts/sample.py end to end, in process: weights from a transformers directory, a checkpoint
directory and a workdir (saved on one mesh, sampled on others), the JSON output, and one-line
errors (exit 2) for bad input."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.checkpoint import Checkpoints
from jaxpar.train import workdir as workdirs
from jaxpar.train.setup import build
from tests.support import tiny
from tests.support.paths import ROOT

spec = importlib.util.spec_from_file_location("sample_script", os.path.join(ROOT, "scripts", "sample.py"))
sample = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sample)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A workdir whose step-0 checkpoint was saved on data=2 x tensor=4 with ZeRO-3 (byte corpus)."""
    config = tiny.llama()
    config.mesh.update(data=2, tensor=4)
    config.parallel.zero_stage = 3
    workdir = tmp_path_factory.mktemp("run")
    program = build(config, jax.devices())
    state = program.init()
    state = state.replace(params=jax.tree.map(lambda p: p * 6 if p.ndim > 1 else p, state.params))
    with Checkpoints(str(workdir / "checkpoints"), every_steps=0) as checkpoints:
        checkpoints.save(0, state, data_state={"step": 0}, config=config.to_json_best_effort(), force=True)
        checkpoints.wait()
    workdirs.write_config(str(workdir), config)
    params = jax.tree.map(np.asarray, state.params)
    return workdir, config.model, params


def run(capsys, *argv):
    code = sample.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_workdir_and_checkpoint_sample_on_other_meshes(run_dir, capsys, tmp_path):
    workdir, model, params = run_dir
    expected = jaxpar.generate(model, params, [[104, 105], [5, 6, 7]], max_new_tokens=10)
    for flags in (["--tensor=2"], ["--data=1"], ["--tensor=8"]):
        out_file = tmp_path / "out.jsonl"
        code, out, err = run(capsys, f"--workdir={workdir}", "--prompt=hi", "--prompt_ids=5,6,7", "--max_new_tokens=10",
                             f"--output={out_file}", *flags)
        assert code == 0, err
        assert "KV cache:" in out and "MiB per device" in out and "(step 0)" in out
        records = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert [r["completion_ids"] for r in records] == expected
        assert records[0]["prompt_ids"] == [104, 105]
        assert records[0]["text"] == bytes(expected[0]).decode("utf-8", errors="replace")
    code, out, err = run(capsys, f"--checkpoint={workdir / 'checkpoints'}", "--step=0", "--prompt_ids=5,6,7", "--max_new_tokens=10",
                         f"--output={out_file}")
    assert code == 0, err
    assert [json.loads(line)["completion_ids"] for line in out_file.read_text().splitlines()] == expected[1:]


def test_from_hf_with_samples_and_seed(capsys, tmp_path):
    from jaxpar.interop import hf
    from tests.support.hf_models import llama_model

    llama_model("gqa_untied").save_pretrained(tmp_path / "hf")
    cfg, params = hf.load(tmp_path / "hf")
    expected = jaxpar.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=6)
    out_file = tmp_path / "greedy.jsonl"
    code, out, err = run(capsys, f"--from_hf={tmp_path / 'hf'}", "--prompt_ids=1,2,3;4,5", "--max_new_tokens=6",
                         f"--output={out_file}", "--eos_id=299")
    assert code == 0, err
    assert [json.loads(line)["completion_ids"] for line in out_file.read_text().splitlines()] == expected
    sampled = []
    for _ in range(2):
        code, _, err = run(capsys, f"--from_hf={tmp_path / 'hf'}", "--prompt_ids=1,2,3", "--max_new_tokens=6", "--num_samples=3",
                           "--temperature=1.0", "--top_k=20", "--seed=3", f"--output={out_file}", "--eos_id=299")
        assert code == 0, err
        sampled.append([json.loads(line)["completion_ids"] for line in out_file.read_text().splitlines()])
    assert sampled[0] == sampled[1] and len(sampled[0]) == 3
    assert len({tuple(s) for s in sampled[0]}) > 1  # the samples of one prompt differ


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt_ids=1", "--top_p=0"], "--top_p=0.0 must be in (0, 1]"),
        (["--prompt_ids=1", "--temperature=-1"], "--temperature=-1.0 must be >= 0"),
        (["--prompt_ids=" + ",".join(["1"] * 65)], "longer than model.max_position_embeddings=64"),
        # one line per problem: heads, KV heads, MLP, vocab
        (["--prompt_ids=1", "--tensor=3"], "model.num_attention_heads=8 is not divisible by --tensor=3"),
        (["--prompt_ids=1", "--pipeline=2"], "--pipeline=2: sampling does not split the model over pipeline"),
        (["--prompt_ids=1", "--step=7"], "--step=7: "),
        (["--prompt_ids=1,x"], "--prompt_ids: '1,x' is not comma-separated integers"),
        ([], "give a prompt"),
    ],
    ids=["top_p", "temperature", "too_long", "tensor3", "pipeline", "no_step", "bad_ids", "no_prompt"],
)
def test_bad_input_is_one_line_exit_2(run_dir, capsys, flags, message):
    workdir = run_dir[0]
    code, out, err = run(capsys, f"--workdir={workdir}", *flags)
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert message in err and len(lines) == (4 if "--tensor=3" in flags else 1), err
    assert all(line.startswith("error: ") for line in lines)


def test_no_checkpoint_is_one_line_exit_2(capsys, tmp_path):
    workdirs.write_config(str(tmp_path), tiny.llama())
    code, _, err = run(capsys, f"--workdir={tmp_path}", "--prompt=hi")
    assert code == 2 and "holds no complete checkpoint" in err and err.count("\n") == 1, err
    code, _, err = run(capsys, f"--workdir={tmp_path / 'nope'}", "--prompt=hi")
    assert code == 2 and "does not exist" in err, err
