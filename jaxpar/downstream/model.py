"""jaxpar as an lm-eval model, over params already on a mesh (`jaxpar.sampling.load.Loaded`).

    lm = JaxparLM(Loaded(...))               # the training loop's params, or `jaxpar.loading.load(...)`
    lm_eval.simple_evaluate(model=lm, tasks=[...], task_manager=TaskManager(include_path=...))

Registered for lm-eval's own command line as `jaxpar` by `jaxpar.loading.lm_eval`, which loads a
workdir, a checkpoint or a transformers directory first (`--model jaxpar --model_args workdir=RUN`).

It subclasses lm-eval's `TemplateLM`, so a (context, continuation) pair is split into token ids by
lm-eval's own code (trailing spaces moved to the continuation, an empty context replaced by the
prefix token); `tok_encode` and the prefix / end tokens, the left cut of long inputs (to
`max_length`, default model.max_position_embeddings), the rolling windows and the stop sequences
follow lm-eval's transformers backend, so the two give the same numbers on the same checkpoint.
Scoring is `jaxpar.downstream.scoring`; generation is the KV-cache sampler, greedy unless a task
asks for `do_sample` (then temperature / top_k / top_p from its generation kwargs, seed 0).
Requests are not grouped by shared context (lm-eval's one-token-continuation cache): each is scored.
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.downstream.scoring import Scorer, generate
from jaxpar.sampling.filters import SamplingParams

DEFAULT_ROWS = 16
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's transformers backend's


def _rows(batch_size) -> int:
    """lm-eval's --batch_size: an int, or "auto" / "auto:N" / None (then the default)."""
    try:
        return max(1, int(batch_size))
    except (TypeError, ValueError):
        return DEFAULT_ROWS


class JaxparLM(TemplateLM):
    def __init__(self, loaded, *, batch_size=DEFAULT_ROWS, max_length: int = 0, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 **_lm_eval_extras):  # device, max_batch_size: lm-eval's, unused here
        super().__init__()
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source} has no tokenizer; lm-eval's tasks are text")
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.params, self.sampler = loaded.params, loaded.sampler
        self._max_length = int(max_length) or int(loaded.model_config.max_position_embeddings)
        self._max_gen_toks, self.rows = int(max_gen_toks), _rows(batch_size)
        self.scorer = Scorer(self.sampler, self._max_length, self.rows)
        self.is_bytes = isinstance(self.tokenizer, ByteTokenizer)

    # -- what lm-eval asks of a TemplateLM ------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.loaded.eos_id if self.loaded.eos_id is not None else 0  # a byte run without EOS: the NUL byte

    @property
    def prefix_token_id(self) -> int:
        bos = None if self.is_bytes else self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return "bytes" if self.is_bytes else getattr(self.tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        if self.is_bytes:
            return [int(t) for t in self.tokenizer.encode(string)]
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kwargs["add_special_tokens"] = False  # the text already starts with BOS
        return list(self.tokenizer.encode(string, **kwargs))

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.is_bytes:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
        results = self.scorer.loglikelihoods(self.params, [(context, continuation) for _, context, continuation in requests])
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for pair in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(pair))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.scorer.loglikelihoods(self.params, windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str | None] = [None] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new_tokens = int(kwargs.pop("max_gen_toks"))
            if new_tokens >= self.max_length:
                raise ValueError(f"max_gen_toks={new_tokens} must be below the model's max_length={self.max_length}")
            prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens):] or [self.prefix_token_id]
                       for i in members]
            sampling = SamplingParams(float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                                      int(kwargs.get("top_k", 0) or 0), float(kwargs.get("top_p", 1.0) or 1.0))
            completions = generate(self.sampler, self.params, prompts, new_tokens, self.loaded.eos_id, self.rows, sampling)
            for i, completion in zip(members, completions):
                text = postprocess_generated_text(self.tok_decode(completion), until, None)
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results
