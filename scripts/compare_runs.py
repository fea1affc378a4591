"""Compare training runs of several schemes: final validation loss and loss gap to BF16.

    python scripts/compare_runs.py runs/c4_sweep                     # trainer run dirs / offline W&B
    python scripts/compare_runs.py --wandb my-team/nvfp4-c4-sweep    # a W&B project (API, online)
    python scripts/compare_runs.py runs/c4_sweep --plot gap.png --curves gap_curves.png --out report.md

Sources (any mix, deduplicated):

* a trainer run directory (``metrics.jsonl`` and/or ``summary.json``); its config is read from
  ``.hydra/config.yaml`` (Hydra's copy), ``config.yaml``/``config.json`` next to the metrics,
  or the offline W&B run inside it; model, scheme and seed can also come from its name
  (``<model>-<scheme>-<budget>-s<seed>``). Directories given on the command line are searched
  recursively (``checkpoints/`` and ``.submitit/`` are skipped);
* an offline (or online) W&B run folder ``wandb/offline-run-*/`` found outside a trainer run
  directory, read straight from its ``run-<id>.wandb`` transaction log (no ``wandb sync``):
  config, summary and history. Folders of one run id (a resumed run) are merged in time order;
* a W&B project, ``--wandb ENTITY/PROJECT`` (needs an API key and network).

Pairing: a run is compared with the BF16 runs (``--baseline``, default ``bf16``) of the same model
and the same token budget (the ``tokens`` of its summary; else tokens-per-parameter × non-embedding
parameters; else ``train.tokens_per_param``; else ``train.steps``). Runs of different budgets never
pair. With seeds on both sides, the gap is the mean over the seeds both have of (scheme − BF16);
without common seeds it is mean(scheme) − mean(BF16) and the table says "unpaired". ``n`` is the
number of seeds averaged. Scheme runs of a model and budget without a BF16 run are listed in their
own section, and so are runs without a final validation loss (unfinished or failed).

Outputs: the markdown report on stdout (and ``--out``), a PNG of loss gap against tokens per
parameter (one panel per model size, one line per scheme, ``--plot``), optionally a PNG of the gap
along training (``--curves``: validation loss of the scheme minus BF16's at the same steps), and
optionally ``--json``. ``--writeback`` stores ``loss_gap`` (and ``loss_gap_baseline``) in the W&B
summary of every paired run read through the API; runs read from files are skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

BASELINE = "bf16"
SCHEME_ORDER = ["bf16", "nvidia", "four_over_six", "tetrajet_v2", "quartet2"]
ABLATION_DEFAULTS = {  # quant.<key> defaults of configs/quant/*.yaml; other values label the scheme
    "forward": True,
    "backward": True,
    "rotation": None,
    "four_over_six": None,
    "sr_four_over_six": False,
    "delayed_amax": False,
    "range_alignment": None,
    "keep_edge_blocks": None,
}
RUN_NAME = re.compile(r"^(?P<model>[^-]+)-(?P<scheme>.+)-(?P<budget>\d+(?:\.\d+)?(?:tpp|steps))-s(?P<seed>\d+)$")
SKIP_DIRS = {"checkpoints", ".submitit", "wandb", ".hydra", "__pycache__", ".git"}


class CompareError(RuntimeError):
    """Nothing to compare, or an unusable input; the message says what to do."""


@dataclass
class Run:
    """One training run, whatever its source."""

    name: str
    source: str  # "local", "wandb-offline", "wandb"
    path: str
    model: str | None = None
    scheme: str | None = None
    seed: int | None = None
    tokens: int | None = None
    params: int | None = None  # non-embedding parameters
    tokens_per_param_cfg: float | None = None
    steps: int | None = None
    final_val_loss: float | None = None
    last_step: int | None = None
    val_curve: dict[int, float] = field(default_factory=dict)  # step -> val/loss
    run_id: str | None = None
    handle: Any = None  # the wandb.apis.public.Run, for --writeback

    @property
    def tokens_per_param(self) -> float | None:
        if self.tokens and self.params:
            return self.tokens / self.params
        return self.tokens_per_param_cfg

    @property
    def budget(self) -> tuple | None:
        """What two runs must share to be compared (besides the model)."""
        if self.tokens:
            return ("tokens", int(self.tokens))
        if self.tokens_per_param_cfg is not None and self.params:
            return ("tokens", int(round(self.tokens_per_param_cfg * self.params)))
        if self.tokens_per_param_cfg is not None:
            return ("tpp", float(self.tokens_per_param_cfg))
        if self.steps:
            return ("steps", int(self.steps))
        return None


# ----------------------------------------------------------------------------- config helpers


def _get(cfg: dict | None, dotted: str, default: Any = None) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _num(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def scheme_label(name: str | None, quant_cfg: dict | None) -> str | None:
    """The scheme's name, plus ``[key=value,...]`` for every ablation switch off its default."""
    if name is None or not isinstance(quant_cfg, dict):
        return name
    extra = [f"{k}={quant_cfg[k]}" for k, default in ABLATION_DEFAULTS.items()
             if k in quant_cfg and quant_cfg[k] != default]
    if name == BASELINE:
        return name  # the identity scheme: ablation switches change nothing
    return f"{name}[{','.join(extra)}]" if extra else name


def _non_embedding_params(model_cfg: dict | None) -> int | None:
    """Count of a model config's non-embedding parameters (built on the meta device)."""
    if not isinstance(model_cfg, dict):
        return None
    try:
        repo = str(Path(__file__).resolve().parents[1])
        if repo not in sys.path:
            sys.path.insert(0, repo)
        from model import build_model

        return build_model(model_cfg, device="meta").num_params(non_embedding=True)
    except Exception:
        return None


def _apply_config(run: Run, cfg: dict | None) -> None:
    """Fill what is still unknown about ``run`` from a resolved trainer config."""
    if not isinstance(cfg, dict):
        return
    run.model = run.model or _get(cfg, "model.name")
    if run.scheme is None and _get(cfg, "quant.name") is not None:
        run.scheme = scheme_label(_get(cfg, "quant.name"), _get(cfg, "quant"))
    elif run.scheme is not None and isinstance(_get(cfg, "quant"), dict):
        run.scheme = scheme_label(run.scheme, _get(cfg, "quant"))
    if run.seed is None and isinstance(cfg.get("seed"), int):
        run.seed = cfg["seed"]
    if run.tokens_per_param_cfg is None:
        run.tokens_per_param_cfg = _num(_get(cfg, "train.tokens_per_param"))
    if run.steps is None and run.tokens is None and run.tokens_per_param_cfg is None:
        steps = _get(cfg, "train.steps")
        run.steps = int(steps) if isinstance(steps, int) else None
    if run.params is None and run.tokens_per_param_cfg is not None:
        run.params = _non_embedding_params(_get(cfg, "model"))
    if run.name in ("", None) and cfg.get("run_name"):
        run.name = cfg["run_name"]


def _apply_summary(run: Run, summary: dict) -> None:
    run.final_val_loss = _num(summary.get("final_val_loss"))
    if summary.get("tokens") is not None:
        run.tokens = int(summary["tokens"])
    if summary.get("non_embedding_params") is not None:
        run.params = int(summary["non_embedding_params"])
    if summary.get("steps") is not None:
        run.steps = int(summary["steps"])
    run.model = summary.get("model") or run.model
    # summary.scheme is the bare name; the config's quant group may add ablation labels later.
    run.scheme = summary.get("scheme") or run.scheme


def _apply_name(run: Run, name: str) -> None:
    """``<model>-<scheme>-<budget>-s<seed>`` (train.yaml's run_name) for what is still unknown."""
    m = RUN_NAME.match(name)
    if not m:
        return
    run.model = run.model or m["model"]
    run.scheme = run.scheme or m["scheme"]
    if run.seed is None:
        run.seed = int(m["seed"])
    budget = m["budget"]
    if run.tokens is None and run.tokens_per_param_cfg is None and run.steps is None:
        if budget.endswith("tpp"):
            run.tokens_per_param_cfg = float(budget[:-3])
        else:
            run.steps = int(budget[:-5])


# ----------------------------------------------------------------------------- W&B transaction log

_LOG_HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"  # ident, magic, version
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> Iterable[bytes]:
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


def _wandb_file(folder: Path) -> Path | None:
    files = sorted(folder.glob("run-*.wandb"))
    return files[0] if files else None


def wandb_run_folders(root: Path) -> list[Path]:
    """``offline-run-*`` / ``run-*`` folders holding a ``.wandb`` file under ``root/wandb``."""
    base = root / "wandb"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir()
                  if p.is_dir() and p.name.startswith(("offline-run-", "run-")) and _wandb_file(p))


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
            part = parse_wandb_file(_wandb_file(folder))
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


def _val_curve(rows: Iterable[dict], step_key: str) -> dict[int, float]:
    curve = {}
    for row in rows:
        v, step = _num(row.get("val/loss")), row.get(step_key)
        if v is not None and step is not None:
            curve[int(step)] = v  # a resumed run may log a step again: the last value wins
    return curve


def run_from_wandb_log(log: WandbLog, source: str, path: str) -> Run:
    run = Run(name=log.name or _get(log.config, "run_name") or Path(path).name, source=source, path=path,
              run_id=log.run_id)
    _apply_summary(run, log.summary)
    _apply_config(run, log.config)
    _apply_name(run, run.name)
    run.val_curve = _val_curve(log.history, "_step")
    steps = [int(r["_step"]) for r in log.history if r.get("_step") is not None]
    run.last_step = max(steps) if steps else None
    return run


# ----------------------------------------------------------------------------- local run dirs


def _read_local_config(run_dir: Path) -> dict | None:
    for candidate in (run_dir / ".hydra" / "config.yaml", run_dir / "config.yaml"):
        if candidate.is_file():
            from omegaconf import OmegaConf

            try:
                return OmegaConf.to_container(OmegaConf.load(candidate), resolve=False)
            except Exception:
                continue
    if (run_dir / "config.json").is_file():
        return json.loads((run_dir / "config.json").read_text())
    return None


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / "metrics.jsonl").is_file()


def read_run_dir(run_dir: Path) -> Run:
    """A trainer run directory: summary.json, metrics.jsonl, and the config it can find."""
    run = Run(name=run_dir.name, source="local", path=str(run_dir))
    if (run_dir / "summary.json").is_file():
        _apply_summary(run, json.loads((run_dir / "summary.json").read_text()))
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill
    run.val_curve = _val_curve(rows, "step")
    steps = [int(r["step"]) for r in rows if r.get("step") is not None]
    run.last_step = max(steps) if steps else None
    cfg = _read_local_config(run_dir)
    wb_folders = wandb_run_folders(run_dir)
    if wb_folders:
        log = read_wandb_folders(wb_folders)[-1]  # the trainer writes one W&B run per run dir
        run.run_id = log.run_id
        cfg = cfg or log.config
        if run.final_val_loss is None and not (run_dir / "summary.json").is_file():
            run.final_val_loss = _num(log.summary.get("final_val_loss"))
    _apply_config(run, cfg)
    _apply_name(run, run.name)
    if cfg and cfg.get("run_name") and RUN_NAME.match(str(cfg["run_name"])):
        run.name = cfg["run_name"]
    return run


def collect_paths(paths: Iterable[Path]) -> tuple[list[Run], list[str]]:
    """Every run under ``paths`` (run dirs, offline W&B folders, .wandb files); notes on skips."""
    runs: list[Run] = []
    notes: list[str] = []
    for root in paths:
        root = Path(root)
        if not root.exists():
            raise CompareError(f"{root} does not exist")
        if root.is_file():
            if root.suffix != ".wandb":
                raise CompareError(f"{root}: expected a directory or a .wandb file")
            runs.append(run_from_wandb_log(parse_wandb_file(root), "wandb-offline", str(root)))
            continue
        if root.name.startswith(("offline-run-", "run-")) and _wandb_file(root):
            runs += [run_from_wandb_log(log, "wandb-offline", log.path) for log in read_wandb_folders([root])]
            continue
        stack = [root]
        while stack:
            d = stack.pop()
            if is_run_dir(d):
                try:
                    runs.append(read_run_dir(d))
                except Exception as err:  # one broken run must not hide the others
                    notes.append(f"skipped {d}: {err}")
                continue
            for log in read_wandb_folders(wandb_run_folders(d), notes):
                runs.append(run_from_wandb_log(log, "wandb-offline", log.path))
            try:
                children = sorted(p for p in d.iterdir() if p.is_dir() and p.name not in SKIP_DIRS)
            except PermissionError:
                continue
            stack.extend(reversed(children))
    return runs, notes


# ----------------------------------------------------------------------------- W&B API


def collect_wandb_project(project: str, api: Any = None) -> list[Run]:
    """Every run of a W&B project through ``wandb.Api()`` (``ENTITY/PROJECT``)."""
    if api is None:
        import wandb

        try:
            api = wandb.Api(timeout=60)
        except Exception as err:
            raise CompareError(
                f"cannot reach W&B for --wandb {project}: {str(err).rstrip('.')}. Fix: `wandb login` (or set "
                f"WANDB_API_KEY) on a machine with network, or pass the run directories instead."
            ) from err
    try:
        return [_api_run(r, project) for r in api.runs(project)]
    except CompareError:
        raise
    except Exception as err:
        raise CompareError(f"reading the W&B project {project} failed: {str(err).rstrip('.')}. Fix: check "
                           f"ENTITY/PROJECT, the API key and the network, or pass the run directories "
                           f"instead.") from err


def _api_run(r: Any, project: str) -> Run:
    """One run of the W&B API (``wandb.apis.public.Run``)."""
    config = {k: v for k, v in dict(r.config).items() if not k.startswith("_")}
    summary = dict(getattr(r, "summary_metrics", None) or r.summary)
    run = Run(name=r.name, source="wandb", path=f"{project}/{r.id}", run_id=r.id, handle=r)
    _apply_summary(run, summary)
    _apply_config(run, config)
    _apply_name(run, run.name)
    try:
        rows = r.scan_history(keys=["_step", "val/loss"])
        run.val_curve = _val_curve(rows, "_step")
    except Exception:
        run.val_curve = {}
    run.last_step = _num(summary.get("_step"))
    return run


def writeback(rows: list["GapRow"], log=print) -> int:
    """Store each paired run's gap as ``loss_gap`` in its W&B summary (API runs only)."""
    written = skipped = 0
    for row in rows:
        for run in row.runs:
            if run.handle is None:
                skipped += 1
                continue
            run.handle.summary["loss_gap"] = row.gap
            run.handle.summary["loss_gap_baseline"] = row.baseline_loss
            run.handle.summary.update()
            written += 1
    if skipped:
        log(f"--writeback: {skipped} run(s) read from files were skipped: only runs read through "
            f"the W&B API (--wandb ENTITY/PROJECT) can be updated; sync offline runs "
            f"(`wandb sync <run dir>/wandb/offline-run-*`) and rerun with --wandb.")
    if written:
        log(f"--writeback: loss_gap written to {written} W&B run(s).")
    return written


# ----------------------------------------------------------------------------- pairing


@dataclass
class GapRow:
    model: str
    params: int | None
    tokens: int | None
    tokens_per_param: float | None
    budget: tuple
    scheme: str
    final_loss: float  # mean over the scheme's runs
    n: int  # seeds averaged
    baseline_loss: float | None = None
    gap: float | None = None
    gap_sd: float | None = None
    paired: bool = True
    runs: list[Run] = field(default_factory=list)
    curve: dict[int, float] = field(default_factory=dict)  # step -> mean gap


@dataclass
class Report:
    rows: list[GapRow]  # paired (and the baselines themselves, gap None)
    unmatched: list[GapRow]  # no BF16 run of that model and budget
    incomplete: list[Run]
    notes: list[str]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _scheme_key(s: str) -> tuple:
    base = s.split("[")[0]
    return (SCHEME_ORDER.index(base) if base in SCHEME_ORDER else len(SCHEME_ORDER), s)


def dedup(runs: list[Run], notes: list[str]) -> list[Run]:
    """One run per (model, scheme, budget, seed) when the seed is known, and per W&B id."""
    order = {"local": 0, "wandb-offline": 1, "wandb": 2}
    kept: dict[tuple, Run] = {}
    out = []
    for run in sorted(runs, key=lambda r: (r.final_val_loss is None, order.get(r.source, 3))):
        keys = []
        if run.seed is not None:
            keys.append(("cfg", run.model, run.scheme, run.budget, run.seed))
        if run.run_id:
            keys.append(("id", run.run_id))
        dup = next((kept[k] for k in keys if k in kept), None)
        if dup is not None:
            notes.append(f"duplicate of {dup.name} ({dup.path}) ignored: {run.path}")
            continue
        for k in keys:
            kept[k] = run
        out.append(run)
    return out


def compare(runs: list[Run], baseline: str = BASELINE, notes: list[str] | None = None) -> Report:
    """Pair every scheme's runs with the baseline's of the same model and budget."""
    notes = list(notes or [])
    if not runs:
        raise CompareError("no runs found. Fix: pass trainer run directories (with summary.json / "
                           "metrics.jsonl), offline W&B folders, or --wandb ENTITY/PROJECT.")
    runs = dedup(runs, notes)
    incomplete, complete = [], []
    for run in runs:
        if run.final_val_loss is None:
            incomplete.append(run)
        elif run.model is None or run.scheme is None or run.budget is None:
            notes.append(f"{run.path}: model, scheme or token budget unknown; not compared")
        else:
            complete.append(run)
    groups: dict[tuple, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in complete:
        groups[(run.model, run.budget)][run.scheme].append(run)

    rows, unmatched = [], []
    for (model, budget), by_scheme in groups.items():
        base_runs = by_scheme.get(baseline, [])
        base_by_seed = {r.seed: r for r in base_runs if r.seed is not None}
        for scheme in sorted(by_scheme, key=_scheme_key):
            rs = by_scheme[scheme]
            ref = rs[0]
            tokens = next((r.tokens for r in rs if r.tokens), None)
            params = next((r.params for r in rs if r.params), None)
            row = GapRow(model=model, params=params, tokens=tokens,
                         tokens_per_param=(tokens / params) if tokens and params else ref.tokens_per_param,
                         budget=budget, scheme=scheme, final_loss=_mean([r.final_val_loss for r in rs]),
                         n=len(rs), runs=rs)
            if scheme == baseline:
                row.baseline_loss = row.final_loss
                rows.append(row)
                continue
            if not base_runs:
                unmatched.append(row)
                continue
            pairs = [(r, base_by_seed[r.seed]) for r in rs if r.seed is not None and r.seed in base_by_seed]
            if pairs:
                gaps = [r.final_val_loss - b.final_val_loss for r, b in pairs]
                row.gap, row.gap_sd, row.n = _mean(gaps), _sd(gaps), len(pairs)
                row.final_loss = _mean([r.final_val_loss for r, _ in pairs])
                row.baseline_loss = _mean([b.final_val_loss for _, b in pairs])
                row.runs = [r for r, _ in pairs]
                if len(pairs) < len(rs):
                    notes.append(f"{model} {scheme} {_budget_text(budget)}: {len(rs) - len(pairs)} run(s) "
                                 f"without a BF16 run of the same seed left out of the gap")
            else:
                row.baseline_loss = _mean([b.final_val_loss for b in base_runs])
                row.gap = row.final_loss - row.baseline_loss
                row.gap_sd = _sd([r.final_val_loss for r in rs])
                row.paired = False
            row.curve = _gap_curve(row.runs, base_by_seed, base_runs, row.paired)
            rows.append(row)
    def key(r: GapRow) -> tuple:
        return (r.params or 0, r.model, r.tokens_per_param or 0, str(r.budget), _scheme_key(r.scheme))

    return Report(sorted(rows, key=key), sorted(unmatched, key=key), incomplete, notes)


def _gap_curve(runs: list[Run], base_by_seed: dict, base_runs: list[Run], paired: bool) -> dict[int, float]:
    """Mean over runs of val/loss(scheme) − val/loss(BF16) at the steps both evaluated."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        bases = [base_by_seed[run.seed]] if paired else base_runs
        for step, v in run.val_curve.items():
            ref = [b.val_curve[step] for b in bases if step in b.val_curve]
            if ref:
                per_step[step].append(v - _mean(ref))
    return {s: _mean(v) for s, v in sorted(per_step.items())}


# ----------------------------------------------------------------------------- output


def _budget_text(budget: tuple) -> str:
    kind, value = budget
    return {"tokens": f"{value:,} tokens", "tpp": f"{value:g} tokens/param", "steps": f"{value} steps"}[kind]


def _fmt(x: float | None, spec: str = ".4f", signed: bool = False) -> str:
    if x is None:
        return "—"
    return format(x, ("+" if signed else "") + spec)


def _tokens_text(row: GapRow) -> str:
    return f"{row.tokens:,}" if row.tokens else _budget_text(row.budget)


def markdown(report: Report, baseline: str = BASELINE) -> str:
    out = [f"## Final validation loss and loss gap to {baseline}", ""]
    if report.rows:
        out += ["| model | non-emb. params | tokens | tokens/param | scheme | final val loss | "
                f"{baseline} | gap | n |", "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in report.rows:
            gap = "baseline" if r.scheme == baseline else _fmt(r.gap, signed=True)
            if r.gap is not None and r.gap_sd is not None:
                gap += f" ± {r.gap_sd:.4f}"
            if r.gap is not None and not r.paired:
                gap += " (unpaired)"
            out.append(f"| {r.model} | {r.params:,} | {_tokens_text(r)} | {_fmt(r.tokens_per_param, '.4g')} | "
                       f"{r.scheme} | {r.final_loss:.4f} | {_fmt(r.baseline_loss)} | {gap} | {r.n} |"
                       if r.params else
                       f"| {r.model} | — | {_tokens_text(r)} | {_fmt(r.tokens_per_param, '.4g')} | "
                       f"{r.scheme} | {r.final_loss:.4f} | {_fmt(r.baseline_loss)} | {gap} | {r.n} |")
        out += ["", "n: seeds averaged (paired with the BF16 run of the same seed); ± is their standard "
                "deviation. Gap > 0: the scheme's validation loss is above BF16's.", ""]
        pivot = _pivot(report.rows, baseline)
        if pivot:
            out += pivot
    else:
        out += ["(no run has a matching BF16 baseline)", ""]
    if report.unmatched:
        out += [f"## Runs without a matching {baseline} baseline", "",
                "| model | tokens | tokens/param | scheme | final val loss | n | runs |",
                "|---|---:|---:|---|---:|---:|---|"]
        for r in report.unmatched:
            out.append(f"| {r.model} | {_tokens_text(r)} | {_fmt(r.tokens_per_param, '.4g')} | {r.scheme} | "
                       f"{r.final_loss:.4f} | {r.n} | {', '.join(x.name for x in r.runs)} |")
        out += ["", f"No {baseline} run of the same model and token budget was found; runs of other "
                "budgets are never paired.", ""]
    if report.incomplete:
        out += ["## Runs without a final validation loss (unfinished or failed)", "",
                "| run | last logged step | last val loss | where |", "|---|---:|---:|---|"]
        for run in report.incomplete:
            last_val = run.val_curve[max(run.val_curve)] if run.val_curve else None
            out.append(f"| {run.name} | {run.last_step if run.last_step is not None else '—'} | "
                       f"{_fmt(last_val)} | {run.path} |")
        out.append("")
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    return "\n".join(out)


def _pivot(rows: list[GapRow], baseline: str) -> list[str]:
    """Per model: tokens/param down, schemes across, gaps in the cells (the SPEC §5 layout)."""
    out = []
    by_model: dict[str, list[GapRow]] = defaultdict(list)
    for r in rows:
        if r.scheme != baseline and r.gap is not None:
            by_model[r.model].append(r)
    for model, rs in by_model.items():
        schemes = sorted({r.scheme for r in rs}, key=_scheme_key)
        budgets = sorted({r.budget for r in rs}, key=lambda b: next(
            (r.tokens_per_param or 0) for r in rs if r.budget == b))
        out += [f"### Loss gap to {baseline}, {model}", "",
                "| tokens/param | " + " | ".join(schemes) + " |", "|---:|" + "---:|" * len(schemes)]
        for b in budgets:
            cells = {r.scheme: r for r in rs if r.budget == b}
            tpp = next(r.tokens_per_param for r in rs if r.budget == b)
            label = _fmt(tpp, ".4g") if tpp is not None else _budget_text(b)
            out.append(f"| {label} | " + " | ".join(_fmt(cells[s].gap, signed=True) if s in cells else "—"
                                                    for s in schemes) + " |")
        out.append("")
    return out


def _color(scheme: str, schemes: list[str]) -> Any:
    import matplotlib.pyplot as plt

    return plt.get_cmap("tab10")(schemes.index(scheme) % 10)


def _save_figure(fig, path: Path, dpi: int) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_gaps(report: Report, path: Path, baseline: str = BASELINE) -> Path:
    """Loss gap against tokens per parameter: one panel per model size, one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.scheme != baseline and r.gap is not None and r.tokens_per_param]
    if not rows:
        raise CompareError(f"nothing to plot: no run has a matching {baseline} baseline")
    models = sorted({r.model for r in rows}, key=lambda m: next((r.params or 0) for r in rows if r.model == m))
    schemes = sorted({r.scheme for r in rows}, key=_scheme_key)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        mrows = [r for r in rows if r.model == model]
        for scheme in schemes:
            pts = sorted((r.tokens_per_param, r.gap, r.gap_sd or 0.0) for r in mrows if r.scheme == scheme)
            if not pts:
                continue
            x, y, e = zip(*pts)
            ax.errorbar(x, y, yerr=e if any(e) else None, marker="o", ms=4, capsize=2, label=scheme,
                        color=_color(scheme, schemes))
        params = next((r.params for r in mrows if r.params), None)
        ax.set_title(f"{model}" + (f" ({params / 1e6:.1f}M non-emb. params)" if params else ""), fontsize=10)
        ax.set_xscale("log")
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("tokens per parameter")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"final val loss − {baseline}")
    axes[0][-1].legend(fontsize=8)
    return _save_figure(fig, path, dpi=120)


def plot_curves(report: Report, path: Path, baseline: str = BASELINE) -> Path:
    """Gap along training: one panel per (model, budget), one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.scheme != baseline and r.curve]
    if not rows:
        raise CompareError(f"no validation curves to compare: the runs share no val/loss steps with "
                           f"their {baseline} baseline (set train.eval_every lower)")
    models = sorted({r.model for r in rows}, key=lambda m: next((r.params or 0) for r in rows if r.model == m))
    budgets = sorted({r.budget for r in rows}, key=lambda b: next((r.tokens_per_param or 0) for r in rows
                                                                  if r.budget == b))
    schemes = sorted({r.scheme for r in rows}, key=_scheme_key)
    fig, axes = plt.subplots(len(models), len(budgets), figsize=(3.6 * len(budgets), 2.9 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            cell = [r for r in rows if r.model == model and r.budget == budget]
            if not cell:
                ax.set_visible(False)
                continue
            for r in cell:
                steps = sorted(r.curve)
                ax.plot(steps, [r.curve[s] for s in steps], marker=".", label=r.scheme,
                        color=_color(r.scheme, schemes))
            tpp = cell[0].tokens_per_param
            ax.set_title(f"{model}, " + (f"{tpp:.4g} tokens/param" if tpp else _budget_text(budget)), fontsize=9)
            ax.axhline(0.0, color="grey", lw=0.8, ls=":")
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel(f"val loss − {baseline}")
            ax.legend(fontsize=7)
    return _save_figure(fig, path, dpi=110)


def report_json(report: Report) -> dict:
    def row(r: GapRow) -> dict:
        return {"model": r.model, "non_embedding_params": r.params, "tokens": r.tokens,
                "tokens_per_param": r.tokens_per_param, "scheme": r.scheme, "final_val_loss": r.final_loss,
                "baseline_val_loss": r.baseline_loss, "loss_gap": r.gap, "loss_gap_sd": r.gap_sd, "n": r.n,
                "paired": r.paired, "runs": [x.name for x in r.runs],
                "gap_curve": {str(k): v for k, v in r.curve.items()}}

    return {"rows": [row(r) for r in report.rows], "no_baseline": [row(r) for r in report.unmatched],
            "incomplete": [{"name": r.name, "path": r.path, "last_step": r.last_step} for r in report.incomplete],
            "notes": report.notes}


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path,
                   help="run directories, sweep directories, offline W&B run folders or .wandb files")
    p.add_argument("--wandb", action="append", default=[], metavar="ENTITY/PROJECT",
                   help="read the runs of a W&B project through the API (repeatable)")
    p.add_argument("--baseline", default=BASELINE, help="scheme the gaps are taken against (default: bf16)")
    p.add_argument("--plot", type=Path, default=Path("loss_gap.png"),
                   help="PNG of loss gap vs tokens per parameter (default: loss_gap.png)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--curves", type=Path, nargs="?", const=Path("loss_gap_curves.png"), default=None,
                   help="also plot the gap along training (default file: loss_gap_curves.png)")
    p.add_argument("--out", type=Path, help="also write the markdown report to this file")
    p.add_argument("--json", type=Path, help="also write the numbers as JSON")
    p.add_argument("--writeback", action="store_true",
                   help="store loss_gap in the W&B summary of every paired run read through the API")
    a = p.parse_args(argv)
    if not a.paths and not a.wandb:
        p.error("give run directories (e.g. runs/c4_sweep) and/or --wandb ENTITY/PROJECT")
    try:
        runs, notes = collect_paths(a.paths)
        for project in a.wandb:
            runs += collect_wandb_project(project)
        report = compare(runs, a.baseline, notes)
        text = markdown(report, a.baseline)
        print(text)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(text + "\n")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(report_json(report), indent=2) + "\n")
        paired = [r for r in report.rows if r.gap is not None]
        if not a.no_plot:
            if paired:
                print(f"loss-gap plot: {plot_gaps(report, a.plot, a.baseline)}")
            else:
                print(f"no loss-gap plot: no run has a matching {a.baseline} baseline")
        if a.curves is not None:
            if any(r.curve for r in paired):
                print(f"gap-curve plot: {plot_curves(report, a.curves, a.baseline)}")
            else:
                print("no gap-curve plot: no paired runs with validation losses at common steps")
        if a.writeback:
            if paired:
                writeback(paired)
            else:
                print("--writeback: nothing to write (no paired runs)")
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
