"""``dcp-plan``'s translations for users: library field names -> the flags they set, and the
Megatron-LM flags that mean nothing here, with what to use instead (``args.refuse``)."""

from __future__ import annotations

FLAGS = {
    "long_sequences": "--long-sequences",
    "global_batch_size": "--global-batch-size",
    "global_batch_tokens": "--global-batch-tokens",
    "capacity_tokens_per_rank": "--max-tokens-per-rank",
    "microbatch_group_size": "--microbatch-group-size",
    "microbatch_tolerance": "--microbatch-tolerance",
    "min_cp": "--min-cp",
    "cp_sizes": "--cp-sizes",
    "drop_last": "--drop-last",
    "skip_bad_records": "--skip-bad-records",
    "cost_model": "--cost-model",
    "min_cp=": "--min-cp ",
    "vpp=": "--vpp ",
    "pp >=": "--pp >=",
    "pp=": "--pp ",
    "dp=": "--dp ",
    "cp=": "--cp ",
    "tp=": "--tp ",
    "epochs=": "--epochs ",
    "workers=": "--workers ",
    "ray_address": "--ray-address",
    "field=": "--field ",
}
"""Python field names in library errors -> the flags a command-line user sets."""

MEGATRON_REFUSED = {
    "--micro-batch-size": "dcp-plan chooses every step's microbatches; bound their size with "
    "--max-tokens-per-rank (Megatron's --max-seqlen-per-dp-cp-rank)",
    "--seq-length": "samples keep their own lengths; cap the padded tokens per rank with "
    "--max-tokens-per-rank and choose what happens to longer samples with --long-sequences",
    "--num-microbatches": "microbatch counts are planned per step; see --microbatch-tolerance",
}
"""Megatron flags that mean nothing here, refused with what to use instead."""
