"""The streaming safetensors writer/reader: standard files, exact bytes, checksums computed on the way."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash

from dynemb.checkpoint import CheckpointError, block_file, checksum, file_image, tensorfile
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


def test_round_trip_matches_safetensors_and_xxhash(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 8)  # many chunks per tensor
    path = tmp_path / "t.safetensors"
    tensors = _tensors()
    record = write_tensors(path, tensors, {"note": "hi"})
    raw = path.read_bytes()
    assert record == FileRecord(xxhash.xxh3_128(raw).hexdigest(), len(raw), "xxh3-128")
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
    with pytest.raises(CheckpointError, match="xxh3-128 checksum mismatch"):
        read_tensors(path, record)
    with pytest.raises(CheckpointError, match="file is missing"):
        read_tensors(tmp_path / "nope.safetensors", record)


def test_unsupported_tensors_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="tensor 'c' must be a dense tensor"):
        write_tensors(tmp_path / "t.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="tensor 's' must be a dense tensor"):
        write_tensors(tmp_path / "t.safetensors", {"s": torch.eye(2).to_sparse()})


def test_strided_columns_are_written_exactly_from_views(tmp_path, monkeypatch):
    """A table's score and version columns are interleaved (stride 2): their pieces are strided views (no copy of
    the column), and their bytes land in the file as a contiguous column's, across many staging buffers."""
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 4096)
    pair = torch.arange(20_000, dtype=torch.int64).view(10_000, 2) * 3 - 7
    scores, versions = pair[:, 0], pair[:, 1]
    pieces = list(tensorfile.flat_pieces(scores))
    assert len(pieces) > 1 and all(p.data_ptr() >= pair.data_ptr() and p.stride() == (2,) for p in pieces)
    assert torch.equal(torch.cat(pieces), scores)
    path = tmp_path / "stamps.safetensors"
    record = write_tensors(path, {"scores": scores, "versions": versions})
    got, _ = read_tensors(path, record)  # the checksum of what was written
    assert torch.equal(got["scores"], scores) and torch.equal(got["versions"], versions)


@pytest.mark.parametrize("chunk", [8, 4096, 1 << 20])
def test_direct_and_buffered_writes_and_file_images_give_the_same_file(tmp_path, monkeypatch, chunk):
    """O_DIRECT (where this file system takes it), the page cache, and a background save's FileImage filled by
    another thread while it is written: the same bytes and record, whatever the chunk size."""
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(file_image, "CHUNK_BYTES", chunk)
    tensors = {**_tensors(), "big": torch.randn(3000, 7, generator=torch.Generator().manual_seed(1))}
    direct = write_tensors(tmp_path / "direct.safetensors", tensors, {"note": "hi"})
    monkeypatch.setattr(block_file, "DIRECT", False)
    buffered = write_tensors(tmp_path / "buffered.safetensors", tensors, {"note": "hi"})
    monkeypatch.undo()
    image = file_image.FileImage(tensors, {"note": "hi"})
    filler = threading.Thread(target=image.fill)
    filler.start()
    imaged = image.write(tmp_path / "image.safetensors")
    filler.join()
    raw = (tmp_path / "direct.safetensors").read_bytes()
    assert direct == buffered == imaged == FileRecord(xxhash.xxh3_128(raw).hexdigest(), len(raw))
    assert raw == (tmp_path / "buffered.safetensors").read_bytes() == (tmp_path / "image.safetensors").read_bytes()
    got, metadata = read_tensors(tmp_path / "image.safetensors", imaged)
    assert metadata == {"note": "hi"} and all(torch.equal(got[n], t) for n, t in tensors.items())


def test_a_direct_write_the_file_system_refuses_goes_through_the_page_cache(tmp_path, monkeypatch):
    real_write, refused = block_file.os.write, []

    def write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(block_file.os, "write", write)
    tensors = {"x": torch.arange(10_000.0)}
    record = write_tensors(tmp_path / "t.safetensors", tensors)
    monkeypatch.undo()
    assert torch.equal(read_tensors(tmp_path / "t.safetensors", record)[0]["x"], tensors["x"])
    with block_file.BlockFile(tmp_path / "probe") as probe:
        assert len(refused) == int(probe.direct)  # one refusal where O_DIRECT opened, then buffered writes


def test_a_file_image_whose_fill_fails_fails_its_write(tmp_path):
    class Broken:
        dtype, shape = torch.float32, torch.Size([4])

        def numel(self):
            return 4

        def element_size(self):
            return 4

        def pieces(self):
            raise RuntimeError("device lost")

    image = file_image.FileImage({"x": Broken()})
    with pytest.raises(RuntimeError, match="device lost"):
        image.fill()
    with pytest.raises(CheckpointError, match="the snapshot for this file failed.*device lost"):
        image.write(tmp_path / "t.safetensors")


def test_records_name_their_algorithm_and_sha256_records_still_verify(tmp_path):
    path = tmp_path / "t.safetensors"
    record = write_tensors(path, {"x": torch.arange(100)})
    raw = path.read_bytes()
    assert record.to_json() == {"algorithm": "xxh3-128", "checksum": xxhash.xxh3_128(raw).hexdigest(),
                                "bytes": len(raw)}
    assert checksum.record_from_json(record.to_json(), "here") == record
    old = checksum.record_from_json({"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}, "here")
    assert old.algorithm == "sha256"
    assert torch.equal(read_tensors(path, old)[0]["x"], torch.arange(100))  # hashed with sha256 as it is read
    assert tensorfile.verify_file(path, old)["x"][1] == torch.Size([100])
    with pytest.raises(CheckpointError, match="sha256 checksum mismatch"):
        read_tensors(path, old._replace(checksum="0" * 64))
    for bad in ({"algorithm": "md5", "checksum": "00", "bytes": 1}, {"checksum": "00"}, {"sha256": 1, "bytes": 1},
                None, {"algorithm": "xxh3-128", "checksum": "00", "bytes": True}):
        with pytest.raises(CheckpointError, match="^here: "):
            checksum.record_from_json(bad, "here")
