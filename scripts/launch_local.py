"""Run one command as N cooperating JAX processes on this machine (CPU devices), like a small cluster.

  python scripts/launch_local.py --processes=2 --devices_per_process=4 -- \
      python scripts/train.py --config=configs/llama_tiny.py --workdir=/tmp/run

Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES, JAX_PROCESS_ID
(read by `jaxpar.distributed.initialize`), JAX_PLATFORMS=cpu and JAX_NUM_CPU_DEVICES (read by JAX).
Output lines are prefixed with `[i]`; Gloo's lines announcing that a process connected to all its
peers are left out (a connection short of its peers is kept). If a process fails, one line names it
and why (killed by which signal, or what its exit code means), the others are terminated (SIGTERM,
then SIGKILL after GRACE_S); the exit status is the first failure's (or 0; a signal N as the shell's
128 + N).

With `--max_restarts=N`, a failure a restart can mend relaunches every process, after `--backoff_s`
seconds (doubled at each restart, at most MAX_BACKOFF_S), up to N times; each start of scripts/train.py
resumes from the newest complete checkpoint and prints what the fault cost (`jaxpar.train.goodput`).
The exit code decides (scripts/train.py's docstring): bad input (2) and a non-finite stop (3) fail again
the same way, and an interrupt (130: a person's Ctrl-C) is a decision, so these end the launcher at
once; anything else — a process killed (a lost node, kill -9, the OOM killer), a lost peer (4), JAX's
fatal exit when process 0 died (134), a preemption's SIGTERM (143), a checkpoint that could not be
written or read (1) — is retried.

With `--elastic --hosts_file=FILE` the run is elastic: FILE holds how many processes may run now
(what a cluster's scheduler knows as its healthy hosts; at most --processes). Every (re)launch reads
it, so a restart after a lost process runs on the processes that are left; while a run goes on, a
count that grows stops it at a checkpoint (SIGTERM: scripts/train.py saves and exits) and relaunches
it on more. Growing back is not a fault and uses no restart. Every process gets
JAXPAR_ELASTIC_DEVICES = the full size (--processes x --devices_per_process), which scripts/train.py
reads as `--elastic_devices`: on fewer devices, with `mesh.data=-1` (the default), the data axis
takes the devices there are and the microbatch count grows by the factor the replicas shrank
(`jaxpar.train.elastic`), so the global batch, each device's rows and the data position stay; with
`--plan` the planner lays the run out again instead.

This is for trying multi-process runs, not for speed: the processes' collectives go through Gloo over
TCP on one machine instead of within one process, so a step takes longer than in one process with all
the devices (1.5-2x for configs/llama_tiny.py, 2 x 4 against 1 x 8 devices, on a shared 2-core host).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar import command
from jaxpar.command import Command, Flag

# Kept equal to jaxpar.distributed's and jaxpar.train.elastic's names, which would import JAX into this launcher.
ELASTIC_ENV = "JAXPAR_ELASTIC_DEVICES"
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
GRACE_S = 10.0  # between SIGTERM and SIGKILL for the survivors of a failed run
GROW_GRACE_S = 600.0  # for a run stopped to grow: its final checkpoint must be written
MAX_BACKOFF_S = 60.0
# Exit codes a restart cannot mend: bad input, a non-finite stop, a person's Ctrl-C.
NOT_RETRIED = (2, 3, 130)
# scripts/train.py's exit codes (its docstring).
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


# Gloo (the CPU collectives' transport) prints to stdout, from C++ and from several threads, a line per
# process and communicator as it connects:
#   "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"
# Threads cut into each other's lines and into the program's own, so its pieces are taken out wherever
# they are in a line; a whole message whose counts differ (a connection short of its peers) is kept.
CONNECTED, EXPECTED = r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. ?", r"Expected number of connected peer ranks is : (\d+)"
GLOO = re.compile(f"(?P<whole>{CONNECTED}{EXPECTED})|{CONNECTED}|{EXPECTED}")
SLOWER = ("[launch_local] {processes} processes on one machine: their collectives go through Gloo over TCP instead of "
          "within one process, so a step takes longer than in one process with all {devices} devices (1.5-2x on the tiny model)")


def without_chatter(line: str) -> str | None:
    """`line` without Gloo's connection messages; None when nothing else was on it."""

    def keep_short(match: re.Match) -> str:
        return match.group(0) if match.group("whole") and match.group(2) != match.group(3) else ""

    text = GLOO.sub(keep_short, line.rstrip("\n"))
    return None if not text.strip() and text != line.rstrip("\n") else text + "\n"


def _pump(index: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        line = without_chatter(line)
        if line is None:
            continue
        with lock:
            sys.stdout.write(f"[{index}] {line}")
            sys.stdout.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


GROW = "grow"  # launch's status when more processes became available (`--hosts_file`)


def launch(command: list[str], processes: int, devices_per_process: int, env: dict | None = None, grows=lambda: False):
    """Runs `command` as `processes` processes; returns the first nonzero exit status, or 0, or GROW
    once `grows()` is true (the processes then stopped with SIGTERM: they checkpoint and exit)."""
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
            if grows():
                _stop(procs, GROW_GRACE_S)
                for t in pumps:
                    t.join(timeout=5)
                return GROW
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    for t in pumps:
        t.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return status


def shell_status(status: int) -> int:
    return status if status >= 0 else 128 - status  # killed by signal N: the shell's 128 + N


def retried(status: int) -> bool:
    """Whether a run that ended with `status` (a process's return code) is relaunched."""
    return status != 0 and shell_status(status) not in NOT_RETRIED


def _say(line: str) -> None:
    print(f"[launch_local] {line}", flush=True)


def read_hosts(path: str) -> int:
    """The process count a hosts file allows now (its first line, an integer >= 0)."""
    with open(path) as f:
        return int(f.readline().strip())


def hosts_problem(path: str) -> str | None:
    try:
        count = read_hosts(path)
    except (OSError, ValueError) as e:
        return f"--hosts_file={path}: must hold the number of processes that may run ({type(e).__name__}: {e})"
    return None if count >= 1 else f"--hosts_file={path} holds {count}: at least 1 process must be able to start"


def allowed(processes: int, hosts_file: str, last: int) -> int:
    """What the hosts file allows now, at most --processes (`last` while it cannot be read)."""
    try:
        return min(read_hosts(hosts_file), processes)
    except (OSError, ValueError):
        return last


def available(processes: int, hosts_file: str, last: int, sleep=time.sleep) -> int:
    """How many processes to launch: --processes, or what the hosts file allows (while it allows
    none, wait: the scheduler is finding hosts)."""
    if not hosts_file:
        return processes
    while (count := allowed(processes, hosts_file, last)) < 1:
        sleep(1.0)
    return count


def _grows(processes: int, hosts_file: str, running: int):
    """While `running` processes run: whether the hosts file allows more now."""
    return lambda: bool(hosts_file) and allowed(processes, hosts_file, running) > running


def launch_with_restarts(command: list[str], processes: int, devices: int, max_restarts: int, backoff_s: float,
                         sleep=time.sleep, hosts_file: str = "", env: dict | None = None) -> int:
    """`launch`, relaunched after each failure `retried` allows, at most `max_restarts` times; with a
    hosts file, on the processes it allows, and again on more when it allows more."""
    restart, count = 0, processes
    while True:
        try:
            was, count = count, available(processes, hosts_file, count, sleep)
            if count != was:
                _say(f"{count} process{'es' * (count > 1)} available (--elastic): the run continues on {count} x {devices} devices")
            status = launch(command, count, devices, env=env, grows=_grows(processes, hosts_file, count))
        except KeyboardInterrupt:
            return 130
        if status == GROW:
            _say("more processes available (--elastic): stopping at a checkpoint to continue on them")
            continue
        if not retried(status):
            if status and max_restarts:
                _say(f"not restarting: exit {shell_status(status)} ({EXIT_MEANINGS.get(shell_status(status), 'failed')}) "
                     f"would end the same way again")
            return status
        if restart == max_restarts:
            _say(f"no restart left ({max_restarts} used); the run is at its newest complete checkpoint")
            return status
        restart += 1
        delay = min(backoff_s * 2 ** (restart - 1), MAX_BACKOFF_S)
        _say(f"restart {restart} of {max_restarts} in {delay:g} s: every process again, from the newest complete checkpoint")
        try:
            sleep(delay)
        except KeyboardInterrupt:
            return 130


def run(args, _) -> int:
    print(SLOWER.format(processes=args.processes, devices=args.processes * args.devices_per_process), file=sys.stderr, flush=True)
    env = dict(os.environ, **{ELASTIC_ENV: str(args.processes * args.devices_per_process)}) if args.elastic else None
    status = launch_with_restarts(args.rest, args.processes, args.devices_per_process, args.max_restarts, args.backoff_s,
                                  hosts_file=args.hosts_file, env=env)
    return shell_status(status)


def _checks(args) -> list[str]:
    errors = [] if args.rest else ["give the command to run after --: launch_local.py --processes=N -- COMMAND ..."]
    if args.elastic != bool(args.hosts_file):
        errors.append("--elastic and --hosts_file=FILE go together: the file says how many processes may run now")
    problem = args.hosts_file and hosts_problem(args.hosts_file)
    return errors + ([problem] if problem else [])


COMMANDS = (
    Command(None, "run one command as N cooperating JAX processes on this machine", run, flags=(
        Flag("processes", int, 2, "processes to start", at_least=1),
        Flag("devices_per_process", int, 4, "CPU devices of each process", at_least=1),
        Flag("max_restarts", int, 0, "relaunch every process after a failure a restart can mend (not bad input, a "
             "non-finite stop or Ctrl-C), at most this many times", at_least=0),
        Flag("backoff_s", float, 1.0, "seconds before the first relaunch, doubled at each next one (at most 60)", at_least=0),
        Flag("elastic", bool, False, "continue on the processes the hosts file allows, keeping the global batch and each "
             "device's rows (JAXPAR_ELASTIC_DEVICES for scripts/train.py), and grow back when it allows more"),
        Flag("hosts_file", str, "", "with --elastic: a file holding how many processes may run now (at most --processes), read "
             "at each launch; when it grows, the run stops at a checkpoint and continues on more"),
    ), devices=False, rest=True, checks=_checks),
)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
