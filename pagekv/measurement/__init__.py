"""Measurement: the replay harness and its tables, the kvpress peer that runs
kvpress's own presses in a venv of their own, and our press for kvpress
(integrations). Imports any layer of `pagekv`; nothing imports it but the CLI
and the tests.
"""
