"""The plan as a torchtitan data loader: this rank's packed microbatches, in plan order.

``PlanDataLoader`` is a ``BaseDataLoader`` (torchtitan's data-loader protocol: iterable of
``(input_dict, labels)``, plus ``state_dict``/``load_state_dict`` for its checkpointer). Each item
is one microbatch of one step, for this rank: ``input`` [1, L] token ids and ``positions``
[1, L] (restarting at 0 for every document, so llama3's RoPE gets each document's own positions
on every CP rank) in the plan's shard layout, ``labels`` [1, L] with ``IGNORE_INDEX`` wherever
the loss mask is 0 (padding, a document's last token), and under ``MICROBATCH_KEY`` the
``runtime.replay.Microbatch`` itself (its cu_seqlens, CP size and rank, process group), which
``PlanTrainer.post_dataloading_process`` turns into the attention's metadata. The trainer moves
tensors to the device and leaves that entry alone.

Every rank reads only its own samples (``runtime.replay.Replayer``); steps come out in order,
one step's microbatches at a time. The loader's state is the plan position: the next step and
a digest of the plan header, so torchtitan's checkpointer saves it with the model and a resume
with another plan is refused.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planner.sources.textenc import tokenizer_file
from runtime.adapters.torchtitan.titan import IGNORE_INDEX, BaseDataLoader, BaseTokenizer
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.replay import Microbatch, Replayer
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from runtime.train.model import check_token_ids

MICROBATCH_KEY = "dcp_microbatch"
"""``input_dict`` key of the ``Microbatch`` (not a tensor: the trainer does not move it)."""


def plan_digest(reader: PlanReader) -> str:
    """Short sha256 of the plan header: what a checkpoint is bound to."""
    return hashlib.sha256(reader.header.to_json().encode()).hexdigest()[:16]


def titan_batch(micro: Microbatch, vocab_size: int, where: Callable[[], str]
                ) -> tuple[dict[str, Any], torch.Tensor]:
    """One microbatch as torchtitan's ``(input_dict, labels)``: CPU tensors, a batch of one.

    ``labels`` hold ``IGNORE_INDEX`` wherever the loss mask is 0; with ``vocab_size`` > 0 the
    token ids are checked against it (``where()`` names the microbatch in the error).
    """
    mb = micro.inputs
    assert mb.tokens is not None
    assert mb.position_ids is not None
    assert mb.labels is not None
    assert mb.loss_mask is not None
    if vocab_size:
        check_token_ids(mb.tokens, vocab_size, where)
    labels = torch.where(mb.loss_mask != 0, mb.labels, torch.full_like(mb.labels, IGNORE_INDEX))
    inputs = {"input": mb.tokens[None], "positions": mb.position_ids[None], MICROBATCH_KEY: micro}
    return inputs, labels[None]


class PlanTokenizer(BaseTokenizer):
    """The plan's datasets are pre-tokenized; torchtitan only asks for the vocabulary size."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0
        """Size of the model's vocabulary (token ids are checked against it)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        del kwargs  # tokenizer_path: nothing to load
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("plan datasets are pre-tokenized")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("plan datasets are pre-tokenized")

    def get_vocab_size(self) -> int:
        return self.vocab_size


def text_tokenizer(reader: PlanReader, configured: str | None,
                   titan: BaseTokenizer | None) -> str | None:
    """The tokenizer a text plan is read with: ``configured`` (the loader's
    ``tokenizer_path``), else torchtitan's own tokenizer when it is a ``HuggingFaceTokenizer``
    loaded from the plan's file (same sha256), else None (the path the plan records).

    Raises:
        ValueError: torchtitan's tokenizer is another file than the plan's: the model would be
            trained on ids of one tokenizer and used with another's.
    """
    recorded = reader.header.dataset.tokenizer
    own = getattr(titan, "tokenizer_path", None)  # HuggingFaceTokenizer keeps its folder
    if not recorded or not own:
        return configured  # torchtitan builds a tokenizer even for plans of token ids
    f = tokenizer_file(own)
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    if digest != recorded.get("sha256"):
        raise ValueError(f"{reader.path}: torchtitan's tokenizer {f} (hf_assets_path) is not the "
                         f"one the plan was made with, {recorded.get('path')} (sha256 "
                         f"{digest[:12]}, the plan's {str(recorded.get('sha256'))[:12]}): point "
                         "hf_assets_path at the plan's tokenizer")
    return configured or str(f)


def _check_job(reader: PlanReader, dp_world_size: int, dp_rank: int) -> Topology:
    """This rank's topology; ValueError unless torchtitan's data-parallel world is the pool."""
    path, parallel = reader.path, reader.header.parallel
    if parallel.tp > 1 or parallel.pp > 1:
        raise ValueError(f"{path}: plan uses tp={parallel.tp}, pp={parallel.pp}; the torchtitan "
                         "adapter supports the dp x cp pool only")
    # A wrong process count first (it says what to launch), then a config that splits the
    # right count otherwise.
    if dist.is_initialized() and dist.get_world_size() != parallel.world_size:
        raise ValueError(f"{path}: plan built for world_size={parallel.world_size}, got "
                         f"{dist.get_world_size()}: launch {parallel.launch_hint()}")
    if dp_world_size != parallel.pool_size:
        raise ValueError(
            f"{path}: plan built for a pool of {parallel.pool_size} ranks, torchtitan's "
            f"data-parallel world is {dp_world_size}: use parallelism."
            "data_parallel_shard_degree=-1 and context_parallel_degree=1 (the plan does CP)")
    topology = Topology.from_header(parallel, rank=dist.get_rank(),
                                    world_size=dist.get_world_size())
    if topology.pool_rank != dp_rank:
        raise ValueError(f"torchtitan's data-parallel rank {dp_rank} is not this rank's pool "
                         f"rank {topology.pool_rank}")
    return topology


class PlanDataLoader(BaseDataLoader):
    """Replays a plan's microbatches for this rank (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        plan: str = ""
        """Plan file made by ``dcp-plan`` for this job (pool = the data-parallel world)."""
        vocab_size: int = 0
        """When > 0, token ids must be below it (a clear error names step and samples)."""
        datasets: list[str] = field(default_factory=list)
        """Several dataset items in order (files, directories, globs); empty: ``dataset``."""
        field: str | None = None
        """Record field (JSONL) or column of the tokens; None: the one the plan was made with
        (its header's ``dataset.field``), which this overrides."""
        tokenizer_path: str | None = None
        """A text plan's ``tokenizer.json`` (or its folder) where it is not at the path the plan
        records (the sha256 must match); None: torchtitan's own tokenizer when it is a
        ``HuggingFaceTokenizer`` of the same file (``hf_assets_path``), else the recorded path."""
        timeout_seconds: float | None = None
        """Timeout of the plan's CP groups; None: ``PlanTrainer`` sets the trainer's
        ``comm.train_timeout_seconds`` (torch's default, 30 min for gloo, if built alone)."""
        # ``dataset`` (inherited): the dataset the plan was made for.

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int,
                 tokenizer: BaseTokenizer | None = None, seq_len: int = 0,
                 local_batch_size: int = 1, snapshot_every_n_steps: int | None = None,
                 catalog: GroupCatalog | None = None) -> None:
        del seq_len, snapshot_every_n_steps  # the plan fixes the batches
        if not config.plan or not (config.dataset or config.datasets):
            raise ValueError("PlanDataLoader.Config needs plan= and dataset=")
        if local_batch_size != 1:
            raise ValueError(f"training.local_batch_size must be 1 (one packed buffer per "
                             f"microbatch), got {local_batch_size}")
        self.config = config
        self.reader = PlanReader(config.plan)
        try:
            # Read as the planner counted (bad records skipped), lengths and content checked.
            self.source = open_plan_source(
                self.reader, config.datasets or config.dataset, field=config.field,
                tokenizer=text_tokenizer(self.reader, config.tokenizer_path, tokenizer),
                vocab_size=config.vocab_size)
        except BaseException:
            self.reader.close()
            raise
        try:
            self.lengths = self.source.lengths()
            self.topology = _check_job(self.reader, dp_world_size, dp_rank)
            # Collective: every rank creates every group of the plan, in catalog order.
            timeout = (None if config.timeout_seconds is None
                       else timedelta(seconds=config.timeout_seconds))
            self.catalog = catalog or GroupCatalog.create(self.topology,
                                                          self.reader.header.cp_sizes,
                                                          timeout=timeout)
            self.replayer = Replayer(self.reader, self.source, self.topology, self.catalog,
                                     check_dataset=False)  # checked above
        except BaseException:
            self.close()  # nothing left open after a refusal
            raise
        self.digest = plan_digest(self.reader)
        self.next_step = 0

    @property
    def num_steps(self) -> int:
        return self.reader.num_steps

    def num_microbatches(self, step: int) -> int:
        """Microbatches of ``step`` (the same on every rank)."""
        return self.reader.step(step).num_microbatches

    def token_counts(self, step: int) -> tuple[int, int]:
        """(real tokens, loss tokens) of the whole step, from the plan (no collective).

        A segment's last token has a label only when its sample continues past the segment.
        """
        plan = self.reader.step(step)
        lengths = self.lengths
        tokens = loss_tokens = 0
        for s, off, n in zip(plan.sample_index.tolist(), plan.token_offset.tolist(),
                             plan.num_tokens.tolist(), strict=True):
            if s < 0:
                continue
            tokens += n
            loss_tokens += n - 1 + (1 if off + n < int(lengths[s]) else 0)
        return tokens, loss_tokens

    def _where(self, step: int, micro: Microbatch) -> str:
        samples = sorted(set(micro.rows.sample_index.tolist()) - {-1})
        return (f"{self.config.dataset}: step {step} microbatch {micro.rows.microbatch} "
                f"(samples {samples})")

    def item(self, step: int, micro: Microbatch) -> tuple[dict[str, Any], torch.Tensor]:
        """One microbatch of ``step`` as torchtitan's ``(input_dict, labels)``."""
        return titan_batch(micro, self.config.vocab_size,
                           functools.partial(self._where, step, micro))

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        while self.next_step < self.num_steps:
            step = self.next_step
            micros = self.replayer.microbatches(step)
            for i, micro in enumerate(micros):
                if i == len(micros) - 1:
                    # The step is handed out whole: a checkpoint taken after it resumes at the
                    # next one (torchtitan saves between steps, never inside one).
                    self.next_step = step + 1
                yield self.item(step, micro)

    def state_dict(self) -> dict[str, Any]:
        return {"plan_position": {"next_step": self.next_step, "plan": self.digest}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        position = state_dict["plan_position"]
        if position["plan"] != self.digest:
            raise ValueError(f"checkpoint was written for plan {position['plan']}, "
                             f"{self.config.plan} is {self.digest}: resume with the same plan")
        next_step = int(position["next_step"])
        if not 0 <= next_step <= self.num_steps:
            raise ValueError(f"checkpoint resumes at step {next_step}, the plan has "
                             f"{self.num_steps}")
        self.next_step = next_step

    def close(self) -> None:
        """Close the plan and the dataset."""
        for obj in (self.reader, self.source):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
