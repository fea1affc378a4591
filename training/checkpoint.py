"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written so that a partial, corrupt or
non-finite one is never trusted.

A checkpoint is a directory ``step_XXXXXXXX/`` holding the DCP shards of the model and optimizer
(each rank writes its own; resharding to another world size is DCP's job), ``extra.pt`` (step, data
loader position, quantizer RNG counters, torch RNG state, W&B run id, config fingerprint) and
``COMPLETE``, the manifest: every file with its size and its xxh3-128 checksum.

Saving: nothing non-finite is written (every floating tensor of the state is checked first). All
ranks write into ``.step_XXXXXXXX.tmp/`` and hash the shards they wrote; after a barrier rank 0
writes ``extra.pt`` and ``COMPLETE`` and renames the directory. A step that already has a checkpoint
that verifies is not written again, so no window exists in which that step is missing. A failed
save (a full disk, say) removes its partial directory and says why.

Consolidation: :func:`export` writes a checkpoint, or a run directory's newest one that verifies
(:func:`resolve_checkpoint`), as one ``torch.save`` file for evaluation and export
(scripts/export_checkpoint.py, scripts/export_hf.py, :mod:`inference.trained_model`).

Loading: :meth:`Checkpointer.newest_verified` checks every file of a checkpoint against its
manifest (the ranks share the hashing) and falls back to the next older one, naming each it
skipped and why. ``extra.pt`` is read with ``torch.load(weights_only=True)``, which unpickles only
tensors and plain containers, never arbitrary objects.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from quant import randomness

from .distributed import all_gather_objects, barrier, rank_and_world
from .identity import BUDGET_KEYS
from .precision_schedule import DEFAULT_PRECISION

# DCP warns once per save that it runs without a process group; that is the intended one-process mode.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

log = logging.getLogger("train")

_NAME = re.compile(r"^step_(\d{8})$")
_TMP = re.compile(r"^\.step_(\d{8})\.tmp$")
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
MANIFEST = "COMPLETE"
EXTRA = "extra.pt"

FINGERPRINT_KEYS = ("model", "quant", "optim", "precision", "train.seq_len", "train.batch_size",
                    "train.micro_batch_size", *BUDGET_KEYS, "seed", "world_size")
"""Config entries a checkpoint must agree with to be resumed: the model, the scheme, everything
that fixes the learning-rate schedule, the data order and the arithmetic (precision, micro-batch
size), and the world size (see ``parallel.allow_reshard``)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or trusted; the message says why and what to do."""


def flatten(node: Any, prefix: str) -> dict[str, Any]:
    """A nested config ``node`` as ``{dotted leaf key: value}`` under ``prefix``."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k in sorted(node):
            out |= flatten(node[k], f"{prefix}.{k}")
        return out
    return {prefix: node}


def select(cfg: dict, dotted: str) -> Any:
    """The value at a dotted key of a nested config (None when absent)."""
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def config_fingerprint(cfg: dict) -> dict[str, Any]:
    """The values of :data:`FINGERPRINT_KEYS` in a resolved config (a plain dict), flattened to
    dotted leaf keys (``optim.lr``), JSON-compatible."""
    out: dict[str, Any] = {}
    for key in FINGERPRINT_KEYS:
        out |= flatten(json.loads(json.dumps(select(cfg, key), default=str)), key)
    return out


ADDED_KEYS = {"quant.bf16_tail": None, "quant.recipe": [], "quant.schedule.at": None,
              "quant.schedule.precision": DEFAULT_PRECISION}
"""Fingerprint keys that configs gained after checkpoints had been written, each with the value
that does what a run without the key did: a checkpoint that lacks one resumes as if it had saved
that value (so a run started before the precision recipes resumes unchanged)."""


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every fingerprint key that differs (a key the
    checkpoint predates counts as its :data:`ADDED_KEYS` value)."""
    missing = object()
    saved = {**{k: v for k, v in ADDED_KEYS.items() if k not in saved}, **saved}
    keys = sorted(set(saved) | set(current))
    return {k: (saved.get(k), current.get(k)) for k in keys
            if saved.get(k, missing) != current.get(k, missing)}


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], path: Path,
                      allowed: Iterable[str] = ()) -> dict[str, tuple[Any, Any]]:
    """Refuse to resume from a checkpoint written under a different config.

    ``allowed`` lists keys (or key prefixes: ``optim`` allows every ``optim.*``) that may differ;
    the allowed changes are returned, so that the caller logs them."""
    allowed = tuple(allowed)
    changes = fingerprint_changes(saved, current)

    def is_allowed(key: str) -> bool:
        return any(key == a or key.startswith(a + ".") for a in allowed)

    refused = {k: v for k, v in changes.items() if not is_allowed(k)}
    if refused:
        listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in refused.items())
        keys = ",".join(refused)
        raise ValueError(
            f"checkpoint {path} was written with a different config than this run: {listed}. "
            f"Resuming would silently mix two experiments. Fix: restore the original settings; "
            f"or start a new run with another run_name=... (or resume=false, which moves this run "
            f"aside); or, to continue this run with the change on purpose, add "
            f"'resume_with_changes=[{keys}]' (the change is logged)."
        )
    return {k: v for k, v in changes.items() if is_allowed(k)}


def file_checksum(path: Path, chunk: int = 1 << 23) -> str:
    """xxh3-128 of a file's bytes, as hex."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, Any] | None:
    """``COMPLETE`` as a dict, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def is_complete(path: Path) -> bool:
    """True when ``path/COMPLETE`` lists checksums and every listed file has its recorded size
    (a cheap test; :func:`verify` reads the bytes)."""
    manifest = read_manifest(path)
    if manifest is None:
        return False
    files = manifest["files"]
    return all(isinstance(e, dict) and "xxh3_128" in e and (Path(path) / n).is_file()
               and (Path(path) / n).stat().st_size == e.get("size") for n, e in files.items())


def _problem(path: Path, names: Iterable[str], files: dict[str, Any]) -> str | None:
    for name in names:
        entry, f = files[name], path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['size']} (truncated?)"
        if file_checksum(f) != entry["xxh3_128"]:
            return f"{name} does not match its checksum (corrupt)"
    return None


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when the checkpoint at ``path`` is intact, else what is wrong with it.

    ``share=(rank, world)`` checks only every world-th file from the rank-th (the ranks split the
    hashing; :meth:`Checkpointer.newest_verified` gathers their answers)."""
    path = Path(path)
    if not path.is_dir():
        return "it does not exist"
    manifest = read_manifest(path)
    if manifest is None:
        return f"it has no readable {MANIFEST} manifest (a save that did not finish)"
    files = manifest["files"]
    if EXTRA not in files or not all(isinstance(e, dict) and "xxh3_128" in e for e in files.values()):
        return "its manifest has no checksums (written by an older version of this trainer)"
    rank, world = share
    return _problem(path, sorted(files)[rank::world], files)


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The trainer state of a checkpoint (``extra.pt``), unpickling only tensors and plain
    containers (``weights_only=True``)."""
    return torch.load(Path(path) / EXTRA, map_location="cpu", weights_only=True)


def _state_nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_nbytes(v) for v in state)
    return 0


def nonfinite_entries(state: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating tensors of ``state`` (this rank's shards) with a NaN or inf."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return [prefix] if local.is_floating_point() and not bool(local.isfinite().all()) else []
    if isinstance(state, dict):
        return [n for k, v in state.items() for n in nonfinite_entries(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(state, (list, tuple)):
        return [n for i, v in enumerate(state) for n in nonfinite_entries(v, f"{prefix}.{i}")]
    return []


@dataclass
class TrainState:
    """What a resumed run needs besides the model and optimizer shards to continue bit-identically:
    the step, the data loader's position, the quantizers' and torch's RNG states (read when the
    checkpoint is taken), the W&B run id, the config fingerprint and resolved config, and the last
    validation loss(es), ``val/loss`` and, for a run that also validates in BF16, ``val/loss_bf16``
    (a run checkpointed after its final validation writes its summary from them on resuming).
    :meth:`extra` is what ``extra.pt`` holds."""

    step: int
    loader: Any  # data.loader.TokenLoader: state_dict() / load_state_dict()
    fingerprint: dict[str, Any]
    config: dict[str, Any]
    wandb_run_id: str | None = None
    val_loss: float | None = None
    val_loss_bf16: float | None = None

    def extra(self) -> dict[str, Any]:
        """The state as ``extra.pt`` stores it."""
        return {"step": self.step, "loader": self.loader.state_dict(), "quant_rng": randomness.state_dict(),
                "torch_rng": torch.get_rng_state(), "wandb_run_id": self.wandb_run_id,
                "fingerprint": self.fingerprint, "config": self.config, "val_loss": self.val_loss,
                "val_loss_bf16": self.val_loss_bf16}

    def restore(self, extra: dict[str, Any], rank: int) -> None:
        """Continue from a checkpoint's ``extra`` on ``rank`` (the quantizer streams are per rank)."""
        self.loader.load_state_dict(extra["loader"])
        randomness.load_state_dict({**extra["quant_rng"], "rank": rank})
        torch.set_rng_state(extra["torch_rng"])
        self.step, self.wandb_run_id = extra["step"], extra["wandb_run_id"]
        self.val_loss, self.val_loss_bf16 = extra.get("val_loss"), extra.get("val_loss_bf16")


@dataclass
class Saved:
    """What :meth:`Checkpointer.save` did: the path, bytes written (0 when the step already had a
    verified checkpoint) and seconds taken (the wait for an asynchronous save comes later)."""

    path: Path
    nbytes: int
    seconds: float


class Checkpointer:
    """DCP checkpoints of one run in ``directory``, keeping the newest ``keep`` (None: all).

    Every method that writes or verifies is collective: all ranks call it at the same point.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 2, async_save: bool = False,
                 is_main: bool = True) -> None:
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(
                f"train.keep_checkpoints={keep} would delete every checkpoint. Fix: a number ≥ 1 "
                f"(the newest N are kept), or null to keep all."
            )
        self.directory = Path(directory)
        self.keep, self.async_save, self.is_main = keep, async_save, is_main
        self._pending = None

    def all(self) -> list[tuple[int, Path]]:
        """Checkpoints whose manifest is complete (sizes only), oldest first."""
        return [(s, p) for s, p in self._named() if is_complete(p)]

    def _named(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def latest(self) -> Path | None:
        """The newest checkpoint with a complete manifest (sizes only, not verified)."""
        found = self.all()
        return found[-1][1] if found else None

    def newest_verified(self, clean: bool = False) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest checkpoint that verifies (collective: the ranks share the hashing), and
        ``(path, reason)`` for each newer one that was skipped. With ``clean`` (the trainer, as
        it starts), interrupted saves (``.step_*.tmp``) count as skipped and rank 0 removes them;
        other readers leave them alone, since a running job may be writing one."""
        skipped: list[tuple[Path, str]] = []
        if clean and self.directory.is_dir():
            for tmp in sorted(p for p in self.directory.iterdir() if _TMP.match(p.name)):
                skipped.append((tmp, "an interrupted save (removed)"))
            barrier()
            if self.is_main:
                for tmp, _ in skipped:
                    shutil.rmtree(tmp, ignore_errors=True)
        rank, world = rank_and_world()
        for _, path in reversed(self._named()):
            problems = [p for p in all_gather_objects(verify(path, (rank, world))) if p]
            if not problems:
                try:
                    read_extra(path)
                except Exception as err:  # a verified but unreadable extra.pt: not trusted
                    problems = [f"{EXTRA} does not load ({type(err).__name__}: {err})"]
            if not problems:
                return path, skipped
            skipped.append((path, problems[0]))
        return None, skipped

    def save(self, step: int, model, optimizer, state: TrainState | dict[str, Any],
             force_sync: bool = False) -> Saved:
        """Save model and optimizer shards plus the trainer ``state`` (or a bare ``extra`` dict,
        as tools write it); asynchronous if configured.

        Raises :class:`CheckpointError` when the state holds a non-finite value (nothing is
        written) or the write fails (the partial directory is removed)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        extra = state.extra() if isinstance(state, TrainState) else state
        self.wait()
        t0 = time.perf_counter()
        final = self.directory / f"step_{step:08d}"
        if all_gather_objects(is_complete(final))[0] and not any(all_gather_objects(verify(final, rank_and_world()))):
            return Saved(final, 0, time.perf_counter() - t0)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        shards = {"model": model_sd, "optim": optim_sd}
        bad = [n for names in all_gather_objects(nonfinite_entries(shards)) for n in names]
        if bad:
            shown = ", ".join(sorted(set(bad))[:5]) + (" …" if len(set(bad)) > 5 else "")
            raise CheckpointError(
                f"refusing to save step {step}: {len(set(bad))} tensor(s) hold NaN or inf ({shown}). "
                f"Nothing was written; the newest good checkpoint is kept."
            )
        tmp = self.directory / f".{final.name}.tmp"
        if self.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        nbytes = _state_nbytes(shards)
        try:
            if self.async_save and not force_sync:
                self._pending = (dcp.async_save(shards, checkpoint_id=str(tmp)), tmp, final, extra, nbytes)
            else:
                dcp.save(shards, checkpoint_id=str(tmp))
                self._finalize(tmp, final, extra)
        except (Exception, CheckpointException) as err:  # DCP's exception is a BaseException
            self._fail(step, tmp, nbytes, err)
        return Saved(final, nbytes, time.perf_counter() - t0)

    def wait(self) -> None:
        """Finish a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, final, extra, nbytes = self._pending
        self._pending = None
        try:
            future.result()
            self._finalize(tmp, final, extra)
        except (Exception, CheckpointException) as err:
            self._fail(int(final.name[5:]), tmp, nbytes, err)

    def _fail(self, step: int, tmp: Path, nbytes: int, err: BaseException) -> None:
        """Remove the partial save and raise a :class:`CheckpointError` that says why."""
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        good = self.latest()
        where = self.directory if self.directory.exists() else self.directory.parent
        free = shutil.disk_usage(where).free
        kept = f"the newest checkpoint, {good}, is kept" if good else "no earlier checkpoint exists"
        if free < nbytes or _is_no_space(err):
            raise CheckpointError(
                f"no space left on the disk of {self.directory} while saving step {step}: "
                f"{free / 2**20:.0f} MiB free, the checkpoint needs about {nbytes / 2**20:.0f} MiB. "
                f"The partial checkpoint was removed and {kept}. Fix: free space (or lower "
                f"train.keep_checkpoints), or move the run to a larger disk with run_root=...; then "
                f"rerun the same command to resume."
            ) from err
        raise CheckpointError(
            f"saving step {step} to {self.directory} failed ({type(err).__name__}: {err}). The "
            f"partial checkpoint was removed and {kept}."
        ) from err

    def _finalize(self, tmp: Path, final: Path, extra: dict[str, Any]) -> None:
        rank, _ = rank_and_world()
        barrier()
        mine = {p.name: p for p in tmp.iterdir() if (m := _SHARD.match(p.name)) and int(m.group(1)) == rank}
        sums = {name: {"size": p.stat().st_size, "xxh3_128": file_checksum(p)} for name, p in mine.items()}
        gathered = all_gather_objects(sums)
        if self.is_main:
            torch.save(extra, tmp / EXTRA)
            files = {k: v for part in gathered for k, v in part.items()}
            for p in sorted(tmp.iterdir()):
                if p.is_file() and p.name not in files:
                    files[p.name] = {"size": p.stat().st_size, "xxh3_128": file_checksum(p)}
            manifest = {"step": int(final.name[5:]), "files": dict(sorted(files.items()))}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if final.exists():  # a leftover that does not verify (a verified one is never re-saved)
                shutil.rmtree(final)
            os.replace(tmp, final)
            if self.keep is not None:
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


def _is_no_space(err: BaseException) -> bool:
    """True when ``err`` or anything it wraps is an ENOSPC (DCP wraps each rank's failure)."""
    import errno

    seen: set[int] = set()
    stack: list[Any] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left" in str(e):
            return True
        stack += [getattr(e, "__cause__", None), getattr(e, "__context__", None)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())
    return False


# ----------------------------------------------------------------------------- consolidation


def _newest_in(checkpoints: Path) -> str:
    """A sentence naming the newest complete checkpoint in ``checkpoints``, or "" when none."""
    newest, _ = Checkpointer(checkpoints).newest_verified()
    return f" The newest complete checkpoint in {checkpoints} is {newest}." if newest else ""


def resolve_checkpoint(path: Path) -> Path:
    """The complete checkpoint directory that ``path`` names: ``path`` itself when it is one, or
    the newest complete checkpoint of the run directory ``path`` (in ``path/checkpoints/``).

    FileNotFoundError when ``path`` does not exist or a run directory has no complete
    checkpoint; ValueError when ``path`` is an incomplete checkpoint or neither kind of directory.
    Each message names the newest complete checkpoint nearby, when there is one.
    """
    usage = "pass runs/<run> (its newest complete checkpoint) or runs/<run>/checkpoints/step_XXXXXXXX"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist. Fix: {usage}.{_newest_in(path.parent)}")
    problem = verify(path)
    if problem is None:
        return path
    if (path / "checkpoints").is_dir():
        newest, _ = Checkpointer(path / "checkpoints").newest_verified()
        if newest is None:
            raise FileNotFoundError(
                f"the run directory {path} has no complete checkpoint in {path / 'checkpoints'} "
                f"(training saves one every train.ckpt_every steps and at the end). Fix: let the "
                f"run reach a checkpoint, or pass another run."
            )
        return newest
    if path.name.startswith("step_"):
        raise ValueError(
            f"{path} is not a complete checkpoint: {problem}. Fix: "
            f"{usage}, one that training finished writing.{_newest_in(path.parent)}"
        )
    raise ValueError(
        f"{path} is neither a checkpoint (step_XXXXXXXX with a COMPLETE manifest) nor a run "
        f"directory (with a checkpoints/ folder). Fix: {usage}.{_newest_in(path)}"
    )


def export(checkpoint: Path, out: Path) -> Path:
    """Consolidate ``checkpoint`` (a checkpoint or a run directory, see
    :func:`resolve_checkpoint`) into one ``torch.save`` file ``out``, in one process on CPU
    whatever the world size that wrote it: ``{"model": state_dict, "config": resolved run config,
    "step": step}``. The state dict has ``nn.Linear``-compatible keys, so it loads into
    ``model.build_model(config["model"])`` with or without ``quant.quantize_model``. Returns ``out``."""
    checkpoint = resolve_checkpoint(Path(checkpoint))
    extra = read_extra(checkpoint)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(checkpoint, full)
        state = torch.load(full, map_location="cpu", weights_only=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state["model"], "config": extra["config"], "step": extra["step"]}, out)
    return out
