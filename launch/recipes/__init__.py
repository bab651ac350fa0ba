"""Recipes: what runs around or instead of RL training: SFT, DPO and RFT, evaluation and
collection sweeps, and the experiments that chain them (SFT then RL, horizons, freezes)."""
