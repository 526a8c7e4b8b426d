"""Local lm-eval tasks for the harness tests, made on the spot (no hub): lm-eval's own YAML format over
jsonl files (`dataset_path: json`, `dataset_kwargs.data_files`), words from the test tokenizer's corpus.

- `jaxpar_mc`: multiple choice, 10 questions of 4 choices (acc, acc_norm); one question is longer than
  the models' 128 positions, so its inputs are cut from the left;
- `jaxpar_gen`: greedy generation of up to 12 tokens, stopping at "brown" or "lazy" (exact_match);
- `jaxpar_rolling`: the log-likelihood of whole texts, two of them longer than one window (perplexities).
"""

from __future__ import annotations

import json
import os

import numpy as np

from tests.support.documents import WORDS

MC, GEN, ROLLING = "jaxpar_mc", "jaxpar_gen", "jaxpar_rolling"
TASKS = (MC, GEN, ROLLING)


def _words(rng, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(low, high + 1))))


def write_tasks(folder) -> str:
    """The three tasks' YAML and data files in `folder`; returns it (lm-eval's include_path)."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    questions = [dict(question=_words(rng, 150, 150) if i == 3 else _words(rng, 3, 12),
                      choices=[_words(rng, 1, 3) for _ in range(4)], answer=int(rng.integers(4))) for i in range(10)]
    texts = [dict(text=_words(rng, 5, 20)) for _ in range(3)] + [dict(text=_words(rng, 200, 260)) for _ in range(2)]
    _jsonl(os.path.join(folder, "questions.jsonl"), questions)
    _jsonl(os.path.join(folder, "texts.jsonl"), texts)
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    mc = common.format(data=os.path.join(folder, "questions.jsonl")) + (
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    gen = common.format(data=os.path.join(folder, "questions.jsonl")) + (
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{choices[0]}}"\n'
        'generation_kwargs:\n  until: ["brown", "lazy"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    rolling = common.format(data=os.path.join(folder, "texts.jsonl")) + (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    for name, body in ((MC, mc), (GEN, gen), (ROLLING, rolling)):
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(f"task: {name}\n" + body)
    return folder


def _jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def hf_checkpoint(folder) -> str:
    """A random Llama (GQA, untied, vocab 300, 128 positions) and a local BPE tokenizer saved together."""
    from tests.support.documents import make_tokenizer
    from tests.support.hf_models import llama_model

    folder = os.fspath(folder)
    make_tokenizer(folder, vocab_size=120)
    llama_model("gqa_untied").save_pretrained(folder)
    return folder
