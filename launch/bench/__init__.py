"""The benchmarks behind `longhorizon bench NAME`: one module each, and what they share.

cli.py dispatches the command; tables.py prints their tables and last JSON line; memory.py
measures the memory they report. `longhorizon bench --help` lists the benchmarks.
"""
