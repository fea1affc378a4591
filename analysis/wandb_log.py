"""Offline W&B runs read straight from their ``run-<id>.wandb`` transaction logs (no ``wandb sync``).

A run folder (``wandb/offline-run-*/`` or ``wandb/run-*/``) holds one transaction log; a resumed
run gets a new folder with the same run id, and :func:`read_wandb_folders` merges those in time
order. The records are decoded with W&B's own protobuf classes (``wandb_internal_pb2``).
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CompareError

_LOG_HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"  # ident, magic, version
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> Iterator[bytes]:
    """The serialized records of a ``.wandb`` transaction log.

    The file is a 7-byte header (``:W&B``, magic 0xBEE1, version 0) followed by LevelDB-log style
    chunks in 32 KiB blocks: CRC-32 of (type byte + payload), little-endian uint16 length, a type
    byte (full / first / middle / last piece of a record), the payload. A chunk header never
    straddles a block: less than 7 bytes left in a block are zero padding. Reading stops at the
    first torn or corrupt chunk (a run killed mid-write), keeping the records before it.
    """
    data = Path(path).read_bytes()
    if not data.startswith(_LOG_HEADER[:6]):
        raise CompareError(f"{path} is not a W&B transaction log (bad header)")
    pos, pending = len(_LOG_HEADER), None
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding (pre-allocated tail)
            pos += left
            continue
        payload = data[pos + 7: pos + 7 + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            break
        pos += 7 + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE and pending is not None:
            pending += payload
        elif kind == _LAST and pending is not None:
            yield pending + payload
            pending = None


def _item_key(item: Any) -> tuple[str, ...]:
    return tuple(item.nested_key) if item.nested_key else (item.key,)


def _set_nested(d: dict, key: tuple[str, ...], value: Any) -> None:
    for part in key[:-1]:
        d = d.setdefault(part, {})
        if not isinstance(d, dict):
            return
    d[key[-1]] = value


def _del_nested(d: dict, key: tuple[str, ...]) -> None:
    for part in key[:-1]:
        d = d.get(part)
        if not isinstance(d, dict):
            return
    d.pop(key[-1], None)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class WandbLog:
    """What an offline W&B run holds: its id, name, config, summary and history rows."""

    run_id: str | None = None
    name: str | None = None
    project: str | None = None
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    path: str = ""  # the (newest) run folder


def parse_wandb_file(path: Path, into: WandbLog | None = None) -> WandbLog:
    """Decode a ``run-<id>.wandb`` file with W&B's own protobuf classes (``wandb_internal_pb2``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    log = into or WandbLog()
    for raw in read_wandb_records(path):
        rec = pb.Record()
        try:
            rec.ParseFromString(raw)
        except Exception:
            break
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            log.run_id = r.run_id or log.run_id
            log.name = r.display_name or log.name
            log.project = r.project or log.project
            for item in r.config.update:
                _set_nested(log.config, _item_key(item), _loads(item.value_json))
            for item in r.summary.update:
                _set_nested(log.summary, _item_key(item), _loads(item.value_json))
        elif kind == "config":
            for item in rec.config.update:
                _set_nested(log.config, _item_key(item), _loads(item.value_json))
            for item in rec.config.remove:
                _del_nested(log.config, _item_key(item))
        elif kind == "summary":
            for item in rec.summary.update:
                _set_nested(log.summary, _item_key(item), _loads(item.value_json))
            for item in rec.summary.remove:
                _del_nested(log.summary, _item_key(item))
        elif kind == "history":
            row = {"/".join(_item_key(i)): _loads(i.value_json) for i in rec.history.item}
            if rec.history.HasField("step"):
                row.setdefault("_step", rec.history.step.num)
            log.history.append(row)
    log.config.pop("_wandb", None)
    return log


def wandb_file(folder: Path) -> Path | None:
    """The ``run-*.wandb`` transaction log of a W&B run folder, or None."""
    files = sorted(folder.glob("run-*.wandb"))
    return files[0] if files else None


def is_wandb_run_folder(path: Path) -> bool:
    """True for an ``offline-run-*`` / ``run-*`` folder that holds a transaction log."""
    return path.name.startswith(("offline-run-", "run-")) and wandb_file(path) is not None


def wandb_run_folders(root: Path) -> list[Path]:
    """``offline-run-*`` / ``run-*`` folders holding a ``.wandb`` file under ``root/wandb``."""
    base = root / "wandb"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and is_wandb_run_folder(p))


def _started(folder: Path) -> tuple[str, int]:
    """Order of a run folder: ``<offline-run|run>-YYYYMMDD_HHMMSS-<id>[-<n>]`` (W&B adds ``-<n>``
    when a resumed run starts within the same second)."""
    m = re.search(r"(\d{8}_\d{6})-.*?(?:-(\d+))?$", folder.name)
    return (m.group(1), int(m.group(2) or 0)) if m else (folder.name, 0)


def _merge(into: dict, update: dict) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def read_wandb_folders(folders: list[Path], notes: list[str] | None = None) -> list[WandbLog]:
    """One log per run id; folders of one id (a resumed run gets a new folder) are merged in time
    order: later config and summary values win, histories are concatenated. A folder that cannot
    be read is skipped with a note (or raises without ``notes``)."""
    logs: dict[str, WandbLog] = {}
    for folder in sorted(folders, key=_started):
        try:
            part = parse_wandb_file(wandb_file(folder))
        except Exception as err:
            if notes is None:
                raise
            notes.append(f"skipped {folder}: {err}")
            continue
        part.path = str(folder)
        key = part.run_id or str(folder)
        if key not in logs:
            logs[key] = part
            continue
        log = logs[key]
        log.name, log.project, log.path = part.name or log.name, part.project or log.project, part.path
        _merge(log.config, part.config)
        _merge(log.summary, part.summary)
        log.history += part.history
    return list(logs.values())
