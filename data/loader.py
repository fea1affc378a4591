"""Memory-mapped loading of prepared datasets, with a checkpointable, rank-independent state.

A split is one token stream of ``T`` tokens: format 2's extents of the unit files, or format 1's
shards, in the manifest's order. Sample ``i`` is the window of
``seq_len + 1`` tokens starting at ``i * seq_len``, for ``i`` in ``[0, (T - 1) // seq_len)``;
consecutive windows overlap by one token, so every token after the first is a target exactly once
per epoch. Epoch ``e`` visits the samples in the order of a permutation drawn from
``numpy.random.default_rng((seed, e))`` (`sample_order`).

The state is global: (epoch, position in that epoch's order, seed, dataset fingerprint). Each
`TokenLoader.next_batch` takes the next ``global_batch_size`` samples of the order (continuing into
the next epoch when one ends) and returns rank ``r``'s rows ``[r * local, (r + 1) * local)``, with
``local = global_batch_size // world_size``. Any world size therefore sees the same global batches,
and a state saved under one world size resumes under another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.prepare import load_manifest


def _pieces(manifest: dict[str, Any], split: str) -> tuple[list[tuple[str, int]], np.ndarray]:
    """(the token files of ``split`` with their token counts; its pieces as rows ``[file index,
    offset, tokens]``, in stream order): format 1's shards are whole files, format 2's extents
    are runs inside the unit files."""
    if manifest.get("format_version", 1) == 1:
        shards = manifest["splits"][split]["shards"]
        files = [(s["file"], s["tokens"]) for s in shards]
        rows = [[i, 0, s["tokens"]] for i, s in enumerate(shards)]
    else:
        files = [(u["file"], u["tokens"]) for u in manifest["units"]]
        rows = manifest["splits"][split]["extents"]
    return files, np.array(rows, dtype=np.int64).reshape(-1, 3)


def _open_token_file(path: Path, tokens: int, dtype: np.dtype) -> np.ndarray:
    """``path`` memory-mapped; FileNotFoundError or ValueError, naming the fix, when it is missing
    or not of the manifest's size."""
    if not path.is_file():
        raise FileNotFoundError(
            f"token file {path} of the manifest is missing. The dataset was changed after "
            "preparation: prepare it again (the same call repairs it)."
        )
    expected = tokens * dtype.itemsize
    if path.stat().st_size != expected:
        raise ValueError(
            f"token file {path} is {path.stat().st_size} bytes; the manifest expects "
            f"{expected}. The dataset was changed after preparation: prepare it again "
            "(the same call repairs it)."
        )
    return np.memmap(path, dtype=dtype, mode="r") if tokens else np.zeros(0, dtype=dtype)


class _TokenStream:
    """The token files of one split, memory-mapped, read as one continuous array of tokens."""

    def __init__(
        self, dataset_dir: str | os.PathLike, split: str, seq_len: int, need_sample: bool = True
    ) -> None:
        self.dir = Path(dataset_dir).expanduser().resolve()
        self.manifest = load_manifest(self.dir)
        if split not in self.manifest["splits"]:
            raise ValueError(
                f"unknown split {split!r}: {self.dir} has {list(self.manifest['splits'])}."
            )
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}.")
        dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        files, self.pieces = _pieces(self.manifest, split)
        self.files = [_open_token_file(self.dir / name, tokens, dtype) for name, tokens in files]
        self.starts = np.concatenate([[0], np.cumsum(self.pieces[:, 2])]).astype(np.int64)
        self.seq_len = seq_len
        self.num_samples = max(0, (int(self.starts[-1]) - 1) // seq_len)
        if self.num_samples == 0 and need_sample:
            raise ValueError(
                f"the {split!r} split of {self.dir} has {int(self.starts[-1])} tokens, fewer than "
                f"one sample of seq_len + 1 = {seq_len + 1}. Use a shorter seq_len, or prepare "
                f"more data{' or a larger val_fraction' if split == 'val' else ''}."
            )

    def tokens(self, begin: int, end: int) -> np.ndarray:
        """Tokens ``[begin, end)`` of the stream as int64."""
        out = np.empty(end - begin, dtype=np.int64)
        piece = int(np.searchsorted(self.starts, begin, side="right")) - 1
        filled = 0
        while filled < len(out):
            file, offset, count = (int(x) for x in self.pieces[piece])
            skip = begin + filled - int(self.starts[piece])
            take = min(count - skip, len(out) - filled)
            out[filled : filled + take] = self.files[file][offset + skip : offset + skip + take]
            filled += take
            piece += 1
        return out

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def window(self, sample: int) -> np.ndarray:
        """Tokens ``[sample * seq_len, sample * seq_len + seq_len + 1)`` as int64."""
        begin = sample * self.seq_len
        return self.tokens(begin, begin + self.seq_len + 1)

    def batch(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) LongTensors of shape (len(samples), seq_len)."""
        tokens = torch.from_numpy(np.stack([self.window(int(i)) for i in samples]))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def sample_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """Epoch ``epoch``'s order of the samples: ``numpy.random.default_rng((seed, epoch))
    .permutation(num_samples)``, held as uint32 (4 bytes a sample) when the indices fit.

    Shuffling ``arange`` in place is what ``permutation`` does, and the shuffle's random draws do
    not depend on the dtype, so both give the same order.
    """
    dtype = np.uint32 if num_samples <= 1 << 32 else np.int64
    order = np.arange(num_samples, dtype=dtype)
    np.random.default_rng((seed, epoch)).shuffle(order)
    return order


def read_split(dataset_dir: str | os.PathLike, split: str) -> np.ndarray:
    """The whole token stream of ``split`` as one array of the dataset's dtype (it reads every
    token: for inspection and tests, not for training)."""
    stream = _TokenStream(dataset_dir, split, 1, need_sample=False)
    return stream.tokens(0, int(stream.starts[-1])).astype(stream.manifest["dtype"])


def _local_rows(global_batch_size: int, rank: int, world_size: int) -> slice:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}.")
    if global_batch_size < 1 or global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not a positive multiple of world_size "
            f"{world_size}: every rank must get the same number of rows. Pick a global batch size "
            "divisible by the number of ranks."
        )
    local = global_batch_size // world_size
    return slice(rank * local, (rank + 1) * local)


class TokenLoader:
    """Shuffled training batches of a prepared dataset: this rank's rows of each global batch.

    Args:
        dataset_dir: directory returned by `data.prepare.prepare` / `prepare_from_config`.
        split: ``"train"`` or ``"val"``.
        seq_len: tokens per input row (each sample holds ``seq_len + 1`` tokens).
        global_batch_size: rows per batch summed over all ranks.
        rank, world_size: this process's data-parallel rank and the number of ranks.
        seed: seed of the sample order (replaced by the seed of a loaded state).
    """

    def __init__(
        self,
        dataset_dir: str | os.PathLike,
        split: str,
        seq_len: int,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        self._rows = _local_rows(global_batch_size, rank, world_size)
        self._stream = _TokenStream(dataset_dir, split, seq_len)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}.")
        self.split = split
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order_cache: tuple[tuple[int, int], np.ndarray] | None = None

    @property
    def num_samples(self) -> int:
        """Samples per epoch."""
        return self._stream.num_samples

    @property
    def fingerprint(self) -> str:
        """The dataset fingerprint from its manifest."""
        return self._stream.fingerprint

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, from the manifest."""
        return self._stream.manifest["vocab_size"]

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != (self.seed, epoch):
            self._order_cache = ((self.seed, epoch), sample_order(self.seed, epoch, self.num_samples))
        return self._order_cache[1]

    def _next_samples(self) -> np.ndarray:
        """The next global batch's sample indices; advances the state."""
        parts = []
        needed = self.global_batch_size
        while needed:
            take = min(needed, self.num_samples - self.position)
            parts.append(self._order(self.epoch)[self.position : self.position + take])
            self.position += take
            needed -= take
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(parts)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): LongTensors of shape (global_batch_size // world_size, seq_len)."""
        return self._stream.batch(self._next_samples()[self._rows])

    def state_dict(self) -> dict[str, Any]:
        """The global position in the sample order; identical on every rank."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "split": self.split,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the next batch is the one that followed it when it was saved.

        Refuses (ValueError) a state of other shards, another split or another seq_len. Global
        batch size and world size may differ from the saving run's.
        """
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"the loader state belongs to dataset fingerprint {state['fingerprint']}, but "
                f"{self._stream.dir} has fingerprint {self.fingerprint}: its shards or tokenizer "
                "differ from the saving run's. Resume with the dataset directory the run was "
                "started with, or start the data order afresh by not loading the loader state."
            )
        for key in ("split", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the loader state was saved with {key}={state[key]!r}, this loader has "
                    f"{key}={getattr(self, key)!r}. Build the loader with {key}={state[key]!r}."
                )
        if not 0 <= state["position"] < self.num_samples:
            raise ValueError(
                f"loader state position {state['position']} is outside [0, {self.num_samples})."
            )
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]


def val_batches(
    dataset_dir: str | os.PathLike,
    seq_len: int,
    batch_size: int,
    num_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches: the same on every call, for any world size.

    ``num_batches * batch_size`` samples evenly spaced over the validation split, in order;
    ``num_batches=None`` takes as many batches as the split holds (``num_samples // batch_size``).
    ``batch_size`` is global: each rank gets its rows of every batch, as in `TokenLoader`.
    Errors (too few samples, bad batch size) are raised by the call, not by the first ``next``.
    """
    rows = _local_rows(batch_size, rank, world_size)
    stream = _TokenStream(dataset_dir, "val", seq_len)
    available = stream.num_samples // batch_size
    count = available if num_batches is None else num_batches
    if count < 1 or count > available:
        raise ValueError(
            f"asked for {count} validation batches of {batch_size} samples, but the val split of "
            f"{stream.dir} has {stream.num_samples} samples of seq_len {seq_len} "
            f"({available} batches). Ask for fewer or smaller batches, or prepare with a larger "
            "val_fraction."
        )
    total = count * batch_size
    samples = np.arange(total, dtype=np.int64) * (stream.num_samples - 1) // max(total - 1, 1)
    return (stream.batch(batch[rows]) for batch in samples.reshape(count, batch_size))
