"""Population-shift warning: the batch statistics by hand, and on the shared images: quiet on unseen batches of
the training population, loud on shifts built here (geometry, contrast, added borders, DICOM age tags)."""
from __future__ import annotations

import numpy as np
import pytest

from hfl_components import shift

NAMES = ("a", "b")


def _ref(m=100, seed=0):
    rng = np.random.default_rng(seed)
    return shift.build_reference(rng.normal([0.0, 5.0], [1.0, 2.0], (m, 2)), stat_names=NAMES), rng


def test_batch_z_by_hand_and_small_batches_not_judged():
    ref, rng = _ref()
    mu, sd = np.array(ref["image"]["mean"]), np.array(ref["image"]["sd"])
    batch = rng.normal(mu, sd, (32, 2))
    batch[:, 1] += 1.5 * sd[1]  # a 1.5-sd shift of the second statistic
    res = shift.check_batch(ref, batch)
    z = (batch.mean(0) - mu) / (sd * np.sqrt(1 / 32 + 1 / 100))
    assert res["groups"]["image"]["score"] == pytest.approx(np.abs(z).max())
    assert "b z = +" in res["groups"]["image"]["detail"]
    assert res["warn"] and res["line"].startswith("WARNING: population shift: these 32 images")
    assert "\n" not in res["line"]
    small = shift.check_batch(ref, batch[: shift.MIN_BATCH - 1])
    assert not small["checked"] and not small["warn"] and "not judged" in small["line"]
    with pytest.raises(ValueError, match="against a reference of 2"):
        shift.check_batch(ref, batch[:, :1])


def test_attributes_age_manufacturer_by_hand():
    ref, rng = _ref()
    facts = [{"width": 1000, "height": 1000, "format": "DICOM", "manufacturer": "ACME", "age_years": 3.0}] * 100
    ref = shift.build_reference(rng.normal(size=(100, 2)), facts, stat_names=NAMES)
    assert ref["age_years"] == [3.0, 3.0] and ref["manufacturers"] == {"ACME": 100}
    stats = np.array(ref["image"]["mean"]) + np.zeros((20, 2))
    adults = [{**facts[0], "age_years": 45.0}] * 6 + [facts[0]] * 14  # 6 of 20 outside 2-4 years
    res = shift.check_batch(ref, stats, adults)
    assert res["groups"]["age"]["score"] == pytest.approx(0.3) and res["groups"]["age"]["fired"]
    assert res["flags"]["age"] == 6 and "6 of 20 images with a PatientAge outside 3-3 years" in res["line"]
    few = shift.check_batch(ref, stats, adults[:4] + [facts[0]] * 16)  # 4 of 20 = 0.2 < 0.25: counted, quiet
    assert not few["warn"] and few["flags"]["age"] == 4
    other = shift.check_batch(ref, stats, [{**facts[0], "manufacturer": "Other"}] * 20)
    assert other["groups"]["manufacturer"]["score"] == 1.0 and other["warn"]
    # declared population: ages from it when the files carry none
    jpeg = shift.build_reference(rng.normal(size=(10, 2)), [{"width": 9, "height": 9}] * 10, stat_names=NAMES,
                                 population=shift.KERMANY_POPULATION)
    assert jpeg["age_years"] == [1.0, 5.0] and "aged 1-5" in shift.population_statement(jpeg)


def test_merge_references_pools_exactly():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, (40, 2)), rng.normal(3, 2, (70, 2))
    m = shift.merge_references([shift.build_reference(a, stat_names=NAMES), shift.build_reference(b, stat_names=NAMES)])
    both = np.concatenate([a, b])
    assert m["n"] == 110
    assert m["image"]["mean"] == pytest.approx(both.mean(0).tolist())
    assert m["image"]["sd"] == pytest.approx(both.std(0, ddof=1).tolist())
    with pytest.raises(ValueError, match="no population references"):
        shift.merge_references([])


# --- on the shared images ---------------------------------------------------------------------------------------------
SIZE = 48
N_REF = 110
N_BATCH = 32


@pytest.fixture(scope="module")
def population(data_root, tmp_path_factory):
    """A reference from 110 tuning-part images under a fixed random-init ``cnn``, and the other tuning images."""
    import torch

    from chest_xray.splits import split_rows
    from hfl_components.models import build_model
    from nvflare_jobs.evaluation.population import check_files  # noqa: F401 -- the path under test

    root = data_root / "chest_xray_224"
    if not root.is_dir():
        pytest.skip(f"no chest_xray_224 under {data_root}")
    rows = split_rows("tuning")
    order = np.random.default_rng(0).permutation(len(rows))
    files = [root / rows[i]["path"] for i in order[: N_REF + 5 * N_BATCH]]
    torch.manual_seed(0)
    model = build_model({"family": "cnn", "num_classes": 2}).eval()
    ref = _reference(files[:N_REF], model)
    return {"ref": ref, "model": model, "unseen": files[N_REF:], "tmp": tmp_path_factory.mktemp("shifts")}


def _reference(files, model):
    import torch

    from chest_xray import build_transforms
    from chest_xray.population import population_facts

    tf = build_transforms(SIZE, "eval")
    X = torch.stack([tf({"image": str(f), "label": 0})["image"] for f in files])
    stats, feats = shift.features_and_statistics(model, X)
    return shift.build_reference(stats, [population_facts(f) for f in files], feats,
                                 population=shift.KERMANY_POPULATION)


def _check(population, files):
    from nvflare_jobs.evaluation.population import check_files

    return check_files(files, population["ref"], model=population["model"], size=SIZE)


def test_quiet_on_unseen_in_population_batches(population):
    unseen = population["unseen"]
    for k in range(5):  # five disjoint batches of 32 images the reference never saw
        res = _check(population, unseen[k * N_BATCH:(k + 1) * N_BATCH])
        assert res["checked"] and not res["warn"], res["line"]
        assert res["line"].startswith("population check: 32 images consistent")


def _write(tmp, name, arrays, fmt="png", age=None):
    """Write 2-d uint8 arrays as PNG files, or as DICOM (DX, MONOCHROME2, 8 bit) with ``PatientAge``."""
    from PIL import Image

    d = tmp / name
    d.mkdir(exist_ok=True)
    out = []
    for i, a in enumerate(arrays):
        p = d / f"{i}.{'dcm' if fmt == 'dcm' else 'png'}"
        if fmt == "dcm":
            _dicom(p, a, age)
        else:
            Image.fromarray(a).save(p)
        out.append(p)
    return out


def _dicom(path, a, age):
    import pydicom
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.ViewPosition, ds.PatientAge = "DX", "PA", age
    ds.Rows, ds.Columns = a.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = a.astype(np.uint8).tobytes()
    pydicom.dcmwrite(str(path), ds, enforce_file_format=True)


def _grey(f):
    from PIL import Image

    with Image.open(f) as im:
        return np.asarray(im.convert("L"))


@pytest.mark.parametrize("kind", ["geometry", "contrast", "black_border", "white_border", "adult_dicom_age"])
def test_fires_on_built_shifts(population, kind):
    from PIL import Image

    files = population["unseen"][:N_BATCH]
    imgs = [_grey(f) for f in files]
    tmp = population["tmp"]
    if kind == "geometry":  # another export geometry: 300 x 180 px, wider than high
        arr = [np.asarray(Image.fromarray(a).resize((300, 180), Image.BILINEAR)) for a in imgs]
        out = _write(tmp, kind, arr)
    elif kind == "contrast":  # another tone curve (gamma 0.6)
        out = _write(tmp, kind, [(255 * (a / 255.0) ** 0.6).astype(np.uint8) for a in imgs])
    elif kind in ("black_border", "white_border"):  # bands of 10 % of the side added around the film
        v = 0 if kind == "black_border" else 255
        out = _write(tmp, kind, [np.pad(a, ((22, 22), (22, 22)), constant_values=v) for a in imgs])
    else:  # the same pixels as DICOM of adult patients
        out = _write(tmp, kind, imgs, fmt="dcm", age="045Y")
    res = _check(population, out)
    assert res["checked"] and res["warn"], res["line"]
    assert res["line"].startswith("WARNING: population shift: these 32 images") and "\n" not in res["line"]
    expect = {"geometry": "image geometry", "contrast": "image statistics", "black_border": "image statistics",
              "white_border": "image statistics", "adult_dicom_age": "patient age: 32 of 32"}[kind]
    assert expect in res["line"]


def test_dicom_of_the_training_ages_stays_quiet(population):
    """The same pixels as DICOM of 3-year-olds: the age part alone made the adult batch warn."""
    files = population["unseen"][:N_BATCH]
    out = _write(population["tmp"], "child_dicom", [_grey(f) for f in files], fmt="dcm", age="003Y")
    res = _check(population, out)
    assert not res["warn"], res["line"]
    assert res["groups"]["age"]["score"] == 0.0


def test_predict_warns_once_at_batch_level(population, tmp_path, capsys):
    from hfl_components.models.files import save_model_file
    from nvflare_jobs.evaluation import predict_files

    model = population["model"]
    mf = save_model_file(tmp_path / "site-1_deployed.pt", {"family": "cnn", "num_classes": 2}, model.state_dict(),
                         input_size=SIZE, labels="binary", site="site-1", kind="deployed",
                         population=population["ref"])
    files = population["unseen"][:N_BATCH]
    quiet = predict_files(mf, [str(f) for f in files], tmp_path / "a.csv")
    assert quiet["population"]["checked"] and not quiet["population"]["warn"]
    assert "population shift" not in capsys.readouterr().err
    bordered = _write(tmp_path, "bands", [np.pad(_grey(f), 22) for f in files])
    loud = predict_files(mf, [str(tmp_path / "bands")], tmp_path / "b.csv")
    err = [ln for ln in capsys.readouterr().err.splitlines() if "population shift" in ln]
    assert loud["population"]["warn"] and len(err) == 1 and str(mf) in err[0]
    assert loud["n_ok"] == len(bordered)
    # a model file without a reference: predicted as before, the check says why it did not run
    plain = save_model_file(tmp_path / "plain.pt", {"family": "cnn", "num_classes": 2}, model.state_dict(),
                            input_size=SIZE, labels="binary")
    r = predict_files(plain, [str(f) for f in files[:3]], tmp_path / "c.csv")
    assert not r["population"]["checked"] and "records no training population" in r["population"]["line"]


def test_a_reference_of_another_model_is_said_not_raised():
    from nvflare_jobs.evaluation.population import batch_check

    ref, rng = _ref()
    ref["features"] = {"mean": [0.0] * 4, "sd": [1.0] * 4, "n_dims": 4, "n_kept": 4,
                       "distance": {"mean": 0.0, "sd": 1.0, "q99": 2.0, "n": 100}}
    res = batch_check(ref, [rng.normal(size=(20, 2))], [{}] * 20, [rng.normal(size=(20, 8))])
    assert not res["checked"] and "does not fit" in res["line"] and "4" in res["line"]


def test_site_check_warns_on_a_shift_against_the_named_deployed_model(population, tmp_path):
    """site check with deployed_model in the site config: quiet on in-population images, one warning line on a
    built shift (another geometry), and a warning naming the file when it records no population."""
    import csv

    import yaml
    from PIL import Image

    from hfl_components.models.files import save_model_file
    from nvflare_jobs.site_check import check_site

    model = population["model"]
    with_ref, without = tmp_path / "with.pt", tmp_path / "without.pt"
    spec = {"family": "cnn", "num_classes": 2}
    save_model_file(with_ref, spec, model.state_dict(), input_size=SIZE, labels="binary", population=population["ref"])
    save_model_file(without, spec, model.state_dict(), input_size=SIZE, labels="binary")
    files = population["unseen"][:N_BATCH]
    wide = _write(tmp_path, "wide", [np.asarray(Image.fromarray(_grey(f)).resize((300, 180))) for f in files])

    def run(paths, model_file):
        man = tmp_path / f"m{len(list(tmp_path.glob('m*.csv')))}.csv"
        with man.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "label", "split", "patient_id"])
            for i, f in enumerate(paths):
                w.writerow([str(f), i % 2, ["train", "val", "test"][i % 3], f"p{i}"])
        cfg = tmp_path / "site-1.yaml"
        cfg.write_text(yaml.safe_dump({"data": {"manifest": str(man), "labels": "binary"},
                                       "model": {"family": "cnn", "depth": "shallow"}, "input_size": SIZE,
                                       "deployed_model": str(model_file)}))
        return check_site(cfg, "site-1")

    quiet = run(files, with_ref)
    assert quiet["population"]["checked"] and not quiet["population"]["warn"], quiet["population"]["line"]
    shifted = run(wide, with_ref)
    assert shifted["population"]["warn"]
    assert [w for w in shifted["warnings"] if w.startswith("population shift against")]
    none = run(files, without)
    assert "population" not in none and any("records no training population" in w for w in none["warnings"])
