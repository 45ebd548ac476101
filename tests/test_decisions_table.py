"""The table of current defaults at the top of docs/decisions.md is the one ``docs/defaults_table.py`` generates
from the method catalogue: every value is the catalogue's, and every link names an entry of the log."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "decisions.md"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("defaults_table", REPO / "docs" / "defaults_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_table_is_the_generated_one(gen):
    text = DOC.read_text(encoding="utf-8")
    assert gen.BEGIN in text and gen.END in text
    assert gen.updated(text) == text, "docs/decisions.md: run `python -m docs.defaults_table`"


def test_the_table_comes_before_every_entry_and_shows_the_catalogues_distill_steps(gen):
    from hfl_components.flare import catalogue

    text = DOC.read_text(encoding="utf-8")
    first_entry = text.index("\n## ", text.index(gen.END))
    assert text.index(gen.BEGIN) < first_entry
    steps = catalogue.option_defaults("ohfl")["distill_steps"]
    row = next(r for r in text.splitlines() if r.startswith("| `distill_steps` |"))
    assert f"| `{steps}` | ohfl |" in row and "becomes the default" in row
    # the first place the log states the distillation steps is the table's current value
    start = text.index(row)
    assert start < text.index("distill_steps") < start + len(row)


def test_every_link_names_one_heading_of_the_log(gen):
    text = DOC.read_text(encoding="utf-8")
    anchors = {gen.anchor(h) for h in gen.headings(text)}
    block = text[text.index(gen.BEGIN):text.index(gen.END)]
    links = [seg.split(")")[0] for seg in block.split("](#")[1:]]
    assert links and all(a in anchors for a in links)


def test_a_changed_default_changes_the_table(gen, monkeypatch):
    from hfl_components.flare import catalogue

    text = DOC.read_text(encoding="utf-8")
    real = catalogue.option_defaults
    monkeypatch.setattr(catalogue, "option_defaults",
                        lambda m: {**real(m), **({"distill_steps": 123} if m == "ohfl" else {})})
    new = gen.updated(text)
    assert new != text and "| `distill_steps` | `123` | ohfl |" in new


def test_github_anchors_by_hand(gen):
    assert gen.anchor("OHFL ground_metric = acts") == "ohfl-ground_metric--acts"
    assert gen.anchor("FedProto lambda = 0, gamma = 1/64") == "fedproto-lambda--0-gamma--164"
    assert gen.anchor("OHFL gate = on, criterion AUC → balanced accuracy") == "ohfl-gate--on-criterion-auc--balanced-accuracy"


def test_an_entry_named_by_two_headings_is_refused(gen):
    with pytest.raises(ValueError, match="2 entries start with 'OHFL ground_metric = acts'"):
        gen.table(DOC.read_text(encoding="utf-8") + "\n## OHFL ground_metric = acts (again)\n")
