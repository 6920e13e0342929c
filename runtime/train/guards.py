"""What stops a run cleanly instead of silently or with a traceback: non-finite steps, stalled
or lost peers, and SIGTERM.

- ``nonfinite_ok``: stop naming the step (the default; one NaN poisons every later step through
  AdamW's moments), or skip the update. Every engine calls it before its optimizer step (native,
  Megatron, torchtitan, and each one's oracle). After the native pool all-reduce every rank
  holds the same loss and gradients, so every rank takes the same decision alone; where ranks
  hold different gradients (Megatron's TP/PP shards, FSDP's shards) ``agree=True`` takes the
  worst verdict of all ranks in one all-reduce, so all stop or skip together.
- ``describe_dist_error``: a collective that timed out (``--distributed-timeout-minutes``) or
  lost its peer becomes one line naming the rank and the timeout.
- ``Terminated``: raised by the SIGTERM handler (torchrun forwards SIGTERM to every worker), so
  ``finally`` blocks clean up (a checkpoint being staged is removed) as on Ctrl-C.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

_VERDICTS = ("", "gradients are", "loss is")


def nonfinite_ok(step: int, loss: float, grads: list[torch.Tensor], *, skip: bool,
                 agree: bool = False) -> bool:
    """True if the step's loss and gradients are finite.

    Otherwise raise ValueError naming the step, or, with ``skip``, warn on stderr and return
    False so that the caller skips the optimizer update. ``agree``: a collective over the
    default group (every rank must call it), for ranks that hold different gradients.
    """
    code = 2 if not math.isfinite(loss) else 0
    if not code and grads:
        # A DTensor's norm would be a collective of its own: check this rank's shard.
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        norms = torch._foreach_norm(local)
        if not bool(torch.isfinite(torch.stack(norms)).all()):
            code = 1
    if agree and dist.is_initialized() and dist.get_world_size() > 1:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        t = torch.tensor([code], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        code = int(t.item())
    what = _VERDICTS[code]
    if not what:
        return True
    if not skip:
        raise ValueError(f"step {step}: the {what} not finite (loss {loss}); stopping before "
                         "the optimizer update (--skip-nonfinite-steps skips such steps instead)")
    print(f"dcp-train: warning: step {step}: the {what} not finite (loss {loss}); update "
          "skipped", file=sys.stderr, flush=True)
    return False


def describe_dist_error(e: BaseException, timeout_minutes: float) -> str | None:
    """One line for a collective that timed out or lost a peer; None for any other error."""
    text = str(e)
    low = text.lower()
    first = text.splitlines()[0][:200] if text else type(e).__name__
    rank = dist.get_rank() if dist.is_initialized() else 0
    if "timed out" in low or "timeout" in low:
        return (f"rank {rank}: a collective timed out after {timeout_minutes:g} min "
                f"(--distributed-timeout-minutes): a rank stalled or died ({first})")
    if any(w in low for w in ("connection closed", "connection reset", "broken pipe")):
        return f"rank {rank}: lost a peer during a collective (did another rank die?): {first}"
    return None


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (see the module docstring)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def raise_terminated(signum: int, frame: object) -> None:
    """A signal handler: ``signal.signal(signal.SIGTERM, raise_terminated)``."""
    raise Terminated(signum)
