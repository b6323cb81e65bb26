"""A dependency-free TensorBoard scalar event writer, and a reader used by the tests.

Why: `shardlab train` only logs scalars (loss, throughput, learning rate); depending on the
`tensorboard` and `protobuf` packages for that is heavy. The on-disk format is small and stable:

  * framing is TFRecord: uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes,
    the payload, uint32 masked CRC32C of the payload;
  * each payload is an `Event` protobuf (tensorflow/core/util/event.proto), of which only this
    subset is used; the first event of a file carries `file_version = "brain.Event:2"`.

    Event   {double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;}
    Summary {repeated Value value = 1;}
    Value   {string tag = 1; float simple_value = 2;}
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

_U32, _U64 = 0xFFFFFFFF, (1 << 64) - 1
_file_counter = itertools.count()  # makes names unique even for writers opened in one second


def _crc_entry(byte: int) -> int:
    for _ in range(8):
        byte = (byte >> 1) ^ 0x82F63B78 if byte & 1 else byte >> 1
    return byte


_CRC_TABLE = [_crc_entry(b) for b in range(256)]  # byte-at-a-time: 8x fewer steps than bits


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli, reflected): TFRecord uses this one, not zlib's CRC32."""
    crc = _U32
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _U32


def _masked_crc(data: bytes) -> int:
    # TFRecord masks CRCs so that the CRC of data which itself embeds CRCs stays well mixed.
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & _U32


# -- protobuf encoding: only the wire types the Event subset needs --------------------------

def _varint(value: int) -> bytes:
    value &= _U64  # a negative int64 is encoded as its 64-bit two's complement (10 bytes)
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32 range: store ±inf, as a float32 cast would
        return struct.pack("<f", value * float("inf"))


class EventWriter:
    """Writes scalar summaries to a new `events.out.tfevents.*` file in `log_dir`."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / (f"events.out.tfevents.{int(time.time())}."
                                    f"{socket.gethostname()}.{os.getpid()}.{next(_file_counter)}")
        self._file = open(self.path, "xb")  # "x": never clobber another writer's file
        self._write_event(time.time(), 0, _len_delimited(3, b"brain.Event:2"))
        self.flush()

    def _write_event(self, wall_time: float, step: int, rest: bytes) -> None:
        data = _key(1, 1) + struct.pack("<d", wall_time)
        if step:  # proto3 leaves default values out
            data += _key(2, 0) + _varint(step)
        data += rest
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", _masked_crc(header))
                         + data + struct.pack("<I", _masked_crc(data)))

    def add_scalar(self, tag: str, value: float, step: int,
                   wall_time: float | None = None) -> None:
        summary_value = _len_delimited(1, tag.encode()) + _key(2, 5) + _float32(float(value))
        summary = _len_delimited(5, _len_delimited(1, summary_value))
        self._write_event(time.time() if wall_time is None else wall_time, int(step), summary)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()  # a no-op when already closed

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- reading (for tests): the same subset; other fields are skipped by wire type ------------

def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(buf):
        result |= (buf[pos] & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not buf[pos - 1] & 0x80:
            return result, pos
    raise ValueError("truncated varint")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield (field number, wire type, value): int for varints, raw bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
        elif wire_type in (1, 2, 5):
            size = {1: 8, 5: 4}.get(wire_type)
            if size is None:  # length-delimited: the length comes first, as a varint
                size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
            if pos > len(buf):
                raise ValueError("truncated field")
        else:  # groups (3, 4) are deprecated and never appear in event files
            raise ValueError(f"unsupported wire type {wire_type}")
        yield field, wire_type, value


def _records(path: Path) -> Iterator[bytes]:
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        header, header_crc = data[pos:pos + 8], data[pos + 8:pos + 12]
        if len(header_crc) < 4 or struct.unpack("<I", header_crc)[0] != _masked_crc(header):
            raise ValueError(f"{path}: corrupt record header at offset {pos}")
        end = pos + 12 + struct.unpack("<Q", header)[0]
        payload, crc = data[pos + 12:end], data[end:end + 4]
        if len(crc) < 4 or struct.unpack("<I", crc)[0] != _masked_crc(payload):
            raise ValueError(f"{path}: corrupt record data at offset {pos}")
        yield payload
        pos = end + 4


def _sub(buf: bytes, field: int, wire_type: int) -> list:
    return [v for f, t, v in _fields(buf) if (f, t) == (field, wire_type)]


def read_scalars(path_or_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Map tag -> [(step, value)] in file order, from one event file or all of them in a dir."""
    path = Path(path_or_dir)
    files = sorted(path.glob("events.out.tfevents.*")) if path.is_dir() else [path]
    scalars: dict[str, list[tuple[int, float]]] = {}
    for file in files:
        for event in _records(file):
            step = (_sub(event, 2, 0) or [0])[-1]
            step -= (step >> 63) << 64  # varint is unsigned: back to a signed int64
            for summary in _sub(event, 5, 2):
                for value in _sub(summary, 1, 2):
                    tags, simple = _sub(value, 1, 2), _sub(value, 2, 5)
                    if tags and simple:
                        scalars.setdefault(tags[-1].decode(), []).append(
                            (step, struct.unpack("<f", simple[-1])[0]))
    return scalars
