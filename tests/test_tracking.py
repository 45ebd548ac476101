"""Experiment tracking through NVFlare's components: a simulator run of the main job (OHFL, tiny budget) writes
TensorBoard event files on the server with each site's per-epoch loss curve and validation metrics; nothing in
them names an image, a path, a patient or a DICOM field; ``cxr-hfl status --json`` names every site."""
from __future__ import annotations

import csv
import json

import pytest

from tests.deploy_helpers import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_simulator_run_writes_per_site_loss_curves_and_nothing_identifying(tmp_path, data_root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (data_root / "chest_xray_original").is_dir():
        pytest.skip(f"no chest_xray_original under {data_root}")
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "ohfl", "--sites", "3", "--local-epochs", "2", "--finetune-epochs", "1",
                "--max-train-images", "16", "--input-sizes", "32", "--batch-size", "8", "--probe", "generated",
                "--data", str(data_root / "chest_xray_original"), "--out", str(run), timeout=540)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    m = json.loads((run / "metrics.json").read_text())
    tb = run / "workspace" / "server" / "simulate_job" / "tb_events"
    assert m["tensorboard"] == str(tb.resolve())
    sites = sorted(m["sites"])
    assert sorted(p.name for p in tb.iterdir()) == sites == ["site-1", "site-2", "site-3"]
    forbidden = {str(data_root), "chest_xray", ".jpeg", ".dcm", "PatientID", "PatientName"}
    for site in sites:
        used = [row["path"] for row in csv.DictReader((run / "partition" / "sites" / f"{site}.csv").open())]
        ea = EventAccumulator(str(tb / site), size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        tags = ea.Tags()
        # NVFlare streams each event as its own message: the receiver may write them out of order, the steps say
        loss = sorted((e.step, e.value) for e in ea.Scalars("train/loss"))
        # two local epochs (OHFL uploads once), steps 1, 2 of the site's epoch counter; one fine-tuning epoch after
        assert [s for s, _ in loss] == [1, 2] and all(v > 0 for _, v in loss), loss
        assert [e.step for e in ea.Scalars("finetune/loss")] == [3]
        assert {"val/accuracy", "val/balanced_accuracy"} <= set(tags["scalars"])
        blob = b"".join(p.read_bytes() for p in (tb / site).iterdir())
        leaks = [s for s in forbidden | {u for u in used[:50]} | {u.rsplit("/", 1)[-1] for u in used[:50]}
                 if s.encode() in blob]
        assert not leaks, f"{site}: {leaks[:5]}"
    # the run's models.json indexes every model file with its hash
    import hashlib

    idx = json.loads((run / "models.json").read_text())["models"]
    assert {e["name"] for e in idx} >= {f"{s}_deployed" for s in sites}
    for e in idx:
        assert e["sha256"] == hashlib.sha256((run / e["file"]).read_bytes()).hexdigest()
    r = run_cli("status", str(run), "--json")
    v = json.loads(r.stdout)
    assert r.returncode == 0 and v["job_state"] == "FINISHED:COMPLETED" and sorted(v["sites"]) == sites
    assert all(s["state"] == "took part" and s["test"] for s in v["sites"].values()) and v["gate"] is not None
