"""One pipeline stage's forward and recomputing backward, on one rank's slice of the model.

A stage is a run of consecutive decoder layers. The first global stage also embeds the tokens
and the last one also runs the final norm, LM head and loss, so the loss gradient is born on the
rank that needs it and 1F1B can start a microbatch's backward the step after its forward.
Embedding and head parameters ("shared": every top-level param but `layers`) are replicated over
`pipeline`; only the first / last stage produce gradients for them.

Backwards recompute the stage forward from its stashed input with `jax.vjp`, differentiating
only what the action needs: full B (params, shared, input), split B (input only: what the
previous stage waits for), W (params and shared only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import models
from jaxpar.parallel.pipeline_plan import FIRST, LAST, MIDDLE
from jaxpar.train.loss import mean_cross_entropy


class Stage:
    """Forward functions of the three stage kinds for one model config and run options.

    `layer_params` is the `layers` subtree holding only this stage's layers [Lc, ...]; merged into
    the model's graph, the model's `run_layers` scans over exactly those.
    """

    def __init__(self, model_config, opts):
        self.cfg = models.frozen(model_config)
        self.opts = opts
        self.graph = models.graphdef(self.cfg)

    def _model(self, layer_params, shared):
        return nnx.merge(self.graph, {**shared, "layers": layer_params})

    def forward(self, kind: int, layer_params, shared, x, tokens):
        """FIRST/MIDDLE: the stage output [mb, S, D]. LAST: the microbatch's mean loss (fp32).
        `tokens` is the microbatch [mb, S + 1] (inputs then shifted targets)."""
        model = self._model(layer_params, shared)
        if kind == FIRST:
            x = model.embed_tokens(tokens[:, :-1], self.opts)
        y, _ = model.run_layers(x, self.opts)
        if kind != LAST:
            return y
        return mean_cross_entropy(model.logits_from_hidden(y, self.opts), tokens[:, 1:])

    def backward(self, kind: int, layer_params, shared, x, tokens, cotangent, *, params: bool, inputs: bool):
        """Recomputes `forward` and pulls `cotangent` back. Returns (d layer_params | None,
        d shared | None, d x | None, loss | None): only what `params` / `inputs` ask for; the
        loss is the recomputed primal on the LAST stage."""
        primals = [layer_params, shared, x]
        wrt = []
        if params:
            wrt.append(0)
            if kind != MIDDLE:  # middle stages never touch embedding / head
                wrt.append(1)
        if inputs and kind != FIRST:  # stage 0's input is tokens
            wrt.append(2)

        def f(*diff):
            args = list(primals)
            for i, d in zip(wrt, diff):
                args[i] = d
            return self.forward(kind, *args, tokens)

        out, pullback = jax.vjp(f, *(primals[i] for i in wrt))
        got = dict(zip(wrt, pullback(cotangent.astype(out.dtype))))
        loss = out if kind == LAST else None
        return got.get(0), got.get(1), got.get(2), loss


def zeros_f32(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
