"""Weighted mixtures of document streams (`data.mixture`, `data.mixture_stages`), and streams read
one after another.

`MixtureStream`: the n-th document comes from source i with probability w_i / Σw: a uniform number
u_n, drawn from a generator seeded by (`train.seed`, n // BLOCK), falls in source i's share of
[0, 1). The order depends only on the seed, never on the mesh or on where a run was resumed. Weights
count documents, as in `datasets.interleave_datasets` and grain's mix: a source of long documents
contributes more tokens per draw than its weight says.

Stages (`data.mixture_stages`, Levanter's weights by step): the weights change at given train steps
(counted from 1, as in the logs; batch i is step i + 1's). The packer tells the stream which batch it
packs (`jaxpar.data.packing.StepStream`), and draw n uses the weights of that batch's stage with the
same u_n: every document that starts in step k's batch was drawn with step k's weights (a document
drawn for the batch before a switch that did not fit is put back and drawn again; only the rest of a
document longer than a row, begun before the switch, continues after it). Within a stage draws are
independent with the stage's probabilities.

The state is the number of draws, the batch being packed and every source's own state, all in every
checkpoint.

`ChainStream`: sources read one after the other (the eval set of a mixture: each source's
held-out documents, in source order).
"""

from __future__ import annotations

import bisect

import numpy as np

from jaxpar.data.packing import StepStream

BLOCK = 4096  # draws made at a time
_SALT = 0x6D6978  # separates the mixture's draws from other users of the seed


def _cdf(weights) -> np.ndarray:
    """Where each source's share of [0, 1) ends (numpy's `Generator.choice` arithmetic, so a mixture
    without stages draws what it drew before stages existed)."""
    cdf = (weights / weights.sum()).cumsum()
    return cdf / cdf[-1]


class MixtureStream(StepStream):
    def __init__(self, streams: list, weights: list[float], seed: int, stages: tuple = ()):
        """`weights`: one per stream, > 0, from step 1; `stages`: (step, weights) pairs after it, steps
        increasing from 2, weights >= 0 with some > 0."""
        weights = np.asarray(weights, np.float64)
        if len(streams) != len(weights) or not len(streams) or not np.all(np.isfinite(weights) & (weights > 0)):
            raise ValueError(f"a mixture needs one positive weight per source, got {weights.tolist()}")
        self.starts, self.cdfs = [1], [_cdf(weights)]
        for step, stage in stages:
            stage = np.asarray(stage, np.float64)
            if len(stage) != len(streams) or not np.all(np.isfinite(stage) & (stage >= 0)) or not stage.sum() > 0:
                raise ValueError(f"a stage needs one weight >= 0 per source, some > 0, got {stage.tolist()}")
            if int(step) <= self.starts[-1]:
                raise ValueError(f"stages start at increasing steps after step 1, got {step} after {self.starts[-1]}")
            self.starts.append(int(step))
            self.cdfs.append(_cdf(stage))
        self.streams, self.probabilities, self.seed = streams, weights / weights.sum(), int(seed)
        self.channels = max(getattr(s, "channels", 2) for s in streams)  # of the batches (`jaxpar.data.packing`)
        self.draws, self.batch = 0, 0
        self._block, self._uniforms, self._choices = -1, None, {}

    def stage_of(self, batch: int) -> int:
        """The stage (0: data.mixture's own weights) of batch `batch`, train step batch + 1."""
        return bisect.bisect_right(self.starts, batch + 1) - 1

    def begin_batch(self, index: int) -> bool:
        changed = self.stage_of(index) != self.stage_of(self.batch)
        self.batch = int(index)
        return changed

    def source_of(self, draw: int) -> int:
        """The source of draw number `draw`, with the weights of the batch being packed."""
        block = draw // BLOCK
        if block != self._block:
            self._uniforms = np.random.default_rng([self.seed, _SALT, block]).random(BLOCK)
            self._block, self._choices = block, {}
        stage = self.stage_of(self.batch)
        if stage not in self._choices:
            self._choices[stage] = self.cdfs[stage].searchsorted(self._uniforms, side="right")
        return int(self._choices[stage][draw % BLOCK])

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        tokens = next(self.streams[self.source_of(self.draws)])
        self.draws += 1
        return tokens

    def get_state(self) -> dict:
        return {"draws": self.draws, "batch": self.batch, "sources": [s.get_state() for s in self.streams]}

    def set_state(self, state: dict) -> None:
        self.draws, self.batch = int(state["draws"]), int(state.get("batch", 0))  # 0: a checkpoint from before stages
        for stream, saved in zip(self.streams, state["sources"], strict=True):
            stream.set_state(saved)


class ChainStream:
    def __init__(self, streams: list):
        self.streams, self.current = streams, 0
        self.channels = max(getattr(s, "channels", 2) for s in streams)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        while self.current < len(self.streams):
            try:
                return next(self.streams[self.current])
            except StopIteration:
                self.current += 1
        raise StopIteration

    def get_state(self) -> dict:
        return {"current": self.current, "sources": [s.get_state() for s in self.streams]}

    def set_state(self, state: dict) -> None:
        self.current = int(state["current"])
        for stream, saved in zip(self.streams, state["sources"], strict=True):
            stream.set_state(saved)
