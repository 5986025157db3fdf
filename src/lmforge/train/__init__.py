"""Training: optimizer, learning-rate schedule, precision, checkpoints, the loop, DDP."""
