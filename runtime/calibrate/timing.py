"""What ``dcp-calibrate`` times, and how: the grids of buffers and the microbatch timer.

A *buffer* is a tuple of document lengths, packed back to back as one CP group's THD buffer (no
padding: every length is already a multiple of 2k). The timer runs this rank's zigzag shard of a
buffer through the model exactly as ``dcp-train`` runs a microbatch (bind the attention to the
group, forward under autocast, per-token loss, backward of the summed loss; gradients accumulate,
there is no optimizer step) and times it:

- after a barrier over the world and with the device idle, so every rank starts together and the
  host work before the first kernel (attention binding, index building) is inside the interval;
- with CUDA events on GPU (``time.perf_counter`` on CPU);
- on random token ids and labels (never zeros: they can run faster than real data), the same on
  every rank of a group, drawn from (seed, configuration number);
- a repeat's time is the slowest rank's (an all-reduce MAX over the world): a group finishes when
  its last rank does, and groups run side by side as in a step.

Grids (``single_grid``, ``ring_grid``) are pure functions of ints. Example: ``single_grid(4096,
512, 2048, quick=True)`` is ``[(2048, 2048), (512,) * 8, (2048, 512, 512, 512, 512),
(1024,), (512, 512)]``: totals 4096 and 1024, every other length up to the longest, and one
mixed buffer (a long document plus short ones) at the largest total.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from planner.groups import ZIGZAG
from runtime.calibrate.fit import Sample
from runtime.data.batch import MicrobatchInputs, to_device
from runtime.data.shard import cu_seqlens_np, shard_indices_np
from runtime.train.backends import make_backend
from runtime.train.loss import per_token_loss
from runtime.train.model import GPT, GPTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Compute dtypes, as ``dcp-train`` names them (bf16 is autocast over fp32 weights)."""


def _lengths_between(lo: int, hi: int, quick: bool) -> list[int]:
    out = []
    n = lo
    while n <= hi:
        out.append(n)
        n *= 2
    if quick:  # every other length, always keeping the longest
        out = sorted(set(out[::2]) | {out[-1]})
    return out


def single_grid(max_tokens: int, min_length: int, max_length: int, *,
                quick: bool = False) -> list[tuple[int, ...]]:
    """CP=1 buffers, largest total first (the memory high-water mark runs first).

    Totals max_tokens / {1, 4, 16} (quick: / {1, 4}); for each, T // L documents of every length
    L = min_length * 2^j <= min(max_length, T), and one mixed buffer: a document of
    min(max_length, T / 2) tokens followed by documents of min_length (quick: largest T only).
    """
    fractions = (1, 4) if quick else (1, 4, 16)
    totals = sorted({max_tokens // f for f in fractions if max_tokens // f >= min_length},
                    reverse=True)
    grid: list[tuple[int, ...]] = []
    for total in totals:
        for length in sorted(_lengths_between(min_length, min(max_length, total), quick),
                             reverse=True):
            grid.append((length,) * (total // length))
        long = min(max_length, total // 2)
        if long >= 2 * min_length and (not quick or total == totals[0]):
            grid.append((long,) + (min_length,) * ((total - long) // min_length))
    return grid


def ring_grid(max_tokens: int, min_length: int, max_length: int, cp_sizes: Sequence[int], *,
              quick: bool = False) -> list[tuple[int, tuple[int, ...]]]:
    """(k, buffer of the whole group) for every CP size k > 1, largest first.

    Per-rank shares s = max_tokens / {16, 4, 2} (quick: / {8, 2}); s stops at half the CP=1
    maximum because the ring's receive buffers need memory the CP=1 probe did not see. The group
    holds k s tokens of documents of length max(min_length, max_length / 8) and max_length
    (quick: max_length only), each capped at k s and rounded up to a multiple of 2k (zigzag).
    """
    shares = (8, 2) if quick else (16, 4, 2)
    doc_lengths = (max_length,) if quick else (max(min_length, max_length // 8), max_length)
    grid = []
    for k in sorted(set(cp_sizes)):
        if k < 2:
            continue
        for share in sorted({max_tokens // f for f in shares}, reverse=True):
            total = k * share
            for length in sorted({min(n, total) for n in doc_lengths}, reverse=True):
                length = -(-length // (2 * k)) * (2 * k)
                if total >= length:
                    grid.append((k, (length,) * (total // length)))
    return grid


class MicrobatchTimer:
    """This rank's model, attention backend and timing loop (see the module docstring).

    Args:
        model_config: the model shape.
        attention: backend name for ``runtime.train.backends.make_backend`` (te, torch or
        reference).
        dtype: ``bf16`` (autocast over fp32 weights) or ``fp32``.
        device: where the model runs; the default process group must be initialised.
        seed: seed of the weights and of the random tokens.
    """

    def __init__(self, model_config: GPTConfig, *, attention: str, dtype: str,
                 device: torch.device, seed: int) -> None:
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.vocab = model_config.vocab_size
        self.model = GPT(model_config, seed=seed).to(device)
        self.backend = make_backend(attention, ZIGZAG, model_config)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.dtype == "fp32":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.dtype])

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def inputs(self, lengths: tuple[int, ...], cp_size: int, rank_start: int,
               number: int) -> MicrobatchInputs:
        """This rank's zigzag shard of buffer ``lengths`` of random tokens, on the device."""
        lens = np.asarray(lengths, dtype=np.int64)
        total = int(lens.sum())
        cu = cu_seqlens_np(lens)
        cp_rank = self.rank - rank_start
        idx = shard_indices_np(ZIGZAG, cu, cp_size, cp_rank)
        # Same generator on every rank of the group, so the shards are of one buffer.
        rng = np.random.default_rng([self.seed, number])
        tokens = rng.integers(0, self.vocab, size=total)[idx]
        labels = rng.integers(0, self.vocab, size=total)[idx]
        positions = (np.arange(total) - np.repeat(cu[:-1].astype(np.int64), lens))[idx]
        cu_t = torch.from_numpy(cu)
        mb = MicrobatchInputs(
            tokens=torch.from_numpy(tokens), position_ids=torch.from_numpy(positions),
            labels=torch.from_numpy(labels), loss_mask=torch.ones(len(idx)), cu_seqlens=cu_t,
            cu_seqlens_padded=cu_t.clone(), max_seqlen=int(lens.max()), cp_size=cp_size,
            cp_rank=cp_rank, rank_start=rank_start, microbatch=0, num_tokens=total)
        return to_device(mb, self.device)

    def run(self, mb: MicrobatchInputs, group: dist.ProcessGroup | None,
            ranks: Sequence[int]) -> None:
        """One forward + per-token loss + backward, as ``dcp-train`` runs a microbatch."""
        assert mb.tokens is not None
        assert mb.labels is not None
        assert mb.loss_mask is not None
        with self.backend.bind(mb, group, ranks) as attention:
            with self._autocast():
                logits = self.model(mb.tokens, mb.position_ids, attention)
            loss_sum, _ = per_token_loss(logits, mb.labels, mb.loss_mask)
            loss_sum.backward()  # type: ignore[no-untyped-call]

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.all_reduce(torch.zeros(1, device=self._comm_device()))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_once(self, mb: MicrobatchInputs, group: dist.ProcessGroup | None,
                   ranks: Sequence[int]) -> float:
        self._barrier()
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            self.run(mb, group, ranks)
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]
        start.record()
        self.run(mb, group, ranks)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def measure(self, lengths: tuple[int, ...], cp_size: int, number: int, *,
                group: dist.ProcessGroup | None, ranks: Sequence[int], rank_start: int,
                warmup: int, repeats: int) -> Sample:
        """Median over repeats of the slowest rank's seconds (a collective over the world).

        Args:
            lengths: the group's whole buffer.
            cp_size: ranks in the group.
            number: configuration number (seeds the tokens; equal on every rank).
            group: this rank's CP group (None at cp_size 1).
            ranks: the group's global ranks, in CP order.
            rank_start: first global rank of the group.
            warmup: untimed runs.
            repeats: timed runs.
        """
        mb = self.inputs(lengths, cp_size, rank_start, number)
        for _ in range(warmup):
            self._time_once(mb, group, ranks)
        times = torch.tensor([self._time_once(mb, group, ranks) for _ in range(repeats)],
                             dtype=torch.float64, device=self._comm_device())
        if self.world_size > 1:
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        per_repeat = tuple(float(x) for x in times.cpu().tolist())
        return Sample(cp_size=cp_size, lengths=lengths, seconds=float(np.median(per_repeat)),
                      repeats=per_repeat)

    def peak_bytes(self, lengths: tuple[int, ...]) -> int:
        """Peak CUDA memory allocated during one CP=1 run of ``lengths``."""
        mb = self.inputs(lengths, 1, self.rank, number=1 << 30)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run(mb, None, [self.rank])
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))
