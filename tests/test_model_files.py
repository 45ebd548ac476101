"""The model file (hfl_components.models.files): round trip, provenance, and clear refusals naming the file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hfl_components.models import build_model, load_model_file, read_model_header, save_model_file
from hfl_components.models.files import HEADER_KEY, file_sha256

torch.set_num_threads(1)

SPEC = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 3}


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(SPEC)


def test_round_trip_keeps_weights_outputs_and_header(tmp_path):
    m = _model()
    manifest = tmp_path / "site-1.csv"
    manifest.write_text("path,label,split\na.png,0,train\n")
    p = save_model_file(tmp_path / "m.pt", SPEC, m.state_dict(), input_size=48, labels="subtype", site="site-1",
                        kind="deployed", provenance={"method": "ohfl", "seed": 7,
                                                     "manifest_sha256": file_sha256(manifest)})
    m2, h = load_model_file(p)
    assert not m2.training
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    x = torch.randn(2, 1, 48, 48)
    with torch.no_grad():
        assert torch.equal(m.eval()(x), m2(x))
    assert h["spec"] == SPEC and h["input_size"] == 48 and h["site"] == "site-1" and h["kind"] == "deployed"
    assert h["labels"] == "subtype" and h["class_names"] == ["NORMAL", "BACTERIAL", "VIRAL"]
    import hashlib

    assert h["provenance"]["manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert h["provenance"]["method"] == "ohfl" and h["provenance"]["seed"] == 7
    assert h["provenance"]["code_version"].startswith("cxr-hfl")
    assert read_model_header(p) == h


def test_numpy_state_and_no_pickle(tmp_path):
    """The server saves numpy weights; the file is safetensors (no pickle / zip magic) with a JSON header."""
    m = _model(1)
    state = {k: v.numpy().copy() for k, v in m.state_dict().items()}
    p = save_model_file(tmp_path / "g.pt", SPEC, state, provenance={"method": "fedavg", "seed": 0})
    raw = p.read_bytes()
    assert raw[:2] != b"PK"
    n = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and 8 + n < len(raw)
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    assert json.loads(meta[HEADER_KEY])["input_size"] is None
    m2, _ = load_model_file(p)
    for k, v in state.items():
        assert np.array_equal(v, m2.state_dict()[k].numpy()), k


def test_corrupt_weights_refused_naming_the_file(tmp_path):
    p = save_model_file(tmp_path / "m.pt", SPEC, _model().state_dict(), labels="subtype")
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0xFF  # flip bits in the last tensor's data
    p.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"m\.pt: corrupt model file \(the weights do not match the hash"):
        load_model_file(p)
    p.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
    with pytest.raises(ValueError, match=r"m\.pt: "):
        load_model_file(p)


def test_mismatched_labels_and_spec_refused(tmp_path):
    with pytest.raises(ValueError, match="label scheme 'binary' has 2 classes, the model 3"):
        save_model_file(tmp_path / "a.pt", SPEC, _model().state_dict(), labels="binary")
    other = {**SPEC, "depth": "deep"}
    p = save_model_file(tmp_path / "b.pt", other, build_model(other).state_dict())
    # same weights under a header that claims the shallow spec: rebuilt model does not fit
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    hdr = json.loads(head["__metadata__"][HEADER_KEY])
    hdr["spec"] = SPEC
    head["__metadata__"][HEADER_KEY] = json.dumps(hdr)
    new = json.dumps(head).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    (tmp_path / "c.pt").write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    with pytest.raises(ValueError, match=r"c\.pt: model file does not match its own spec"):
        load_model_file(tmp_path / "c.pt")


def test_old_torch_save_file_and_other_files_refused_clearly(tmp_path):
    old = tmp_path / "site-1_deployed.pt"
    torch.save({"spec": SPEC, "state_dict": _model().state_dict()}, old)
    with pytest.raises(ValueError, match=r"site-1_deployed\.pt: a model file in the old torch.save \(pickle\) format"):
        load_model_file(old)
    txt = tmp_path / "notes.pt"
    txt.write_text("hello world, not a model")
    with pytest.raises(ValueError, match=r"notes\.pt: not a cxr-hfl model file"):
        load_model_file(txt)
    with pytest.raises(ValueError, match="is a folder"):
        load_model_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_model_file(tmp_path / "missing.pt")


def test_a_header_length_whose_low_byte_is_the_pickle_opcode_is_still_a_model_file(tmp_path):
    """A safetensors file starts with its header length (little-endian); when that length is 0x..80 the first byte
    equals pickle's PROTO opcode, and the file must still load (it was refused as an old torch.save file)."""
    m = _model(1)
    for k in range(300):
        p = save_model_file(tmp_path / "m.pt", SPEC, m.state_dict(), site="s" * (1 + k))
        if p.read_bytes()[:1] == b"\x80":
            break
    else:
        pytest.fail("no site name length gave a header length ending in 0x80")
    model, h = load_model_file(p)
    assert h["site"] == "s" * (1 + k)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m.state_dict().values()))
