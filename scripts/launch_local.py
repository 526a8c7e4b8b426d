"""Run one command as N cooperating JAX processes on this machine (CPU devices), like a small cluster.

  python scripts/launch_local.py --processes=2 --devices_per_process=4 -- \
      python scripts/train.py --config=configs/llama_tiny.py --workdir=/tmp/run

Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES, JAX_PROCESS_ID
(read by `jaxpar.distributed.initialize`), JAX_PLATFORMS=cpu and JAX_NUM_CPU_DEVICES (read by JAX).
Output lines are prefixed with `[i]`. If a process fails, one line names it and why (killed by which
signal, or what its exit code means), the others are terminated (SIGTERM, then SIGKILL after
GRACE_S); the exit status is the first failure's (or 0; a signal N as the shell's 128 + N).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

# Kept equal to jaxpar.distributed's names; this script does not import jaxpar (it may run from anywhere).
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
GRACE_S = 10.0  # between SIGTERM and SIGKILL for the survivors of a failed run
# scripts/train.py's exit codes (its docstring); kept here because this script does not import jaxpar.
EXIT_MEANINGS = {
    1: "a checkpoint could not be written or read",
    2: "bad input",
    3: "stopped for non-finite values",
    4: "it lost another process",
    130: "interrupted by SIGINT",
    143: "interrupted by SIGTERM",
}


def describe_exit(returncode: int) -> str:
    """"was killed by SIGKILL", "exited with 2 (bad input)", ..."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}" + (" (out of memory? a kill -9? a lost node?)" if name == "SIGKILL" else "")
    meaning = EXIT_MEANINGS.get(returncode)
    return f"exited with {returncode}" + (f" ({meaning})" if meaning else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, port: int, processes: int, index: int, devices: int) -> dict:
    env = dict(base)
    # A forced host device count in XLA_FLAGS (tests set one) would contradict JAX_NUM_CPU_DEVICES.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(
        {
            COORDINATOR_ENV: f"127.0.0.1:{port}",
            NUM_PROCESSES_ENV: str(processes),
            PROCESS_ID_ENV: str(index),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(devices),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _pump(index: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(command: list[str], processes: int, devices_per_process: int, env: dict | None = None) -> int:
    """Runs `command` as `processes` processes; returns the first nonzero exit status, or 0."""
    base = dict(os.environ if env is None else env)
    port = free_port()
    lock = threading.Lock()
    procs, pumps = [], []
    for i in range(processes):
        p = subprocess.Popen(
            command,
            env=process_env(base, port, processes, i, devices_per_process),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        procs.append(p)
        pumps.append(threading.Thread(target=_pump, args=(i, p.stdout, lock), daemon=True))
        pumps[-1].start()
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                with lock:
                    print(
                        f"[launch_local] process {procs.index(failed[0])} {describe_exit(status)}; stopping the others",
                        flush=True,
                    )
                _stop(procs)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    for t in pumps:
        t.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return status


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: launch_local.py --processes=N --devices_per_process=D -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error(f"--processes={args.processes} and --devices_per_process={args.devices_per_process} must be >= 1")
    status = launch(command, args.processes, args.devices_per_process)
    return status if status >= 0 else 128 - status  # killed by signal N: the shell's 128 + N


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
