"""A minimal TensorBoard scalar writer (TFRecord of Event protos), with no TensorFlow.

Only scalars are written: Event{wall_time=1, step=2, summary=5{value=1{tag=1, simple_value=2}}}.
"""
from __future__ import annotations

import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def scalar_event(step: int, scalars: dict[str, float], wall_time: float) -> bytes:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
        for tag, v in scalars.items())
    return (_field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
            + _bytes_field(5, values))


class ScalarWriter:
    """Appends scalar events to `events.out.tfevents.*` in `log_dir`."""

    def __init__(self, log_dir: str | Path):
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._file = open(log_dir / name, "ab")
        self._record(_field(1, 1, struct.pack("<d", time.time()))
                     + _bytes_field(3, b"brain.Event:2"))  # file_version header event

    def _record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", _masked_crc(header)) + data
                         + struct.pack("<I", _masked_crc(data)))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._record(scalar_event(step, scalars, time.time()))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
