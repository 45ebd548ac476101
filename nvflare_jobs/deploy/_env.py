"""The nvflare command line as subprocesses, with an environment kept out of the user's home (see the package
docstring)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_PROJECT = REPO / "site_configs" / "project.yml"
STATE_FILE = "cxr_hfl_poc.json"
POC_ADMIN = "poc-admin@cxr-consortium.example.org"  # nvflare poc needs exactly one project_admin; never used to submit
SERVER_PORTS = (8002, 8003)  # POC fed_learn and admin ports
SITE_SCRIPT_NAME = "site_script.py"


class DeployError(RuntimeError):
    """A provisioning / POC / submission step failed; the message says which and where its log is."""


# ------------------------------------------------------------------------------------------------ environment
def nvflare_exe() -> str:
    """The ``nvflare`` command of this interpreter's environment (else the first on PATH)."""
    cand = Path(sys.executable).parent / "nvflare"
    if cand.is_file():
        return str(cand)
    found = shutil.which("nvflare")
    if not found:
        raise DeployError("the nvflare command is not installed in this environment (pip install nvflare)")
    return found


def nvflare_env(poc_dir: str | os.PathLike | None = None, home: str | os.PathLike | None = None) -> dict:
    """Environment for NVFlare subprocesses (see the module docstring)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("CXR_HFL_SITE_CONFIG_DIR", None)
    env.pop("NVFL_WORKSPACE", None)
    env["PYTHONUNBUFFERED"] = "1"
    if poc_dir is not None:
        poc_dir = Path(poc_dir).resolve()
        env["NVFLARE_POC_WORKSPACE"] = str(poc_dir / "nvflare_poc")
        home = home or poc_dir / "home"
    if home is not None:
        Path(home).mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(Path(home).resolve())
    return env


def run_nvflare(args: list[str], env: dict, *, timeout: float = 300, log: Path | None = None,
                json_out: bool = False, check: bool = True, umask: int | None = None):
    """Run ``nvflare ARGS``; output goes to ``log`` (a file, so NVFlare's daemons never hold our pipe open).
    ``umask`` (e.g. ``0o077``): the file-creation mask of the command and every process it starts (POC: the
    server and sites, so the job store and workspaces are readable by their owner only).

    Returns the parsed JSON ``data`` when ``json_out`` (``nvflare --format json``), else the output text.
    Raises DeployError on a non-zero exit (when ``check``) or a timeout.
    """
    cmd = [nvflare_exe(), *(["--format", "json"] if json_out else []), *args]
    own_log = log is None
    if own_log:
        import tempfile

        fd, name = tempfile.mkstemp(prefix="nvflare_", suffix=".log")
        os.close(fd)
        log = Path(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=timeout, cwd=env.get("HOME"),
                                    **({} if umask is None else {"umask": umask})).returncode
            except subprocess.TimeoutExpired:
                raise DeployError(f"`nvflare {' '.join(args)}` timed out after {timeout:.0f} s (log: {log})") from None
        text = log.read_text(errors="replace")
    finally:
        if own_log:
            log.unlink(missing_ok=True)
    if check and rc != 0:
        raise DeployError(f"`nvflare {' '.join(args)}` failed (exit {rc}):\n{text[-3000:]}")
    if not json_out:
        return text
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if check and doc.get("status") not in (None, "ok"):
                raise DeployError(f"`nvflare {' '.join(args)}`: {doc}")
            return doc.get("data", doc)
    raise DeployError(f"`nvflare {' '.join(args)}` printed no JSON result:\n{text[-3000:]}")
