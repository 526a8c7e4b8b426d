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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.manual import vary_everywhere


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

    def forward(self, layer_params, shared, x, positions, segment_ids=None):
        """(stage output [mb, S, D], router statistics summed over the stage's layers).
        `segment_ids` [mb, S]: packed documents (None: one sequence per row)."""
        y, aux = self.model(layer_params, shared).run_layers(x, positions, self.opts, segment_ids)
        # Typed alike (varying over every manual axis), so cotangents and branch outputs match.
        return y, jax.tree.map(lambda a: vary_everywhere(jnp.sum(a, axis=0)), aux)

    def backward(self, branch, layer_params, shared, x, positions, output_grad, stats_grad, segment_ids=None):
        """Recomputes `forward` and pulls (output_grad, stats_grad) back. Returns (d layer_params |
        None, d x | None): only what the `BackBranch` asks for."""
        primals = {0: layer_params, 1: x}
        wrt = ([0] if branch.params else []) + ([1] if branch.inputs else [])

        def f(*diff):
            args = dict(primals) | dict(zip(wrt, diff))
            return self.forward(args[0], shared, args[1], positions, segment_ids)

        (y, stats), pullback = jax.vjp(f, *(primals[i] for i in wrt))
        got = dict(zip(wrt, pullback((output_grad.astype(y.dtype), stats_grad))))
        return got.get(0), got.get(1)
