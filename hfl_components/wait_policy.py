"""How long the server waits for sites on one task: a pure policy with an injectable clock (no NVFlare).

The controller (``hfl_components.flare.controllers``) polls :meth:`WaitPolicy.decide` every half second with what it
has observed about each target site of the task:

* ``fetched_at`` -- when the site fetched the task (NVFlare records it per client task); a site process that is
  not running never fetches;
* ``answered_at`` and ``compute_s`` -- when the answer arrived and the site's own compute seconds for the task
  (``meta["compute_s"]``);
* ``last_heard`` -- the last progress heartbeat from the site (sent every ``HEARTBEAT_S`` seconds while it works
  on a task), ``None`` when the site never sent one (an older site script, or a deployment that drops the events).

Rules for a site that has not answered (each drop carries a one-line reason for the console and ``metrics.json``):

1. **Down before:** a site that did not answer an earlier task and has not fetched this one is not waited for.
2. **Never fetched:** a site that has not fetched the task ``fetch_grace_s`` (30 s) after it was sent is not
   running (it never started, or its process died) and is dropped.
3. **Gone silent:** a site that fetched the task and heart-beat before, but has been silent for ``silence_s``
   (30 s = 6 missed heartbeats), has stopped and is dropped.
4. **Adaptive late wait:** once ``min_sites`` sites have answered, the others get at most
   ``max(floor_s, k x the slowest answering site's compute seconds)`` more (``floor_s`` = 60 s, ``k`` = 3: a site
   three times slower than the slowest site that answered is still waited for). After that, a site that is still
   heart-beating is *kept* (slow but alive, e.g. a bigger model); one that is not is dropped.
5. **Fixed override:** with ``late_wait_s`` set (``--late-wait``), rule 4 uses that fixed number of seconds instead
   and drops every unanswered site when it runs out, alive or not (the behaviour before the adaptive wait).

The task is over when every site has answered or been dropped, or when fewer than ``min_sites`` answers remain
possible (the controller then fails the round by name instead of waiting).
"""
from __future__ import annotations

from dataclasses import dataclass, field

HEARTBEAT_S = 5.0  # a busy site sends a progress heartbeat this often
DEFAULT_K = 3.0
DEFAULT_FLOOR_S = 60.0
DEFAULT_FETCH_GRACE_S = 30.0
DEFAULT_SILENCE_S = 30.0


@dataclass
class SiteView:
    """What the server has observed about one target site during one task (times in seconds, one clock)."""

    fetched_at: float | None = None
    answered_at: float | None = None
    compute_s: float | None = None
    last_heard: float | None = None


@dataclass
class Decision:
    """``done``: stop waiting now. ``dropped``: {site: reason} for unanswered sites no longer waited for.
    ``waiting``: sites still waited for. ``deadline``: seconds (on the policy's clock) when the late wait of rule 4/5
    ends, None before ``min_sites`` answered. ``too_few``: fewer than ``min_sites`` answers remain possible."""

    done: bool
    dropped: dict = field(default_factory=dict)
    waiting: list = field(default_factory=list)
    deadline: float | None = None
    too_few: bool = False


class WaitPolicy:
    """Waiting rules for one task (see the module docstring).

    Args:
        min_sites (int): answers needed for the round to go on.
        late_wait_s (float | None): fixed late wait (``--late-wait``); None = adaptive (rule 4).
        k (float): multiple of the slowest answering site's compute time in the adaptive late wait. Default 3.
        floor_s (float): the adaptive late wait is never shorter than this. Default 60 s.
        fetch_grace_s (float): a site that has not fetched the task after this long is not running. Default 30 s.
        silence_s (float): a heart-beating site silent this long has stopped. Default 30 s.
    """

    def __init__(self, min_sites: int, late_wait_s: float | None = None, k: float = DEFAULT_K,
                 floor_s: float = DEFAULT_FLOOR_S, fetch_grace_s: float = DEFAULT_FETCH_GRACE_S,
                 silence_s: float = DEFAULT_SILENCE_S):
        if min_sites < 1:
            raise ValueError(f"min_sites must be >= 1, got {min_sites}")
        if late_wait_s is not None and late_wait_s < 0:
            raise ValueError(f"late_wait_s must be >= 0 or None, got {late_wait_s}")
        self.min_sites = int(min_sites)
        self.late_wait_s = None if late_wait_s is None else float(late_wait_s)
        self.k = float(k)
        self.floor_s = float(floor_s)
        self.fetch_grace_s = float(fetch_grace_s)
        self.silence_s = float(silence_s)

    def late_wait(self, answered: dict[str, SiteView], start: float) -> float:
        """Seconds to wait for the rest once ``min_sites`` have answered (rule 4, or the fixed override)."""
        if self.late_wait_s is not None:
            return self.late_wait_s
        slowest = max((v.compute_s if v.compute_s is not None else v.answered_at - start)
                      for v in answered.values())
        return max(self.floor_s, self.k * float(slowest))

    def decide(self, now: float, start: float, sites: dict[str, SiteView], down_before=()) -> Decision:
        """Which unanswered sites are still waited for at time ``now`` of a task sent at ``start``.

        Args:
            now, start: seconds on one clock (``time.monotonic`` in the controller, a fake clock in tests).
            sites: {site: SiteView} for every target of the task.
            down_before: sites that did not answer an earlier task (rule 1).
        Returns:
            :class:`Decision`.
        """
        answered = {s: v for s, v in sites.items() if v.answered_at is not None}
        deadline, lw = None, None
        if len(answered) >= self.min_sites and answered:
            t_min = sorted(v.answered_at for v in answered.values())[self.min_sites - 1]
            lw = self.late_wait(answered, start)
            deadline = t_min + lw
        dropped, waiting = {}, []
        for s, v in sorted(sites.items()):
            if v.answered_at is not None:
                continue
            if v.fetched_at is None and s in set(down_before):
                dropped[s] = "did not answer an earlier task and has not fetched this one (site down)"
            elif v.fetched_at is None and now - start >= self.fetch_grace_s:
                dropped[s] = (f"did not fetch the task within {self.fetch_grace_s:.0f} s (site process not running: "
                              f"it never started or has stopped)")
            elif v.fetched_at is not None and v.last_heard is not None and now - v.last_heard >= self.silence_s:
                dropped[s] = (f"silent for {now - v.last_heard:.0f} s while working on the task (no heartbeat; "
                              f"site stopped)")
            elif deadline is not None and now >= deadline:
                alive = v.last_heard is not None and now - v.last_heard < self.silence_s
                if self.late_wait_s is None and alive:
                    waiting.append(s)  # slow but alive: kept
                else:
                    dropped[s] = (f"no answer {now - start:.0f} s after the task was sent (late wait of "
                                  f"{lw:.0f} s after "
                                  f"{self.min_sites} answers ran out)")
            else:
                waiting.append(s)
        too_few = len(answered) + len(waiting) < self.min_sites
        return Decision(done=not waiting or too_few, dropped=dropped, waiting=waiting, deadline=deadline,
                        too_few=too_few)
