"""Rules for the grey-scale attributes of a DICOM image that are missing, inconsistent or contradictory.

Each rule reads the attribute as the major viewers do and returns a note that :func:`chest_xray.io.read_image`
records in ``meta["grayscale_notes"]`` (a scan lists it, ``site check`` counts it), so a site can see every step
that changed its pixels.

- **VOI LUT output range** (PS3.3 C.11.2.1.1): the LUT Descriptor's third value gives the bits of a LUT entry,
  and the LUT output is scaled to [0, 2^bits - 1]. Some CR modalities (Agfa among them) write 16 while the LUT data
  are 12-bit; read literally, the image is 16x too dark. Rule: the output range is [0, 2^b - 1] with b the bits
  the LUT's largest entry needs (at least 8) whenever b differs from the descriptor's value, as cornerstone and
  dicom-rs do; a note names both bit counts.
- **Polarity: Photometric Interpretation and Presentation LUT Shape** (PS3.3 C.7.6.3.1.2, C.11.6.1.1): the
  standard has two ways of saying "low values are bright": MONOCHROME1, and a Presentation LUT Shape of INVERSE
  (which it pairs with MONOCHROME1; IDENTITY goes with MONOCHROME2). Rule: the image is inverted once when either
  says so, never twice; a pair that contradicts itself (MONOCHROME2 with INVERSE, MONOCHROME1 with IDENTITY) is
  noted, and so is a Presentation LUT Shape that is neither value (ignored).
- **Modality LUT** (PS3.3 C.11.1): a Modality LUT Sequence of one item, or Rescale Slope and Intercept, never
  both. A LUT is applied by hand, as the VOI LUT is (values below its first mapped value take the first entry,
  above the last the last; a first mapped value written as US for signed data is read as signed); its entries are
  read as 16-bit words whatever bits the descriptor states (8-bit entries packed one per byte excepted). The
  standard allows 8 or 16 bits per entry: another value (12 is written by some modalities, and pydicom refuses
  it) is noted. A LUT beside Rescale Slope / Intercept wins (as pydicom and DCMTK read it) and the rescale is
  noted as ignored; so is every item after the first. Rescale Slope / Intercept go through pydicom's
  ``apply_modality_lut``.
- **Pixel Padding Value** (PS3.3 C.7.5.1.1.2): stored values equal to it (or within it and Pixel Padding Range
  Limit) lie outside the radiograph. Rule: they are left out of the range an image without a usable VOI transform
  is scaled to, and shown black, as viewers show them; a note gives their count. A padding value no pixel holds is
  ignored silently, and so is one every pixel holds (nothing would be left).
"""

from __future__ import annotations

import numpy as np

#: Kinds of the notes these rules write (``meta["grayscale_notes"][i]["kind"]``).
NOTE_KINDS = ("VOI LUT rescaled", "VOI LUT length", "polarity contradiction", "Presentation LUT Shape ignored",
              "pixel padding", "modality LUT")


def _note(kind: str, text: str) -> dict[str, str]:
    return {"kind": kind, "note": text}


def voi_lut_bits(item) -> tuple[int, dict[str, str] | None]:
    """Bits of a VOI LUT's output (the scale of its entries), and a note when the descriptor disagrees with them.

    Args:
        item: a VOI LUT Sequence item (LUT Descriptor and LUT Data present, as :func:`voi_problem` checked).

    Returns:
        ``(bits, note)``: the descriptor's bits when the data need exactly those, else the bits the largest entry
        needs (at least 8), with a ``"VOI LUT rescaled"`` note.
    """
    desc_bits = int(item.LUTDescriptor[2])
    values = lut_values(item)
    top = int(values.max()) if values.size else 0
    need = max(8, top.bit_length())
    if need == desc_bits:
        return desc_bits, None
    return need, _note("VOI LUT rescaled", f"VOI LUT Descriptor says {desc_bits}-bit entries but the LUT data are "
                                           f"{need}-bit (largest entry {top}): output scaled to 0..{2 ** need - 1}")


def lut_values(item) -> np.ndarray:
    """The entries of a LUT item (LUT Data as US values or OW words; 8-bit entries one per byte when the data
    hold fewer than two bytes per entry), as integers."""
    n = int(item.LUTDescriptor[0]) or 65536  # 0 means 2^16 entries
    data = item.LUTData
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
        if len(raw) < 2 * n and int(item.LUTDescriptor[2]) <= 8:  # 8-bit entries, one per byte
            return np.frombuffer(raw[:n], "u1")
        return np.frombuffer(raw[: 2 * min(n, len(raw) // 2)], "<u2")  # words; a short LUT keeps what it holds
    return np.asarray(data if isinstance(data, (list, tuple)) or hasattr(data, "__len__") else [data], np.int64)


def lut_length_note(item, what: str = "VOI LUT") -> dict[str, str] | None:
    """A note when a LUT holds another number of entries than its descriptor says (its data are used as they are:
    values past the last entry take the last, as for any LUT), else None. ``what``: "VOI LUT" or "Modality LUT"."""
    n, got = int(item.LUTDescriptor[0]) or 65536, len(lut_values(item))
    if got == n:
        return None
    kind = "VOI LUT length" if what == "VOI LUT" else "modality LUT"
    return _note(kind, f"{what} Descriptor says {n} entries but the LUT data hold {got}: the data's entries used")


def modality_lut_problem(ds) -> str | None:
    """Why the Modality LUT Sequence cannot be applied (one line naming the attribute), or None when it is valid
    or absent: an item needs a three-value LUT Descriptor with 1..16 bits per entry and LUT Data."""
    seq = ds.get("ModalityLUTSequence")
    if not seq:
        return None
    try:
        item = seq[0]
        desc = item.get("LUTDescriptor")
        desc = list(desc) if desc is not None and not isinstance(desc, (int, float)) else [desc]
        if len(desc) != 3 or not 1 <= int(desc[2]) <= 16:
            return f"invalid Modality LUT Sequence: LUT Descriptor {desc} (three values, 1..16 bits per entry)"
        if "LUTData" not in item or not len(lut_values(item)):
            return "invalid Modality LUT Sequence: no LUT Data"
    except (TypeError, ValueError, IndexError, AttributeError) as e:
        return f"invalid Modality LUT Sequence ({type(e).__name__}: {e})"
    return None


def modality_transform(ds, raw: np.ndarray) -> tuple[np.ndarray, list[dict[str, str]]]:
    """Stored values (rows, cols) -> modality-LUT output (float64, same shape), by the rule in the module docstring,
    and the notes it wrote.

    Raises:
        ValueError: the Modality LUT Sequence is malformed (:func:`modality_lut_problem`'s line).
    """
    from pydicom.pixels import apply_modality_lut

    seq = ds.get("ModalityLUTSequence")
    if not seq:
        return np.asarray(apply_modality_lut(raw, ds), dtype=np.float64), []
    why = modality_lut_problem(ds)
    if why:
        raise ValueError(why)
    item, notes = seq[0], []
    bits = int(item.LUTDescriptor[2])
    if bits not in (8, 16):
        notes.append(_note("modality LUT", f"Modality LUT Descriptor says {bits}-bit entries (the standard allows 8 "
                                           "or 16): entries read as 16-bit words and applied by hand"))
    rescale = [k for k in ("RescaleSlope", "RescaleIntercept") if ds.get(k) not in (None, "")]
    if rescale:
        notes.append(_note("modality LUT", "Modality LUT Sequence and Rescale Slope / Intercept both present (the "
                                           "standard allows one): the LUT applied, the rescale ignored"))
    if len(seq) > 1:
        notes.append(_note("modality LUT", f"Modality LUT Sequence holds {len(seq)} items (the standard allows one): "
                                           "the first applied"))
    notes += [n for n in (lut_length_note(item, "Modality LUT"),) if n]
    return apply_lut(raw, item), notes


def apply_lut(arr: np.ndarray, item) -> np.ndarray:
    """``arr`` (modality-LUT output) through a LUT item by hand (PS3.3 C.11.2.1.1): values below the first mapped
    value take the first entry, above the last the last. Every VOI LUT is applied this way: pydicom's LUT reads
    the descriptor's bits literally (it refuses entries wider than the descriptor says), read 8-bit LUTs 4x too
    dark, refused 8-bit entries packed one per byte, and took a negative first mapped value written as US for a
    large positive one."""
    values = lut_values(item)
    first = int(item.LUTDescriptor[1])
    if first >= 2**15 and np.min(arr) < 0:  # a negative first value written as US
        first -= 2**16
    idx = np.clip(np.rint(np.asarray(arr, dtype=np.float64)).astype(np.int64) - first, 0, len(values) - 1)
    return values[idx].astype(np.float64)


def polarity(ds, photometric: str) -> tuple[bool, dict[str, str] | None]:
    """Whether the grey-scale output is inverted (low values bright), by the rule in the module docstring.

    Args:
        ds: the pydicom data set.
        photometric: its Photometric Interpretation, "MONOCHROME1" or "MONOCHROME2".

    Returns:
        ``(inverted, note)``: note is None when the attributes agree or the shape is absent.
    """
    shape = str(ds.get("PresentationLUTShape", "") or "").strip().upper()
    mono1 = photometric == "MONOCHROME1"
    if not shape:
        return mono1, None
    if shape not in ("IDENTITY", "INVERSE"):
        return mono1, _note("Presentation LUT Shape ignored", f"unknown Presentation LUT Shape {shape!r} ignored; "
                                                               f"polarity from {photometric}")
    inverse = shape == "INVERSE"
    if inverse != mono1:
        return True, _note("polarity contradiction", f"{photometric} with Presentation LUT Shape {shape}: read as "
                                                     "inverted (low values bright), as either attribute says")
    return mono1, None



def padding_mask(ds, raw: np.ndarray) -> tuple[np.ndarray | None, dict[str, str] | None]:
    """Boolean mask (rows, cols) of the padding pixels by the rule in the module docstring, and its note; ``(None,
    None)`` when there is no Pixel Padding Value, or it marks no pixel or every pixel."""
    def first(v):
        v = v[0] if isinstance(v, (list, tuple)) or type(v).__name__ == "MultiValue" else v
        return int(v)

    try:
        value = ds.get("PixelPaddingValue")
        if value is None or value == "":
            return None, None
        lo = hi = first(value)
        limit = ds.get("PixelPaddingRangeLimit")
        if limit is not None and limit != "":
            lo, hi = sorted((lo, first(limit)))
    except (TypeError, ValueError, IndexError):
        return None, _note("pixel padding", "Pixel Padding Value is not a number: ignored")
    mask = (raw >= lo) & (raw <= hi)
    n = int(mask.sum())
    if n == 0 or n == mask.size:
        return None, None
    span = f"{lo}" if lo == hi else f"{lo}..{hi}"
    return mask, _note("pixel padding", f"{n} pixels ({100.0 * n / mask.size:.1f} %) hold the Pixel Padding Value "
                                        f"({span}): left out of the grey-scale range and shown black")
