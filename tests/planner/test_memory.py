"""Memory before launch, planner side (issue 33, item 5): ``dcp-plan --memory-per-rank`` refuses
a plan whose heaviest microbatch would not fit, naming it; the sizes and shapes it reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner import PlannerConfig, read_plan
from planner.cli import main
from planner.config import ParallelConfig
from planner.groups import pad_multiple
from planner.longseq import memory_segment_cap
from planner.memory import MemoryModel, parse_bytes, parse_shape, step_heaviest

FLAGS = ["--dp", "1", "--cp", "4", "--max-tokens-per-rank", "16384", "--global-batch-size", "9"]


def _data(tmp: Path) -> Path:
    """The issue's case: one 45,000-token document among short ones."""
    data = tmp / "long.jsonl"
    data.write_text("".join(f'{{"length": {n}}}\n' for n in
                            [300, 45000, 700, 1200, 90, 2000, 64, 512, 3000]))
    return data


def test_one_long_document_is_refused_naming_its_microbatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data(tmp_path)
    free = tmp_path / "free.arrow"
    assert main([str(data), "-o", str(free), *FLAGS, "--quiet"]) == 0
    cols = read_plan(free).step_columns(0)
    row = int(np.flatnonzero(cols["sample_index"] == 1)[0])
    mb, start, k = (int(cols[c][row]) for c in ("microbatch", "rank_start", "cp_size"))
    assert k == 4  # 45,000 tokens need the whole pool of 4 x 16,384

    out = tmp_path / "p.arrow"
    argv = [str(data), "-o", str(out), *FLAGS, "--memory-per-rank", "8GB", "--memory-model",
            "layers=2,hidden=64,heads=4,query-groups=2,vocab=256,attention=reference"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    model = parse_shape("attention=reference")
    peak = model.group_peaks(np.array([4]), np.array([45000]), np.array([45000.0**2]),
                             np.array([45000]))[0]
    assert (f"step 0 microbatch {mb} (CP group of 4 at rank {start}, longest sequence 45,000 "
            f"padded tokens of sample 1) needs about {peak / 2**30:.2f} GiB per rank, more than "
            f"--memory-per-rank 8GB (7.45 GiB)") in err
    assert "holds one sequence of at most" in err
    assert "O(L^2) scores" in err
    assert not out.exists()  # nothing written under the name asked for
    # Fused attention keeps no scores: the same plan fits.
    te = [*argv[:-1], "layers=2,hidden=64,heads=4,query-groups=2,vocab=256,attention=te"]
    assert main([*te, "--quiet"]) == 0
    assert out.exists()


def test_the_limit_needs_its_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([str(_data(tmp_path)), *FLAGS, "--memory-per-rank", "8GB"])
    assert "--memory-per-rank and --memory-model go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(_data(tmp_path)), *FLAGS, "--memory-per-rank", "8 parsecs",
              "--memory-model", "layers=2"])
    assert "not a memory size: '8 parsecs'" in capsys.readouterr().err


def test_sizes_shapes_and_the_quadratic_term() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512mb") == 512 * 10**6
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_shape("layers")
    with pytest.raises(ValueError, match="attention must be"):
        parse_shape("attention=flash")
    ref = parse_shape("layers=4,heads=8,attention=reference")
    te = parse_shape("layers=4,heads=8,attention=te")
    assert te.per_score == 0
    assert ref.per_score == 4 * 8
    # Doubling a sequence on one rank quadruples its scores: (layers + 2) copies of 4 B x H x L^2.
    one = ref.group_peaks(np.array([1]), np.array([4096]), np.array([4096.0**2]),
                          np.array([4096]))[0]
    two = ref.group_peaks(np.array([1]), np.array([8192]), np.array([8192.0**2]),
                          np.array([8192]))[0]
    linear = ref.fixed_bytes + ref.per_token * np.array([4096, 8192])
    assert (two - linear[1]) == pytest.approx(4 * (one - linear[0]))
    assert one - linear[0] == pytest.approx(4 * 8 * 4096**2 * (4 + 2))
    # A group of k: each rank holds (L / k) x L scores.
    four = ref.group_peaks(np.array([4]), np.array([8192]), np.array([8192.0**2]),
                           np.array([8192]))[0]
    assert four - ref.fixed_bytes - ref.per_token * 2048 - ref.per_gathered_token * 8192 \
        == pytest.approx((two - linear[1]) / 4)
    assert ref.longest_fitting(1, one) == 4096
    cols = {"microbatch": np.array([0, 0, 1], np.int32), "rank_start": np.array([0, 1, 0]),
            "cp_size": np.array([1, 1, 2]), "padded_tokens": np.array([100, 300, 200])}
    h = step_heaviest(ref, 5, cols)
    assert h is not None
    assert (h.step, h.microbatch, h.rank_start, h.cp_size, h.longest) == (5, 0, 1, 1, 300)
    assert isinstance(ref, MemoryModel)


REFERENCE = "layers=2,hidden=64,heads=4,query-groups=2,vocab=256,attention=reference"


def test_split_cuts_what_the_limit_cannot_hold(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--long-sequences split`` with a limit: the 45,000-token document, which the pool of 4 x
    16,384 holds whole, is split into segments the limit holds in any group; every microbatch's
    peak is under it, the segments cover the document exactly, and the summary says so."""
    data = _data(tmp_path)
    refused = [str(data), "-o", str(tmp_path / "r.arrow"), *FLAGS, "--memory-per-rank", "8GB",
               "--memory-model", REFERENCE]
    assert main(refused) == 2
    err = capsys.readouterr().err
    model, budget = parse_shape(REFERENCE), parse_bytes("8GB")
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=4), capacity_tokens_per_rank=16384,
                           global_batch_size=9, long_sequences="split")
    cap = memory_segment_cap(config, model, budget)
    assert cap == 9872  # docs/planning.md quotes it
    assert "of sample 1)" in err
    assert f"with --long-sequences split, every sample over {cap:,} tokens is split" in err

    out, js = tmp_path / "s.arrow", tmp_path / "summary.json"
    assert main([*refused[:2], str(out), *refused[3:], "--long-sequences", "split", "--json",
                 "--summary-json", str(js)]) == 0
    summary = json.loads(js.read_text())
    assert (summary["split_samples"], summary["split_for_memory"]) == (1, 1)
    plan = read_plan(out)
    assert main(["validate", str(out), str(data)]) == 0  # coverage of every token, too
    assert plan.header.stats["split_for_memory"] == [1]
    assert plan.header.stats["max_segment_tokens"] == cap
    cols = plan.step_columns(0)
    doc = cols["sample_index"] == 1
    offsets, tokens = cols["token_offset"][doc], cols["num_tokens"][doc]
    order = np.argsort(offsets)
    assert offsets[order].tolist() == np.r_[0, np.cumsum(tokens[order])[:-1]].tolist()
    assert int(tokens.sum()) == 45000
    assert int(tokens.max()) <= cap
    assert doc.sum() == -(-45000 // cap) == 5
    # Every microbatch under the limit, by the same estimate as the refusal.
    for mb in np.unique(cols["microbatch"]):
        one = {c: v[cols["microbatch"] == mb] for c, v in cols.items()}
        h = step_heaviest(model, 0, one)
        assert h is not None
        assert h.peak_bytes <= budget
    # The text summary says it too.
    assert main([*refused[:2], str(tmp_path / "t.arrow"), *refused[3:], "--long-sequences",
                 "split"]) == 0
    assert "1 split (1 for --memory-per-rank)" in capsys.readouterr().out


def test_the_cap_holds_in_every_group_not_only_the_largest() -> None:
    """The longest single sequence a group of 4 holds is too long for a group of 2, where the
    solver may place it: the cap is what the worst group holds, and one token more is over."""
    model, budget = parse_shape(REFERENCE), parse_bytes("8GB")
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=4), capacity_tokens_per_rank=16384,
                           global_batch_size=9, long_sequences="split")
    sizes, cap_tokens = config.sizes, config.capacity_tokens_per_rank
    mult = tuple(pad_multiple(k, 1, config.layout) for k in sizes)
    cap = memory_segment_cap(config, model, budget)
    assert model.worst_group_peak(cap, sizes, cap_tokens, mult) <= budget
    longest4 = model.longest_fitting(4, budget)
    assert longest4 > cap
    assert model.worst_group_peak(longest4, sizes, cap_tokens, mult) > budget
    one = model.group_peaks(np.array([2]), np.array([longest4]), np.array([longest4**2.0]),
                            np.array([longest4]))[0]
    assert one > budget  # alone in a group of 2, it is over
    # Fused attention keeps no scores: no cap (the pool's rule); a limit under the weights: 0.
    te = parse_shape(REFERENCE.replace("reference", "te"))
    assert memory_segment_cap(config, te, budget) == 4 * 16384
    assert memory_segment_cap(config, model, model.fixed_bytes) == 0


def test_no_split_helps_a_limit_the_capacity_alone_exceeds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 100 MB: one rank's activations at 16,384 tokens alone are about 400 MB.
    argv = [str(_data(tmp_path)), "-o", str(tmp_path / "p.arrow"), *FLAGS, "--memory-per-rank",
            "100MB", "--memory-model", REFERENCE, "--long-sequences", "split"]
    assert main(argv) == 2
    assert ("a group packed full at --max-tokens-per-rank is over it whatever its sequences' "
            "lengths: lower --max-tokens-per-rank") in capsys.readouterr().err


def test_plans_without_a_limit_record_nothing_new(tmp_path: Path) -> None:
    out = tmp_path / "p.arrow"
    assert main([str(_data(tmp_path)), "-o", str(out), *FLAGS, "--long-sequences", "split",
                 "--quiet"]) == 0
    stats = read_plan(out).header.stats
    assert "split_for_memory" not in stats
    assert "max_segment_tokens" not in stats
    with pytest.raises(ValueError, match="max_segment_tokens 100 needs long_sequences split"):
        PlannerConfig(parallel=ParallelConfig(dp=1, cp=4), capacity_tokens_per_rank=16384,
                      global_batch_size=9, max_segment_tokens=100)
