"""Actor types (engines): token ids in, token ids and log-probs out; looked up by name."""
