"""Native decoders in worker processes: a decoder that crashes or hangs costs one file, never the caller.

libjpeg-turbo, GDCM, OpenJPEG and the other C decoders behind :func:`chest_xray.read_image` can abort or
segfault on a malformed file (jfolz/simplejpeg#29, a GDCM assertion). The scan (``cxr-hfl partition``) and
``site check`` therefore read every file through :func:`map_isolated`: each file is handed to one of a few worker
processes; a worker that dies (a signal, ``os._exit``) or does not answer within the timeout is replaced, and that
file alone gets a one-line reason (:class:`Crash`). Training then reads only files the scan accepted.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Iterable

#: Seconds one file may take in a worker before the worker is stopped and the file refused (a hung decoder).
FILE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Crash:
    """What :func:`map_isolated` gives for an item whose worker died or hung: ``reason`` is one line, e.g.
    ``"the decoder crashed the reading process (SIGSEGV)"``; ``kind`` is ``"decoder crash"`` or
    ``"decoder timeout"``."""

    reason: str
    kind: str


def _context():
    """``fork`` where the platform has it (a worker starts in milliseconds with the modules already loaded), else
    ``spawn``."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _serve(fn: Callable[[Any], Any], conn) -> None:
    """A worker's loop: ``(index, item)`` in, ``(index, ("ok", fn(item)) | ("raise", exception))`` out; None ends."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        i, item = msg
        try:
            out = ("ok", fn(item))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller, which re-raises it
            out = ("raise", e)
        try:
            conn.send((i, out))
        except Exception as e:  # noqa: BLE001 -- an unpicklable result or exception
            conn.send((i, ("raise", RuntimeError(f"{type(e).__name__}: {e}"))))


class _Worker:
    """One worker process and the items handed to it, in order: it reads them one after the other, so the first
    item without an answer is the one it is on."""

    def __init__(self, ctx, fn):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(fn, child), daemon=True, name="cxr-decode")
        self.proc.start()
        child.close()
        self.assigned: deque[tuple[int, Any]] = deque()  # (index, item) handed over, not yet answered
        self.t0 = 0.0  # when the current item started (the previous answer came, or the first item was given)

    def give(self, i: int, item) -> None:
        if not self.assigned:
            self.t0 = time.monotonic()
        self.conn.send((i, item))
        self.assigned.append((i, item))

    def stop(self, kill: bool = False) -> None:
        try:
            if kill:
                self.proc.kill()
            else:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


def _start(ctx, fn) -> _Worker:
    """A new worker. The caller's objects are frozen out of the garbage collector while it forks, so the worker's
    collections do not touch (and copy) every inherited page."""
    gc.freeze()
    try:
        return _Worker(ctx, fn)
    finally:
        gc.unfreeze()


#: Items handed to a worker ahead of the one it reads.
_AHEAD = 3


def _collect(w: _Worker, ready: list, results: list, todo: deque, timeout_s: float, ctx, fn) -> _Worker:
    """Take ``w``'s answers, or, when it died or hung, give its current item a :class:`Crash`, put the items it had
    not started back in ``todo`` and return a new worker in its place; re-raise an item's exception."""
    while w.assigned and w.conn.poll():
        try:
            i, (status, value) = w.conn.recv()
        except (EOFError, OSError):
            break
        if status == "raise":
            raise value
        results[i] = value
        w.assigned.popleft()
        w.t0 = time.monotonic()
    if not w.assigned:
        return w
    if w.proc.sentinel in ready or not w.proc.is_alive():
        w.proc.join(timeout=5)
        crash = Crash(f"the decoder crashed the reading process ({_death(w.proc.exitcode)}); the file is not used",
                      "decoder crash")
    elif time.monotonic() - w.t0 >= timeout_s:
        crash = Crash(f"not read within {timeout_s:.0f} s (a decoder hung); the reading process was stopped and "
                      "the file is not used", "decoder timeout")
    else:
        return w
    results[w.assigned.popleft()[0]] = crash
    todo.extendleft(reversed(w.assigned))  # handed over but not started: to the next worker
    w.stop(kill=True)
    return _start(ctx, fn)


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def map_isolated(fn: Callable[[Any], Any], items: Iterable[Any], workers: int = 1,
                 timeout_s: float = FILE_TIMEOUT_S) -> list[Any]:
    """``fn(item)`` for every item, in order, run by ``workers`` worker processes that a crash does not take down.

    Args:
        fn: a function of one item (picklable where processes are spawned: a module-level function or a
            ``functools.partial`` of one).
        items: picklable items.
        workers: processes reading side by side (>= 1).
        timeout_s: seconds one item may take; a worker still busy after it is killed (a hung decoder).

    Returns:
        one entry per item: ``fn(item)``, or a :class:`Crash` when the worker died or timed out on that item (the
        worker is replaced and the other items go on).

    Raises:
        ValueError: ``workers < 1``.
        Exception: the first exception ``fn`` raised in a worker, re-raised here after the workers are stopped.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    todo = deque(enumerate(items))
    results: list[Any] = [None] * len(todo)
    ctx = _context()
    pool = [_start(ctx, fn) for _ in range(min(workers, len(todo)))]

    def top_up(w: _Worker) -> None:  # a few items ahead: a worker never waits for this process to be scheduled
        while todo and len(w.assigned) < _AHEAD:
            w.give(*todo.popleft())

    try:
        for w in pool:
            top_up(w)
        while any(w.assigned for w in pool):
            busy = [w for w in pool if w.assigned]
            left = min(w.t0 + timeout_s for w in busy) - time.monotonic()
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=max(0.0, left))
            for k, w in enumerate(pool):
                if w.assigned:
                    pool[k] = _collect(w, ready, results, todo, timeout_s, ctx, fn)
                    top_up(pool[k])
    finally:
        for w in pool:
            w.stop()
    return results

