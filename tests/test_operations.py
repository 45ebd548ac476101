"""Fast checks of the operations plumbing: process-tree cleanup, the live progress display, the quiet log config,
the rerun message."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def test_kill_tree_reaches_a_grandchild_in_its_own_session(tmp_path):
    """Like NVFlare's site workers (started with os.setsid), the grandchild sits in its own session: a signal to
    the process group would miss it, the snapshot of descendants does not."""
    from nvflare_jobs.proctree import kill_tree

    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
            f" start_new_session=True); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(200):
        if pidfile.is_file() and pidfile.read_text():
            break
        time.sleep(0.05)
    grandchild = psutil.Process(int(pidfile.read_text()))
    assert grandchild.ppid() == child.pid and psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE
    try:
        pids = kill_tree(child.pid, grace_s=5)
        assert pids == [grandchild.pid]
        assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        child.wait(timeout=10)


def _status(path, **st):
    (path / "server" / "simulate_job" / "cxr_hfl_results").mkdir(parents=True, exist_ok=True)
    (path / "server" / "simulate_job" / "cxr_hfl_results" / "status.json").write_text(json.dumps(st))


def test_live_progress_lines_report_waiting_sites_epochs_and_exclusions_once(tmp_path):
    from nvflare_jobs.progress import LiveProgress

    out = io.StringIO()
    live = LiveProgress(tmp_path, ["site-1", "site-2"], stream=out, bars=False)
    assert live.poll() is None  # nothing written yet
    _status(tmp_path, phase="waiting", task="fedavg_train", round=1, waiting_for=["site-1", "site-2"],
            sites={"site-1": {"task": "fedavg_train", "round": 1, "stage": "round 1", "epoch": 2, "epochs": 3,
                              "loss": 0.51234}})
    live.poll()
    _status(tmp_path, phase="waiting", task="fedavg_train", round=1, waiting_for=["site-1"],
            dropped_now={"site-2": "did not fetch the task within 30 s (site process not running)"})
    live.poll()
    live.poll()  # unchanged: nothing new printed
    _status(tmp_path, phase="averaging", round=1, excluded={"site-2": "did not fetch the task within 30 s (site "
                                                                       "process not running)"})
    live.poll()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[cxr-hfl] round 1 fedavg_train: waiting for site-1, site-2"
    assert lines[1].split() == "[cxr-hfl] site-1 training fedavg_train r1 round 1 epoch 2/3 loss 0.512".split()
    assert sum("site site-2 excluded" in x and "did not fetch" in x for x in lines) == 1  # once, at once
    assert lines[-1] == "[cxr-hfl] server: averaging"
    assert lines.count("[cxr-hfl] round 1 fedavg_train: waiting for site-1") == 1


def test_simulator_console_shows_the_status_view_of_cxr_hfl_status(tmp_path):
    """Line mode words each site as `cxr-hfl status` does (state, task, epoch, loss, validation metric), once per
    change; at the end the console prints the run's whole status view, equal to `cxr-hfl status RUN` on the same
    run folder."""
    from nvflare_jobs.progress import LiveProgress
    from nvflare_jobs.status import format_view, run_folder_view

    run = tmp_path / "run-7"
    ws = run / "workspace"
    out = io.StringIO()
    live = LiveProgress(ws, ["site-1", "site-2"], stream=out, bars=False)
    beat = {"task": "fedavg_train", "round": 1, "epoch": 3, "epochs": 3, "loss": 0.4}
    _status(ws, phase="waiting", task="fedavg_train", round=1, waiting_for=["site-2"], answered=["site-1"],
            sites={"site-1": beat, "site-2": dict(beat, epoch=1, loss=0.9)})
    live.poll()
    live.poll()
    _status(ws, phase="waiting", task="fedavg_train", round=1, waiting_for=["site-2"], answered=["site-1"],
            sites={"site-1": beat, "site-2": dict(beat, epoch=2, loss=0.7)})
    live.poll()
    _status(ws, phase="done", method="fedavg", round=1, answered=["site-1", "site-2"], gate={"adopted": ["site-1"]},
            excluded={}, sites={"site-1": beat, "site-2": dict(beat, loss=0.5)},
            latest_val={"site-1": {"round": 1, "balanced_accuracy": 0.75}})
    live.stop()
    lines = out.getvalue().splitlines()
    assert lines[1].split() == "[cxr-hfl] site-1 answered fedavg_train r1 epoch 3/3 loss 0.400".split()
    assert lines[2].split() == "[cxr-hfl] site-2 training fedavg_train r1 epoch 1/3 loss 0.900".split()
    assert lines[3].split() == "[cxr-hfl] site-2 training fedavg_train r1 epoch 2/3 loss 0.700".split()
    assert sum(x.startswith("[cxr-hfl] site-") for x in lines) == 3  # once per change; the end is the view's
    assert any(x.startswith("  site-1") and "val balanced_accuracy 0.750 (round 1)" in x for x in lines)
    view = format_view(run_folder_view(run))
    assert view.startswith("job run-7: FINISHED:COMPLETED (fedavg)") and "gate:" in view
    assert "\n".join(lines[-len(view.splitlines()):]) == view


def test_quiet_log_config_keeps_info_off_the_console(tmp_path):
    from nvflare_jobs.progress import quiet_log_config

    cfg = json.loads(quiet_log_config(tmp_path).read_text())
    assert cfg["handlers"]["consoleHandler"]["level"] == "ERROR"
    assert cfg["handlers"]["logFileHandler"]["level"] == "DEBUG"  # everything still reaches log.txt


def test_rerun_into_an_unfinished_run_folder_says_how_to_replace_it(tmp_path):
    from nvflare_jobs.runner import _prepare_run_dir

    run = tmp_path / "run"
    (run / "workspace").mkdir(parents=True)
    with pytest.raises(FileExistsError) as e:
        _prepare_run_dir(run, overwrite=False)
    msg = str(e.value)
    assert "unfinished" in msg and "--overwrite" in msg and "cannot be resumed" in msg
    (run / "metrics.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds a run \\(finished"):
        _prepare_run_dir(run, overwrite=False)


def test_live_progress_bars_show_server_and_site_state(tmp_path):
    """Terminal mode (tqdm bars): the server bar says what it waits for, a site bar shows epoch/epochs and loss, an
    excluded site is marked, and the exclusion line is still printed."""
    from nvflare_jobs.progress import LiveProgress

    out = io.StringIO()
    live = LiveProgress(tmp_path, ["site-1", "site-2"], stream=out, bars=True)
    _status(tmp_path, phase="waiting", task="ohfl_train", round=0, waiting_for=["site-1"], down=["site-2"],
            excluded={"site-2": "silent for 30 s while working on the task"},
            sites={"site-1": {"task": "ohfl_train", "round": 0, "stage": "local", "epoch": 7, "epochs": 20,
                              "loss": 0.25}})
    live.poll()
    assert live._tq["site-1"].n == 7 and live._tq["site-1"].total == 20
    text = out.getvalue()
    assert "round 0 ohfl_train: waiting for site-1" in text and "loss 0.250" in text
    assert "site site-2 excluded: silent for 30 s" in text and live._tq["site-2"].desc.startswith("site-2: excluded (silent")
    live.stop()


def test_simulator_ports_are_never_handed_out_twice():
    from nvflare.private.fed.app.simulator import simulator_runner

    from nvflare_jobs.proctree import unique_simulator_ports

    original = simulator_runner.get_open_ports
    try:
        unique_simulator_ports()
        ports = [simulator_runner.get_open_ports(1)[0] for _ in range(300)]
        assert len(set(ports)) == 300 and all(1024 <= p < 65536 for p in ports)
    finally:
        simulator_runner.get_open_ports = original


def test_progress_uses_line_mode_on_a_zero_width_terminal():
    """A pty that reports 0 columns (``script``, some CI consoles) gets line mode, not invisible tqdm bars; the
    same pty given a width gets bars."""
    import fcntl
    import os
    import struct
    import termios

    from nvflare_jobs.progress import _usable_terminal

    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 0, 0, 0))
            assert tty.isatty() and not _usable_terminal(tty)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            assert _usable_terminal(tty)
    finally:
        os.close(master)
        os.close(slave)


def test_ctrl_c_during_a_threaded_partition_scan_is_one_line_and_writes_nothing(tmp_path):
    """SIGINT arrives while `cxr-hfl partition` verifies files in 4 threads: exit 130, one line on stderr (no
    traceback, no 'stopped 0 process(es) ... NVFlare server and site workers' from a command that started none),
    the remaining files are not read, and no output folder is left."""
    import numpy as np
    from PIL import Image

    for i in range(40):
        cls = "NORMAL" if i % 2 else "PNEUMONIA"
        p = tmp_path / "data" / cls / f"IM-{i:04d}-0001.jpeg"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((32, 40), i, np.uint8)).save(p)
    out, count = tmp_path / "p", tmp_path / "count"
    code = f"""
import os, signal, sys, time
import chest_xray.dataset as d
real, seen = d._scan_file, []
def slow(*a, **k):
    seen.append(1)
    if len(seen) == 5:
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    return real(*a, **k)
d._scan_file = slow
from nvflare_jobs.cli import main
try:
    rc = main(["partition", "--data", {str(tmp_path / "data")!r}, "--sites", "2", "--out", {str(out)!r}])
finally:
    open({str(count)!r}, "w").write(str(len(seen)))
sys.exit(rc)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CXR_SCAN_WORKERS": "4",
                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines() == ["cxr-hfl partition: interrupted, all its processes stopped"], r.stderr
    assert not out.exists()
    assert int(count.read_text()) < 40  # the queued files were cancelled, not scanned to the end
