"""Other processes a test needs beside its own: a holder of a workdir's lock, a free port for a coordinator."""

import os
import socket
import subprocess
import sys

from jaxpar.train import workdir as workdirs

HOLD = """
import fcntl, json, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write(json.dumps({"host": "elsewhere", "pid": os.getpid(), "since": "then"})); f.flush()
print("locked", flush=True)
time.sleep(120)
"""


def hold_lock(workdir):
    """A live process holding `workdir`'s run lock (as another host's run would: it names host
    "elsewhere"); the caller kills it."""
    os.makedirs(workdir, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir / workdirs.LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
