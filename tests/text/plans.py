"""Text plans for the runtime's tests, and their token-id twins.

``text_plans`` writes a text corpus (JSONL or Parquet, field ``text``) and the same records
pre-tokenized (JSONL ``input_ids``: ``TextEncoder.encode`` of each text), plans the token-id
dataset with ``dcp-plan`` and writes the text plan as that plan with its header's dataset
rewritten to the text corpus (``dataset.tokenizer``: the spec, ``dataset.field``: ``text``).
Both plans then have the very same steps, so a run on each must give the same losses: only the
way the tokens are read differs. (``dcp-plan --tokenizer`` writes such plans itself; building
them here keeps these tests independent of the planner's text readers.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from planner.cli import main as plan_main
from planner.planfile.io import PlanFile, write_plan
from planner.sources.textenc import TextEncoder, load_encoder
from tests.text.bpe import texts, train_bpe


@dataclass(frozen=True)
class TextPlans:
    tokenizer: Path
    encoder: TextEncoder
    text: Path
    """The text corpus (``text`` field or column)."""
    ids: Path
    """The same records as token ids (JSONL ``input_ids``)."""
    text_plan: Path
    ids_plan: Path
    documents: list[str]


def write_text(path: Path, documents: list[str]) -> Path:
    """``documents`` as JSONL records ``{"text": ...}`` or a Parquet ``text`` column."""
    if path.suffix == ".parquet":
        pq.write_table(pa.table({"text": documents, "id": list(range(len(documents)))}),
                       path, row_group_size=7)
    else:
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                                for i, t in enumerate(documents)))
    return path


def rewrite_as_text(ids_plan: Path, out: Path, text: Path, encoder: TextEncoder,
                    field: str = "text") -> Path:
    """``ids_plan`` with its dataset rewritten to the text corpus ``text`` (same lengths)."""
    with PlanFile(ids_plan) as f:
        header, steps = f.header, [f.step(i) for i in range(f.num_steps)]
    fmt = "parquet" if text.suffix == ".parquet" else "jsonl"
    files = [{**header.dataset.files[0], "path": str(text), "format": fmt}]
    dataset = replace(header.dataset, path=str(text), format=fmt, files=files, field=field,
                      tokenizer=encoder.spec.to_dict())
    return write_plan(out, replace(header, dataset=dataset), steps)


def text_plans(tmp: Path, plan_flags: list[str], *, n: int = 40, suffix: str = ".jsonl",
               append_eod: bool = True, seed: int = 2) -> TextPlans:
    """A tokenizer trained here, a corpus of ``n`` documents (none empty) and both plans."""
    tokenizer = train_bpe(tmp / "tok")
    encoder = load_encoder(tokenizer, append_eod=append_eod)
    documents = [t for t in texts(n + 1, seed=seed) if t]
    text = write_text(tmp / f"corpus{suffix}", documents)
    ids = tmp / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": t.tolist()}) + "\n"
                           for t in encoder.encode(documents)))
    ids_plan = tmp / "ids.arrow"
    assert plan_main([str(ids), "-o", str(ids_plan), "--quiet", *plan_flags]) == 0
    text_plan = rewrite_as_text(ids_plan, tmp / "text.arrow", text, encoder)
    return TextPlans(tokenizer=tokenizer, encoder=encoder, text=text, ids=ids,
                     text_plan=text_plan, ids_plan=ids_plan, documents=documents)
