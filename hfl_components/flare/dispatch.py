"""A site's task dispatch: the handler of each task the server sends, as the method catalogue names it, wrapped so
the site runtime knows the task's method and that method's default epochs. The site script and the in-process
transport call :func:`handler`; the handlers themselves (:mod:`hfl_components.flare.site_methods`, the controller
modules) never import the catalogue, which names them."""
from __future__ import annotations

import functools

from hfl_components.flare.catalogue import CATALOGUE, method_defaults, site_handler
from hfl_components.flare.site_crosseval import cross_eval
from hfl_components.flare.site_methods import protect_answer


def _with_method(task_handler):
    """Wrap a handler so the site runtime knows the method of the task it runs (``meta["method"]``, sent by the
    server; recorded in the provenance of the model files the site saves) and its catalogue defaults
    (``rt.method_defaults``: epochs a site config leaves out). Under the site config's ``dp`` a prototype method
    is refused (its uploads are class means of training features, which DP-SGD does not cover), as is the
    pooled-data reference (role ``ceiling``: its training images leave the site), and the answer
    passes :func:`hfl_components.flare.site_methods.protect_answer`."""
    @functools.wraps(task_handler)
    def run(rt, params, meta):
        rt.method = meta.get("method") or rt.method
        rt.method_defaults = method_defaults(rt.method) if rt.method in CATALOGUE else None
        if rt.cfg.get("dp") and rt.method in CATALOGUE and CATALOGUE[rt.method].prototype:
            raise ValueError(f"site {rt.site}: dp covers model weights, but {rt.method} uploads class prototypes / "
                             "relation matrices of training features, which it does not cover; remove dp from "
                             "the site config or choose ohfl, fedavg, fedprox, fens or local")
        if rt.cfg.get("dp") and rt.method in CATALOGUE and CATALOGUE[rt.method].role == "ceiling":
            raise ValueError(f"site {rt.site}: dp covers model weights, but {rt.method} is the pooled-data reference: "
                             "its training images leave the site, which no DP-SGD budget covers; remove dp from the "
                             "site config or choose ohfl, fedavg, fedprox, fens or local")
        return protect_answer(rt, task_handler.__name__, task_handler(rt, params, meta))

    return run


def handler(task: str):
    """The site handler of ``task`` (the catalogue's ``site_handler``; ``cross_eval``, the cross-site evaluation
    of model files, belongs to no method: :func:`hfl_components.flare.site_crosseval.cross_eval`), wrapped to
    record the task's method.

    Raises:
        ValueError: no method answers ``task`` (the message lists the known tasks).
    """
    return _with_method(cross_eval if task == "cross_eval" else site_handler(task))
