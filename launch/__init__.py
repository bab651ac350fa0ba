"""The top layer: the `longhorizon` command and the Python API (cli.py, api.py), the cross-part config
rules (checks.py), the process entry point (worker.py), launchers/, recipes/, bench/, reports and plots."""
