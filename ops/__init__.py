"""Operator tools: the `pflower` command (run, sweep, compare, deploy, certs, adapt)."""
