"""A lost peer in a multi-process run: noticed within seconds, named in one line, every survivor stopped.

When a process dies (kill -9, the OOM killer, a lost node), JAX tells the others nothing a program can
act on: a survivor in a collective gets a Gloo error (CPU) or waits (NCCL), and at exit JAX's
shutdown barrier waits for the dead process until the heartbeat timeout, after which JAX's client
terminates the process from C++ with a stack trace (measured: exit 134, 62 s after the kill).

So each process listens on a TCP port of its own (the kernel completes connections; nothing is
served) and publishes its address in the coordination service's key-value store when it joins
(`watch`). A watcher thread connects to its ring neighbour's port every PROBE_S: refused means the
process is gone (the kernel closed its socket when it died); no answer for LOST_AFTER_S means its
host is unreachable. The first process to notice publishes the verdict under LOST_KEY, which every
watcher also reads, so all survivors stop within about two seconds, each printing one line that
names the lost process and ending with EXIT_PEER_LOST, without running JAX's shutdown barrier. The
main thread does the same at once when a collective fails (`stop_if_peer_lost`, called by the
training loop). A process that ends on its own (done, or an error of its own) first marks itself
ended and stops its watcher (`atexit`, before JAX's shutdown): its neighbours do not take a normal
finish for a loss, and no thread is inside a JAX call when Python finalizes (a daemon thread torn
down there aborts the process: "FATAL: exception not rethrown").

The resume point is the last complete checkpoint: a save in flight never completes (Orbax finalises
a checkpoint only after every process has committed its shards).

Limitation: process 0 hosts JAX's coordination service. When it dies, JAX's client in every other
process terminates that process at once, from C++ (its own fatal message, exit 134), before any
Python code can run; `scripts/launch_local.py` and the scheduler report which process died first.
"""

from __future__ import annotations

import atexit
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable

EXIT_PEER_LOST = 4
PROBE_S = 1.0  # between two probes of the neighbour (and reads of the verdict)
CONNECT_TIMEOUT_S = 2.0
LOST_AFTER_S = 10.0  # a neighbour whose host does not answer for this long is lost
ADDRESS_KEY, ENDED_KEY, LOST_KEY = "jaxpar/liveness/{}", "jaxpar/ended/{}", "jaxpar/lost"


def _outbound_ip(coordinator: str) -> str:
    """This host's address on the route to the coordinator (what the peers can reach)."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: nothing is sent, the kernel only picks the route
        return probe.getsockname()[0]


def _probe(address: tuple[str, int], timeout: float = CONNECT_TIMEOUT_S) -> str:
    """"alive", "gone" (connection refused: nobody listens there any more) or "unreachable"."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return "alive"
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "unreachable"


class _Watch:
    def __init__(self, client, process_id: int, num_processes: int, coordinator: str):
        self.client, self.me, self.n = client, process_id, num_processes
        self.server = socket.create_server((_outbound_ip(coordinator), 0), family=_family(coordinator), backlog=128)
        self.server.setblocking(False)
        host, port = self.server.getsockname()[:2]
        client.key_value_set(ADDRESS_KEY.format(process_id), f"{host} {port}")
        self.peers = {}
        for i in range(num_processes):
            if i != process_id:
                host, port = client.blocking_key_value_get(ADDRESS_KEY.format(i), 300_000).split()
                self.peers[i] = (host, int(port))
        self.hint: Callable[[], str] = lambda: "the last complete checkpoint is the resume point"
        self.reporting, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxpar-peers", daemon=True)
        self.thread.start()
        atexit.register(self.end)

    # -- the watcher thread ----------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except (BlockingIOError, OSError):
                return
            connection.close()

    def _run(self) -> None:
        neighbour = (self.me + 1) % self.n
        unreachable_since = None
        while not self.stop.wait(0):
            select.select([self.server], [], [], PROBE_S)
            self._drain()
            if self.stop.is_set():
                return
            verdict = self._published()
            if verdict is not None:
                self.report(verdict)
            state = _probe(self.peers[neighbour])
            if state == "alive" or self._ended(neighbour):
                unreachable_since = None
            elif state == "gone":
                self.report(self._describe(neighbour, "gone"), publish=True)
            else:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= LOST_AFTER_S:
                    self.report(self._describe(neighbour, "unreachable"), publish=True)

    def _published(self) -> str | None:
        try:
            return self.client.key_value_try_get(LOST_KEY)
        except Exception:  # noqa: BLE001 - not set yet (NOT_FOUND), or the service is unreachable
            return None

    def _ended(self, process: int) -> bool:
        try:
            self.client.key_value_try_get(ENDED_KEY.format(process))
        except Exception:  # noqa: BLE001 - NOT_FOUND: it has not ended on its own
            return False
        return True

    def _describe(self, process: int, state: str) -> str:
        host, port = self.peers[process]
        why = {
            "gone": f"its liveness port {host}:{port} refuses connections: the process died or was killed",
            "unreachable": f"{host}:{port} has not answered for {LOST_AFTER_S:.0f} s: its host is unreachable",
            "ended": "it ended on its own; see its error",
        }[state]
        return f"process {process} of {self.n} is lost ({why})"

    # -- stopping --------------------------------------------------------------------------

    def report(self, verdict: str, publish: bool = False) -> None:
        """One line on stderr, then the end of this process (EXIT_PEER_LOST); the first caller wins."""
        if not self.reporting.acquire(blocking=False):
            threading.Event().wait()  # another thread is ending the process
            return
        if publish:
            try:
                self.client.key_value_set(LOST_KEY, verdict)
            except Exception:  # noqa: BLE001 - the others find out by themselves
                pass
        try:
            hint = self.hint()
        except Exception:  # noqa: BLE001 - the hint is a courtesy
            hint = "the last complete checkpoint is the resume point"
        line = f"error: {verdict}; stopping process {self.me} too (exit {EXIT_PEER_LOST}): {hint}; restart every process\n"
        sys.stdout.flush()
        os.write(2, line.encode())
        os._exit(EXIT_PEER_LOST)  # JAX's shutdown barrier would wait for the lost process, then abort

    def lost_now(self, count_ended: bool) -> str | None:
        """The verdict on the other processes, probing each now (main thread, after an error);
        `count_ended`: a peer that ended on its own counts too (the error is a failed collective)."""
        if (verdict := self._published()) is not None:
            return verdict
        for process, address in self.peers.items():
            state = _probe(address)
            if state == "alive":
                continue
            if not self._ended(process):
                return self._describe(process, state)
            if count_ended:
                return self._describe(process, "ended")
        return None

    def end(self) -> None:
        """This process ends on its own: its neighbours must not take that for a loss; the watcher
        stops (joined, so it is not inside a JAX call when Python finalizes)."""
        try:
            self.client.key_value_set(ENDED_KEY.format(self.me), "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service may already be shut down
            pass
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * CONNECT_TIMEOUT_S + PROBE_S)


def _family(coordinator: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in coordinator.rsplit(":", 1)[0] else socket.AF_INET


_WATCH: _Watch | None = None


def watch() -> None:
    """Starts watching the other processes (after jax.distributed.initialize; no-op for one process)."""
    global _WATCH
    from jax._src import distributed as jax_distributed  # the client multihost_utils uses too

    state = jax_distributed.global_state
    if _WATCH is not None or state.client is None or state.num_processes < 2:
        return
    _WATCH = _Watch(state.client, state.process_id, state.num_processes, state.coordinator_address)


def set_hint(hint: Callable[[], str]) -> None:
    """What the lost-peer line says about resuming (e.g. the newest complete checkpoint)."""
    if _WATCH is not None:
        _WATCH.hint = hint


def stop_if_peer_lost(collective_failed: bool) -> None:
    """After an error in a multi-process run: if a peer is lost, report it and end this process
    (one line, EXIT_PEER_LOST) instead of letting the error's traceback and JAX's abort follow.
    `collective_failed` (a JAX runtime error): a peer that ended on its own explains it too."""
    if _WATCH is not None and (verdict := _WATCH.lost_now(collective_failed)) is not None:
        _WATCH.report(verdict, publish=True)
