"""Reads the records of an offline wandb run (`run-<id>.wandb`) for the logger tests.

wandb >= 0.2x writes and reads this file only in its Go core; no Python reader ships with it any
more. The format is LevelDB's log format behind a 7-byte header (`:W&B`, magic 0xBEE1, version 0):
32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1: full, 2: first, 3: middle, 4: last)`
and a piece of a serialised `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK, HEADER, CHUNK_HEADER = 32 * 1024, 7, 7


def read_records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    records, pending, pos = [], b"", HEADER
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        piece = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == 0 and length == 0:  # zero padding
            continue
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def run_info(run_dir: Path) -> dict:
    """The run's group and name, its config keys, every logged history key and the file names it holds."""
    (wandb_file,) = Path(run_dir).glob("run-*.wandb")
    info = {"group": None, "name": None, "config": {}, "history": {}, "files": set()}
    for record in read_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info["group"], info["name"] = record.run.run_group, record.run.display_name
            info["config"].update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "config":
            info["config"].update({item.key: item.value_json for item in record.config.update})
        elif kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                info["history"].setdefault(key, []).append(item.value_json)
        elif kind == "files":
            info["files"].update(f.path for f in record.files.files)
    return info
