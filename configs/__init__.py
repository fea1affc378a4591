"""Hydra configs of train.py (configs/train.yaml and its groups), a package so that the installed
console script nvfp4-train finds them (``pkg://configs``)."""
