"""The fusion stages' timing: one helper, so the stages themselves hold no clock arithmetic."""
from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(seconds: dict, phase: str):
    """Add the wall seconds of the ``with`` block to ``seconds[phase]`` (created at 0.0), also when it raises."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
