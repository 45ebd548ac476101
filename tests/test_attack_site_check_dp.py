"""`cxr-hfl site check` refuses a dp budget that a job would refuse before training (batch above the training
images, delta >= 1/n), in one line naming the site, instead of printing OK."""
import csv

import pytest

from nvflare_jobs.site_check import check_site


def _site(tmp_path, data_root, extra: str, n_per_class: int = 3):
    rows = []
    for label, cls in enumerate(("NORMAL", "PNEUMONIA")):
        files = sorted((data_root / "chest_xray_original" / "train" / cls).iterdir())[: n_per_class + 2]
        splits = ["train"] * n_per_class + ["val", "test"]
        rows += [[str(f), label, sp] for f, sp in zip(files, splits)]
    man = tmp_path / "m.csv"
    with open(man, "w", newline="") as fh:
        csv.writer(fh).writerows([["path", "label", "split"], *rows])
    cfg = tmp_path / "hosp-dp.yaml"
    cfg.write_text(f"data: {{manifest: {man}, labels: binary}}\nmodel: {{family: cnn, depth: shallow}}\n"
                   f"input_size: 32\n{extra}\n")
    return cfg


@pytest.mark.parametrize("extra, words", [
    ("batch_size: 16\ndp: {epsilon: 8}", ("batch size 16", "6 training images")),
    ("batch_size: 2\ndp: {epsilon: 8, delta: 0.5}", ("delta 0.5", "1/n")),
])
def test_site_check_refuses_an_impossible_dp_budget(tmp_path, data_root, extra, words):
    rep = check_site(_site(tmp_path, data_root, extra), read_images=False)
    dp_errors = [e for e in rep["errors"] if "dp" in e]
    assert len(dp_errors) == 1, rep["errors"]
    assert "hosp-dp" in dp_errors[0] and all(w in dp_errors[0] for w in words), dp_errors[0]


def test_site_check_accepts_a_possible_dp_budget(tmp_path, data_root):
    rep = check_site(_site(tmp_path, data_root, "batch_size: 2\ndp: {epsilon: 8}"), read_images=False)
    assert not [e for e in rep["errors"] if "dp" in e], rep["errors"]


def test_site_check_without_images_still_names_a_deployed_model_it_cannot_read(tmp_path, data_root):
    """``--no-images`` skips the population check, but a ``deployed_model`` that is missing or not a model file is
    still one warning naming the file (before: nothing was said)."""
    junk = tmp_path / "junk.pt"
    junk.write_text("not a model")
    for model in (tmp_path / "missing.pt", junk):
        rep = check_site(_site(tmp_path, data_root, f"deployed_model: {model}"), read_images=False)
        lines = [w for w in rep["warnings"] if "deployed_model" in w]
        assert len(lines) == 1 and str(model) in lines[0] and "cannot be read" in lines[0], rep["warnings"]
