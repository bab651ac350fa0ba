"""BabyAI: minigrid's instruction-following grid levels, rendered as text with high-level actions."""
