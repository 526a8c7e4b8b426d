"""One pipeline stage's forward and recomputing backward, on one rank's slice of the model.

A stage is a run of consecutive decoder layers. The last global stage also runs the final norm,
LM head and loss, so the loss gradient is born on the rank that needs it and 1F1B can start a
microbatch's backward the step after its forward. The embedding is applied by the engine
outside the per-step branches (see `engine.py`); the first stage's backward only returns the
gradient of its input, which the engine pulls back into the embedding table. Embedding / head
parameters ("shared": every top-level param but `layers`) are replicated over `pipeline`.

Backwards recompute the stage forward from its stashed input with `jax.vjp`, differentiating
only what the action needs (a `BackBranch`): full B (params, head, input), split B (input only:
what the previous stage waits for), W (params and head only; on the first stage also the
input, for the embedding's weight gradient).
"""

from __future__ import annotations

import jax

from jaxpar import models
from jaxpar.parallel.tensor import mean_cross_entropy


class Stage:
    """The forward and backward of a stage for one model config and run options.

    `layer_params` is the `layers` subtree holding only this stage's layers [Lc, ...]; merged into
    the model's graph, the model's `run_layers` scans over exactly those.
    """

    def __init__(self, model_config, opts):
        self.cfg = models.frozen(model_config)
        self.opts = opts

    def _model(self, layer_params, shared):
        return models.merge(self.cfg, {**shared, "layers": layer_params})

    def embed(self, layer_params, shared, tokens):
        return self._model(layer_params, shared).embed_tokens(tokens, self.opts)

    def forward(self, last: bool, layer_params, shared, x, positions, targets):
        """The stage output [mb, S, D]; on the last stage the microbatch's mean loss (fp32)."""
        model = self._model(layer_params, shared)
        y, _ = model.run_layers(x, positions, self.opts)
        if not last:
            return y
        with jax.named_scope("loss"):
            return mean_cross_entropy(model.logits_from_hidden(y, self.opts), targets)

    def backward(self, branch, layer_params, shared, x, positions, targets, cotangent):
        """Recomputes `forward` and pulls `cotangent` back. Returns (d layer_params | None,
        d shared | None, d x | None, loss | None): only what the `BackBranch` asks for; the loss
        is the recomputed primal on the last stage."""
        primals = [layer_params, shared, x]
        wrt = ([0] + ([1] if branch.last else [])) if branch.params else []
        if branch.inputs:
            wrt.append(2)

        def f(*diff):
            args = list(primals)
            for i, d in zip(wrt, diff):
                args[i] = d
            return self.forward(branch.last, *args, positions, targets)

        out, pullback = jax.vjp(f, *(primals[i] for i in wrt))
        got = dict(zip(wrt, pullback(cotangent.astype(out.dtype))))
        return got.get(0), got.get(1), got.get(2), (out if branch.last else None)
