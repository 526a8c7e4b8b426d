"""What preflight says of a pipeline whose end stages run more than layers (`jaxpar.parallel.pipeline.stage.Ends`).

DeepSeek-V3's leading dense layers run on the first stage and are in no stage split; its
multi-token prediction modules run on the last stage with the whole LM head, so they need
`parallel.pipeline_vocab="ends"`. That these layouts train like one device is
tests/models/test_families_degeneracy.py's (the `*_dense_mtp*` cases).
"""

import pytest

from jaxpar.train.preflight import ConfigError, check
from tests.support import tiny


def _problems(config, devices: int) -> list[str]:
    try:
        check(config, devices)
    except ConfigError as e:
        return str(e).splitlines()
    return []


# A vocab the default byte tokenizer fits (preflight checks the data too).
VOCAB = 256


def _deepseek(layers: int = 3, **parallel):
    # 3 layers: one dense, then two routed (tests/support/tiny.py); one prediction module.
    return tiny.with_overrides(tiny.deepseek_v3(vocab_size=VOCAB, num_hidden_layers=layers), {"pipeline": 2},
                               parallel={"num_microbatches": 2, **parallel})


def test_dense_layer_and_prediction_module_pass_with_the_head_on_the_last_stage():
    assert _problems(_deepseek(pipeline_vocab="ends"), 2) == []


def test_prediction_with_a_spread_head_is_one_line_naming_the_key():
    problems = _problems(_deepseek(), 2)
    assert len(problems) == 1 and "parallel.pipeline_vocab='ends'" in problems[0], problems
    # Without the prediction loss the modules do not run: the spread head is fine.
    config = _deepseek()
    config.train.mtp_loss_weight = 0.0
    assert _problems(config, 2) == []


@pytest.mark.parametrize("split, ok", [("1,1", True), ("2,1", False)])
def test_an_explicit_split_counts_the_staged_layers_only(split, ok):
    problems = _problems(_deepseek(pipeline_vocab="ends", pipeline_stage_layers=split), 2)
    if ok:
        assert problems == []
    else:
        assert len(problems) == 1 and "sums to 3, not the 2 staged layers" in problems[0], problems


def test_too_few_staged_layers_for_the_stages():
    problems = _problems(_deepseek(layers=2, pipeline_vocab="ends"), 2)
    assert len(problems) == 1 and "the 1 staged layers" in problems[0] and "cannot fill" in problems[0], problems


def test_dense_layers_among_moe_layers_are_still_refused():
    config = tiny.with_overrides(tiny.qwen3_moe(vocab_size=VOCAB, num_hidden_layers=3, mlp_only_layers=[1]), {"pipeline": 2},
                                 parallel={"num_microbatches": 2})
    problems = _problems(config, 2)
    assert len(problems) == 1 and "mlp_only_layers" in problems[0], problems
