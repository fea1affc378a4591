"""The trainer (training/trainer.py) and its parts: the step, validation, checkpoints, tracking, stops."""
