"""Fault injection: each test injects one real fault into a real job and checks the job's
final state, its step log and its committed snapshots (see helpers.py)."""
