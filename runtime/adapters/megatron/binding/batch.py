"""The plan's microbatches as the batches Megatron's ``forward_step_func`` reads.

``PlanBatches`` turns a plan step into the ``data_iterator`` argument of
``get_forward_backward_func()``: one iterator for a plain model, one per model chunk with
virtual pipeline stages (the interleaved schedule takes a list). Each ``next()`` builds one
microbatch, lazily (at most one ahead of the schedule), with only the fields its stage owns:

- ``tokens``, ``position_ids``: int64 ``[1, T]`` on the first stage (chunk 0 of pp rank 0), else
  None. ``T`` is this rank's share of the group's packed buffer (``runtime.data.batch``);
- ``labels``, ``loss_mask``: on the last stage (last chunk of the last pp rank), else None;
- ``mtp``: a model with multi-token prediction (``mtp_depth``), on the last stage:
  ``runtime.data.mtp.MTPInputs`` (each depth's labels and loss mask, shifted within each
  sequence, and the shift map Megatron's MTP layers roll their inputs through); the last stage
  then also gets ``tokens`` and ``position_ids`` (the MTP layers embed them). Else None;
- ``padding_mask``: bool, True for a real token and False for padding, on every stage, in the
  tokens' layout. Under sequence parallelism Megatron's ``GPTModel`` scatters it over the TP
  ranks on the first stage; on the other stages the hidden states are already scattered, so it
  arrives here as this TP rank's ``[1, T / tp]`` slice;
- ``segments``: ``Segments``, which row (sequence) of the group each of this rank's slots holds
  and each row's real tokens: what a per-sequence statistic needs (``moe.py``);
- ``attention_mask``: None (causality and document boundaries are in the packing metadata);
- ``packed_seq_params``: ``PackedSeqParams(qkv_format="thd")`` with 1-D int32 ``cu_seqlens_q/kv``
  (real lengths) and ``cu_seqlens_q/kv_padded`` (padded lengths), global (not divided by the CP
  size), ``max_seqlen_q/kv`` = the group's largest padded length, ``cp_group`` = the
  microbatch's group (this rank alone at size 1) and ``local_cp_size`` = its size.

``num_microbatches(step)`` is the plan's count for that step (it varies): pass it to the schedule
as ``num_microbatches``. Every rank of the pool gets the same count, as the schedules require.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from planner.groups import ZIGZAG
from runtime.adapters.megatron.binding.groups import MegatronGroups
from runtime.adapters.megatron.compat import mcore
from runtime.data.batch import MicrobatchInputs, build_microbatch, to_device
from runtime.data.mtp import mtp_inputs
from runtime.data.plan_reader import GroupRows, PlanReader
from runtime.data.tokens import TokenSource
from runtime.data.walk import walk
from runtime.train.model import check_token_ids

Batch = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Segments:
    """The group's rows as this rank's slots see them (``batch["segments"]``)."""

    seq_index: torch.Tensor
    """int64 [slots]: the row of the group (0..rows-1) each of this rank's slots belongs to,
    padding included (a padded slot belongs to the row it pads), in the tokens' layout."""
    seq_tokens: torch.Tensor
    """int64 [rows]: real tokens of each row (all ranks of the group)."""
    group_tokens: int
    """Real tokens of the whole group."""
    rank_start: int
    """The group's block: pool ranks [rank_start, rank_start + cp_size)."""
    cp_size: int


def slots(rows: GroupRows, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(row of each of this rank's slots, whether the slot holds a real token)."""
    w = walk(rows, layout)
    return w.row, w.real


def padding_mask(rows: GroupRows, layout: str) -> torch.Tensor:
    """True where this rank's slot of the packed buffer holds a real token (1-D bool)."""
    return torch.from_numpy(slots(rows, layout)[1])


def packed_seq_params(mb: MicrobatchInputs, cp_group: Any) -> mcore.PackedSeqParams:
    """Megatron's THD metadata for one microbatch (see the module docstring)."""
    return mcore.PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
        cu_seqlens_q_padded=mb.cu_seqlens_padded, cu_seqlens_kv_padded=mb.cu_seqlens_padded,
        max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen, cp_group=cp_group,
        local_cp_size=mb.cp_size)


def _where(step: int, microbatch: int, rows: GroupRows) -> str:
    samples = sorted(set(rows.sample_index.tolist()) - {-1})
    return f"step {step} microbatch {microbatch} (samples {samples})"


class PlanBatches:
    """This rank's view of a plan as Megatron batches (see the module docstring).

    Args:
        reader: the opened plan (zigzag layout: Megatron's THD RoPE assumes it).
        source: the plan's dataset.
        groups: this rank's groups (``create_groups`` or ``groups_from_parallel_state``).
        num_chunks: model chunks on this rank (the virtual pipeline size).
        device: where the batch tensors go.
        vocab_size: when set, token ids outside [0, vocab_size) are a ValueError naming the
            step, microbatch and samples (the embedding would fail without saying where).
        mtp_depth: the model's multi-token prediction layers (0: none).

    Raises:
        ValueError: the plan's layout is not zigzag, or the job is not the plan's.
    """

    def __init__(self, reader: PlanReader, source: TokenSource, groups: MegatronGroups, *,
                 num_chunks: int = 1, device: torch.device | str = "cpu",
                 vocab_size: int = 0, mtp_depth: int = 0) -> None:
        if reader.layout != ZIGZAG and max(reader.header.cp_sizes) > 1:
            raise ValueError(f"{reader.path}: layout {reader.layout!r}; Megatron's THD RoPE "
                             "splits every sequence in zigzag chunks (plan with --layout zigzag)")
        reader.check_job(groups.topology)
        self.reader = reader
        self.source = source
        self.groups = groups
        self.num_chunks = num_chunks
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.mtp_depth = mtp_depth
        par = reader.header.parallel
        self._sp_split = par.sequence_parallel and par.tp > 1
        t = groups.topology
        self._pool_rank, self._tp, self._tp_rank = t.pool_rank, t.tp, t.tp_rank
        self._first = t.pp_rank == 0
        self._last = t.pp_rank == t.pp - 1

    def num_microbatches(self, step: int) -> int:
        """The plan's microbatch count of ``step``."""
        return self.reader.step(step).num_microbatches

    def step_tokens(self, step: int) -> int:
        """Real tokens of ``step`` over the whole pool."""
        return int(np.asarray(self.reader.step(step).num_tokens, dtype=np.int64).sum())

    def rows(self, step: int, microbatch: int) -> GroupRows:
        """The plan rows of this rank's group in one microbatch."""
        return self.reader.step(step).group_for(microbatch, self._pool_rank)

    def batch(self, step: int, microbatch: int, chunk: int = 0) -> Batch:
        """One microbatch for model chunk ``chunk`` (built now; see the module docstring)."""
        rows = self.rows(step, microbatch)
        first, last = self.stage_of(chunk)
        mb = build_microbatch(rows, self.source, layout=self.reader.layout,
                              is_first_stage=first or (last and self.mtp_depth > 0),
                              is_last_stage=last)
        if self.vocab_size and mb.tokens is not None:  # CPU tensor: a min and a max, no sync
            check_token_ids(mb.tokens, self.vocab_size, functools.partial(
                _where, step, microbatch, rows))
        return self.to_batch(mb, rows, chunk)

    def stage_of(self, chunk: int) -> tuple[bool, bool]:
        """(first stage, last stage) of model chunk ``chunk`` on this rank."""
        return self._first and chunk == 0, self._last and chunk == self.num_chunks - 1

    def to_batch(self, mb: MicrobatchInputs, rows: GroupRows, chunk: int = 0) -> Batch:
        """A built microbatch as chunk ``chunk``'s Megatron batch (fields it does not own are
        dropped; also used for evaluation microbatches, which ``EvalSchedule`` builds)."""
        first, last = self.stage_of(chunk)
        mtp_here = last and self.mtp_depth > 0
        mtp = None
        if mtp_here:
            if mb.tokens is None:  # an evaluation microbatch of a later stage: built without
                mb = build_microbatch(rows, self.source, layout=self.reader.layout)
            mtp = mtp_inputs(rows, self.source, layout=self.reader.layout,
                             depth=self.mtp_depth).to(self.device)
        mb = to_device(mb, self.device)
        slot_rows, real = slots(rows, self.reader.layout)
        mask = torch.from_numpy(real)
        if self._sp_split and not first:
            mask = mask.chunk(self._tp)[self._tp_rank]
        group = self.groups.cp_group(rows.rank_start, rows.cp_size)
        segments = Segments(seq_index=torch.from_numpy(slot_rows).to(self.device),
                            seq_tokens=torch.from_numpy(rows.num_tokens).to(self.device),
                            group_tokens=int(rows.num_tokens.sum()),
                            rank_start=rows.rank_start, cp_size=rows.cp_size)

        def row(t: torch.Tensor | None, keep: bool) -> torch.Tensor | None:
            return None if t is None or not keep else t[None]

        return {
            "tokens": row(mb.tokens, first or mtp_here),
            "position_ids": row(mb.position_ids, first or mtp_here),
            "labels": row(mb.labels, last), "loss_mask": row(mb.loss_mask, last),
            "attention_mask": None, "padding_mask": mask[None].to(self.device),
            "packed_seq_params": packed_seq_params(mb, group), "segments": segments,
            "mtp": mtp,
        }

    def _iterate(self, step: int, chunk: int) -> Iterator[Batch]:
        for m in range(self.num_microbatches(step)):
            yield self.batch(step, m, chunk)

    def data_iterator(self, step: int) -> Iterator[Batch] | list[Iterator[Batch]]:
        """The ``data_iterator`` for ``step``: an iterator, or a list of one per chunk."""
        its = [self._iterate(step, c) for c in range(self.num_chunks)]
        return its[0] if self.num_chunks == 1 else its
