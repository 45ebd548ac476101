"""Options are validated once (``catalogue.validate_options``) when the controller is built, and the same check runs
when an exported job starts on the server, before any site trains."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy_helpers import REPO_ROOT, tiny_manifests, tiny_profile

SITES = ("hospital-a", "hospital-b")


def _export_ohfl(tmp_path: Path, profile: Path) -> Path:
    from nvflare_jobs.spec import resolve

    return resolve("ohfl", {"probe": "generated", "probe_size": 8, "profile": str(profile)}).export(tmp_path / "jobs")


def _edit_server_arg(job: Path, key: str, value) -> dict:
    f = job / "app_server" / "config" / "config_fed_server.json"
    cfg = json.loads(f.read_text())
    wf = cfg["workflows"][0]
    assert wf["path"].endswith("OHFLController") and "probe" in wf["args"]
    wf["args"][key] = value  # NVFlare exports only arguments that differ from the defaults: add or replace
    f.write_text(json.dumps(cfg, indent=1))
    return wf


def _build_like_nvflare(wf: dict):
    """The server's component builder: import the class at ``path`` and call it with ``args``."""
    mod, _, name = wf["path"].rpartition(".")
    return getattr(importlib.import_module(mod), name)(**wf["args"])


def test_edited_exported_job_fails_the_option_check_naming_the_option(tmp_path):
    from hfl_components.flare.options import OptionError

    man = {s: tmp_path / "data" / f"{s}.csv" for s in SITES}  # not read: the export needs only the model specs
    job = _export_ohfl(tmp_path, tiny_profile(man, tmp_path / "profile", "ohfl"))
    wf = _edit_server_arg(job, "strategy", "cid")
    assert _build_like_nvflare(wf).check_options()["strategy"] == "cid"  # the unedited value passes
    wf = _edit_server_arg(job, "strategy", "bogus")
    ctl = _build_like_nvflare(wf)
    with pytest.raises(OptionError, match=r"option 'strategy' \(--strategy\) must be one of \['cid', 'cdd', 'cia', "
                                          r"'rand'\], got 'bogus'"):
        ctl.check_options()
    wf = _edit_server_arg(job, "strategy", "cid")
    wf = _edit_server_arg(job, "ground_metric", "euclid")
    with pytest.raises(OptionError, match="ground_metric"):
        _build_like_nvflare(wf).check_options()
    wf = _edit_server_arg(job, "ground_metric", "acts")
    for key, bad, says in (("probe_size", 0, "option 'probe_size' (--probe-size): needs at least 4 probe images"),
                           ("probe_size", -3, "got -3"), ("min_sites", 0, "ohfl: min_sites must be at least 1, got 0"),
                           ("num_rounds", 0, "ohfl: num_rounds must be at least 1, got 0")):
        good = wf["args"].get(key, 8 if key == "probe_size" else 1)
        with pytest.raises(ValueError) as e:
            _build_like_nvflare(_edit_server_arg(job, key, bad)).check_options()
        assert says in str(e.value), str(e.value)
        wf = _edit_server_arg(job, key, good)
    assert _build_like_nvflare(wf).check_options()["probe_size"] == 8  # the exported value, back in place


def test_export_job_refuses_a_probe_too_small_for_cka(capsys):
    from nvflare_jobs.commands.simulate import cli_spec

    with pytest.raises(SystemExit, match=r"ohfl: option 'probe_size' \(--probe-size\): needs at least 4 probe images"):
        cli_spec(["--method", "ohfl", "--probe", "generated", "--probe-size", "3"])
    assert cli_spec(["--method", "ohfl", "--probe", "generated", "--probe-size", "4"]).probe_size == 4


@pytest.mark.slow
def test_edited_exported_job_fails_at_start_before_any_site_trains(tmp_path, data_root):
    """The exported OHFL job with ``strategy`` edited to a bad value is run in the NVFlare simulator with real site
    data: the server refuses to start, naming the option, and no site receives a training task."""
    man = tiny_manifests(data_root, tmp_path / "manifests", list(SITES), n_train=4, n_val=2, n_test=2)
    profile = tiny_profile(man, tmp_path / "profile", "ohfl")
    job = _export_ohfl(tmp_path, profile)
    _edit_server_arg(job, "strategy", "bogus")
    ws = tmp_path / "ws"
    env = {**os.environ, "CXR_HFL_SITE_CONFIG_DIR": str(profile), "PYTHONPATH": str(REPO_ROOT)}
    code = ("import sys; from nvflare.private.fed.app.simulator.simulator_runner import SimulatorRunner; "
            f"r = SimulatorRunner(job_folder={str(job)!r}, workspace={str(ws)!r}, clients={','.join(SITES)!r}, "
            "threads=2); sys.exit(r.run())")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                   timeout=600)
    logs = {p.relative_to(ws): p.read_text(errors="replace") for p in ws.rglob("log.txt")}
    server = "\n".join(t for p, t in logs.items() if p.parts[0] == "server")
    assert "invalid job configuration" in server and "'strategy'" in server and "'bogus'" in server, server[-3000:]
    results = next(ws.rglob("cxr_hfl_results/server_results.json"))
    assert "strategy" in json.loads(results.read_text())["failed"]
    sites = "\n".join(t for p, t in logs.items() if p.parts[0] in SITES)
    assert "ohfl_train" not in sites and "ohfl_train" not in server.split("refusing to start")[0]
    assert not list(ws.rglob("cxr_hfl_state/local_model.pt")), "a site trained"


def test_edited_job_string_gate_reaches_the_sites_as_the_checked_bool(tmp_path):
    """An exported OHFL job edited by hand to ``"gate": "no"`` (or "false") passes the start check as False; the
    task_config the sites read must then hold False, not the truthy string (which turned the gate on)."""
    man = {s: tmp_path / "data" / f"{s}.csv" for s in SITES}
    job = _export_ohfl(tmp_path, tiny_profile(man, tmp_path / "profile", "ohfl"))
    wf = _edit_server_arg(job, "strategy", "cid")
    for text, want in (("no", False), ("false", False), ("0", False), ("yes", True)):
        wf["args"]["task_config"]["gate"] = text
        ctl = _build_like_nvflare(wf)
        ctl.use_checked_options(ctl.check_options())
        assert ctl.task_config["gate"] is want, (text, ctl.task_config)
    assert ctl.task_config["init"] == "site" and ctl.strategy == "cid"  # other values untouched


def test_edited_job_bad_probe_size_or_server_device_names_the_argument(tmp_path):
    """A hand-edited ``"probe_size": "abc"`` used to fail in the constructor with Python's "invalid literal for int()"
    and ``"fusion_device": "tpu"`` without naming the argument; both now name it."""
    from hfl_components.flare.options import OptionError

    man = {s: tmp_path / "data" / f"{s}.csv" for s in SITES}
    job = _export_ohfl(tmp_path, tiny_profile(man, tmp_path / "profile", "ohfl"))
    wf = _edit_server_arg(job, "probe_size", "abc")
    with pytest.raises(OptionError, match=r"ohfl: option 'probe_size' \(--probe-size\): expected int, got 'abc'"):
        _build_like_nvflare(wf).check_options()
    wf = _edit_server_arg(job, "probe_size", "16")  # a quoted number is read as the number
    assert _build_like_nvflare(wf).probe_size == 16
    wf = _edit_server_arg(job, "fusion_device", "tpu")
    with pytest.raises(ValueError, match=r"^ohfl: fusion_device \(--server-device\) must be one of auto"):
        _build_like_nvflare(wf)


@pytest.mark.parametrize("key,value,says", [
    ("seed", "a", "must be an integer, got 'a'"), ("late_wait_s", -5, "must be at least 0, got -5"),
    ("min_sites", 0, "must be at least 1, got 0"), ("num_rounds", 2.5, "must be an integer, got 2.5"),
    ("task_timeout", True, "must be an integer, got True")])
def test_edited_job_bad_common_argument_names_it(tmp_path, key, value, says):
    """The common controller arguments of a hand-edited job are checked where NVFlare builds the controller: a
    negative ``late_wait_s`` used to become the adaptive wait silently, ``"seed": "a"`` failed in int() without a
    name. A quoted number is still read as the number."""
    man = {s: tmp_path / "data" / f"{s}.csv" for s in SITES}
    job = _export_ohfl(tmp_path, tiny_profile(man, tmp_path / "profile", "ohfl"))
    wf = _edit_server_arg(job, key, value)
    with pytest.raises(ValueError) as e:
        _build_like_nvflare(wf)
    assert str(e.value) == f"ohfl: {key} {says}"
    wf = _edit_server_arg(job, key, "7")
    assert getattr(_build_like_nvflare(wf), key) == 7
