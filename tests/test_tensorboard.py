"""The dependency-free TensorBoard writer: CRC, round trip, corruption, and real-TensorBoard reads."""

from __future__ import annotations

import math
import struct
import time

import pytest

from shardlab.train.tensorboard import EventWriter, _fields, _records, crc32c, read_scalars

# Steps cover 0, the int32 boundary and beyond, and a negative (int64 is two's complement).
# Values are exactly representable in float32 except 0.1, which is compared at float32 precision.
POINTS = {
    "loss": [(0, 2.5), (1, 2.25), (2**31 + 5, -0.125), (2**40, 0.1)],
    "lr": [(0, 3e-4), (7, -1.0), (-3, 1e6)],
    "train/tokens_per_s": [(2**62, 123456.0)],
}


def _write(log_dir, points=POINTS) -> EventWriter:
    with EventWriter(log_dir) as writer:
        for tag, series in points.items():
            for step, value in series:
                writer.add_scalar(tag, value, step, wall_time=1_700_000_000.0 + step % 1000)
    return writer


def _assert_matches(got, expected=POINTS) -> None:
    assert set(got) == set(expected)
    for tag, series in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in series]
        for (_, value), (_, want) in zip(got[tag], series):
            assert value == pytest.approx(want, rel=1e-7)


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    # RFC 3720 (iSCSI) appendix B.4 vectors.
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43


def test_round_trip_file_and_dir(tmp_path):
    writer = _write(tmp_path / "new" / "run")  # nested dir is created
    assert writer.path.name.startswith("events.out.tfevents.")
    _assert_matches(read_scalars(writer.path))
    _assert_matches(read_scalars(writer.path.parent))


def test_writers_in_one_dir_get_distinct_files(tmp_path):
    first = _write(tmp_path, {"a": [(1, 1.0)]})
    second = _write(tmp_path, {"b": [(2, 2.0)]})
    assert first.path != second.path
    assert read_scalars(tmp_path) == {"a": [(1, 1.0)], "b": [(2, 2.0)]}


def test_non_finite_and_out_of_float32_range(tmp_path):
    got = read_scalars(_write(tmp_path, {"x": [(1, 1e40), (2, -1e40), (3, math.nan)]}).path)["x"]
    assert got[0] == (1, math.inf) and got[1] == (2, -math.inf) and math.isnan(got[2][1])


def test_first_record_is_file_version_event(tmp_path):
    before = time.time()
    first = next(_records(_write(tmp_path).path))
    fields = {field: value for field, _, value in _fields(first)}
    assert fields[3] == b"brain.Event:2"
    assert before - 1 <= struct.unpack("<d", fields[1])[0] <= time.time() + 1
    assert set(fields) == {1, 3}  # no step (proto3 default 0) and no summary


def test_reader_skips_unknown_fields(tmp_path):
    writer = EventWriter(tmp_path)
    # Unknown fields of every wire type we accept, before the summary: the reader must skip them.
    unknown = b"\xb8\x06\x96\x01" + b"\x25\x00\x00\x80\x3f" + b"\x31" + bytes(8) + b"\x3a\x02hi"
    writer._write_event(1.0, 9, unknown + b"\x2a\x0d\x0a\x0b\x0a\x04loss\x15\x00\x00\x20\x40")
    writer.close()
    assert read_scalars(writer.path) == {"loss": [(9, 2.5)]}


@pytest.mark.parametrize("where", ["header", "header_crc", "data", "data_crc"])
def test_corrupt_byte_is_detected(tmp_path, where):
    path = _write(tmp_path).path
    raw = bytearray(path.read_bytes())
    start = 16 + struct.unpack("<Q", raw[:8])[0]  # second record (first scalar event)
    length = struct.unpack("<Q", raw[start:start + 8])[0]
    raw[start + {"header": 3, "header_crc": 9, "data": 12 + length // 2,
                 "data_crc": 13 + length}[where]] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{path.name}.*offset {start}\b"):
        read_scalars(path)


def test_truncated_file_is_detected(tmp_path):
    path = _write(tmp_path).path
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="corrupt record"):
        read_scalars(path)


def test_real_tensorboard_reads_it(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # EventAccumulator drops "orphaned" events when steps go backwards, so keep them increasing.
    points = {"loss": [(0, 2.5), (5, -0.125)], "lr": [(2**31 + 5, 0.1), (2**40, 3e-4)]}
    _write(tmp_path, points)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "lr"]
    for tag, series in points.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in series]
        assert [v for _, v in got] == pytest.approx([v for _, v in series], rel=1e-7)
