"""Deterministic global batches, independent of mesh and process count.

`DocumentBatches` is what training reads: packed documents [G, 2, S+1] (`jaxpar.data.packing`)
from the training stream (`jaxpar.data.corpus`), made on the host one step ahead of the device by
a background thread. Every process packs the whole global batch (packing is sequential) and
hands its devices only their rows (`to_global`). Its checkpointed state is the step and the
packer's position, so a resumed run packs exactly the batches the run would have; a checkpoint
that holds only the step (written before documents) is replayed from the start.

`GlobalBatches` is the token stream as windows (random access, used by tests and tools): the
token stream is cut into non-overlapping windows of `seq_len + 1` tokens (inputs plus the targets
shifted by one); a trailing partial window is dropped. A grain MapDataset shuffles window indices with
`seed` and repeats, reshuffling each epoch, so element `i` of the infinite order is a pure function of
(tokens, seq_len, seed, i). Step k's global batch is elements `k*G .. k*G+G-1`; each process builds only
the rows its devices hold and `jax.make_array_from_process_local_data` assembles the global array.
The whole iteration state is therefore the step number.
"""

from __future__ import annotations

import queue
import threading

import grain
import jax
import numpy as np


class _Windows:
    """Random-access view of the token stream as windows, built lazily (tokens may be a memmap)."""

    def __init__(self, tokens: np.ndarray, width: int):
        self.tokens, self.width = tokens, width
        self.count = len(tokens) // width

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index) -> np.ndarray:
        start = int(index) * self.width
        return np.asarray(self.tokens[start : start + self.width], dtype=np.int32)


class GlobalBatches:
    """The [global_batch_size, seq_len + 1] int32 batch of every step; rows built on demand."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int):
        # Keep an np.memmap as is: windows are read lazily, never the whole file.
        tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"train.seq_len={seq_len} and train.global_batch_size={global_batch_size} must be >= 1")
        self.seq_len, self.global_batch_size, self.seed = int(seq_len), int(global_batch_size), int(seed)
        self.windows = _Windows(tokens, self.seq_len + 1)
        if len(self.windows) < self.global_batch_size:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens = {len(self.windows)} windows of "
                f"train.seq_len+1={self.seq_len + 1}, fewer than train.global_batch_size={self.global_batch_size}; "
                f"lower train.seq_len / train.global_batch_size or raise data.max_corpus_bytes (or use a bigger corpus)"
            )
        # shuffle(seed).repeat() reshuffles every epoch and stays random access (no iteration state).
        self.dataset = grain.MapDataset.source(self.windows).shuffle(seed=self.seed).repeat()

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.global_batch_size, self.seq_len + 1)

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of step `step`'s global batch, shape [stop - start, seq_len + 1] int32."""
        stop = self.global_batch_size if stop is None else stop
        if step < 0 or not 0 <= start <= stop <= self.global_batch_size:
            raise ValueError(
                f"rows(step={step}, {start}, {stop}): need step >= 0 and 0 <= start <= stop <= {self.global_batch_size}"
            )
        base = int(step) * self.global_batch_size
        out = np.empty((stop - start, self.seq_len + 1), dtype=np.int32)
        for r, j in enumerate(range(start, stop)):
            out[r] = self.dataset[base + j]
        return out


def process_rows(sharding: jax.sharding.Sharding, global_shape) -> tuple[int, int]:
    """The contiguous [start, stop) of batch rows (dim 0) held by this process's addressable devices."""
    size = int(global_shape[0])
    spans = sorted(
        {idx[0].indices(size)[:2] for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values()}
    )
    if not spans:
        raise ValueError(f"sharding {sharding} has no addressable devices in this process")
    start, stop = spans[0]
    for lo, hi in spans[1:]:
        if lo > stop:  # a gap: this process's rows are not one slice of the batch
            raise ValueError(
                f"this process's devices hold non-contiguous batch rows {spans} under {sharding}; order the mesh so "
                f"each process's devices are adjacent along the batch axes"
            )
        stop = max(stop, hi)
    return start, stop


def global_batch(batches: GlobalBatches, step: int, sharding: jax.sharding.Sharding) -> jax.Array:
    """Step `step`'s global batch as a jax.Array laid out by `sharding`; each process builds only its rows."""
    shape = batches.shape
    start, stop = process_rows(sharding, shape)
    local = batches.rows(step, start, stop)
    return jax.make_array_from_process_local_data(sharding, local, shape)


class BatchIterator:
    """Yields successive global batches; its checkpointable state is only {"step": k}.

    With `sharding=None` it yields the full batch as a host np.ndarray (single-process use, tests).
    """

    def __init__(self, batches: GlobalBatches, sharding: jax.sharding.Sharding | None = None, step: int = 0):
        self.batches, self.sharding, self.step = batches, sharding, int(step)

    def __iter__(self):
        return self

    def __next__(self):
        if self.sharding is None:
            batch = self.batches.rows(self.step)
        else:
            batch = global_batch(self.batches, self.step, self.sharding)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"BatchIterator.set_state: step must be >= 0, got {step}")
        self.step = step


def to_global(batch: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host batch every process holds whole, as a jax.Array laid out by `sharding` (each process
    hands over only its devices' rows)."""
    start, stop = process_rows(sharding, batch.shape)
    return jax.make_array_from_process_local_data(sharding, batch[start:stop], batch.shape)


class DocumentBatches:
    """The training batches of packed documents: an endless iterator of host arrays [G, 2, S+1]
    over `packer` (a `jaxpar.data.packing.Packer` on the training stream), the next one packed in
    a background thread while the device runs the current step. State: {"step", "packer"}."""

    def __init__(self, packer, step: int = 0, prefetch: bool = True):
        self.packer, self.step, self.prefetch = packer, int(step), prefetch
        self._queue, self._thread, self._state = None, None, None

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        # Each batch travels with the packer's state after it: the state of the batches consumed.
        while not stop.is_set():
            try:
                item = (next(self.packer), self.packer.get_state(), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                item = (None, None, e)
            out.put(item)
            if item[2] is not None:
                return

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread, self._queue = None, None

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if not self.prefetch:
            batch = next(self.packer)
            self._state = self.packer.get_state()
        else:
            if self._thread is None:
                self._start()
            batch, state, error = self._queue.get()
            if error is not None:  # the position stays after the last batch returned: a checkpoint may still be saved
                self.close()
                raise error
            self._state = state
        self.step += 1
        return batch

    def get_state(self) -> dict:
        """The position after the batches returned so far."""
        if self._state is None:
            return {"step": self.step, "packer": self.packer.get_state()}
        return {"step": self.step, "packer": self._state}

    def set_state(self, state: dict) -> None:
        self.close()
        target = int(state["step"])
        if "packer" in state:
            self.packer.set_state(state["packer"])
            self.step, self._state = target, state["packer"]
            return
        # A checkpoint from before documents: replay the batches from the start (exact, slower).
        for _ in range(target):
            next(self.packer)
        self.step, self._state = target, self.packer.get_state()
