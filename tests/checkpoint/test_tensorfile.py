"""The streaming safetensors writer/reader: standard files, exact bytes, checksums computed on the way."""

from __future__ import annotations

import hashlib

import pytest
import safetensors
import safetensors.torch
import torch

from dynemb.checkpoint import CheckpointError, tensorfile
from dynemb.checkpoint.tensorfile import FileRecord, read_tensors, write_tensors


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 3, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "f64": torch.randn(3, generator=g).double(),
        "i64": torch.tensor([torch.iinfo(torch.int64).min, -1, 0, torch.iinfo(torch.int64).max]),
        "i32": torch.tensor([torch.iinfo(torch.int32).min, 7], dtype=torch.int32),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(12.0).view(3, 4).t(),
        # one element of an interleaved column: torch calls it contiguous whatever its stride
        "one_of_two": torch.tensor([[-5, 9]])[:, 0],
        "one_row": torch.arange(6, dtype=torch.int32).view(3, 2)[:1, 1:],
    }


@pytest.mark.parametrize("name", sorted(_tensors()))
def test_byte_view_gives_the_row_major_bytes_of_any_tensor(name):
    t = _tensors()[name]
    flat = t.reshape(-1).clone()
    want = (flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat).numpy().tobytes()  # numpy has no bf16
    assert tensorfile.byte_view(t).numpy().tobytes() == want


def test_round_trip_matches_safetensors_and_hashlib(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 8)  # many chunks per tensor
    path = tmp_path / "t.safetensors"
    tensors = _tensors()
    record = write_tensors(path, tensors, {"note": "hi"})
    raw = path.read_bytes()
    assert record == FileRecord(hashlib.sha256(raw).hexdigest(), len(raw))
    got, metadata = read_tensors(path, record)
    official = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == metadata == {"note": "hi"}
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert torch.equal(official[name], t), name


def test_truncated_and_garbled_files(tmp_path):
    path = tmp_path / "t.safetensors"
    record = write_tensors(path, {"x": torch.arange(100)})
    raw = path.read_bytes()
    path.write_bytes(raw[:-8])
    with pytest.raises(CheckpointError, match="size is .* bytes, the manifest says"):
        read_tensors(path, record)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        read_tensors(path)
    path.write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(CheckpointError, match="sha256 checksum mismatch"):
        read_tensors(path, record)
    with pytest.raises(CheckpointError, match="file is missing"):
        read_tensors(tmp_path / "nope.safetensors", record)


def test_unsupported_tensors_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="tensor 'c' must be a dense tensor"):
        write_tensors(tmp_path / "t.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="tensor 's' must be a dense tensor"):
        write_tensors(tmp_path / "t.safetensors", {"s": torch.eye(2).to_sparse()})


def test_strided_columns_are_written_exactly_and_their_chunks_count_as_copies(tmp_path, monkeypatch):
    """A table's score and version columns are interleaved (stride 2): their bytes are written as a contiguous
    column's, and each chunk is a fresh copy, so the digest must count it among the copies it bounds."""
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 4096)
    pair = torch.arange(20_000, dtype=torch.int64).view(10_000, 2) * 3 - 7
    scores, versions = pair[:, 0], pair[:, 1]
    chunks = list(tensorfile._byte_chunks(scores))
    assert len(chunks) > 1 and all(copied for _, copied in chunks)
    assert b"".join(bytes(c) for c, _ in chunks) == scores.contiguous().numpy().tobytes()
    assert not any(copied for _, copied in tensorfile._byte_chunks(versions.contiguous()))
    path = tmp_path / "stamps.safetensors"
    record = write_tensors(path, {"scores": scores, "versions": versions})
    got, _ = read_tensors(path, record)  # the sha256 of what was written
    assert torch.equal(got["scores"], scores) and torch.equal(got["versions"], versions)
