"""Deep search: multi-turn search and reasoning over a local passage corpus."""
