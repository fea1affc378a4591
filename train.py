"""Pre-train a Llama model whose block linears run in NVFP4 (or BF16).

    python train.py                                   # tiny model, quartet2, bundled corpus, CPU is fine
    python train.py quant=nvidia model=30m train.tokens_per_param=100
    python train.py quant=quartet2 model=1.9b data=c4 data.tokenizer_path=/path/to/tokenizer.model

Configs live in configs/ (Hydra; the command line is training/cli.py), the trainer in
training/trainer.py. See README.md, docs/reliability.md and docs/performance.md.
"""

from __future__ import annotations

from training.cpu_kernels import pin as pin_cpu_kernels
from training.preemption import install_early


def main() -> None:
    """The command line. Stop requests (SIGTERM, SIGUSR1, Ctrl-C) that arrive while torch imports
    are recorded, not lost: the handlers go in before anything heavy is imported
    (training/preemption.py). The CPU kernels are chosen before torch loads too, so that a CPU run
    gives the same numbers on every x86-64 machine (training/cpu_kernels.py)."""
    install_early()
    pin_cpu_kernels()
    from training.cli import main as train_from_command_line

    train_from_command_line()


if __name__ == "__main__":
    main()
