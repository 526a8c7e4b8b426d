"""The probe's mixtures (`data.mixture`, flag and list forms, and its stages) and eval sets (`eval.*`): each bad input
through scripts/train.py's `main`, in this process, refused before anything is compiled or written
with one line naming the key, the mixture entry (`data.mixture[i]`) or the eval file and its line
(`tests/train/probe.py` checks the contract)."""

import pytest

from tests.train.probe import Probe

NOT_UTF8 = b'{"text": "caf\xe9"}'


def mixture(value: str, *extra: str) -> tuple:
    return ("--config.data.source=text", f"--config.data.mixture={value}", *extra)


def stages(t, value: str, named: bool = False) -> tuple:
    """A mixture of two sources (named a and b, or unnamed) with `--config.data.mixture_stages=value`."""
    entries = f"[{{'path': '{t.a()}', 'weight': 1, 'name': 'a'}}, {{'path': '{t.b()}', 'weight': 1, 'name': 'b'}}]"
    return mixture(entries if named else f"{t.a()}:1,{t.b()}:2", f"--config.data.mixture_stages={value}")


def with_eval(t, path: str, *extra: str) -> tuple:
    return ("--config.data.source=text", f"--config.data.path={t.records('train.jsonl', 400)}", f"--config.eval.path={path}", *extra)


# (id, make(t) -> (train.py flags, words the one line must hold))
CASES = [
    # -- weights
    ("weight_nan", lambda t: (mixture(f"{t.a()}:1,{t.b()}:nan"), "data.mixture[1].weight=nan must be a finite number > 0")),
    ("weight_inf", lambda t: (mixture(f"{t.a()}:inf,{t.b()}:1"), "data.mixture[0].weight=inf must be a finite number > 0")),
    ("weight_minus_inf", lambda t: (mixture(f"{t.a()}:1,{t.b()}:-inf"), "data.mixture[1].weight=-inf")),
    ("weight_negative", lambda t: (mixture(f"{t.a()}:1,{t.b()}:-2"), "data.mixture[1].weight=-2.0")),
    ("weight_word", lambda t: (mixture(f"{t.a()}:1,{t.b()}:heavy"), "data.mixture entry 1")),
    ("weight_missing", lambda t: (mixture(f"{t.a()}:1,{t.b()}"), "is not PATH:WEIGHT")),
    ("path_missing", lambda t: (mixture(f"{t.a()}:1,:2"), "data.mixture entry 1 ':2' is not PATH:WEIGHT")),
    ("list_weight_bool", lambda t: (mixture(f"[{{'path': '{t.a()}', 'weight': True}}]"), "data.mixture[0].weight=True")),
    ("list_no_weight", lambda t: (mixture(f"[{{'path': '{t.a()}'}}]"), "data.mixture[0]=")),
    ("list_unknown_key", lambda t: (mixture(f"[{{'path': '{t.a()}', 'weight': 1, 'shuffle': True}}]"),
                                    "data.mixture[0] has unknown key(s) shuffle")),
    ("list_bad_source", lambda t: (mixture(f"[{{'path': '{t.a()}', 'weight': 1}}, {{'path': '{t.b()}', 'weight': 1, 'source': 'web'}}]"),
                                   "data.mixture[1].source='web'")),
    ("not_a_list", lambda t: (mixture("[1, 2"), "--config.data.mixture='[1, 2' is not a list")),
    ("and_data_path", lambda t: (mixture(f"{t.a()}:1,{t.b()}:1", f"--config.data.path={t.a()}"), "data.mixture are both set")),
    # -- stages (data.mixture_stages)
    ("stages_at_step_one", lambda t: (stages(t, "[[1, [1, 2]]]"), "data.mixture_stages[0] starts at step 1; data.mixture's own")),
    ("stages_not_increasing", lambda t: (stages(t, "[[10, [1, 2]], [10, [2, 1]]]"), "data.mixture_stages[1] starts at step 10; "
                                                                                     "the stage before starts at step 10")),
    ("stages_float_step", lambda t: (stages(t, "[[10.5, [1, 2]]]"), "data.mixture_stages[0] starts at step 10.5")),
    ("stages_wrong_length", lambda t: (stages(t, "[[10, [1, 2, 3]]]"), "gives 3 weights for data.mixture's 2 entries")),
    ("stages_negative", lambda t: (stages(t, "[[10, [1, -1]]]"), "the weight -1 of data.mixture[1] must be a finite number >= 0")),
    ("stages_all_zero", lambda t: (stages(t, "[[10, [0, 0.0]]]"), "data.mixture_stages[0] weighs every data.mixture entry 0")),
    ("stages_not_pairs", lambda t: (stages(t, "1000:1,3"), "data.mixture_stages[0]='1000:1' must be [STEP, WEIGHTS]")),
    ("stages_unnamed_entries", lambda t: (stages(t, "[[10, {'web': 1}]]"), "data.mixture_stages[0] weighs 'web', which names no")),
    ("stages_unknown_name", lambda t: (stages(t, "[[10, {'a': 1, 'web': 1}]]", named=True), "weighs 'web', which names no data.mixture "
                                                                                            "entry (names: 'a', 'b')")),
    ("stages_name_left_out", lambda t: (stages(t, "[[10, {'a': 1}]]", named=True), "data.mixture_stages[0] leaves out 'b'")),
    ("stages_without_mixture", lambda t: (("--config.data.source=text", f"--config.data.path={t.a()}",
                                           "--config.data.mixture_stages=[[10, [1]]]"), "data.mixture_stages is set but data.mixture")),
    ("name_repeated", lambda t: (mixture(f"[{{'path': '{t.a()}', 'weight': 1, 'name': 'x'}}, {{'path': '{t.b()}', 'weight': 1, "
                                         f"'name': 'x'}}]"), "data.mixture[1].name='x' is also data.mixture[0]'s")),
    # -- the sources of a mixture, each named by its entry
    ("entry_missing_file", lambda t: (mixture(f"{t.a()}:1,{t.root / 'gone.jsonl'}:1"), "data.mixture[1].path=")),
    ("entry_bad_record", lambda t: (mixture(f"{t.a()}:1,{t.records('b.jsonl', bad={9: NOT_UTF8})}:1"),
                                    "data.mixture[1].path: ")),
    ("entry_tokens_dtype", lambda t: (mixture(f"[{{'path': '{t.a()}', 'weight': 1}}, {{'path': '{t.token_file()}', 'weight': 1, "
                                              f"'source': 'tokens', 'token_dtype': 'uint32'}}]"), "says data.mixture[1].path='")),
    ("entry_datasets_empty", lambda t: (mixture(f"[{{'path': '{t.a()}', 'weight': 1}}, {{'path': '{t.write('e.jsonl', '')}', "
                                                f"'weight': 1, 'source': 'datasets'}}]"), "data.mixture[1].path: ")),
    # -- eval sets
    ("eval_share_one", lambda t: (("--config.eval.share=1.0",), "eval.share=1.0")),
    ("eval_share_negative", lambda t: (("--config.eval.share=-0.1",), "eval.share=-0.1")),
    ("eval_steps_negative", lambda t: (("--config.eval.share=0.2", "--config.eval.steps=-1"), "eval.steps=-1")),
    ("eval_every_negative", lambda t: (("--config.eval.share=0.2", "--config.eval.every_steps=-5"), "eval.every_steps=-5")),
    ("eval_every_without_set", lambda t: (("--config.eval.every_steps=10",), "eval.every_steps=10 but there is no eval set")),
    ("eval_both", lambda t: (with_eval(t, t.records("ev.jsonl"), "--config.eval.share=0.1"), "are both set; hold out one way")),
    ("eval_empty_file", lambda t: (with_eval(t, t.write("ev.jsonl", "")), "holds no document of 2 or more tokens")),
    ("eval_datasets_empty", lambda t: (with_eval(t, t.write("ev.jsonl", ""), "--config.data.source=datasets"),
                                       "eval.path: ")),
    ("eval_datasets_txt", lambda t: (with_eval(t, t.write("ev.txt", "hello there"), "--config.data.source=datasets"),
                                     "matches files of unknown format .txt")),
    ("eval_late_no_field", lambda t: (with_eval(t, t.records("ev.jsonl", 3000, bad={2999: b'{"body": 1}'})),
                                      "eval.path: ")),
    ("eval_late_not_utf8", lambda t: (with_eval(t, t.records("ev.jsonl", 3000, bad={2500: NOT_UTF8}), "--config.data.source=datasets"),
                                      "ev.jsonl line 2500 is not UTF-8")),
    ("eval_parquet_null_late", lambda t: (with_eval(t, t.parquet("ev.parquet", {"text": ["a b c"] * 4999 + [None]}),
                                                    "--config.data.source=datasets"), "ev.parquet record 5000 has no 'text' field")),
    ("eval_tokens_dtype", lambda t: (("--config.data.source=tokens", f"--config.data.path={t.token_file()}",
                                      f"--config.eval.path={t.token_file('ev.bin', 'uint32')}"), "says eval.path='")),
    ("eval_too_few_batches", lambda t: (with_eval(t, t.records("ev.jsonl", 3), "--config.eval.steps=50"), "fewer than eval.steps=50")),
    ("eval_share_holds_nothing", lambda t: (("--config.data.source=text", f"--config.data.path={t.records('a.jsonl', 400)}",
                                             "--config.eval.share=1e-9"), "held out holds no document")),
]


class MixtureProbe(Probe):
    def a(self) -> str:
        return self.records("a.jsonl", 400)

    def b(self) -> str:
        return self.records("b.jsonl", 400)

    def token_file(self, name: str = "t.bin", dtype: str = "uint16") -> str:
        """1088 ids of `dtype` with their sidecar."""
        return self.tokens(name, [5] * 1088, dtype, sidecar={})


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_mixture_or_eval_set_is_one_line_before_anything_is_written(case, tmp_path, capsys, monkeypatch):
    t = MixtureProbe(tmp_path, capsys, monkeypatch)
    extra, expected = case[1](t)
    t.refused("train", t.train(*extra), expected)
