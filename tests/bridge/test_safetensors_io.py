"""The bridge's streaming safetensors reader agrees with the safetensors library and refuses damaged files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore.bridge.errors import BridgeError
from mcore.bridge.safetensors_io import read_header, read_tensor

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


def _random(shape, dtype, generator):
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=generator).to(dtype)


@pytest.fixture()
def tensors():
    g = torch.Generator().manual_seed(7)
    shapes = [(3, 5), (7,), (), (2, 0, 3), (4, 1, 6)]
    return {f"t{i}.{str(d)[6:]}": _random(shapes[i % len(shapes)], d, g) for i, d in enumerate(DTYPES)}


def test_reader_reads_library_files_exactly(tmp_path, tensors):
    path = tmp_path / "y.safetensors"
    save_file(tensors, path)
    header = read_header(path)
    reference = load_file(path)
    assert list(header.tensors) == sorted(header.tensors, key=lambda n: header.tensors[n].offset)
    for name, entry in header.tensors.items():
        got = read_tensor(entry)
        assert got.dtype == reference[name].dtype and torch.equal(got, reference[name]), name


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[:-3], "truncated safetensors file"),
        (lambda data: data[:5], "fewer than the 8-byte header length"),
        (lambda data: struct.pack("<Q", 10**12) + data[8:], "header claims"),
        (lambda data: data[:8] + b"x" + data[9:], "corrupt safetensors header"),
        (lambda data: data + b"\0" * 8, "header describes"),
    ],
)
def test_damaged_files_are_reported_with_the_path(tmp_path, damage, message):
    path = tmp_path / "d.safetensors"
    save_file({"w": torch.rand(4, 4), "b": torch.rand(4)}, path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BridgeError, match=message) as exc:
        read_header(path)
    assert str(path) in str(exc.value)


def test_offsets_that_do_not_match_the_shape_are_refused(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "o.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 12)
    with pytest.raises(BridgeError, match="needs 16 bytes but its offsets"):
        read_header(path)
