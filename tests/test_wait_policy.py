"""The server's waiting rules (``hfl_components.wait_policy``) on a fake clock: dead sites are dropped at the next
task without waiting out a late wait, slow-but-alive sites are kept, the adaptive bound is max(60 s, k x slowest)."""
from __future__ import annotations

import pytest

from hfl_components.wait_policy import SiteView, WaitPolicy


def _run(policy, sites_fn, t_end=10_000.0, step=0.5, down=()):
    """Advance a fake clock from 0 until the policy says done; returns (time, decision)."""
    t = 0.0
    while t <= t_end:
        d = policy.decide(t, 0.0, sites_fn(t), down_before=down)
        if d.done:
            return t, d
        t += step
    raise AssertionError("policy never finished")


def _view(t, fetch=None, answer=None, compute=None, beats_until=None, beat_every=5.0):
    """A site seen at time t: fetched at ``fetch``, answered at ``answer``, heart-beating until ``beats_until``."""
    v = SiteView()
    if fetch is not None and t >= fetch:
        v.fetched_at = fetch
    if answer is not None and t >= answer:
        v.answered_at, v.compute_s = answer, compute
    if beats_until is not None and fetch is not None and t >= fetch:
        last = min(t, beats_until)
        v.last_heard = fetch + beat_every * int((last - fetch) // beat_every)
    return v


def test_site_down_before_is_dropped_at_once_at_the_next_task():
    """A killed site (no answer to the last task) never fetches the next: it is not waited for at all, and the task
    ends as soon as the live sites answer -- long before a fixed late wait of 900 s would."""
    pol = WaitPolicy(min_sites=2, late_wait_s=900)

    def sites(t):
        return {"a": _view(t, 0.2, 12.0, 11.0, 12.0), "b": _view(t, 0.3, 15.0, 14.0, 15.0), "dead": _view(t)}

    t, d = _run(pol, sites, down=("dead",))
    assert t == 15.0  # the moment the last live site answered
    assert list(d.dropped) == ["dead"] and "site down" in d.dropped["dead"]
    d0 = pol.decide(0.0, 0.0, sites(0.0), down_before=("dead",))
    assert d0.dropped == {"dead": d.dropped["dead"]} and sorted(d0.waiting) == ["a", "b"]  # at task start


def test_site_that_never_started_is_dropped_after_the_fetch_grace_not_the_late_wait():
    pol = WaitPolicy(min_sites=2, late_wait_s=900, fetch_grace_s=30)

    def sites(t):
        return {"a": _view(t, 1, 100.0, 99.0, 100.0), "b": _view(t, 1, 120.0, 119.0, 120.0), "never": _view(t)}

    d = pol.decide(29.5, 0.0, sites(29.5))
    assert "never" in d.waiting  # within the grace a slow starter is still waited for
    d = pol.decide(30.0, 0.0, sites(30.0))
    assert "did not fetch the task within 30 s" in d.dropped["never"] and not d.done
    t, d = _run(pol, sites)
    assert t == 120.0 and set(d.dropped) == {"never"}


def test_killed_mid_task_with_heartbeats_is_dropped_after_the_silence_window():
    """Killed at t=40 while training (heartbeats every 5 s stop): dropped 30 s after its last heartbeat, while
    the other sites are still working (min_sites not yet reached)."""
    pol = WaitPolicy(min_sites=2, silence_s=30)

    def sites(t):
        return {"a": _view(t, 1, 300.0, 299.0, 300.0), "b": _view(t, 1, 310.0, 309.0, 310.0),
                "killed": _view(t, 1, None, None, beats_until=40.0)}

    last_beat = 1 + 5 * int((40.0 - 1) // 5)  # 36
    d = pol.decide(last_beat + 29.5, 0.0, sites(last_beat + 29.5))
    assert "killed" in d.waiting
    d = pol.decide(last_beat + 30, 0.0, sites(last_beat + 30))
    assert "silent for 30 s" in d.dropped["killed"] and sorted(d.waiting) == ["a", "b"]


def test_slow_but_alive_site_is_kept_past_the_adaptive_bound():
    """A site 10x slower than the others (a bigger model) keeps heart-beating: it is waited for until it answers,
    although the adaptive bound max(60, 3 x 20 s) = 60 s after the 2nd answer ran out long before."""
    pol = WaitPolicy(min_sites=2)

    def sites(t):
        return {"a": _view(t, 1, 20.0, 19.0, 20.0), "b": _view(t, 1, 21.0, 20.0, 21.0),
                "big": _view(t, 1, 400.0, 399.0, beats_until=400.0)}

    t, d = _run(pol, sites)
    assert t == 400.0 and d.dropped == {}
    mid = pol.decide(200.0, 0.0, sites(200.0))
    assert mid.waiting == ["big"] and mid.deadline == pytest.approx(21.0 + 60.0)


def test_adaptive_bound_without_heartbeats_is_max_of_floor_and_k_times_slowest():
    """A site that fetched the task but never heart-beats (liveness unknown) gets max(60 s, k x slowest compute)
    after min_sites answered; compute seconds come from the answers, not from wall time."""
    for compute, k, expect in ((10.0, 3.0, 60.0), (50.0, 3.0, 150.0), (50.0, 2.0, 100.0)):
        pol = WaitPolicy(min_sites=2, k=k)

        def sites(t, c=compute):
            return {"a": _view(t, 1, 70.0, c - 5, None), "b": _view(t, 1, 80.0, c, None), "mute": _view(t, 1)}

        t, d = _run(pol, sites)
        assert t == pytest.approx(80.0 + expect), (compute, k)
        assert "late wait of" in d.dropped["mute"] and f"{expect:.0f} s" in d.dropped["mute"]
        assert pol.late_wait({"a": sites(200)["a"], "b": sites(200)["b"]}, 0.0) == pytest.approx(expect)


def test_fixed_late_wait_overrides_and_drops_even_alive_sites():
    pol = WaitPolicy(min_sites=2, late_wait_s=100)

    def sites(t):
        return {"a": _view(t, 1, 20.0, 19.0, 20.0), "b": _view(t, 1, 21.0, 20.0, 21.0),
                "big": _view(t, 1, 400.0, 399.0, beats_until=400.0)}

    t, d = _run(pol, sites)
    assert t == 121.0 and list(d.dropped) == ["big"]
    pol0 = WaitPolicy(min_sites=2, late_wait_s=float("inf"))  # --late-wait 0: wait for every live site
    t, d = _run(pol0, sites)
    assert t == 400.0 and not d.dropped


def test_too_few_possible_answers_ends_the_task_at_once():
    """min_sites=3 of 3 and one site is down: the task cannot succeed, so the policy stops at once (the controller
    then fails the round by name) instead of waiting for the others."""
    pol = WaitPolicy(min_sites=3)
    d = pol.decide(0.0, 0.0, {"a": SiteView(), "b": SiteView(), "dead": SiteView()}, down_before=("dead",))
    assert d.done and d.too_few and list(d.dropped) == ["dead"]
    with pytest.raises(ValueError):
        WaitPolicy(min_sites=0)
