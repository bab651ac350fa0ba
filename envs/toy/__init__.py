"""A tiny multi-turn codebook environment for learning tests."""
