"""One process of a multi-process run on this machine (used by tests/distributed/test_multiprocess.py).

Usage: python multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS OUT_JSON
Builds this process's rows of two global batches, runs two training steps on a data × tensor mesh
over all processes' devices, and writes the batch checksums and losses (process 0 only). `run` is
also called in-process by the test for the one-process reference.
"""

import json
import sys

import jax
import jax.numpy as jnp

if __name__ == "__main__":
    port, num_processes, process_id, local_devices, out = sys.argv[1:6]
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(local_devices))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(num_processes), process_id=int(process_id))

from jaxpar.data import GlobalBatches, global_batch, load_tokens
from jaxpar.train.setup import build
from tests.support import tiny


def run(config):
    """Checksums, locally held row counts and losses of two steps on all devices of all processes."""
    batches = GlobalBatches(load_tokens(config.data), config.train.seq_len, config.train.global_batch_size, config.train.seed)
    program = build(config)
    checksum = jax.jit(lambda b: jnp.sum(b * (1 + jnp.arange(b.shape[0]))[:, None]), out_shardings=program.rules.sharding(()))
    state, result = program.init(), {"checksums": [], "losses": [], "local_rows": []}
    for step in range(2):
        batch = global_batch(batches, step, program.batch_sharding)
        result["checksums"].append(int(checksum(batch)))
        result["local_rows"].append(sum(s.data.shape[0] for s in batch.addressable_shards if s.replica_id == 0))
        state, metrics = program.step(state, batch)
        result["losses"].append(float(metrics["loss"]))
    return result


def multiprocess_config():
    config = tiny.with_overrides(tiny.llama(vocab_size=256), {"data": 4, "tensor": 2}, data={"max_corpus_bytes": 100_000})
    return config


if __name__ == "__main__":
    result = run(multiprocess_config())
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
