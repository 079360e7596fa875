"""Benchmarks (``.venv/bin/python bench/run.py``); not collected by the test run."""
