"""SentencePiece tokenizer: load any SentencePiece model file, or train a byte-fallback BPE model.

A trained model uses identity normalisation, keeps every whitespace character and falls back to
UTF-8 bytes for characters outside its vocabulary, so ``decode(encode(text)) == text`` for any
text. Ids 0, 1 and 2 are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS), as in the Llama-2 tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

# SentencePiece trains on "sentences"; lines longer than this many bytes would be skipped.
_MAX_LINE_BYTES = 16384


class Tokenizer:
    """A loaded SentencePiece model (e.g. one trained by `train_tokenizer`, or Llama-2's)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser().resolve()
        if not self.path.is_file():
            raise FileNotFoundError(
                f"tokenizer model not found: {self.path}. Give the path of an existing "
                "SentencePiece model file (for C4, Llama-2's tokenizer.model), or leave "
                "data.tokenizer_path null (CLI: --vocab-size instead of --tokenizer) to train one "
                "on the corpus."
            )
        blob = self.path.read_bytes()
        self.sha256 = hashlib.sha256(blob).hexdigest()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(blob)
        except RuntimeError as err:
            raise ValueError(
                f"{self.path} is not a SentencePiece model file ({err}). Point the tokenizer path "
                "at a .model file such as Llama-2's tokenizer.model."
            ) from err
        if self.eos_id < 0:
            raise ValueError(
                f"tokenizer {self.path} defines no EOS piece, but every document must end with "
                "EOS. Use a SentencePiece model trained with eos_id >= 0."
            )

    @property
    def vocab_size(self) -> int:
        """Number of pieces; every id is in ``[0, vocab_size)``."""
        return self._sp.vocab_size()

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence piece, appended after every document."""
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-sequence piece (-1 when the model has none)."""
        return self._sp.bos_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS or EOS."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` on each text, on this thread only (callers parallelise with processes)."""
        return self._sp.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (the inverse of `encode`)."""
        return self._sp.decode([int(i) for i in ids])


def train_tokenizer(texts: Iterable[str], path: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """Train a byte-fallback BPE model of ``vocab_size`` pieces on ``texts``, saved at ``path``.

    Each text is split into lines, which are SentencePiece's training sentences. The model file is
    written atomically (temporary file, then rename). Training is deterministic: the same texts and
    vocabulary size give the same file.
    """
    path = Path(path)
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(
            f"cannot train a tokenizer for {path}: the corpus has no text. Check the input files."
        )
    blob = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=blob,
            model_type="bpe",
            vocab_size=vocab_size,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            byte_fallback=True,
            character_coverage=0.9995,
            max_sentence_length=_MAX_LINE_BYTES,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ValueError(
            f"SentencePiece could not train a {vocab_size}-piece BPE tokenizer: {err}. "
            "If the vocabulary is too large for this corpus, lower the vocabulary size."
        ) from err
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob.getvalue())
    os.replace(tmp, path)
    return Tokenizer(path)


def check_vocab(vocab: int | Tokenizer, model_vocab_size: int) -> None:
    """Raise ValueError when token ids from ``vocab`` would index past a model embedding.

    ``vocab`` is a tokenizer or its vocabulary size (e.g. the manifest's ``vocab_size``). A model
    embedding larger than the vocabulary (padded, say, to a multiple of 64) is fine.
    """
    size = vocab.vocab_size if isinstance(vocab, Tokenizer) else int(vocab)
    if size > model_vocab_size:
        raise ValueError(
            f"the tokenizer's vocabulary ({size} pieces) is bigger than the model's embedding "
            f"({model_vocab_size} rows): ids up to {size - 1} would index past it. Set the model's "
            f"vocab_size to at least {size} (the dataset manifest's vocab_size), or use a "
            f"tokenizer with at most {model_vocab_size} pieces."
        )
