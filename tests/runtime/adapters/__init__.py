"""Tests of the framework adapters (runtime/adapters)."""
