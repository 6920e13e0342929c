"""How large a buffer ``dcp-calibrate`` may measure: the memory probe, on GPU and on CPU.

Peak memory of one microbatch (forward, per-token loss, backward) is modelled as
``fixed + a T + b sum L^2`` bytes for a buffer of T tokens in documents of lengths L: weights and
gradients, activations and logits per token, and the attention scores a backend may hold per
document (the CPU stand-ins and the reference attention keep L x L scores per head; fused
kernels keep none, so b comes out near 0). Three probe runs fit it: documents of ``L`` x 2, x 4
(T doubles) and ``2L`` x 2 (sum L^2 doubles again), ``L`` = ``PROBE_LENGTH`` or less. Tmax is
then the largest power of two <= ``--max-tokens`` whose grid (its largest buffer: T tokens of
documents of min(max_length, T)) is predicted to fit the rank's budget.

Budgets. GPU: ``memory_fraction`` of the device's memory (one rank per GPU). CPU: the ranks on
one host share its memory, so each may grow by ``memory_fraction`` of what the host has
available (``MemAvailable``, or less under a cgroup limit) divided by the ranks on that host;
peaks are read from the kernel's high-water mark of the process (``VmHWM``, reset before each
probe through ``/proc/self/clear_refs``). Where that is not readable (not Linux) nothing is
probed and ``--max-tokens`` is taken as given, with a warning.

Trade-off: three small runs (about a second on CPU with the default model) against measuring
the largest buffer itself, which is what ran the machine out of memory: with the torch CPU
stand-in, the old default of 65,536 tokens in 32K documents needed ~130 GB.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from runtime.calibrate.timing import MicrobatchTimer

PROBE_LENGTH = 4096
"""Document length of the GPU probe's buffers (CPU: 1024, cheaper there)."""
CPU_PROBE_LENGTH = 1024
"""Document length of the CPU probe's buffers."""


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    """The probe's result; byte counts are 0 where nothing was probed."""

    max_tokens: int
    """Tmax: the largest CP=1 buffer to measure (the same on every rank)."""
    fixed_bytes: int = 0
    """Extrapolated peak at zero tokens: weights, gradients, workspaces (CPU: the process)."""
    bytes_per_token: int = 0
    """Extrapolated peak growth per buffer token: activations and logits."""
    bytes_per_token2: float = 0.0
    """Extrapolated peak growth per squared document length: attention scores held."""
    total_bytes: int = 0
    """GPU: the device's memory; CPU: the host's available memory when probed."""
    budget_bytes: int = 0
    """The peak one rank may reach: ``memory_fraction`` of its share."""
    predicted_peak_bytes: int = 0
    """The model's peak for the largest buffer at Tmax (<= budget_bytes)."""
    ranks_on_host: int = 1
    """Ranks sharing the budget's memory (CPU: this host's ranks; GPU: 1)."""
    device: str = "cpu"
    """Where the budget's memory is: cpu (the host's) or cuda (the rank's GPU)."""


def host_available_bytes() -> int | None:
    """Memory this process's host (or its cgroup) can still give, in bytes; None: unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.split()[1:2] and line.split()[1].isdigit()}
    except OSError:
        return None
    available = info.get("MemAvailable")
    if available is None:
        return None
    # A container's limit is a cgroup's, below what the host says (v2, then v1).
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = Path("/sys/fs/cgroup", limit).read_text().strip()
            used = int(Path("/sys/fs/cgroup", usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:
            available = min(available, max(int(cap) - used, 0))
    return available


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's resident high-water mark to its current size (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _read_hwm() is not None


def peak_rss() -> int:
    """This process's resident high-water mark since the last reset, in bytes (0: unknown)."""
    return _read_hwm() or 0


def _cpu_peak(timer: MicrobatchTimer) -> Callable[[tuple[int, ...]], int]:
    def peak(lengths: tuple[int, ...]) -> int:
        mb = timer.inputs(lengths, 1, timer.rank, number=1 << 30)
        reset_peak_rss()
        timer.run(mb, None, [timer.rank])
        return peak_rss()

    return peak


def ranks_on_this_host() -> int:
    """How many ranks of the world run on this host (a collective)."""
    if dist.get_world_size() == 1:
        return 1
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return sum(name == socket.gethostname() for name in names)


def predicted_peak(probe: MemoryProbe, total: int, max_length: int) -> float:
    """The model's peak for the grid's largest buffer of ``total`` tokens."""
    length = min(max_length, total)
    return (probe.fixed_bytes + probe.bytes_per_token * total
            + probe.bytes_per_token2 * total * length)


def fit_tmax(probe: MemoryProbe, *, max_tokens: int, min_length: int,
             max_length: int) -> MemoryProbe:
    """Tmax under ``probe``'s budget: the largest power of two <= max_tokens that fits.

    Raises:
        ValueError: not even 2 x min_length tokens fit.
    """
    tmax = top = 1 << (max_tokens.bit_length() - 1)
    if top < 2 * min_length:
        # The limit is the flag, not memory: a buffer holds at least two sequences.
        raise ValueError(f"--max-tokens {max_tokens} holds fewer than two sequences of "
                         f"--min-length {min_length} (a buffer of the grid holds at least "
                         f"2 x {min_length} = {2 * min_length} tokens, as a power of two); "
                         f"raise --max-tokens to at least {2 * min_length}"
                         + (" or lower --min-length" if min_length > 2 else ""))
    while tmax > min_length and predicted_peak(probe, tmax, max_length) > probe.budget_bytes:
        tmax //= 2
    if predicted_peak(probe, tmax, max_length) > probe.budget_bytes or tmax < 2 * min_length:
        where = ("the GPU" if probe.device == "cuda" else
                 f"this host ({probe.total_bytes / 2**30:.1f} GiB available, "
                 f"{probe.ranks_on_host} rank(s) on it)")
        raise ValueError(f"{where} holds only about {max(tmax, 0)} tokens of this model within "
                         f"its budget of {probe.budget_bytes / 2**30:.2f} GiB per rank "
                         f"(--memory-fraction); lower --min-length / --max-length, or free "
                         f"memory")
    return replace(probe, max_tokens=tmax,
                   predicted_peak_bytes=int(predicted_peak(probe, tmax, max_length)))


def fit_memory(peak: Callable[[tuple[int, ...]], int], length: int
               ) -> tuple[int, int, float]:
    """(fixed, per token, per squared length) from three probe runs of ``peak``."""
    peak((length,) * 2)  # allocates the gradients (and the allocator's pools), which then stay
    small = peak((length,) * 2)
    wide = peak((length,) * 4)
    long = peak((2 * length,) * 2)
    per_token2 = max(long - wide, 0) / (4 * length * length)
    per_token = max(wide - small - per_token2 * 2 * length * length, 1.0) / (2 * length)
    fixed = small - per_token * 2 * length - per_token2 * 2 * length * length
    return int(fixed), int(per_token), per_token2


def probe_max_tokens(timer: MicrobatchTimer, *, max_tokens: int, min_length: int,
                     max_length: int, memory_fraction: float,
                     available_bytes: int | None = None) -> MemoryProbe:
    """Tmax for this world (a collective: every rank returns the world's minimum).

    Args:
        timer: this rank's model and backend.
        max_tokens: the cap (``--max-tokens``).
        min_length: the shortest document measured.
        max_length: the longest document measured.
        memory_fraction: share of the budget's memory the largest buffer may use.
        available_bytes: CPU only: the host's available memory (default: read from the
            kernel, ``host_available_bytes``).

    Raises:
        ValueError: not even 2 x min_length tokens fit.
    """
    cap = 1 << (max_tokens.bit_length() - 1)
    if timer.device.type == "cuda":
        length = min(PROBE_LENGTH, max_length)
        fixed, per_token, per_token2 = fit_memory(timer.peak_bytes, length)
        total = torch.cuda.get_device_properties(timer.device).total_memory
        probe = MemoryProbe(max_tokens=cap, fixed_bytes=fixed, bytes_per_token=per_token,
                            bytes_per_token2=per_token2, total_bytes=total,
                            budget_bytes=int(memory_fraction * total), device="cuda")
    else:
        ranks = ranks_on_this_host()
        available = host_available_bytes() if available_bytes is None else available_bytes
        if available is None or not reset_peak_rss():
            return MemoryProbe(max_tokens=cap)
        now = peak_rss()
        length = max(2, min(CPU_PROBE_LENGTH, max_length // 2, cap // 4))
        fixed, per_token, per_token2 = fit_memory(_cpu_peak(timer), length)
        probe = MemoryProbe(max_tokens=cap, fixed_bytes=fixed, bytes_per_token=per_token,
                            bytes_per_token2=per_token2, total_bytes=available,
                            budget_bytes=int(now + memory_fraction * available / ranks),
                            ranks_on_host=ranks)
    error = ""
    try:
        probe = fit_tmax(probe, max_tokens=max_tokens, min_length=min_length,
                         max_length=max_length)
    except ValueError as e:
        error = str(e)
    # The world's minimum (and its refusal, if any rank refused) on every rank.
    found = torch.tensor([0 if error else probe.max_tokens], dtype=torch.int64,
                         device=timer.device if dist.get_backend() == "nccl" else "cpu")
    if timer.world_size > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if error:
        raise ValueError(error)
    if int(found.item()) == 0:
        raise ValueError("another rank's memory does not hold 2 x --min-length tokens of this "
                         "model (its error says how much it holds)")
    tmax = int(found.item())
    return replace(probe, max_tokens=tmax,
                   predicted_peak_bytes=int(predicted_peak(probe, tmax, max_length)))
