"""Files a test writes for a run to read: a text file (a config, a corpus) and a token file with its sidecar."""

import json
import os

import numpy as np


def write(path, text) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def tokens(path, ids, dtype="uint16", sidecar=None) -> str:
    np.asarray(ids, dtype).tofile(path)
    if sidecar is not None:
        write(str(path) + ".json", json.dumps({"dtype": dtype, "num_tokens": len(ids), **sidecar}))
    return str(path)
