"""Preflight within `shared_sections` (the planner's search) keeps the checks that read no layout
section once per mesh and train section (`preflight._section_checks`): every candidate still gets
exactly the lines a fresh preflight of it gives."""

from __future__ import annotations

from jaxpar.analysis.planner.candidates import Space, candidates
from jaxpar.command.config_file import load_config
from jaxpar.train.preflight import ConfigError, check, shared_sections
from tests.support.paths import REPO as ROOT


def _problems(config, n: int) -> str:
    try:
        check(config, n, keys_checked=True)
        return ""
    except ConfigError as e:
        return str(e)


def test_shared_preflight_answers_each_candidate_as_a_fresh_one():
    config = load_config(str(ROOT / "configs" / "mixtral_tiny.py"))  # 4 experts: the family's own check refuses mesh.expert=8
    memo, seen, differing = {}, set(), set()
    for candidate in candidates(config, 8, Space(microbatch_options=1)):
        key = (tuple(candidate.mesh.items()), candidate.get("train.grad_accum"), candidate.get("parallel.zero_stage"))
        if key in seen:  # the memo's key is the mesh and train; one candidate per key (and ZeRO stage) is enough
            continue
        seen.add(key)
        applied = candidate.apply(config)
        fresh = _problems(applied, 8)
        with shared_sections(config, memo):
            shared = _problems(applied, 8)
        assert shared == fresh, candidate.describe()
        differing.add(fresh.splitlines()[0] if fresh else "")
    assert "" in differing and any("num_local_experts" in line for line in differing)  # both outcomes, the mesh's own
