"""Cheap checks of ``scripts/train_default_model.py``'s issue 27 helpers: the dependency-free PNG
writer (decoded back with zlib) and the size budget arithmetic."""

from __future__ import annotations

import importlib.util
import os
import struct
import sys
import zlib
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_default_model.py"
_spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
tdm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tdm  # its dataclass looks the module up while it is created
# The script sets OMP/MKL thread variables for its own run as it is imported; they must not leak into
# this process, whose later subprocesses (tests/test_threads.py) would inherit them.
_environ = dict(os.environ)
try:
    _spec.loader.exec_module(tdm)
finally:
    os.environ.clear()
    os.environ.update(_environ)


def test_write_png_round_trips(tmp_path):
    width, height = 3, 2
    pixels = bytearray(range(width * height * 3))
    path = tmp_path / "p.png"
    tdm.write_png(path, width, height, pixels)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and struct.unpack(">II", data[16:24]) == (width, height)
    idat_at = data.index(b"IDAT")
    (idat_len,) = struct.unpack(">I", data[idat_at - 4:idat_at])
    rows = zlib.decompress(data[idat_at + 4:idat_at + 4 + idat_len])
    # each row: filter byte 0, then the row's RGB bytes
    assert rows == b"".join(b"\x00" + bytes(pixels[y * 9:(y + 1) * 9]) for y in range(height))


def test_plot_loss_without_matplotlib_writes_a_png(tmp_path):
    note = tdm.plot_loss(tmp_path / "c.png", [10, 20, 30], [6.0, 5.0, 4.5], [(20, 5.2)])
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert note


def test_model_megabytes():
    # 10 M parameters: 40 MB in fp32, 20 MB in bf16, plus ~60 B a vocab entry of tokenizer.json
    assert tdm.model_megabytes(10_000_000, "float32", 0) == 40.0
    assert tdm.model_megabytes(10_000_000, "bfloat16", 1000) == pytest.approx(20.06)
