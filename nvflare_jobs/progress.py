"""Live console progress of a simulator run, read from the server's ``status.json`` (no NVFlare import).

The server controller (``HFLController``) rewrites ``<server run dir>/cxr_hfl_results/status.json`` whenever its
state changes and every half second while it waits: its phase (waiting, probing, fusing, averaging...), which sites
it is waiting for, which sites it has excluded and why, and each site's last heartbeat (task, round, epoch, loss).
:class:`LiveProgress` polls that file from a thread of the ``cxr-hfl simulate`` process and shows

* on a terminal: one tqdm bar for the server and one per site (epochs of the current task, with the loss);
* otherwise (logs, CI, ``cxr-hfl compare``'s per-run log): one line per change of server phase, and one line per
  change of a site's state, task or epoch, worded as ``cxr-hfl status`` words a site (``status.format_site``);

in both modes, one line at once for every site the server excludes, with the reason, and at the end the run's
status view as ``cxr-hfl status RUN`` prints it (``status.format_view``).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path


def _read(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # being replaced right now
        return None


def describe_server(st: dict) -> str:
    """One line for the server's state, e.g. ``round 1 fedavg_train: waiting for site-2, site-3``."""
    phase = st.get("phase") or "?"
    from nvflare_jobs.status import step

    where = step(st.get("method"), st.get("task"), st.get("round"), st.get("num_rounds"))
    head = (f"{where} ({st['task']})" if where else f"round {st.get('round')} {st.get('task')}") if st.get("task") \
        else "server"
    if phase == "waiting":
        w = st.get("waiting_for") or []
        tail = f"waiting for {', '.join(w)}" if w else "all answers in"
        if st.get("late_wait_ends_in_s") is not None and w:
            tail += f" (late wait ends in {max(0.0, st['late_wait_ends_in_s']):.0f} s unless they heart-beat)"
        return f"{head}: {tail}"
    if phase == "failed":
        return f"server: FAILED: {st.get('error')}"
    from nvflare_jobs.status import describe_progress

    prog = describe_progress(st.get("server_progress"))
    return f"server: {phase}" + (f": {prog}" if prog else "")


def _usable_terminal(stream) -> bool:
    """True when ``stream`` is a terminal that tqdm can draw bars on: a tty with a known, non-zero width (a pty
    opened by ``script`` or some CI consoles reports 0 columns, where tqdm draws nothing; those get line mode)."""
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class LiveProgress:
    """Poll ``status.json`` under ``workspace`` and show the run's progress on ``stream`` (default stderr).

    Args:
        workspace: the simulator workspace (``status.json`` is found under it once the server writes it).
        sites: the site names, in display order.
        interval: seconds between polls. Default 1.
        bars: tqdm bars (None: when ``stream`` is a terminal).
    """

    def __init__(self, workspace: str | Path, sites: list[str], interval: float = 1.0, stream=None, bars=None):
        self.workspace = Path(workspace)
        self.sites = list(sites)
        self.interval = float(interval)
        self.stream = stream or sys.stderr
        self.bars = _usable_terminal(self.stream) if bars is None else bool(bars)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cxr_hfl_progress", daemon=True)
        self._path: Path | None = None
        self._seen_excluded: dict[str, str] = {}
        self._last_lines: dict[str, str] = {}
        self._tq: dict = {}
        self.last_status: dict | None = None

    def __enter__(self):
        self._write(f"[cxr-hfl] the status view from another terminal: cxr-hfl status {self.workspace.parent} "
                    "--watch")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.poll()  # the final state (e.g. exclusions decided in the last second)
        for b in self._tq.values():
            b.close()
        self._tq = {}
        if self.last_status is not None:
            self._write(self.final_view())

    def final_view(self) -> str:
        """The run's last status as ``cxr-hfl status RUN`` words it (every site's state, last task, epoch and loss,
        latest validation metric, exclusions, the gate's decisions)."""
        from nvflare_jobs.status import format_view, job_view

        st = self.last_status or {}
        state = {"done": "FINISHED:COMPLETED", "failed": "FINISHED:FAILED"}.get(st.get("phase"), "STOPPED")
        return format_view(job_view(st, job_state=state, sites=self.sites, job_id=self.workspace.parent.name))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the display must never break a run
                pass

    def _find(self) -> Path | None:
        if self._path is None or not self._path.is_file():
            hits = sorted(self.workspace.glob("server/*/cxr_hfl_results/status.json")) or sorted(
                self.workspace.rglob("cxr_hfl_results/status.json"))
            self._path = hits[-1] if hits else None
        return self._path

    def _write(self, line: str) -> None:
        if self._tq:
            from tqdm import tqdm

            tqdm.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def poll(self) -> dict | None:
        """Read the status once and update the display; returns the status (None before the server wrote it)."""
        st = _read(self._find())
        if st is None:
            return None
        self.last_status = st
        for site, reason in sorted((st.get("excluded") or {}).items()):
            if self._seen_excluded.get(site) != reason:
                self._seen_excluded[site] = reason
                self._write(f"[cxr-hfl] site {site} excluded: {reason}")
        for site, reason in sorted((st.get("dropped_now") or {}).items()):
            if self._seen_excluded.get(site) != reason:
                self._seen_excluded[site] = reason
                self._write(f"[cxr-hfl] site {site} excluded from {st.get('task')}: {reason}")
        if self.bars:
            self._update_bars(st)
        else:
            self._update_lines(st)
        return st

    def _site_views(self, st: dict) -> dict:
        """Each site's entry of the status view (``nvflare_jobs.status.job_view``: state, task, epoch, loss,
        latest validation metric), as ``cxr-hfl status`` shows it."""
        from nvflare_jobs.status import job_view

        return job_view(st, job_state="RUNNING", sites=self.sites)["sites"]

    def _update_lines(self, st: dict) -> None:
        from nvflare_jobs.status import format_site

        server = describe_server(st)
        key = server.split(" (late wait")[0]
        if self._last_lines.get("server") != key:
            self._last_lines["server"] = key
            self._write(f"[cxr-hfl] {server}")
        if st.get("phase") in ("done", "failed"):
            return  # the whole view follows when the run ends (stop)
        for site, d in self._site_views(st).items():
            if site not in (st.get("sites") or {}) or d["state"] == "excluded":
                continue  # no heartbeat yet; an exclusion has its own line
            line = (d["state"], d.get("task"), d.get("round"), d.get("stage"), d.get("epoch"))
            if self._last_lines.get(site) != line:
                self._last_lines[site] = line
                self._write(f"[cxr-hfl] {format_site(site, d, heard=False)}")

    def _update_bars(self, st: dict) -> None:
        from tqdm import tqdm

        from nvflare_jobs.status import format_site

        if not self._tq:
            self._tq["server"] = tqdm(total=0, position=0, bar_format="{desc}", file=self.stream, leave=False)
            for i, s in enumerate(self.sites, start=1):
                self._tq[s] = tqdm(total=1, position=i, desc=f"{s}: starting", file=self.stream, leave=False,
                                   bar_format="  {bar:20} {desc}")
        self._tq["server"].set_description_str(describe_server(st), refresh=True)
        views = self._site_views(st)
        for s in self.sites:
            p = (st.get("sites") or {}).get(s)
            b = self._tq[s]
            if s in (st.get("excluded") or {}) and (p is None or s in (st.get("down") or [])):
                b.set_description_str(f"{s}: excluded ({st['excluded'][s]})", refresh=False)
            elif p:
                b.total = max(1, int(p.get("epochs") or 1))
                b.n = int(p.get("epoch") or 0)
                b.set_description_str(format_site(s, views[s], heard=False), refresh=False)
            else:
                b.set_description_str(f"{s}: starting", refresh=False)
            b.refresh()


def quiet_log_config(run_dir: Path) -> Path:
    """NVFlare's log config with the console handler at ERROR: INFO/WARNING lines go only to the workspace's
    ``log.txt`` files (simulator server and every site), the console keeps errors and the live progress."""
    import copy

    from nvflare.fuel.utils.log_utils import concise_log_dict

    cfg = copy.deepcopy(concise_log_dict)
    cfg["handlers"]["consoleHandler"]["level"] = "ERROR"
    cfg["handlers"]["consoleHandler"]["stream"] = "ext://sys.stderr"
    path = run_dir / "nvflare_log_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path
