"""The Megatron batch's pure parts: ``padding_mask`` and ``PackedSeqParams`` from plan rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.adapters.megatron.binding.batch import packed_seq_params, padding_mask
from runtime.data.batch import build_microbatch
from runtime.data.plan_reader import PlanReader
from runtime.data.shard import zigzag_indices_np
from runtime.data.tokens import open_token_source
from tests.runtime.adapters.megatron.harness import MODEL, write_dataset
from tests.runtime.planfactory import random_plan


def test_padding_mask_marks_real_tokens_in_the_shard_layout(tmp_path: Path) -> None:
    lengths = np.random.default_rng(2).integers(1, 40, size=30)
    data = write_dataset(tmp_path / "d.arrow", lengths, MODEL.vocab_size)
    plan = random_plan(tmp_path / "p.arrow", lengths, dp=2, cp=2, tp=2, sequence_parallel=True,
                       num_steps=2, microbatches=3, split_fraction=0.3, seed=4)
    reader = PlanReader(plan)
    source = open_token_source(str(data))
    seen_padding = 0
    for step in range(reader.num_steps):
        sp = reader.step(step)
        for m in range(sp.num_microbatches):
            for pool_rank in range(4):
                rows = sp.group_for(m, pool_rank)
                # Real flags of the whole packed buffer, row by row, then this rank's slots.
                full = np.concatenate([np.arange(p) < n for n, p in
                                       zip(rows.num_tokens, rows.padded_tokens, strict=True)])
                cu = np.concatenate([[0], np.cumsum(rows.padded_tokens)])
                want = full[zigzag_indices_np(cu, rows.cp_size, rows.cp_rank)]
                got = padding_mask(rows, "zigzag")
                assert got.dtype == torch.bool
                assert got.numpy().tolist() == want.tolist()
                seen_padding += int((~got).sum())
                mb = build_microbatch(rows, source, layout="zigzag")
                assert mb.tokens is not None
                assert got.shape == mb.tokens.shape
                psp = packed_seq_params(mb, None)
                assert psp.qkv_format == "thd"
                assert psp.local_cp_size == rows.cp_size
                assert psp.cu_seqlens_q.dtype == torch.int32
                assert psp.cu_seqlens_q.dim() == 1
                assert psp.cu_seqlens_q_padded.tolist() == cu.tolist()
                assert psp.max_seqlen_q == int(rows.padded_tokens.max())
    assert seen_padding > 0  # the plan pads (tp 2 with SP): the test can see a wrong mask


def test_megatron_bf16_on_the_cpu_is_refused_before_any_work(tmp_path: Path,
                                                              capsys: object) -> None:
    from runtime.train.cli import main

    lengths = np.random.default_rng(3).integers(2, 30, size=12)
    data = write_dataset(tmp_path / "d.arrow", lengths, MODEL.vocab_size)
    plan = random_plan(tmp_path / "p.arrow", lengths, dp=1, cp=1, num_steps=1,
                       microbatches=1, seed=1)
    rc = main(["--framework", "megatron", "--plan", str(plan), "--dataset", str(data),
               "--dtype", "bf16", "--vocab-size", "64"])
    assert rc == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--bf16 is Megatron's mixed precision, for --device cuda" in err
