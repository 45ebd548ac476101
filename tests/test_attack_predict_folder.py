"""`cxr-hfl predict` on a folder: a file without a suffix that is not DICOM (a JPEG exported as ``IM-0001-0003``)
is reported as skipped with its reason, as `partition` reports it, never silently left out of the CSV and the
"N of M files" count; a DICOM without a suffix is still predicted, hidden files (``.DS_Store``) stay out."""
import shutil

from nvflare_jobs.evaluation.predict import collect_files


def test_a_folder_file_without_suffix_that_is_not_dicom_is_reported_skipped(tmp_path, data_root):
    jpeg = sorted((data_root / "chest_xray_original" / "train" / "NORMAL").iterdir())[0]
    dcm = data_root / "dicom" / "RG1_UNCR.dcm"
    shutil.copy(jpeg, tmp_path / "IM-0001-0003")
    shutil.copy(dcm, tmp_path / "IM-0001-0001")
    shutil.copy(jpeg, tmp_path / "a.jpeg")
    (tmp_path / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    skipped: list[dict] = []
    files = collect_files([str(tmp_path)], skipped)
    assert sorted(f.name for f in files) == ["IM-0001-0001", "a.jpeg"]
    assert [s["path"] for s in skipped] == [str(tmp_path / "IM-0001-0003")], skipped
    assert "no suffix, not DICOM" in skipped[0]["reason"]
