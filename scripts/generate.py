"""Sample text from a trained model.

    python scripts/generate.py runs/<run> --prompt "In the beginning"
    python scripts/generate.py model.pt --prompt "And God said" --temperature 0 --max-new-tokens 32
    python scripts/generate.py export/<run>-hf --prompt "..." --num-samples 3 --seed 1

CHECKPOINT is one of: a run directory (its newest complete checkpoint), a DCP checkpoint directory
(``step_XXXXXXXX``), a consolidated ``.pt`` written by scripts/export_checkpoint.py, or an exported
Hugging Face folder (``config.json`` and ``model.safetensors``). The model runs as plain
``build_model(config["model"])`` weights, without quantization (an NVFP4 folder: its weights as
compressed-tensors decompresses them, activations unquantized).

The tokenizer is ``--tokenizer``, else the Hugging Face folder's ``tokenizer.model``, else the run
config's ``data.tokenizer_path`` (relative to the repository root), else the ``tokenizer.model`` of
the run's prepared dataset (``data.prepare.dataset_dir``). The prompt is preceded by EOS, which
separates documents in the training data, so the model continues it as the start of a document.
Sample ``i`` (from 0) is drawn with seed ``--seed + i`` (see ``model.sampling.generate``), so a
fixed seed prints the same text. The samples go to stdout, what was loaded to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data.tokenizer import Tokenizer, check_vocab  # noqa: E402
from inference.trained_model import KINDS, find_tokenizer, load_checkpoint, pick_device  # noqa: E402
from model.sampling import generate  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help=KINDS)
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of sample 0; sample i uses seed + i")
    p.add_argument("--tokenizer", type=Path, help="SentencePiece model file (default: see above)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--num-samples", type=int, default=1)
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> None:
    """Load, tokenize and print ``a.num_samples`` samples."""
    if not a.prompt:
        raise ValueError("the prompt is empty. Fix: --prompt \"some text to continue\".")
    if a.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {a.num_samples}")
    model, config, hf_tokenizer = load_checkpoint(a.checkpoint, pick_device(a.device))
    tokenizer = Tokenizer(find_tokenizer(a.tokenizer, hf_tokenizer, config))
    check_vocab(tokenizer, model.config.vocab_size)
    print(f"tokenizer {tokenizer.path}", file=sys.stderr)
    prompt = tokenizer.encode(a.prompt)
    for i in range(a.num_samples):
        new = generate(model, [tokenizer.eos_id, *prompt], a.max_new_tokens, temperature=a.temperature,
                       top_k=a.top_k, seed=a.seed + i, eos_id=tokenizer.eos_id)
        print(f"--- sample {i + 1}/{a.num_samples} (seed {a.seed + i}) ---")
        print(tokenizer.decode(prompt + new))


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    a = parse_args(argv)
    try:
        run(a)
    except (FileNotFoundError, ValueError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
