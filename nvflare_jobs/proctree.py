"""Stop the whole NVFlare process tree on Ctrl-C / SIGTERM.

NVFlare's simulator runs its server in a ``multiprocessing`` child and starts every site worker with
``os.setsid`` (its own session and process group). A SIGTERM to ``cxr-hfl`` therefore reaches none of them, and a
Ctrl-C reaches the server process but not the site workers: before this module, killing the CLI left the server
and the site workers running. :func:`handle_interrupts` installs handlers that, on SIGINT or SIGTERM, take a
snapshot of every descendant process (psutil, which NVFlare already depends on), terminate them (SIGKILL after a
grace period) and raise ``KeyboardInterrupt`` in the CLI.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

import psutil

INTERRUPTED = threading.Event()
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
received: list[int] = []


def kill_tree(pid: int | None = None, grace_s: float = 5.0) -> list[int]:
    """Terminate every descendant of ``pid`` (default: this process), then SIGKILL those alive after ``grace_s``.

    Returns:
        the pids that were signalled. The snapshot is taken first, so grandchildren whose parent dies first are
        still reached (they would otherwise be re-parented and lost).
    """
    try:
        procs = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in procs]


def _handler(signum, frame):
    if INTERRUPTED.is_set():  # a second signal while cleaning up: nothing more to do than before
        raise KeyboardInterrupt
    INTERRUPTED.set()
    received.append(signum)
    name = signal.Signals(signum).name
    pids = kill_tree()
    if pids:  # a command that started none (partition, site check) says only its own one-line 'interrupted'
        print(f"\n[cxr-hfl] {name}: stopped {len(pids)} process(es) of this run (NVFlare server and site workers)",
              file=sys.stderr, flush=True)
    raise KeyboardInterrupt


@contextmanager
def handle_interrupts():
    """Within the block, SIGINT and SIGTERM stop the whole process tree and raise ``KeyboardInterrupt``.

    Only in the main thread (signal handlers cannot be installed elsewhere); restores the previous handlers after.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_code() -> int:
    """130 after SIGINT, 143 after SIGTERM (the shell convention), 130 when no signal was recorded."""
    return SIGNAL_EXIT.get(received[-1], 130) if received else 130


_PORT_LOCK = threading.Lock()
_PORTS_HANDED_OUT: set[int] = set()


def unique_simulator_ports() -> None:
    """Make the NVFlare simulator hand every site worker a port no other worker of this run got.

    Diagnosis of ``SimulatorClientRunner - ERROR - Communication error with client site-2: [Errno 104] Connection
    reset by peer`` (NVFlare 2.9, ``simulator_runner.py``): each client thread picks its worker's port with
    ``get_open_ports(1)``, which binds port 0 and *closes* the socket, then starts the worker (which binds that
    port only after a few seconds of imports) and connects to ``localhost:port`` at once, retrying. All client threads
    start together (threads == sites). Once closed, the port can be handed out again before the first worker
    binds it; then both client threads connect to the same worker, which accepts one connection and drops its
    listener, and the other thread's connection is reset: that site never starts. This patch (applied before the
    simulator forks) never hands out a port twice within a run and only one that is free on 127.0.0.1 as well.
    It narrows the race; it cannot close it against other programs on the machine, so the server still treats a
    site that never fetches its task as not running (``hfl_components.wait_policy``) and says so by name.
    """
    import socket

    from nvflare.private.fed.app.simulator import simulator_runner

    original = simulator_runner.get_open_ports
    if getattr(original, "_cxr_hfl_unique", False):
        return

    def get_unique_open_ports(number) -> list:
        out = []
        with _PORT_LOCK:
            for _ in range(1000):
                if len(out) >= number:
                    break
                port = original(1)[0]
                if port in _PORTS_HANDED_OUT:
                    continue
                try:
                    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                        s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                _PORTS_HANDED_OUT.add(port)
                out.append(port)
        return out or original(number)

    get_unique_open_ports._cxr_hfl_unique = True
    simulator_runner.get_open_ports = get_unique_open_ports
