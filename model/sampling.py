"""Autoregressive sampling from a :class:`model.llama.Llama` (or any model with its interface).

No KV cache: every new token runs the full forward over the last ``max_seq_len`` tokens (a sliding
window), which is simple and fast enough at the sizes trained here.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def check_sampling_args(prompt_ids: list[int], max_new_tokens: int, temperature: float,
                        top_k: int | None) -> None:
    """ValueError, naming the argument, when :func:`generate` cannot use these arguments."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token to continue from")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy decoding), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for the whole vocabulary), got {top_k}")


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator) -> int:
    """The token drawn from one position's logits (vocab,) by the rule of :func:`generate`."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float()
    if top_k is not None and top_k < logits.numel():
        kept = torch.topk(logits, top_k)
        logits = torch.full_like(logits, float("-inf")).scatter(0, kept.indices, kept.values)
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens; returns the new tokens only.

    Sampling rule, at each step: the model's logits for the last position, computed over the last
    ``model.config.max_seq_len`` tokens of prompt plus tokens so far (so a prompt may be longer than
    the model's context). ``temperature == 0``: the argmax (greedy). Otherwise keep the ``top_k``
    largest logits (all when ``top_k`` is None), take ``softmax(logits / temperature)`` in float32
    and draw one token with ``torch.multinomial`` from a ``torch.Generator`` on the model's device
    seeded with ``seed``: the same seed, model and arguments give the same tokens. Generation stops
    after ``eos_id`` when it is given and drawn (it is the last returned token).

    Runs under ``torch.no_grad`` on the model's device; the model's mode (eval/train) is left as is.
    ValueError for an empty prompt, ``max_new_tokens < 0``, ``temperature < 0`` or ``top_k < 1``.
    """
    check_sampling_args(prompt_ids, max_new_tokens, temperature, top_k)
    device = next(model.parameters()).device
    window = model.config.max_seq_len
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        token = next_token(model(context)[0, -1], temperature, top_k, generator)
        ids.append(token)
        new.append(token)
        if token == eos_id:
            break
    return new
