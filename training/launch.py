"""The ``nvfp4-train`` command: train.py's ``main``, with the stop-request handlers installed
before torch is imported (training/preemption.py), as ``python train.py`` does."""

from __future__ import annotations

from .preemption import install_early


def main() -> None:
    install_early()
    import train

    train.main()
