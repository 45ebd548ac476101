"""The status view words where a job is in the job's own terms: the last task is the final evaluation (not one more
round), and FENS's steps -- one upload in its local phase, R aggregator rounds, one call that only installs the
final aggregator -- never read as a round past the R the user asked for."""
from __future__ import annotations

import re

import pytest

from nvflare_jobs.progress import describe_server
from nvflare_jobs.status import describe_site, format_view, job_view, step


@pytest.mark.parametrize("method, task, rnd, n, want", [
    ("fens", "fens_local", 0, 1, "local phase"),
    ("fens", "fens_aggregate", 1, 1, "aggregator round 1 of 1"),
    ("fens", "fens_aggregate", 2, 3, "aggregator round 2 of 3"),
    ("fens", "fens_aggregate", 2, 1, "installing the final aggregator"),
    ("fens", "evaluate", 2, 1, "final evaluation"),
    ("ohfl", "evaluate", 2, 1, "final evaluation"),
    ("fedavg", "fedavg_train", 1, 3, None),  # the round number says it
    ("ohfl", "ohfl_finetune", 1, 1, None),
    (None, "fens_aggregate", 2, 1, None),  # an older snapshot without the method: as before
    ("fens", None, None, 1, None),
])
def test_step_words_the_tasks_whose_round_number_would_mislead(method, task, rnd, n, want):
    assert step(method, task, rnd, n) == want


def test_fens_with_one_round_never_shows_a_second_round(tmp_path):
    """The real FENS controller and site handlers, in process, --rounds 1: at every task the server's snapshot
    (its round number with the task it sends) words the step as above in `cxr-hfl status`'s head line, the live
    console and the site lines; no line names a round above 1."""
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller
    from tests.test_inprocess import _site

    profile = {"site-1": _site(tmp_path, "site-1", 12), "site-2": _site(tmp_path, "site-2", 12)}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    real, snaps = runtime_answer(runtimes, raise_errors=True), []
    ctl = make_controller("fens", profile, {"rounds": 1, "local_epochs": 1, "seed": 0, "fens_holdout": 0.3,
                                            "fens_epochs": 1})

    def answer(task, site, data):
        if site == "site-1":  # the server's state while the sites work on the task
            snaps.append({**ctl.status_snapshot(), "task": task, "phase": "waiting", "waiting_for": list(profile),
                          "sites": {s: {"task": task, "round": data.current_round} for s in profile}})
        return real(task, site, data)

    InProcessTransport(runtimes, answer).attach(ctl, tmp_path / "server", info=lambda m: None,
                                                warning=lambda m: None)
    ctl.run()
    assert [(s["task"], s["round"], s["num_rounds"]) for s in snaps] == [
        ("fens_local", 0, 1), ("fens_aggregate", 1, 1), ("fens_aggregate", 2, 1), ("evaluate", 2, 1)]
    heads = [format_view(job_view(s, job_state="RUNNING")).splitlines()[0] for s in snaps]
    assert [h.split("; ", 1)[1] for h in heads] == [
        "local phase task fens_local (waiting)", "aggregator round 1 of 1 task fens_aggregate (waiting)",
        "installing the final aggregator task fens_aggregate (waiting)", "final evaluation task evaluate (waiting)"]
    assert [describe_server(s).split(":")[0] for s in snaps] == [
        "local phase (fens_local)", "aggregator round 1 of 1 (fens_aggregate)",
        "installing the final aggregator (fens_aggregate)", "final evaluation (evaluate)"]
    lines = [ln for s in snaps for ln in format_view(job_view(s, job_state="RUNNING")).splitlines()]
    lines += [describe_site(d) for s in snaps for d in job_view(s, job_state="RUNNING")["sites"].values()]
    rounds = [int(a or b) for ln in lines for a, b in re.findall(r"\bround (\d+)|\br(\d+)\b", ln)]
    assert rounds and max(rounds) == 1, lines


def test_validation_of_the_final_evaluation_is_named_so():
    """A site's latest validation metric from the final evaluation reads (final evaluation), not a round past the
    last one; one from a training round keeps its round."""
    snap = {"phase": "done", "method": "fens", "task": "evaluate", "round": 2, "num_rounds": 1,
            "latest_val": {"site-1": {"round": 2, "balanced_accuracy": 0.5},
                           "site-2": {"round": 1, "balanced_accuracy": 0.75}}}
    text = format_view(job_view(snap, job_state="FINISHED:COMPLETED", sites=["site-1", "site-2"]))
    assert "val balanced_accuracy 0.500 (final evaluation)" in text
    assert "val balanced_accuracy 0.750 (round 1)" in text and "round 2" not in text
