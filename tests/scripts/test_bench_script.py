"""scripts/bench.py, each subcommand at its smallest, its printed numbers held to what they must be
whatever the machine's speed: tokens/s against tokens over step time, ratios against their parts,
the MoE and dense models' FLOPs against each other (equal by construction: k·F + E/3 dense units),
first losses against ln(vocab) (a fresh model predicts nearly uniformly), decoded tokens against
transformers'. `step` and `packing` swap in the tiny model (the bench config takes a minute a step).
"""

import json
import math
import re

import pytest

from tests.support import tiny
from tests.support.rounding import assert_printed_quotient
from tests.support.scripts import fields, numbers, run_script

TINY = "import sys; from tests.support import tiny\n"  # the child's preamble: bench.py with the tiny model
SWAP = """
import importlib.util
spec = importlib.util.spec_from_file_location("bench", "scripts/bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
bench.bench_config = lambda model: tiny.with_overrides(tiny.llama(vocab_size=256), {})
sys.exit(bench.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_step_beside_the_peer_and_profile_report_reads_its_trace(tmp_path):
    profile = tmp_path / "profile"
    done = run_script("bench.py", "step", "--steps=1", "--repeats=1", "--peer", f"--profile={profile}", code=TINY + SWAP, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    last = fields(lines[-1])
    config = tiny.llama()
    tokens = config.train.global_batch_size * config.train.seq_len
    assert_printed_quotient(float(last["tokens_per_sec"]), tokens, float(last["step_s"]), decimals=0,
                            denominator_decimals=4, context=lines[-1])
    peer = fields(next(line for line in lines if "peer (HF transformers + PyTorch):" in line).split(":", 1)[1])
    assert "failed" not in peer and float(peer["loss_first"]) == pytest.approx(math.log(256), abs=0.1), peer
    ours = numbers(next(line for line in lines if line.startswith("jaxpar: loss_last=")).split("median")[1])[0]
    theirs, _, _, ratio = numbers(next(line for line in lines if line.startswith("peer: tokens/s median")))[:4]
    assert_printed_quotient(ratio, ours, theirs, decimals=2, numerator_decimals=0, denominator_decimals=0, context=lines)
    report = run_script("profile_report.py", str(profile), "--top=1")
    assert report.returncode == 0, report.stderr[-3000:]
    assert "layer_scan" in report.stdout and "collectives (all)" in report.stdout, report.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packing_one_step_each():
    done = run_script("bench.py", "packing", "--steps=1", "--repeats=1", "--attention=jaxpar_xla", code=TINY + SWAP)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    # Documents of 2..4 tokens in rows of 17: at least 17 / 4 to a row, less any padding at a row's end.
    short = next(line for line in lines if line.startswith("attention=jaxpar_xla short ("))
    assert numbers(short.split("(", 1)[1])[0] >= 3, short
    for kind in ("wall", "cpu"):
        line = next(line for line in lines if line.startswith(f"attention=jaxpar_xla {kind} unpacked_ms="))
        ms = {k: float(v) for k, v in fields(line).items() if k.endswith("_ms")}
        printed = dict(re.findall(r"(\w+) / unpacked = ([\d.]+)", line))
        assert set(printed) == {"stdlib", "short"}, line
        for kind, ratio in printed.items():
            assert_printed_quotient(float(ratio), ms[f"{kind}_ms"], ms["unpacked_ms"], decimals=3, numerator_decimals=1,
                                    denominator_decimals=1, context=line)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_trains_the_adapters_a_closed_form_counts():
    """The tiny Llama (vocab 256) on data 2 x tensor 2: full fine-tuning trains every parameter, LoRA r4
    r·(in + out) per adapted matrix (q, k, v, o, gate, up, down of each layer); the ratio line is made of
    the contenders' own numbers."""
    done = run_script("bench.py", "lora", "--cpu_devices=4", "--mesh=data:2,tensor:2", "--zero_stage=1", "--rank=4",
                      "--steps=1", "--repeats=1", code=TINY + SWAP)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    m = tiny.llama().model
    h, f, q, kv = m.hidden_size, m.intermediate_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
    full = 2 * 256 * h + h + m.num_hidden_layers * (sum(i * o for i, o in layer.values()) + 2 * h)
    adapters = m.num_hidden_layers * sum(4 * (i + o) for i, o in layer.values())
    rows = {line.split()[0]: fields(line) for line in done.stdout.splitlines() if line.startswith("mode=")}
    assert int(rows["mode=full"]["trainable"].replace(",", "")) == full, rows
    assert int(rows["mode=lora4"]["trainable"].replace(",", "")) == adapters, rows
    ratio = numbers(next(line for line in done.stdout.splitlines() if line.startswith("lora4/full: total memory")))
    total = {mode: float(row["total_mib"]) for mode, row in rows.items()}
    # The MiB are printed to 0.1 and the ratio from the unrounded bytes: about 1 MiB each here.
    assert ratio[1] == pytest.approx(total["mode=lora4"] / total["mode=full"], abs=0.06), (ratio, total)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_cached_recomputed_and_transformers_agree():
    done = run_script("bench.py", "generate", "--new_tokens=4", "--batch=2", "--prompt_len=4", "--hidden=32", "--layers=1",
                      "--heads=2", "--kv_heads=1", "--vocab=64", "--repeats=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "greedy tokens equal to transformers: {'cached': True, 'recompute': True}" in done.stdout
    last = fields(done.stdout.strip().splitlines()[-1])
    rate = {name: float(last[f"{name}_tok_s"]) for name in ("cached", "recompute", "hf")}
    assert_printed_quotient(float(last["cached_vs_hf"].rstrip("x")), rate["cached"], rate["hf"], decimals=2,
                            numerator_decimals=1, denominator_decimals=1, context=last)
    assert last["batch"] == "2" and last["new"] == "4", last


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mesh_one_cold_run_without_maxtext():
    """maxtext_tiny on data 8, sequences cut to 32 tokens, 4 steps (the median is of the last): one fresh
    worker process, its tokens/s the batch's tokens over its step time, its first loss a uniform guess's."""
    done = run_script("bench.py", "mesh", "--mesh=dp8", "--steps=4", "--repeats=1", "--override=train.seq_len=32", timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("[1] dp8 remat=full jaxpar: "))
    result = json.loads(line.split(": ", 1)[1])
    assert "error" not in result, result
    assert_printed_quotient(result["tokens_per_s"], 8 * 32, result["median_step_s"], decimals=1, denominator_decimals=4,
                            context=result)
    assert result["first_loss"] == pytest.approx(math.log(256), abs=0.1) and result["compile_train_step_s"] > 0, result
    (row,) = [r for r in done.stdout.splitlines() if r.startswith("| dp8 | full | jaxpar |")]
    assert "| 1.00× |" in row and f"{result['tokens_per_s']:.0f} (" in row, row


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_and_dense_do_the_same_model_flops():
    """6 experts of 16, top-2, against a dense MLP of 2·16 + 6/3 = 34 units: the router's H·E and the
    experts' 3·H·k·F multiply-adds per token equal the dense MLP's 3·H·34, so both print the same model
    GFLOP per step; the last line's ratio is its GFLOP/s over each other."""
    done = run_script("bench.py", "moe", "--experts=6", "--top_k=2", "--expert_ffn=16", "--steps=1", "--repeats=1", timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    flops = {name: numbers(next(line for line in lines if line.startswith(f"{name}: ") and "model GFLOP" in line))[0]
             for name in ("moe", "dense")}
    assert flops["moe"] == flops["dense"], flops
    last = fields(lines[-1])
    assert_printed_quotient(float(last["ratio"]), float(last["moe_gflops"]), float(last["dense_gflops"]), decimals=2,
                            numerator_decimals=1, denominator_decimals=1, context=last)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_save_cost_per_storage(tmp_path):
    """Each storage's runs save steps // every times; the table's ratio is its time per step over none's."""
    disk, shm = tmp_path / "disk", tmp_path / "shm"
    disk.mkdir(), shm.mkdir()
    done = run_script("bench.py", "checkpoint", f"--dirs={shm},{disk}", "--steps=4", "--every=2", "--repeats=1", code=TINY + SWAP)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "storage" not in line
            and "---" not in line]
    assert [r[0].strip() for r in rows] == ["none", str(shm), str(disk)] and [int(r[3]) for r in rows] == [0, 2, 2]
    assert float(rows[0][1]) == float(rows[0][2]) == 0
    for row in rows[1:]:
        assert 0 < float(row[1]) <= float(row[2]), "a save blocks for part of the time it takes to complete"
    base = float(rows[0][5])
    for row in rows:
        assert_printed_quotient(float(row[6].strip().rstrip("x")), float(row[5]), base, decimals=2,
                                numerator_decimals=3, denominator_decimals=3, context=row)
    assert not list(disk.iterdir()) and not list(shm.iterdir()), "the bench leaves no checkpoint behind"


FAULTS_CONFIG = """
from tests.support import tiny
def get_config():
    c = tiny.llama(vocab_size=256)
    c.data.max_corpus_bytes = 100_000
    return c
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_faults_each_scenario_restarts_once_and_a_preemption_loses_nothing(tmp_path):
    """Theory: a SIGTERM saves a final checkpoint (nothing lost); a kill -9 after step 3 with checkpoints
    every 2 loses step 3's time; the uninterrupted run starts once, the others twice."""
    config = tmp_path / "config.py"
    config.write_text(FAULTS_CONFIG)
    done = run_script("bench.py", "faults", f"--train_config={config}", "--steps=5", "--every=2", "--at=3", "--local_every=1",
                      timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r[0].strip(): r for r in (line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| "))}
    assert [int(rows[n][1]) for n in ("none", "sigterm", "kill", "kill+local")] == [1, 2, 2, 2], done.stdout
    assert float(rows["none"][4]) == 0 and float(rows["sigterm"][4]) == 0, "nothing lost without a fault, or to a SIGTERM"
    assert float(rows["kill"][4]) > 0, "step 3 ran after checkpoint 2 and is redone"
    for name in ("none", "sigterm", "kill", "kill+local"):
        assert 0 < float(rows[name][2].strip().rstrip("%")) < 100


def test_window_table_rows_add_up():
    """bench.py window, in process at a tiny size: each speed-up is full causal's time over the row's,
    and the band equals the masked window (it computes the same attention, over less)."""
    from jaxpar.bench import window

    lines = window.bench(seq=64, window=8, heads=2, kv_heads=1, head_dim=8, repeats=1, tiles=[1, 2])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [r[0] for r in rows] == ["full causal (jaxpar_xla)", "window 8 as a mask (jaxpar_xla)",
                                    "window 8, band of 1 tile(s)", "window 8, band of 2 tile(s)"]
    full = float(rows[0][1])
    for name, seconds, speedup, difference in rows:
        assert float(speedup.rstrip("x")) == pytest.approx(full / float(seconds), rel=0.01, abs=0.01), name
        assert name.startswith("full") or float(difference) <= 1e-5, name
