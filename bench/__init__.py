"""Benchmarks: workloads, honest baselines (static CP, Megatron's greedy) and plan quality."""
