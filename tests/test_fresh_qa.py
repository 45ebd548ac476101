"""Bad input a fresh user gave the most recently changed commands (status, site score, evaluate of a FENS run,
predict, confirmatory analyse): each is refused in one line naming the file, exit 2, and nothing is lost."""
from __future__ import annotations

import argparse
import json

import pytest


def _one_line(err: str, *says):
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err


@pytest.mark.parametrize("content", ["{", "[]", "", "42"])
def test_status_names_a_metrics_file_that_is_not_a_json_object(tmp_path, capsys, content):
    from nvflare_jobs.commands.status import run_status

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(content)
    rc = run_status(argparse.Namespace(target=str(run), json=False, watch=None, startup_kit=None))
    assert rc == 2
    _one_line(capsys.readouterr().err, str(run / "metrics.json"), "not a readable JSON object")
    assert (run / "metrics.json").read_text() == content  # nothing lost


def test_status_skips_model_index_entries_that_are_not_objects(tmp_path):
    from nvflare_jobs.status import run_folder_view

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"sites": {"site-1": {}}}))
    (run / "models.json").write_text(json.dumps({"models": ["x", {"name": "site-1_local.pt", "kind": "local"}]}))
    v = run_folder_view(run)
    assert [m["name"] for m in v["models"]] == ["site-1_local.pt"]
    (run / "models.json").write_text("[1, 2]")
    assert run_folder_view(run)["models"] == []
