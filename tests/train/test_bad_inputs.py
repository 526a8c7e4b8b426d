"""Bad input never costs data: a table of bad flags, config keys, config files, corpora, workdirs and
transformers checkpoints, each run through scripts/train.py's `main` (in-process; a few also as real
subprocesses). Every case must exit with code 2, print exactly one line naming the key or file, no
traceback, and leave everything on disk — above all an earlier run's workdir — byte-for-byte as it
was. Most cases pass `--overwrite`: even a run told to replace the earlier one must not touch it
when its input is bad.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support import tiny
from tests.support.compile_flags import subprocess_environment
from tests.support.documents import make_tokenizer, texts, write_jsonl
from tests.support.files import tokens, write
from tests.support.paths import ROOT
from tests.support.processes import hold_lock
from tests.train.probe import CONFIG_FILE, snapshot

SCRIPT = os.path.join(ROOT, "scripts", "train.py")

# A config file written before the optimizer keys moved into their records' sections.
FLAT_KEY_FILE = CONFIG_FILE.replace("    return c", "    c.train.adam_b1 = 0.8\n    return c")


def load_script():
    spec = importlib.util.spec_from_file_location("train_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENOUGH = 16 * 17 * 2  # tokens for two global batches of 16 x (16 + 1)


def data(source, path, dtype="uint16"):
    return [f"--config.data.source={source}", f"--config.data.path={path}", f"--config.data.token_dtype={dtype}"]


def hf_edit(kind):
    """A setup that copies the good transformers checkpoint and damages it one way."""

    def setup(t):
        import shutil

        target = t.root / f"hf_{kind}"
        shutil.copytree(t.hf, target)
        weights = target / "model.safetensors"
        if kind == "no_config":
            os.remove(target / "config.json")
        elif kind == "bad_json":
            (target / "config.json").write_text('{"model_type": "llama", ')
        elif kind == "truncated":
            data_ = weights.read_bytes()
            weights.write_bytes(data_[: len(data_) // 2])
        elif kind == "wrong_shape":
            tensors = load_file(weights)
            tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
            save_file(tensors, weights, metadata={"format": "pt"})
        elif kind == "other_model":
            config = json.loads((target / "config.json").read_text())
            config["hidden_size"] = 128
            (target / "config.json").write_text(json.dumps(config))
        elif kind == "model_type":
            config = json.loads((target / "config.json").read_text())
            config["model_type"] = "gpt2"
            (target / "config.json").write_text(json.dumps(config))
        expected = {
            "no_config": f"{target}: no config.json",
            "bad_json": f"{target / 'config.json'} is not valid JSON",
            "truncated": f"{weights} is not a readable safetensors file",
            "wrong_shape": f"{weights}: tensor model.layers.1.mlp.up_proj.weight has shape [100, 64], config.model needs [128, 64]",
            "other_model": "model.hidden_size (checkpoint 128, config 64)",
            "model_type": f"{target / 'config.json'}: model_type 'gpt2' is not supported",
        }[kind]
        return [f"--config.train.init_from_hf={target}"], expected

    return setup


# (id, setup(t) -> (extra argv, text the one line must contain), overwrite?)
# `t` has: root (tmp dir), config (the good config file), earlier (a workdir holding an earlier run),
# hf (a good transformers checkpoint of the same model), monkeypatch.
CASES = [
    # -- flags
    ("unknown_flag", lambda t: (["--workdri=x"], "did you mean --workdir?")),
    ("cpu_devices_negative", lambda t: (["--cpu_devices=-1"], "--cpu_devices=-1")),
    ("positional", lambda t: (["extra"], "unexpected argument 'extra'")),
    # -- config keys
    ("key_typo", lambda t: (["--config.train.setps=3"], "did you mean --config.train.steps?")),
    ("section_typo", lambda t: (["--config.trian.steps=3"], "did you mean --config.train.steps?")),
    ("set_a_section", lambda t: (["--config.train=3"], "--config.train: train is a section")),
    ("int_type", lambda t: (["--config.train.steps=abc"], "--config.train.steps='abc' must be an int")),
    ("bool_type", lambda t: (["--config.parallel.sequence_parallel=maybe"], "sequence_parallel='maybe' must be true or false")),
    ("none_for_int", lambda t: (["--config.train.steps=None"], "train.steps=None must be an int")),
    ("steps_zero", lambda t: (["--config.train.steps=0"], "train.steps=0 must be >= 1")),
    ("steps_negative", lambda t: (["--config.train.steps=-5"], "train.steps=-5")),
    ("batch_zero", lambda t: (["--config.train.global_batch_size=0"], "train.global_batch_size=0")),
    ("seq_len_zero", lambda t: (["--config.train.seq_len=0"], "train.seq_len=0")),
    ("grad_accum_zero", lambda t: (["--config.train.grad_accum=0"], "train.grad_accum=0")),
    ("lr_negative", lambda t: (["--config.train.learning_rate=-0.001"], "train.learning_rate=-0.001 must be > 0")),
    ("lr_zero", lambda t: (["--config.train.learning_rate=0"], "train.learning_rate=0.0 must be > 0")),
    ("lr_nan", lambda t: (["--config.train.learning_rate=nan"], "train.learning_rate=nan")),
    ("warmup_negative", lambda t: (["--config.train.warmup_steps=-1"], "train.warmup_steps=-1")),
    ("adam_b1_one", lambda t: (["--config.train.adamw.b1=1.0"], "train.adamw.b1=1.0 must be in [0.0, 1.0)")),
    ("adam_b2_above_one", lambda t: (["--config.train.adamw.b2=1.5"], "train.adamw.b2=1.5")),
    ("moved_key", lambda t: (["--config.train.lion_b1=0.5"], "--config.train.lion_b1: the key moved to --config.train.lion.b1")),
    ("moved_key_in_file", lambda t: ([f"--config={write(t.root / 'flat.py', FLAT_KEY_FILE)}"],
                                     "train.adam_b1: the key moved to train.adamw.b1; set that instead")),
    ("v_schedule_other_v", lambda t: (["--config.parallel.pipeline_schedule=zb_v", "--config.parallel.virtual_stages=1"],
                                      "parallel.virtual_stages=1 must be 2 for parallel.pipeline_schedule='zb_v'")),
    ("clip_zero", lambda t: (["--config.train.max_grad_norm=0"], "train.max_grad_norm=0.0 must be > 0")),
    ("seed_negative", lambda t: (["--config.train.seed=-1"], "train.seed=-1")),
    ("decay_negative", lambda t: (["--config.train.weight_decay=-0.1"], "train.weight_decay=-0.1")),
    ("final_fraction", lambda t: (["--config.train.final_learning_rate_fraction=2"], "train.final_learning_rate_fraction=2.0")),
    ("log_every_zero", lambda t: (["--config.train.log_every=0"], "train.log_every=0")),
    ("compute_dtype", lambda t: (["--config.train.compute_dtype=float8"], "train.compute_dtype='float8' is not one of")),
    ("nonfinite_policy", lambda t: (["--config.train.on_nonfinite=ignore"], "train.on_nonfinite='ignore'")),
    ("skip_fraction", lambda t: (["--config.train.max_skipped_fraction=0"], "train.max_skipped_fraction=0.0")),
    ("hidden_zero", lambda t: (["--config.model.hidden_size=0"], "model.hidden_size=0 must be >= 1")),
    ("heads_zero", lambda t: (["--config.model.num_attention_heads=0"], "model.num_attention_heads=0")),
    ("kv_heads_zero", lambda t: (["--config.model.num_key_value_heads=0"], "model.num_key_value_heads=0")),
    ("head_dim_zero", lambda t: (["--config.model.head_dim=0"], "model.head_dim=0")),
    ("layers_negative", lambda t: (["--config.model.num_hidden_layers=-2"], "model.num_hidden_layers=-2")),
    ("eps_negative", lambda t: (["--config.model.rms_norm_eps=-1e-06"], "model.rms_norm_eps=-1e-06 must be > 0")),
    ("rope_type", lambda t: (["--config.model.rope_scaling.rope_type=yarn"], "model.rope_scaling.rope_type='yarn'")),
    ("model_type_unknown", lambda t: (["--config.model.model_type=gpt2"], "model.model_type='gpt2'")),
    ("model_type_switched", lambda t: (["--config.model.model_type=mixtral"], "model.num_local_experts, model.router_aux_loss_coef")),
    ("vocab_below_bytes", lambda t: (["--config.model.vocab_size=100"], "model.vocab_size=100 is below the byte tokenizer")),
    ("seq_beyond_positions", lambda t: (["--config.train.seq_len=100"], "train.seq_len=100 exceeds model.max_position_embeddings")),
    ("mesh_not_dividing", lambda t: (["--config.mesh.tensor=3"], "mesh: the fixed axes multiply to 3")),
    ("batch_not_dividing", lambda t: (["--config.train.global_batch_size=12"], "train.global_batch_size=12 is not divisible")),
    ("zero_stage", lambda t: (["--config.parallel.zero_stage=2"], "parallel.zero_stage=2")),
    ("remat", lambda t: (["--config.parallel.remat=some"], "parallel.remat='some'")),
    ("schedule", lambda t: (["--config.parallel.pipeline_schedule=zigzag"], "parallel.pipeline_schedule='zigzag'")),
    ("cudnn_on_cpu", lambda t: (["--config.parallel.attention_impl=cudnn"], "parallel.attention_impl='cudnn' needs a GPU")),
    ("keep_negative", lambda t: (["--config.checkpoint.keep=-1"], "checkpoint.keep=-1")),
    ("every_negative", lambda t: (["--config.checkpoint.every_steps=-1"], "checkpoint.every_steps=-1")),
    # -- config files
    ("config_missing", lambda t: ([f"--config={t.root / 'nope.py'}"], "nope.py does not exist")),
    ("config_syntax", lambda t: ([f"--config={write(t.root / 'syntax.py', 'def get_config(:')}"], "syntax error in")),
    ("config_no_get_config", lambda t: ([f"--config={write(t.root / 'empty.py', 'x = 1')}"], "defines no get_config()")),
    ("config_raises", lambda t: ([f"--config={write(t.root / 'raises.py', 'def get_config():' + chr(10) + '    return 1 / 0')}"],
                                 "raises.py at line 2 raised ZeroDivisionError")),
    ("config_not_configdict", lambda t: ([f"--config={write(t.root / 'dict.py', 'def get_config(): return {}')}"], "returned a dict")),
    ("config_is_a_folder", lambda t: ([f"--config={t.root}"], "is not a file")),
    # -- data
    ("text_missing", lambda t: (data("text", t.root / "none.txt"), "none.txt' does not exist")),
    ("text_too_short", lambda t: (data("text", write(t.root / "short.txt", "x" * 100)), "short.txt' holds 100 tokens")),
    ("text_empty_folder", lambda t: (data("text", os.path.dirname(write(t.root / "emptydir" / ".hidden", ""))), "holds 0 tokens")),
    ("tokens_odd_size", lambda t: (data("tokens", write(t.root / "odd.bin", "abc")), "odd.bin' is 3 bytes, not a multiple")),
    ("tokens_empty", lambda t: (data("tokens", write(t.root / "empty.bin", "")), "empty.bin' is empty")),
    ("tokens_too_large_id", lambda t: (data("tokens", tokens(t.root / "big.bin", [5] * 700 + [300] + [7] * ENOUGH)),
                                       "holds token id 300 at position 700")),
    ("tokens_negative_id", lambda t: (data("tokens", tokens(t.root / "neg.bin", [5] * ENOUGH + [-3], "int16"), "int16"),
                                      "holds negative token id -3")),
    ("tokens_sidecar_vocab", lambda t: (data("tokens", tokens(t.root / "side.bin", [5] * ENOUGH, sidecar={"vocab_size": 1000})),
                                        "model.vocab_size=256 is smaller than the 1000 tokens")),
    ("tokens_dtype", lambda t: (data("tokens", tokens(t.root / "t.bin", [5] * ENOUGH), "float32"), "data.token_dtype='float32'")),
    ("source_unknown", lambda t: (["--config.data.source=web"], "data.source='web' is not one of")),
    ("path_ignored", lambda t: ([f"--config.data.path={t.root}"], "is set but data.source='stdlib' does not read it")),
    # -- documents, tokenizers, mixtures, eval sets
    ("jsonl_no_text_field", lambda t: (data("text", write_jsonl(t.root / "body.jsonl", texts(50), field="body")),
                                       "no 'text' field; set data.text_field")),
    ("datasets_empty_documents", lambda t: (data("datasets", write_jsonl(t.root / "empty.jsonl", [""] * 20)),
                                            "holds no document of 2 or more tokens")),
    ("tokenizer_vocab_too_big", lambda t: (data("text", t.jsonl())
                                           + [f"--config.data.tokenizer={t.tokenizer()}", "--config.model.vocab_size=16"],
                                           "more than model.vocab_size=16")),
    ("mixture_weight_zero", lambda t: ([f"--config.data.mixture={t.jsonl()}:2,{t.jsonl()}:0", "--config.data.source=text"],
                                       "data.mixture[1].weight=0.0 must be a finite number > 0")),
    ("eval_missing", lambda t: (data("text", t.jsonl()) + [f"--config.eval.path={t.root / 'noeval.jsonl'}"],
                                "noeval.jsonl' does not exist")),
    ("eval_too_short", lambda t: (data("text", t.jsonl())
                                  + [f"--config.eval.path={write_jsonl(t.root / 'ev.jsonl', texts(3))}", "--config.eval.steps=5"],
                                  "fewer than eval.steps=5")),
    # -- workdirs (no --overwrite where the earlier run itself is the problem)
    ("workdir_is_a_file", lambda t: ([f"--workdir={write(t.root / 'afile', 'x')}"], "afile is a file, not a directory")),
    ("workdir_parent_file", lambda t: ([f"--workdir={write(t.root / 'bfile', 'x')}/run"], "bfile is a file")),
    ("workdir_unwritable", lambda t: (t.unwritable(), "is not writable")),
    ("gcs_without_gcsfs", lambda t: (t.without_module("gcsfs", ["--config.checkpoint.dir=gs://jaxpar-test-bucket/run"]),
                                     'checkpoint.dir=gs://jaxpar-test-bucket/run needs the gcsfs package: pip install -e ".[gcs]"')),
    ("checkpoint_dir_file", lambda t: ([f"--config.checkpoint.dir={write(t.root / 'cfile', 'x')}"], "checkpoint.dir=")),
    ("earlier_run_no_checkpoint", lambda t: (t.no_overwrite(t.earlier_logs_only()),
                                             "holds an earlier run (metrics.jsonl, config.json) but no complete checkpoint")),
    ("earlier_run_other_model", lambda t: (t.no_overwrite(["--config.model.hidden_size=128"]), "model.hidden_size (saved 64, now 128)")),
    ("earlier_run_other_data", lambda t: (t.no_overwrite(["--config.data.max_corpus_bytes=90000"]),
                                          "data.max_corpus_bytes (saved 100000, now 90000)")),
    ("workdir_locked", lambda t: (t.locked(), "is in use by another run (host elsewhere, pid")),
    # As root (the tests' user) /proc passes the permission checks, but no directory can be made in
    # it: the lock's creation fails ("cannot create its lock file"); others get preflight's line.
    ("workdir_lock_impossible", lambda t: (["--workdir=/proc/jaxpar-no-such-run"], "--workdir=/proc/jaxpar-no-such-run")),
    # -- transformers checkpoints (train.init_from_hf)
    ("hf_dir_missing", lambda t: ([f"--config.train.init_from_hf={t.root / 'nohf'}"], "train.init_from_hf=")),
    ("hf_no_config", hf_edit("no_config")),
    ("hf_bad_json", hf_edit("bad_json")),
    ("hf_truncated", hf_edit("truncated")),
    ("hf_wrong_shape", hf_edit("wrong_shape")),
    ("hf_other_model", hf_edit("other_model")),
    ("hf_model_type", hf_edit("model_type")),
]


class Setup:
    def __init__(self, root, monkeypatch, hf_dir):
        self.root, self.monkeypatch, self.hf = root, monkeypatch, hf_dir
        self.config = write(root / "config.py", CONFIG_FILE)
        self.earlier = root / "earlier"
        self.overwrite = True
        self.workdir = str(self.earlier)
        self.holder = None
        # An earlier run of the same config: logs and one (metadata-only) complete checkpoint.
        config = tiny.llama(vocab_size=256)
        config.data.max_corpus_bytes, config.train.steps = 100_000, 2
        write(self.earlier / "config.json", config.to_json_best_effort(indent=2))
        write(self.earlier / "metrics.jsonl", '{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.4}\n')
        step = self.earlier / "checkpoints" / "2"
        write(step / "config" / "metadata", config.to_json_best_effort())
        write(step / "_CHECKPOINT_METADATA", "{}")
        write(step / "commit_success.txt", "ok")

    def jsonl(self):
        return write_jsonl(self.root / "docs.jsonl", texts(200, seed=4))

    def tokenizer(self):
        return make_tokenizer(self.root / "tokenizer")

    def no_overwrite(self, argv):
        self.overwrite = False
        return argv

    def earlier_logs_only(self):
        logs = self.root / "logs_only"
        write(logs / "metrics.jsonl", '{"step": 1, "loss": 5.5}\n')
        write(logs / "config.json", "{}")
        self.workdir = str(logs)
        return []

    def without_module(self, name, argv):
        self.monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
        return argv

    def locked(self):
        self.holder = hold_lock(self.earlier)
        return []

    def unwritable(self):
        # Tests run as root, for whom permission bits do not apply: the OS answer is what is faked.
        target = str(self.root / "readonly")
        os.makedirs(target)
        real_access = os.access
        self.monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == target else real_access(p, mode))
        return [f"--workdir={target}"]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    import jax

    from jaxpar import models
    from jaxpar.interop import hf

    directory = tmp_path_factory.mktemp("hf") / "llama"
    model = tiny.llama(vocab_size=256).model
    hf.save(directory, model, jax.device_get(models.init_params(model, 0)))
    return directory


@pytest.fixture(scope="module")
def script():
    return load_script()


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(case, tmp_path, monkeypatch, capsys, script, hf_checkpoint):
    name, make = case
    t = Setup(tmp_path, monkeypatch, hf_checkpoint)
    extra, expected = make(t)
    argv = [f"--config={t.config}", f"--workdir={t.workdir}"] + (["--overwrite"] if t.overwrite else [])
    # Later flags win, so a case may replace --config / --workdir.
    argv = [a for a in argv if not any(e.split("=")[0] == a.split("=")[0] for e in extra)] + extra
    before = snapshot(tmp_path)
    try:
        code = script.main(argv)
    finally:
        if t.holder is not None:
            t.holder.kill()
            t.holder.wait()
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert code == 2, (code, out.err[-2000:], out.out[-2000:])
    assert len(lines) == 1, lines
    assert "Traceback" not in out.err + out.out
    assert lines[0].startswith("error: ") and expected in lines[0], (expected, lines[0])
    assert snapshot(tmp_path) == before, "bad input changed files on disk"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra, expected",
    [
        pytest.param(["--config.train.setps=3"], "error: --config.train.setps: unknown config key; did you mean --config.train.steps?",
                     marks=pytest.mark.slow),
        (["--config.train.learning_rate=-1.0", "--cpu_devices=2"], "error: train.learning_rate=-1.0 must be > 0"),
    ],
    ids=["key_typo", "negative_rate"],
)
def test_bad_input_in_a_real_process(tmp_path, extra, expected):
    config = write(tmp_path / "config.py", CONFIG_FILE)
    workdir = tmp_path / "run"
    env = subprocess_environment(PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, SCRIPT, f"--config={config}", f"--workdir={workdir}", *extra],
        capture_output=True, text=True, env=env, timeout=100,
    )
    assert done.returncode == 2 and done.stderr.strip() == expected, done.stderr[-3000:]
    assert not workdir.exists()
