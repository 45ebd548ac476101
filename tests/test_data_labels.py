"""Label schemes have one owner (chest_xray.labels): names, counts, reverse look-up and the same-scheme check."""
import pytest

from chest_xray import (CLASS_NAMES, LABEL_SCHEMES, LabelSchemeMismatch, class_names, num_classes,
                        one_label_scheme, scheme_for_num_classes)


def test_schemes_names_and_counts():
    assert LABEL_SCHEMES == ("binary", "subtype")
    assert class_names("binary") == ["NORMAL", "PNEUMONIA"]
    assert class_names("subtype") == ["NORMAL", "BACTERIAL", "VIRAL"]
    assert (num_classes("binary"), num_classes("subtype")) == (2, 3)
    names = class_names("binary")
    names.append("X")  # a copy: the owner's table is not changed by a caller
    assert CLASS_NAMES["binary"] == ["NORMAL", "PNEUMONIA"]
    with pytest.raises(ValueError, match="unknown label scheme 'multi'"):
        num_classes("multi")


def test_scheme_for_num_classes_inverts_num_classes():
    for s in LABEL_SCHEMES:
        assert scheme_for_num_classes(num_classes(s)) == s
    with pytest.raises(ValueError, match="no single label scheme has 5 classes"):
        scheme_for_num_classes(5)


def test_one_label_scheme_agrees_and_skips_undeclared():
    assert one_label_scheme({"site-1": "subtype", "site-2": "subtype", "site-3": None}) == "subtype"
    assert one_label_scheme({"site-1": None}) is None
    assert one_label_scheme({}) is None


def test_one_label_scheme_refuses_a_mix_naming_the_sites():
    with pytest.raises(LabelSchemeMismatch) as e:
        one_label_scheme({"site-2": "binary", "site-3": "subtype", "site-1": "binary"})
    assert str(e.value) == "sites declare different label schemes: binary: site-1, site-2; subtype: site-3"
    with pytest.raises(ValueError, match="site site-4: unknown label scheme 'multi'"):
        one_label_scheme({"site-1": "binary", "site-4": "multi"})
