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
