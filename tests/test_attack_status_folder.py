"""`cxr-hfl status RUN` on a run folder whose ``metrics.json`` is a JSON object without a run record (``{}``, an
edited or foreign file) refuses in one line naming the file (exit 2) instead of reporting FINISHED:COMPLETED."""
import json

from nvflare_jobs.cli import main


def test_status_refuses_a_metrics_file_without_a_run_record(tmp_path, capsys):
    for body in ({}, {"sites": {}}, {"pooled": {"auc": 0.9}}):
        (tmp_path / "metrics.json").write_text(json.dumps(body))
        assert main(["status", str(tmp_path)]) == 2, body
        cap = capsys.readouterr()
        err = cap.err.strip()
        assert "COMPLETED" not in cap.out and len(err.splitlines()) == 1, (cap.out, err)
        assert str(tmp_path / "metrics.json") in err, err


def test_status_still_reads_a_run_record(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text(json.dumps({"method": "local", "sites": {}}))
    assert main(["status", str(tmp_path)]) == 0
    assert "FINISHED:COMPLETED" in capsys.readouterr().out
