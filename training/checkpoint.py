"""Single-process checkpoints: one file per step, written atomically, with a config fingerprint.

A checkpoint holds everything a run needs to continue bit-identically: model and optimizer state,
the step (the schedule is a pure function of it), the data loader's position, the quantizers' RNG
counters, torch's RNG states and the W&B run id. It is written to a temporary name and renamed,
so a file under the final name is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d{8})\.pt$")

FINGERPRINT_KEYS = ("model", "quant", "train.seq_len", "train.batch_size", "seed")
"""Config entries a checkpoint must agree with to be resumed."""


def _select(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def config_fingerprint(cfg: dict) -> dict[str, str]:
    """A short hash of each of :data:`FINGERPRINT_KEYS` in a resolved config (a plain dict)."""
    return {
        k: hashlib.sha256(json.dumps(_select(cfg, k), sort_keys=True, default=str).encode()).hexdigest()[:16]
        for k in FINGERPRINT_KEYS
    }


def check_fingerprint(saved: dict[str, str], current: dict[str, str], path: Path) -> None:
    """Refuse to resume from a checkpoint written under a different config."""
    differ = sorted(k for k in current if saved.get(k) != current[k])
    if differ:
        raise ValueError(
            f"checkpoint {path} was written with a different {', '.join(differ)} than this run. "
            f"Resuming would silently mix two experiments. Fix: restore the original settings, "
            f"or start a new run with another run_name=... (or resume=false to overwrite)."
        )


class Checkpointer:
    """Checkpoints of one run in ``directory``: ``step_XXXXXXXX.pt``, keeping the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def all(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.all()
        return found[-1][1] if found else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step:08d}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        for _, old in self.all()[: -self.keep]:
            old.unlink()
        return path

    @staticmethod
    def load(path: str | os.PathLike) -> dict[str, Any]:
        return torch.load(path, map_location="cpu", weights_only=False)
