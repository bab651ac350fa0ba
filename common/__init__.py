"""Shared pieces: wire messages, transports, configuration, chat token building, metrics."""
