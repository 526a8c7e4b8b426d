"""Weighted mixtures of document streams (`data.mixture`), and streams read one after another.

`MixtureStream`: the n-th document comes from source i with probability w_i / Σw, drawn from a
generator seeded by (`train.seed`, n // BLOCK): the order depends only on the seed, never on the
mesh or on where a run was resumed. Weights count documents, as in `datasets.interleave_datasets`
and grain's mix: a source of long documents contributes more tokens per draw than its weight says.
The state is the number of draws and every source's own state, all in every checkpoint.

`ChainStream`: sources read one after the other (the eval set of a mixture: each source's
held-out documents, in source order).
"""

from __future__ import annotations

import numpy as np

BLOCK = 4096  # draws made at a time
_SALT = 0x6D6978  # separates the mixture's draws from other users of the seed


class MixtureStream:
    def __init__(self, streams: list, weights: list[float], seed: int):
        weights = np.asarray(weights, np.float64)
        if len(streams) != len(weights) or not len(streams) or not np.all(np.isfinite(weights) & (weights > 0)):
            raise ValueError(f"a mixture needs one positive weight per source, got {weights.tolist()}")
        self.streams, self.probabilities, self.seed = streams, weights / weights.sum(), int(seed)
        self.draws, self._block, self._choices = 0, -1, None

    def source_of(self, draw: int) -> int:
        """The source of draw number `draw`."""
        block = draw // BLOCK
        if block != self._block:
            rng = np.random.default_rng([self.seed, _SALT, block])
            self._choices, self._block = rng.choice(len(self.streams), size=BLOCK, p=self.probabilities), block
        return int(self._choices[draw % BLOCK])

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        tokens = next(self.streams[self.source_of(self.draws)])
        self.draws += 1
        return tokens

    def get_state(self) -> dict:
        return {"draws": self.draws, "sources": [s.get_state() for s in self.streams]}

    def set_state(self, state: dict) -> None:
        self.draws = int(state["draws"])
        for stream, saved in zip(self.streams, state["sources"], strict=True):
            stream.set_state(saved)


class ChainStream:
    def __init__(self, streams: list):
        self.streams, self.current = streams, 0

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
