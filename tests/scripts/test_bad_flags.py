"""The probe's script flags: scripts/plan.py, sweep.py, prepare_data.py, gpu_check.py and sample.py, each bad
flag through the script's `main` in this process. Each must exit 2 with one `error:` line naming the
flag, before anything is written (prepare_data.py's output and sidecars, sample.py's --output) or
searched (plan.py: a fixed key no layout can pass is answered at once, not after a search over every
device count). `tests/train/probe.py` checks the contract; sample.py's cases read a run trained once
for the module, which must be left as it was."""

import os

import pytest

from tests.support import tiny
from tests.support.paths import REPO
from tests.train.probe import Probe, snapshot, tokenizer_folder

TINY, BIG = str(REPO / "configs" / "llama_tiny.py"), str(REPO / "configs" / "llama3_8b.py")


def plan(*flags: str, config: str = TINY) -> tuple:
    return ("plan", [f"--config={config}", *flags])


def prepare(t, *flags: str, tokenizer: str | None = None) -> tuple:
    return ("prepare_data", [f"--tokenizer={tokenizer or t.tokenizer()}", *flags, "--noprogress"])


def sample(t, *flags: str, prompt: str = "--prompt=def ") -> tuple:
    """sample.py on the module's run (64 positions: the default 64 new tokens would not fit a prompt)."""
    return ("sample", [f"--workdir={t.run}", prompt, "--max_new_tokens=8", *flags])


# (id, make(t) -> ((script, argv), words the one line must hold))
CASES = [
    # -- plan.py
    ("plan_efficiency_zero", lambda t: (plan("--efficiency=0"), "--efficiency=0 must be 'achieved' or a fraction of peak in (0, 1]")),
    ("plan_efficiency_negative", lambda t: (plan("--efficiency=-1"), "--efficiency=-1 must be")),
    ("plan_efficiency_nan", lambda t: (plan("--efficiency=nan"), "--efficiency=nan must be")),
    ("plan_efficiency_above_one", lambda t: (plan("--efficiency=1.5"), "--efficiency=1.5 must be")),
    ("plan_devices_zero", lambda t: (plan("--devices=0"), "--devices=0 must be >= 1")),
    ("plan_devices_negative", lambda t: (plan("--devices=-4"), "--devices=-4 must be >= 1")),
    ("plan_hardware", lambda t: (plan("--hardware=z80"), "--hardware: unknown hardware 'z80'; known: a100-80g")),
    ("plan_compare_zero", lambda t: (plan("--compare=tensor=0"), "--compare: 'tensor=0' is not AXIS=SIZE")),
    ("plan_compare_twice", lambda t: (plan("--compare=tensor=4,tensor=2"), "--compare: tensor is given twice")),
    ("plan_compare_axis", lambda t: (plan("--compare=heads=4"), "--compare: 'heads=4' is not AXIS=SIZE")),
    ("plan_compare_empty", lambda t: (plan("--compare=,"), "--compare=',' names no axis")),
    ("plan_top_zero", lambda t: (plan("--top=0"), "--top=0 must be >= 1")),
    ("plan_batch_zero", lambda t: (plan("--global_batch_size=0"), "--global_batch_size=0 must be >= 1")),
    ("plan_heads_zero", lambda t: (plan("--config.model.num_attention_heads=0"), "model.num_attention_heads=0 must be >= 1")),
    ("plan_fixed_tensor_no_layout", lambda t: (plan("--config.mesh.tensor=3", "--config.model.num_attention_heads=24",
                                                    "--config.model.num_key_value_heads=24", "--config.model.head_dim=128", config=BIG),
                                               "model.intermediate_size=14336 is not divisible by mesh.tensor=3")),
    ("plan_fixed_zero_stage", lambda t: (plan("--config.parallel.zero_stage=2"), "parallel.zero_stage=2")),
    ("plan_config_missing", lambda t: (plan(config=str(t.root / "none.py")), "none.py does not exist")),
    ("plan_key_typo", lambda t: (plan("--config.mesh.tensr=2"), "did you mean --config.mesh.tensor?")),
    # -- sweep.py (compiles every layout: its flags are checked before the first)
    ("sweep_hardware", lambda t: (("sweep", [f"--config={TINY}", f"--out={t.root / 'sweep'}", "--hardware=z80"]),
                                  "--hardware: unknown hardware 'z80'")),
    ("sweep_remats", lambda t: (("sweep", [f"--config={TINY}", f"--out={t.root / 'sweep'}", "--remats=full,most"]),
                                "--remats=most: not one of auto, none, full, save_dots")),
    # -- prepare_data.py
    ("prepare_output_is_input", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'in.jsonl'}",
                                                   "--overwrite"), "would replace the --input file")),
    ("prepare_output_is_input_by_link", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.link('in.jsonl')}",
                                                           "--overwrite"), "would replace the --input file")),
    ("prepare_sidecar_is_input", lambda t: (prepare(t, f"--input={t.records('in.json')}", f"--output={t.root / 'in'}", "--overwrite"),
                                            "writing")),
    ("prepare_input_in_folder", lambda t: (prepare(t, f"--input={t.folder_with_output()}", f"--output={t.root / 'f' / 'out.bin'}",
                                                   "--overwrite"), "out.bin would replace the --input file")),
    ("prepare_undecodable_above_one", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'o.bin'}",
                                                         "--max_undecodable=2"), "--max_undecodable=2.0 must be a fraction in [0, 1]")),
    ("prepare_undecodable_negative", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'o.bin'}",
                                                        "--max_undecodable=-1"), "--max_undecodable=-1.0 must be >= 0.0")),
    ("prepare_undecodable_nan", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'o.bin'}",
                                                   "--max_undecodable=nan"), "--max_undecodable=nan must be a fraction")),
    ("prepare_dtype", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'o.bin'}", "--dtype=int8"),
                                 "--dtype=int8: not one of uint16, uint32")),
    ("prepare_no_tokenizer", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'o.bin'}",
                                                tokenizer=str(t.root / "tok")), "--tokenizer=")),
    ("prepare_output_folder_missing", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.root / 'no' / 'o.bin'}"),
                                                 "its folder does not exist")),
    ("prepare_output_exists", lambda t: (prepare(t, f"--input={t.records('in.jsonl')}", f"--output={t.write('o.bin', 'x')}"),
                                         "already exists; pass --overwrite")),
    ("prepare_line_not_json", lambda t: (prepare(t, f"--input={t.records('in.jsonl', bad={5: b'{x'})}", f"--output={t.root / 'o.bin'}"),
                                         "in.jsonl line 5 is not a JSON object")),
    ("prepare_binary_input", lambda t: (prepare(t, f"--input={t.write('b.txt', os.urandom(5000))}", f"--output={t.root / 'o.bin'}"),
                                        "are not UTF-8")),
    ("prepare_parquet_garbage", lambda t: (prepare(t, f"--input={t.write('a.parquet', b'PAR1 garbage' * 9)}",
                                                   f"--output={t.root / 'o.bin'}"), "a.parquet")),
    # -- gpu_check.py
    ("gpu_check_precision", lambda t: (("gpu_check", ["--size=tiny", "--precisions=bf16,fp9", f"--out={t.root / 'gc'}"]),
                                       "--precisions: 'fp9' is not one of bf16")),
    ("gpu_check_out_is_a_file", lambda t: (("gpu_check", ["--size=tiny", f"--out={t.write('gc', 'x')}"]), "is a file; name a folder")),
    # -- sample.py
    ("sample_output_folder_missing", lambda t: (sample(t, f"--output={t.root / 'no' / 'out.jsonl'}"), "its folder")),
    ("sample_output_is_a_folder", lambda t: (sample(t, f"--output={t.root}"), "is a folder; name a file")),
    ("sample_prompt_file_missing", lambda t: (sample(t, prompt=f"--prompt_file={t.root / 'p.txt'}"), "--prompt_file=")),
    ("sample_two_sources", lambda t: (sample(t, f"--from_hf={t.root}"), "give exactly one of --workdir, --checkpoint, --from_hf")),
    ("sample_temperature", lambda t: (sample(t, "--temperature=-1"), "--temperature=-1.0 must be >= 0")),
    ("sample_top_p_zero", lambda t: (sample(t, "--top_p=0"), "--top_p=0.0 must be in (0, 1]")),
    ("sample_top_k_beyond_vocab", lambda t: (sample(t, "--top_k=100000"), "--top_k=100000 must be between 0 (off) and the vocab size")),
    ("sample_prompt_ids_words", lambda t: (sample(t, prompt="--prompt_ids=1,x"), "--prompt_ids: '1,x' is not comma-separated integers")),
    ("sample_prompt_ids_beyond_vocab", lambda t: (sample(t, prompt="--prompt_ids=1,999"), "prompt 0 has token ids outside [0, 256)")),
    ("sample_too_long", lambda t: (sample(t, "--max_new_tokens=61"), "exceed model.max_position_embeddings=64; ask for at most 60")),
    ("sample_eos_beyond_vocab", lambda t: (sample(t, "--eos_id=300"), "--eos_id=300 is outside [0, 256)")),
    ("sample_step_missing", lambda t: (sample(t, "--step=7"), "--step=7: ")),
    ("sample_pipeline", lambda t: (sample(t, "--pipeline=2"), "--pipeline")),
    ("sample_tensor_beyond_devices", lambda t: (sample(t, "--tensor=16"), "16")),
    ("sample_workdir_missing", lambda t: (("sample", [f"--workdir={t.root / 'none'}", "--prompt=x"]), "does not exist")),
]


class FlagProbe(Probe):
    def link(self, name: str) -> str:
        os.symlink(self.root / name, self.root / "link.jsonl")
        return str(self.root / "link.jsonl")

    def folder_with_output(self) -> str:
        self.records("f/a.jsonl")
        self.write("f/out.bin", b"\x01\x00")  # an earlier output, inside the folder given as input
        return str(self.root / "f")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny Llama run of one step (vocab 256, 64 positions): what sample.py's cases read."""
    from jaxpar.train.loop import train

    workdir = tmp_path_factory.mktemp("probe_run") / "run"
    config = tiny.llama(vocab_size=256)
    config.data.max_corpus_bytes, config.train.steps = 100_000, 1
    train(config, str(workdir), progress=False)
    return workdir


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_flag_is_one_line_before_anything_is_written(case, tmp_path, capsys, monkeypatch, tokenizer_dir, trained_run):
    monkeypatch.chdir(REPO)
    t = FlagProbe(tmp_path, capsys, monkeypatch, tokenizer_dir)
    t.run = trained_run
    run_before = snapshot(trained_run)
    (script, argv), expected = case[1](t)
    t.refused(script, argv, expected)
    assert snapshot(trained_run) == run_before, "sampling changed the run it read"


def test_plan_refuses_a_fixed_mesh_axis_no_layout_passes_without_searching(capsys, monkeypatch):
    """The issue's case: llama3_8b with mesh.tensor=3 fixed (its heads, KV heads and MLP width are not
    divisible by 3) searched every device count up to 16384 for 300 s, printing nothing. Now each
    problem is a line naming mesh.tensor=3, and no layout is ever priced (the search is not entered)."""
    from jaxpar.analysis.planner import search

    def no_search(*args, **kwargs):
        raise AssertionError("the planner searched layouts for a config no layout can pass")

    monkeypatch.setattr(search, "plan_layouts", no_search)
    monkeypatch.setattr(search, "smallest_fitting_plan", no_search)
    import jaxpar.analysis.planner as planner

    monkeypatch.setattr(planner, "plan_layouts", no_search)
    monkeypatch.setattr(planner, "smallest_fitting_plan", no_search)
    from tests.train.probe import script

    assert script("plan").main([f"--config={BIG}", "--config.mesh.tensor=3"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "error: model.num_attention_heads=32 is not divisible by mesh.tensor=3; change model.num_attention_heads or mesh.tensor",
        "error: mesh.tensor=3 is not divisible by model.num_key_value_heads=8; change mesh.tensor or model.num_key_value_heads",
        "error: model.intermediate_size=14336 is not divisible by mesh.tensor=3; change model.intermediate_size or mesh.tensor",
    ], lines
