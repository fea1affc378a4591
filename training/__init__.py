"""What train.py needs around its loop: schedule, optimizer groups, checkpoints, metrics, tracking."""
