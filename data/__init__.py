"""Data pipeline: tokenizer, corpus preparation into token shards, and the token loader.

- `data.tokenizer`: `Tokenizer`, `train_tokenizer`, `check_vocab`.
- `data.prepare`: `prepare`, `prepare_from_config`, `load_manifest` (``python -m data.prepare``).
- `data.units`: the units of work (one per input file), their ledger, and the final step.
- `data.loader`: `TokenLoader`, `val_batches`, `read_split`, `sample_order`.

Modules are imported on use, so that tokenizing worker processes do not import torch.
"""
