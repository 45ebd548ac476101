"""Raw JPEG frames as DICOM exports save them as ``.jpg``, built at test time (nothing committed).

:func:`lossless_frame` encodes grey-scale pixels as JPEG Lossless (Process 14, SOF3) with GDCM, in a child process
(GDCM's Python objects can abort the interpreter at exit when an encoder's output outlives them);
:func:`dicom_frame` takes the first frame of an encapsulated DICOM file as it is.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_ENCODE = r'''
import sys, numpy as np, gdcm
a = np.load(sys.argv[1]); bits = int(sys.argv[3]); ts = getattr(gdcm.TransferSyntax, sys.argv[4])
alloc = 8 if a.dtype == np.uint8 else 16
img = gdcm.Image(); img.SetNumberOfDimensions(2); img.SetDimensions((a.shape[1], a.shape[0], 1))
img.SetPixelFormat(gdcm.PixelFormat(1, alloc, bits, bits - 1, 0))
img.SetPhotometricInterpretation(gdcm.PhotometricInterpretation(gdcm.PhotometricInterpretation.MONOCHROME2))
img.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.ExplicitVRLittleEndian))
el = gdcm.DataElement(gdcm.Tag(0x7fe0, 0x0010)); el.SetByteStringValue(a.astype("<u%d" % (alloc // 8)).tobytes())
img.SetDataElement(el)
ch = gdcm.ImageChangeTransferSyntax(); ch.SetTransferSyntax(gdcm.TransferSyntax(ts)); ch.SetInput(img)
assert ch.Change()
frag = ch.GetOutput().GetDataElement().GetSequenceOfFragments().GetFragment(0)
open(sys.argv[2], "wb").write(frag.GetByteValue().GetBuffer().encode("utf-8", "surrogateescape"))
sys.stdout.flush()
import os; os._exit(0)
'''


def gdcm_frame(pixels: np.ndarray, dest: Path, bits: int, syntax: str = "JPEGLosslessProcess14_1") -> Path:
    """``pixels`` (uint8 or uint16, (H, W)) encoded by GDCM as one JPEG frame of ``bits`` bits per sample."""
    pytest.importorskip("gdcm")
    src = dest.with_suffix(".npy")
    np.save(src, pixels)
    r = subprocess.run([sys.executable, "-c", _ENCODE, str(src), str(dest), str(bits), syntax],
                       capture_output=True, text=True, timeout=120)
    src.unlink()
    if r.returncode != 0 or not dest.is_file():
        pytest.skip(f"GDCM could not encode {syntax}: {r.stderr.strip()[-200:]}")
    return dest


def dicom_frame(src: Path, dest: Path) -> Path:
    """The first frame of an encapsulated (compressed) DICOM file, written as it is."""
    import pydicom
    from pydicom.encaps import generate_frames

    ds = pydicom.dcmread(src)
    dest.write_bytes(next(generate_frames(ds.PixelData, number_of_frames=1)))
    return dest
