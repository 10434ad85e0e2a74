"""Verifiers: functions that score a response against a prompt's gold answer or tests."""
