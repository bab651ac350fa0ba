"""Launchers: the longhorizon command, local process supervision, benchmarks, plots."""
