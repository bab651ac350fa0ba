"""Learner: group buffer, advantages, losses, the update step, broadcast, checkpoints."""
