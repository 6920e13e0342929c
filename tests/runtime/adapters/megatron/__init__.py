"""Tests of the Megatron-core adapter against the real megatron-core package."""
