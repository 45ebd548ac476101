"""A method of FENS's shape -- every site's model sent to every site, a run-record field of its own and a compare
schedule of its own -- added from this one file, with no edit to ``results``, ``status`` or ``compare``: its
catalogue entry declares the record field (``record_fields``) and the budget plan (``plan``), and those consumers
read the declarations.

"Peer ensemble" (test-only): FENS's controller and site handlers, plus a record of what each site received from
its peers (``peer_exchange``), and a compare plan that spends the common budget on local training (one
upload, then one aggregator round of 1 aggregator epoch)."""
from __future__ import annotations

import json

from hfl_components.flare import catalogue
from hfl_components.flare.controllers.fens import FENSController


class PeerEnsembleController(FENSController):
    """FENS, recording the bytes each site received from its peers (every other site's model, once)."""

    method = "peer_ensemble"

    def run_method(self):
        super().run_method()
        sites = sorted(self.record.get("sites") or {})
        self.record["peer_exchange"] = {"sites": len(sites), "models_per_site": len(sites)}


def summarise_peers(v: dict) -> str:
    """The record field's one line (status, compare)."""
    return f"every site holds {v['models_per_site']} site models ({v['sites']} sites)"


def peer_plan(budget: int, entry) -> dict:
    """The method's own schedule under compare's common budget E: E - 1 local epochs, then 1 aggregator round of 1
    aggregator epoch."""
    return {"rounds": 1, "local_epochs": budget - 1, "finetune_epochs": 0, "aggregator_epochs": 1,
            "total_epochs_per_site": budget}


_FENS = catalogue.entry("fens")
ENTRY = catalogue.register(catalogue.MethodEntry(
    "peer_ensemble", f"{__name__}.PeerEnsembleController", dict(_FENS.site_handlers), rounds=1, local_epochs=1,
    options=_FENS.options, schedule="peer", plan=f"{__name__}:peer_plan",
    record_fields=(catalogue.RecordField("peer_exchange", "peer exchange", f"{__name__}:summarise_peers"),),
    upload_checks=dict(_FENS.upload_checks), uploads=_FENS.uploads, summary="test-only: FENS with a peer record"))


def _run_in_process(tmp_path):
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller
    from tests.test_inprocess import _site

    profile = {"site-1": _site(tmp_path, "site-1", 24), "site-2": {**_site(tmp_path, "site-2", 20), "input_size": 24}}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    ctl = make_controller("peer_ensemble", profile, {"rounds": 1, "local_epochs": 1, "seed": 0, "fens_holdout": 0.3,
                                                     "fens_epochs": 1})
    t = InProcessTransport(runtimes, runtime_answer(runtimes, raise_errors=True))
    t.attach(ctl, tmp_path / "server", info=lambda m: None, warning=lambda m: None)
    ctl.run()
    return t, tmp_path / "server" / "cxr_hfl_results" / "server_results.json"


def test_a_fens_shaped_method_needs_no_edit_of_results_status_or_compare(tmp_path):
    from chest_xray import CLASS_NAMES
    from nvflare_jobs.compare import comparison_markdown, comparison_rows, epoch_plan
    from nvflare_jobs.results import assemble_run
    from nvflare_jobs.status import format_view, run_folder_view

    t, results = _run_in_process(tmp_path)
    # its schedule: every site's model to every site (the first aggregator message carries both members)
    first = next(data for task, rnd, data, *_ in t.sent if task == "fens_aggregate")
    assert {k.split(".")[1] for k in first if k.startswith("member.")} == {"0", "1"}
    rec = json.loads(results.read_text())
    assert rec["peer_exchange"]["sites"] == 2 and rec["peer_exchange"]["models_per_site"] == 2
    # results: the declared field reaches metrics.json
    run = tmp_path / "run"
    run.mkdir()
    metrics = assemble_run(results, run, labels="binary", seed=0, wall_time_s=1.0, class_names=CLASS_NAMES["binary"])
    assert metrics["peer_exchange"] == rec["peer_exchange"]
    assert json.loads((run / "metrics.json").read_text())["peer_exchange"] == rec["peer_exchange"]
    # status: shown by its label and summary
    line = "peer exchange: every site holds 2 site models (2 sites)"
    assert ("peer exchange", line.split(": ", 1)[1]) in run_folder_view(run)["record"]
    assert line in format_view(run_folder_view(run))
    # compare: its own budget plan, and its record in the comparison's markdown
    args = type("A", (), {"local_epochs": 20, "finetune_epochs": 10, "rounds": None, "unequal_budgets": False,
                          "proto_protocol": False})()
    assert epoch_plan("peer_ensemble", args) == {"rounds": 1, "local_epochs": 29, "finetune_epochs": 0,
                                                 "aggregator_epochs": 1, "total_epochs_per_site": 30}
    runs = [("peer_ensemble", 0, metrics)]
    md = comparison_markdown(tmp_path, runs, comparison_rows(runs, thresholds=False), plans={})
    assert f"- peer_ensemble, seed 0: {line}" in md
