"""The server refuses a federation whose sites declare different label schemes, naming the sites."""
from __future__ import annotations

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from chest_xray import LabelSchemeMismatch
from hfl_components.flare.site_methods import ok_meta as _ok


def _answer(site: str, labels: str | None) -> FLModel:
    meta = {"status": "ok", "client_name": site, "n_train": 4, "input_size": 32}
    if labels is not None:
        meta["labels"] = labels
    return FLModel(params={"x": np.zeros(2, np.float32)}, metrics={}, meta=meta)


def _controller(answers_per_round):
    from hfl_components.flare.controllers import LocalController

    c = LocalController(num_rounds=len(answers_per_round), min_sites=1, late_wait_s=0)
    queue = list(answers_per_round)
    c.send_model_and_wait = lambda **kw: queue.pop(0)  # what NVFlare would return: the sites' answers
    return c


def test_same_scheme_is_recorded():
    c = _controller([[_answer("site-1", "subtype"), _answer("site-2", "subtype")]])
    good = c.broadcast("local_train", 0)
    assert sorted(good) == ["site-1", "site-2"]
    assert c.record["labels"] == "subtype"
    assert c.record["site_labels"] == {"site-1": "subtype", "site-2": "subtype"}


def test_mixed_schemes_are_refused_naming_the_sites():
    c = _controller([[_answer("site-1", "binary"), _answer("site-2", "subtype"), _answer("site-3", "binary")]])
    with pytest.raises(LabelSchemeMismatch, match="binary: site-1, site-3; subtype: site-2"):
        c.broadcast("local_train", 0)


def test_a_site_answering_late_with_another_scheme_is_refused():
    """Schemes are remembered across rounds: a site first heard in round 1 must match round 0's sites."""
    c = _controller([[_answer("site-1", "binary")], [_answer("site-1", "binary"), _answer("site-2", "subtype")]])
    c.broadcast("local_train", 0)
    with pytest.raises(LabelSchemeMismatch, match="binary: site-1; subtype: site-2"):
        c.broadcast("local_train", 1)


def test_sites_declare_their_scheme_in_every_answer():
    class _RT:
        labels, cfg = "subtype", {"input_size": 32}

        def n_train(self):
            return 5

        def released_count(self, n):  # a site without dp sends its count as it is
            return n

        def dp_record(self):
            return {"dp": False}

    assert _ok(_RT(), spec={"family": "cnn"})["labels"] == "subtype"
