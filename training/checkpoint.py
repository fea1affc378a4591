"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written so that a partial one is never
taken as complete.

A checkpoint is a directory ``step_XXXXXXXX/`` holding the DCP shards of the model and optimizer
(each rank writes its own; resharding to another world size is DCP's job), ``extra.pt`` (step, data
loader position, quantizer RNG counters, torch RNG state, W&B run id, config fingerprint) and
``COMPLETE``, a list of every file with its size. All ranks write into ``.step_XXXXXXXX.tmp/``;
after a barrier rank 0 writes ``extra.pt`` and ``COMPLETE`` and renames the directory. A directory
without ``COMPLETE``, or whose files don't match it (truncated), is ignored.
"""

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

# DCP warns once per save that it runs without a process group; that is the intended one-process mode.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

_NAME = re.compile(r"^step_(\d{8})$")

FINGERPRINT_KEYS = ("model", "quant", "optim", "train.seq_len", "train.batch_size", "train.steps",
                    "train.tokens_per_param", "seed", "world_size")
"""Config entries a checkpoint must agree with to be resumed: the model, the scheme, everything
that fixes the learning-rate schedule and the data order, and the world size (see
``parallel.allow_reshard``)."""


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


def is_complete(path: Path) -> bool:
    """True when ``path/COMPLETE`` exists and every file it lists has the recorded size."""
    marker = path / "COMPLETE"
    if not marker.is_file():
        return False
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


class Checkpointer:
    """DCP checkpoints of one run in ``directory``, keeping the newest ``keep``.

    Every method is collective: all ranks call it at the same point.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2, async_save: bool = False, is_main: bool = True) -> None:
        self.directory = Path(directory)
        self.keep, self.async_save, self.is_main = keep, async_save, is_main
        self._pending = None

    def all(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return sorted((step, p) for step, p in found if is_complete(p))

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1][1] if found else None

    def save(self, step: int, model, optimizer, extra: dict[str, Any], force_sync: bool = False) -> Path:
        """Save model and optimizer shards plus ``extra``; asynchronous if configured."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from .distributed import barrier

        self.wait()
        final = self.directory / f"step_{step:08d}"
        tmp = self.directory / f".{final.name}.tmp"
        if self.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save and not force_sync:
            self._pending = (dcp.async_save(state, checkpoint_id=str(tmp)), tmp, final, extra)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._finalize(tmp, final, extra)
        return final

    def wait(self) -> None:
        """Finish a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, final, extra = self._pending
        self._pending = None
        future.result()
        self._finalize(tmp, final, extra)

    def _finalize(self, tmp: Path, final: Path, extra: dict[str, Any]) -> None:
        from .distributed import barrier

        barrier()
        if self.is_main:
            torch.save(extra, tmp / "extra.pt")
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / "COMPLETE").write_text(json.dumps({"files": files}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in self.all()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()

    @staticmethod
    def load(path: str | os.PathLike, model, optimizer) -> dict[str, Any]:
        """Load shards into ``model``/``optimizer`` (any world size) and return ``extra``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return read_extra(path)


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    return torch.load(Path(path) / "extra.pt", map_location="cpu", weights_only=False)
