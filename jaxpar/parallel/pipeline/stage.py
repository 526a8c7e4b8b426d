"""One pipeline stage's forward and recomputing backward, on one rank's slice of the model.

A stage is a run of consecutive decoder layers (the engine passes exactly the stage's n layers, a
static slice of its padded staged view; see `layout.py`). The embedding
and the LM head + loss are not part of any stage: every rank runs its vocab-parallel share of
them in the engine, outside the per-step branches (`vocab.py`).

A stage's output is its last layer's activations and, for MoE models, its router statistics
summed over its layers (`jaxpar.models.moe.router_statistics`; {} for dense models): the engine
accumulates those per microbatch, so the load-balancing and z losses see every layer.

Backwards recompute the stage forward from its stashed input with `jax.vjp`, differentiating
only what the action needs (a `BackBranch`): full B (params and input), split B (input only:
what the previous stage waits for), W (params; on the first stage also the input, for the
embedding's weight gradient). The cotangent is the output gradient plus the router statistics'
(the gradient of the aux losses with respect to this microbatch's totals).

The end stages may run more than layers (`Ends`, read off the model): the first one the blocks
the model keeps before its staged `layers` (DeepSeek-V3's leading dense layers: `Decoder.
run_stage`), the last one the multi-token prediction modules on its output with their losses
(`Decoder.predict_ahead`: embedding of the tokens ahead, module, the shared LM head; so it needs
the whole head, `parallel.pipeline_vocab="ends"`). Their weights sit in the shared params
(replicated over `pipeline`, never staged); the stage's backward differentiates them with the
layers (`EXTRAS`), and the engine adds those gradients to the shared ones. The modules' losses are
a third output whose cotangent is a constant (their weight in the loss), and their router
statistics join the stage's, so the microbatch's aux losses see them as one device does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.manual import vary_everywhere
from jaxpar.parallel.context.sequence import Ahead
from jaxpar.parallel.tensor import mean_cross_entropy

# The shared params each end stage's extra work reads (its backward differentiates them): the
# first stage's leading blocks; the last stage's prediction modules, the embedding of the tokens
# ahead and the LM head (the embedding's transpose when tied).
EXTRAS = {"first": ("dense_layers",), "last": ("mtp", "embed", "lm_head")}


@dataclass(frozen=True)
class StageModel:
    """What the pipeline needs of the model. The train step builds it from `jaxpar.models`
    (`jaxpar.train.step.stage_model`) and hands it in, so `jaxpar.parallel` never imports the
    models (which import it)."""

    merge: Callable  # params {"layers", "embed", ...} -> the module (`run_layers`, `final_norm`, `head_weight`, `logits_from_hidden`)
    logical: Any  # the params tree with each leaf's logical axis names
    aux_losses: Callable  # router statistics stacked over layers -> (extra loss, metrics); ({}: dense)
    hidden_size: int
    vocab_size: int
    embed_scale: float | None = None  # the embedded tokens' scale (`Decoder.embedding_scale`)
    logit_softcap: float | None = None  # the LM head logits' cap (`Decoder.final_logit_softcap`)


@dataclass(frozen=True)
class Ends:
    """What the end stages run besides their layers (see the module docstring)."""

    first_layers: bool = False  # the model's blocks before `layers` (run on the first stage)
    prediction_depth: int = 0  # multi-token prediction modules trained on the last stage (0: none)

    @staticmethod
    def of(model: StageModel, params, opts, train: bool) -> Ends:
        """Read off the model merged with `params` (a view); prediction only when training with a
        nonzero `train.mtp_loss_weight` (evaluation is the next-token loss alone)."""
        module = model.merge(params)
        depth = type(module).prediction_depth(module.cfg) if train and opts.mtp_loss_weight > 0 else 0
        return Ends(first_layers=module.dense_layers is not None, prediction_depth=depth)

    def extras(self, first: bool, last: bool) -> tuple:
        """The shared keys a stage's backward differentiates besides its layers."""
        keys = EXTRAS["first"] if first and self.first_layers else ()
        return keys + (EXTRAS["last"] if last and self.prediction_depth else ())


class Stage:
    """The forward and backward of a stage for one model and run options.

    `layer_params` is the `layers` subtree holding only this stage's layers [n, ...]; merged into
    the model's graph, the model's `run_layers` scans over exactly those. `shared`
    (embedding / norm / head, any shard of them) only completes the graph; stages never read it.
    """

    def __init__(self, model: StageModel, opts):
        self.merged = model.merge
        self.opts = opts

    def model(self, layer_params, shared):
        return self.merged({**shared, "layers": layer_params})

    def forward(self, layer_params, shared, x, positions, segment_ids=None, *, first=False):
        """(stage output [mb, S, D], router statistics summed over the stage's layers).
        `segment_ids` [mb, S]: packed documents (None: one sequence per row); `first`: the first
        stage (which runs the model's blocks before `layers`, if any)."""
        y, aux = self.model(layer_params, shared).run_stage(x, positions, self.opts, segment_ids, first=first)
        # Typed alike (varying over every manual axis), so cotangents and branch outputs match.
        return y, jax.tree.map(lambda a: vary_everywhere(jnp.sum(a, axis=0)), aux)

    def forward_predicting(self, layer_params, shared, x, positions, segment_ids, ahead: Ahead):
        """The last stage with multi-token prediction: (output, router statistics of its layers
        and the modules, each depth's mean loss [D]) for this microbatch's `ahead` [D, mb, S]."""
        model = self.model(layer_params, shared)
        y, aux = model.run_stage(x, positions, self.opts, segment_ids)
        aux = model.predict_ahead(y, ahead.tokens, positions, self.opts, segment_ids, aux)
        logits = aux.pop("ahead_logits")
        losses = jnp.stack([mean_cross_entropy(logits[k], ahead.targets[k], ahead.weights[k]) for k in range(len(logits))])
        return y, jax.tree.map(lambda a: vary_everywhere(jnp.sum(a, axis=0)), aux), vary_everywhere(losses)

    def backward(self, branch, layer_params, shared, x, positions, output_grad, stats_grad, segment_ids=None, *,
                 first=False, extras=(), ahead=None, loss_grad=None):
        """Recomputes the forward and pulls (output_grad, stats_grad[, loss_grad]) back. Returns
        (d layer_params | None, d x | None, d shared[extras] | None): only what the `BackBranch`
        asks for; the shared `extras` with the params. With `ahead`: `forward_predicting`, its
        losses' cotangent `loss_grad` [D]."""
        params = (layer_params, {k: shared[k] for k in extras if k in shared})
        primals = {0: params, 1: x}
        wrt = ([0] if branch.params else []) + ([1] if branch.inputs else [])

        def f(*diff):
            args = dict(primals) | dict(zip(wrt, diff))
            (layers, extra), h = args[0], args[1]
            full = {**shared, **extra}
            if ahead is None:
                return self.forward(layers, full, h, positions, segment_ids, first=first)
            return self.forward_predicting(layers, full, h, positions, segment_ids, ahead)

        out, pullback = jax.vjp(f, *(primals[i] for i in wrt))
        cotangents = (output_grad.astype(out[0].dtype), stats_grad) + (() if ahead is None else (loss_grad,))
        got = dict(zip(wrt, pullback(cotangents)))
        d_params = got.get(0)
        d_layers, d_extra = (None, None) if d_params is None else d_params
        return d_layers, got.get(1), d_extra or None
