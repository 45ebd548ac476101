"""OHFL's probe preloader: the server prepares the probe at each site size while slower sites still train."""
from __future__ import annotations

import threading
import time


class ProbePreloader:
    """The OHFL probe at each site input size, prepared in one background thread from the moment the first site
    with that size uploads (:meth:`HFLController.on_site_result`), while slower sites still train.

    ``load(size)`` returns ``(tensor, file names, warnings)``. :meth:`get` waits for a size already started, or
    loads it now; either way the same function runs once per size, so the probe is the one a synchronous load
    gives. ``seconds`` sums the loading time of every size (the work, wherever it ran); ``waited`` is how long
    :meth:`get` blocked.
    """

    def __init__(self, load):
        self._load = load
        self._lock = threading.Lock()
        self._pool = None
        self._futures: dict = {}
        self.seconds = 0.0
        self.waited = 0.0

    def _timed(self, size: int):
        t0 = time.perf_counter()
        try:
            return self._load(size)
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - t0

    def start(self, size: int):
        """Start preparing the probe at ``size`` (once); returns its future."""
        from concurrent.futures import ThreadPoolExecutor

        size = int(size)
        with self._lock:
            if size not in self._futures:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ohfl_probe")
                self._futures[size] = self._pool.submit(self._timed, size)
            return self._futures[size]

    def get(self, size: int):
        """The probe at ``size``: ``(tensor, file names, warnings)``; re-raises the loader's error."""
        t0 = time.perf_counter()
        try:
            return self.start(size).result()
        finally:
            self.waited += time.perf_counter() - t0

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
