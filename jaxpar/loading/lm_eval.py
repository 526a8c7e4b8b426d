"""lm-eval's `--model jaxpar`: registered when this module is imported (scripts/harness.py lm_eval
imports it first; lm-eval has no plugin discovery).

    --model jaxpar --model_args workdir=RUN[,step=N]      # or checkpoint=DIR, or from_hf=DIR
                                ,tensor=2,expert=1,data=4,max_length=...,max_gen_toks=...

The run is loaded (`jaxpar.loading.load.load`), then it is `jaxpar.downstream.model.JaxparLM`.
"""

from __future__ import annotations

from lm_eval.api.registry import register_model

from jaxpar.axes import DATA, EXPERT, TENSOR
from jaxpar.downstream.model import JaxparLM
from jaxpar.loading.load import load


@register_model("jaxpar")
class JaxparRunLM(JaxparLM):
    def __init__(self, workdir: str = "", checkpoint: str = "", step: int = -1, from_hf: str = "", *, data: int = 0,
                 tensor: int = 0, expert: int = 0, **options):  # batch_size, max_length, max_gen_toks; lm-eval's own
        loaded = load(str(workdir), str(checkpoint), int(step), str(from_hf), {DATA: data, TENSOR: tensor, EXPERT: expert})
        super().__init__(loaded, **options)
