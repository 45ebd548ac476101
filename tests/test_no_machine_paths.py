"""No committed result holds an absolute machine path: every tracked results file (data files anywhere; Markdown
under ``studies/`` and ``benchmarks/results/``), and every text array of every tracked ``predictions.npz``, is
scanned for paths such as ``/work/...``, ``/home/...``, ``/root/...``, ``/tmp/...`` or ``C:\\...``. Images are keyed
by paths relative to their data root (``train/NORMAL/IM-0115-0001.jpeg``)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
#: absolute paths of a machine: POSIX home, scratch and mount roots, and a Windows drive
MACHINE = re.compile(r"(?<![\w.~-])/(?:work|home|root|tmp|Users|mnt|scratch|private/var|var/folders)/"
                     r"|(?<![A-Za-z])[A-Za-z]:\\")
DATA = (".json", ".jsonl", ".csv", ".txt", ".html", ".npz", ".yaml", ".yml")
RESULT_DIRS = ("studies/", "benchmarks/results/")


def machine_paths(text: str) -> list[str]:
    """The machine paths in ``text`` (each hit with a little context)."""
    return [text[max(0, m.start() - 20):m.end() + 30] for m in MACHINE.finditer(text)]


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of committed files to scan")
    return out.split()


def _results(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith(DATA) or (f.endswith(".md") and f.startswith(RESULT_DIRS))]


def test_the_pattern_finds_machine_paths_and_leaves_relative_ones():
    assert machine_paths('{"data": "/work/shared/data/chest_xray_224"}')
    assert machine_paths("run /home/alice/runs/x") and machine_paths("C:\\Users\\a\\x.jpeg")
    assert machine_paths('"C:\\\\data\\\\x"') and machine_paths("--out /tmp/c2_sim")
    assert not machine_paths('{"data": "../shared/data/chest_xray_224", "run": "runs/confirmatory/seed40/ohfl"}')
    assert not machine_paths("train/NORMAL/IM-0115-0001.jpeg; ./runs/tmp/x; p=0.5/work")


def test_no_committed_result_holds_a_machine_path():
    bad = []
    for f in _results(_tracked()):
        p = REPO / f
        if not p.is_file():
            continue
        if f.endswith(".npz"):
            with np.load(p, allow_pickle=False) as z:
                texts = [str(v) for k in z.files if z[k].dtype.kind in "US" for v in z[k].ravel()]
            hits = [t for t in texts if machine_paths(t)][:1]
        else:
            hits = machine_paths(p.read_text(encoding="utf-8", errors="replace"))[:1]
        bad += [f"{f}: {h!r}" for h in hits]
    assert not bad, "machine paths in committed results:\n" + "\n".join(bad)


def test_the_scan_covers_the_protocols_predictions():
    files = _results(_tracked())
    assert sum(f.endswith("predictions.npz") for f in files) >= 60
    assert "studies/confirmatory/protocols/confirmatory_10seeds/RESULT.md" in files
