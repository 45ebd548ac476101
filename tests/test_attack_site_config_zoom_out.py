"""Bad input on the ``cxr-hfl site check`` path of ``augment: zoom_out``: a key given twice is refused naming the
file and the key (PyYAML kept the last silently, so ``augment: zoom_out`` above the template's own ``augment:``
line vanished), and the check's augment line says that a frame augmentation acts on every class whatever
``augment_classes`` says (it reported ``training images of none`` for ``augment_classes: []``)."""
import numpy as np
import pytest
from PIL import Image

from hfl_components.flare.site_config import SiteConfigError, load_site_config

MODEL = "model: {family: cnn, depth: shallow, width: 1.0}\n"


@pytest.mark.parametrize("text, key, line", [
    ("data: {manifest: x.csv}\n" + MODEL + "augment: zoom_out\nlr: 0.01\naugment: monai\n", "augment", 5),
    ("data: {manifest: x.csv, manifest: y.csv}\n" + MODEL, "manifest", 1),
])
def test_a_key_given_twice_is_refused_naming_the_file_and_the_key(tmp_path, text, key, line):
    f = tmp_path / "hospital-z.yaml"
    f.write_text(text)
    with pytest.raises(SiteConfigError) as e:
        load_site_config("hospital-z", f, check_files=False)
    msg = str(e.value)
    assert str(f) in msg and f"{key!r}" in msg and f"line {line}," in msg and "\n" not in msg


def test_keys_given_once_and_exponent_numbers_still_read(tmp_path):
    f = tmp_path / "hospital-z.yaml"
    f.write_text("data: {manifest: x.csv}\nmodel: {family: cnn, depth: shallow, width: 1.0}\n"
                 "lr: 1e-3\naugment: zoom_out\n")
    cfg = load_site_config("hospital-z", f, check_files=False)
    assert cfg["lr"] == pytest.approx(0.001) and cfg["augment"] == "zoom_out"


@pytest.mark.parametrize("augment, classes, framed", [("zoom_out", "[]", True), ("zoom_out", "all", True),
                                                      ("border", "[]", True), ("monai", "[]", False)])
def test_site_check_says_a_frame_augmentation_acts_on_every_class(tmp_path, augment, classes, framed):
    from nvflare_jobs.site_check import check_site, format_report

    rows = ["path,label,split"]
    for i, (label, split) in enumerate([(0, "train"), (1, "train"), (0, "val"), (1, "val"), (0, "test"), (1, "test")]):
        p = tmp_path / f"im{i}.png"
        Image.fromarray(np.full((70, 90), 40 + 30 * i, np.uint8), mode="L").save(p)
        rows.append(f"{p},{label},{split}")
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    f = tmp_path / "hospital-z.yaml"
    f.write_text(f"data: {{manifest: {tmp_path / 'm.csv'}, labels: binary}}\n{MODEL}"
                 f"augment: {augment}\naugment_classes: {classes}\n")
    rep = check_site(f, workers=1)
    assert rep["errors"] == [] and rep["frame_augment"] == (augment if framed else None)
    line = next(x for x in format_report(rep).splitlines() if x.strip().startswith("augment"))
    assert (f"augment: {augment} frames the training images of every class" in line) == framed


@pytest.mark.parametrize("method", ["fedsaf", "fedproto", "fedtopo"])
@pytest.mark.parametrize("augment", ["zoom_out", "monai", "border_raw"])
def test_a_per_image_augment_for_a_prototype_method_is_refused_before_anything_is_scanned(method, augment):
    """The prototype methods' generated site configs set fast_augment: true (flip + shift on cached tensors), which
    the site config refuses beside a per-image augment: simulate scanned the data and wrote six site configs first
    (six lines naming files it then removed); compare ran every (seed, method) into a failed run (exit 1)."""
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve

    with pytest.raises(SimulateError) as e:
        resolve(method, {"augment": augment})
    assert e.value.key == "augment" and augment in str(e.value) and "\n" not in str(e.value)
    assert resolve("ohfl", {"augment": augment}).augment == augment
    assert resolve(method, {"augment": "batch"}).augment == "batch"  # batch with fast_augment stays valid


def test_compare_refuses_a_per_image_augment_with_a_prototype_method_before_any_run(tmp_path, capsys):
    from nvflare_jobs.compare import compare

    out = tmp_path / "cmp"
    assert compare(out, methods="local,fedsaf", augment="zoom_out") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--augment zoom_out" in err and "fedsaf" in err
    assert not out.exists()
