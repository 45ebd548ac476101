"""One in-process federation: :class:`InProcessTransport` stands in for NVFlare's
``ModelController.send_model_and_wait``, so a controller's ``run()`` drives every site in this process, in turn,
without the simulator's processes and ports (benchmarks, tuning studies, tests).

A site answers each task with ``answer(task, site, data) -> (params, metrics, meta)`` (``data`` the ``FLModel`` the
server sent); :func:`runtime_answer` answers with the real site handlers on one
:class:`~hfl_components.flare.site_tasks.SiteRuntime` per site, with the task ``meta`` the site script builds
(``round``, ``total_rounds``) and a failing task answered as the site script answers it (status ``error`` and the
reason), unless ``raise_errors``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel

Answer = Callable[[str, str, FLModel], tuple]


def task_meta(data: FLModel) -> dict:
    """The ``meta`` a site handler gets for the server's ``data``: the server's meta plus ``round`` and
    ``total_rounds`` (what :mod:`hfl_components.flare.site_script` adds)."""
    meta = dict(data.meta or {})
    meta.setdefault("round", data.current_round or 0)
    if data.total_rounds:
        meta.setdefault("total_rounds", int(data.total_rounds))
    return meta


class InProcessTransport:
    """Send a task to every site in this process and collect the answers as NVFlare would return them.

    Args:
        sites: the site names, in the order they answer.
        answer: ``answer(task, site, data) -> (params, metrics, meta)``.

    Attributes:
        sent: ``(task, round, params, meta)`` of every task the server sent.
        calls: ``{"task", "round", "site_seconds": {site: s}}`` per task.
    """

    def __init__(self, sites: Iterable[str], answer: Answer):
        self.sites = list(sites)
        self.answer = answer
        self.sent: list[tuple] = []
        self.calls: list[dict] = []

    def __call__(self, task_name: str = "train", data: FLModel | None = None, targets=None, min_responses=None,
                 timeout: int = 0, **kw) -> list[FLModel]:
        data = data if data is not None else FLModel(params={}, meta={})
        self.sent.append((task_name, data.current_round, data.params, data.meta))
        out, secs = [], {}
        for site in (list(targets) if targets else self.sites):
            t0 = time.perf_counter()
            params, metrics, meta = self.answer(task_name, site, data)
            secs[site] = time.perf_counter() - t0
            out.append(FLModel(params={k: np.array(v, copy=True) for k, v in (params or {}).items()},
                               metrics=metrics, meta={"client_name": site, **(meta or {})},
                               current_round=data.current_round))
        self.calls.append({"task": task_name, "round": data.current_round, "site_seconds": secs})
        return out

    def attach(self, controller, run_dir: str | Path, info=None, warning=None):
        """Wire ``controller`` to this transport: its tasks go here, its results under ``run_dir``; ``info`` /
        ``warning`` replace its log methods when given. Returns the controller."""
        controller.send_model_and_wait = self
        controller.get_run_dir = lambda: str(run_dir)
        if info is not None:
            controller.info = info
        if warning is not None:
            controller.warning = warning
        return controller


def runtime_answer(runtimes: dict, raise_errors: bool = False, on_result=None) -> Answer:
    """An ``answer`` that runs the catalogue's site handler of each task on ``runtimes[site]`` (a ``SiteRuntime``).

    Args:
        runtimes: ``{site: SiteRuntime}``.
        raise_errors: re-raise a handler's exception (default: answer ``{"status": "error", "error": reason}`` as
            the site script does).
        on_result: ``on_result(site, runtime, round, metrics)`` after each successful answer.
    """
    from hfl_components.flare.dispatch import handler
    from hfl_components.flare.site_tasks import describe_error

    def answer(task: str, site: str, data: FLModel):
        meta = task_meta(data)
        try:
            params, metrics, meta_out = handler(task)(runtimes[site], dict(data.params or {}), meta)
        except Exception as e:  # noqa: BLE001 - reported like the site script does
            if raise_errors:
                raise
            return {}, {}, {"status": "error", "error": f"site {site}: task {task} failed: {describe_error(e)}"}
        if on_result is not None:
            on_result(site, runtimes[site], int(meta["round"]), metrics)
        return params, metrics, meta_out

    return answer
