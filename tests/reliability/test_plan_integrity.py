"""Plan integrity: checksums over every meaningful byte, exact column types, both header copies.

Before format version 2, 5.4% of the single-bit flips of a small plan passed ``dcp-plan validate``
(a capacity of 2048 read as 3048, ``num_tokens`` read as float64 garbage); a damaged first copy of
the header passed, and ``dcp-plan show`` never validated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from planner.cli import main
from planner.planfile.io import PlanFile, write_plan
from planner.planfile.schema import HEADER_KEY, arrow_schema, step_batch
from planner.planfile.validate import validate
from runtime.data.plan_reader import PlanReader
from tests.planner.planfile import handmade
from tests.reliability.helpers import no_traceback

SUMMARY = ("gain: ", "cost: ", "warning: ")
"""The lines ``show`` prints below its table: the gain, the cost model's mark, its warning."""


def _plan(tmp_path: Path) -> Path:
    h = handmade.header()
    schema = arrow_schema(h)
    return write_plan(tmp_path / "p.arrow", h, [step_batch(schema, c) for c in handmade.steps()])


def _content(path: Path) -> tuple[pa.Schema, list[pa.RecordBatch], list[object]]:
    """Open, check every invariant and checksum, and return what a reader sees."""
    with PlanFile(path) as f:
        validate(f.header, f, handmade.LENGTHS, source=str(path))
        got = [f._reader.get_batch_with_custom_metadata(i) for i in range(f.num_steps)]
        return f.schema, [b for b, _ in got], [m for _, m in got]


def _flips_are_caught(tmp_path: Path, bits: list[tuple[int, int]]) -> None:
    path = _plan(tmp_path)
    data = path.read_bytes()
    ref = _content(path)
    damaged = tmp_path / "damaged.arrow"
    damaged.write_bytes(data)
    missed = []
    # One copy, each flip made and undone in place: rewriting a whole file costs ext4 a flush
    # per truncation (4 ms each, most of this test's time), a one-byte write does not.
    fd = os.open(damaged, os.O_RDWR)
    try:
        for byte, bit in bits:
            os.pwrite(fd, bytes([data[byte] ^ (1 << bit)]), byte)
            try:
                got = _content(damaged)
            except ValueError:
                continue  # detected, with a message (any other exception fails the test)
            finally:
                os.pwrite(fd, data[byte:byte + 1], byte)
            # Not detected: only acceptable when nothing a reader sees changed (padding bytes).
            same = (got[0].equals(ref[0], check_metadata=True) and len(got[1]) == len(ref[1])
                    and all(x.equals(y) for x, y in zip(got[1], ref[1], strict=True))
                    and got[2] == ref[2])
            if not same:
                missed.append((byte, bit))
    finally:
        os.close(fd)
    assert damaged.read_bytes() == data  # every flip was undone
    assert not missed, f"undetected flips that change the plan: {missed[:10]}"


def test_one_bit_flip_per_byte_is_detected_or_harmless(tmp_path: Path) -> None:
    size = len(_plan(tmp_path).read_bytes())
    _flips_are_caught(tmp_path, [(i, i % 8) for i in range(size)])


@pytest.mark.slow
def test_every_other_single_bit_flip_is_detected_or_harmless(tmp_path: Path) -> None:
    # The other seven bits of every byte: with the test above, every single-bit flip once.
    size = len(_plan(tmp_path).read_bytes())
    _flips_are_caught(tmp_path, [(i, bit) for i in range(size) for bit in range(8)
                                 if bit != i % 8])


def _rewrite(src: Path, dst: Path, table_fn: object = None, *, drop_checksums: bool = False,
             header_fn: object = None) -> Path:
    """Rewrite a plan with plain pyarrow (no dcp writer): what a foreign tool might produce."""
    with pa.memory_map(str(src)) as s:
        table = ipc.open_file(s).read_all()
    meta = dict(table.schema.metadata)
    if header_fn is not None:
        d = json.loads(meta[HEADER_KEY])
        header_fn(d)  # type: ignore[operator]
        meta[HEADER_KEY] = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    if drop_checksums:
        meta.pop(b"dcp.plan.sha256", None)
    if table_fn is not None:
        table = table_fn(table)  # type: ignore[operator]
    table = table.replace_schema_metadata(meta)
    with pa.OSFile(str(dst), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return dst


def test_column_of_another_type_is_refused(tmp_path: Path) -> None:
    def as_float(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index("num_tokens")
        return t.set_column(i, pa.field("num_tokens", pa.float64(), nullable=False),
                            t.column(i).cast(pa.float64()))

    bad = _rewrite(_plan(tmp_path), tmp_path / "f.arrow", as_float,
                   header_fn=lambda d: d.update(format_version=1), drop_checksums=True)
    with pytest.raises(ValueError, match="column 'num_tokens' has type double, expected "
                                         "non-null int32"):
        PlanFile(bad)


def test_v2_plan_without_checksums_is_refused(tmp_path: Path) -> None:
    bad = _rewrite(_plan(tmp_path), tmp_path / "nock.arrow", drop_checksums=True)
    with pytest.raises(ValueError, match="header has no checksum"):
        PlanFile(bad)


def test_edited_header_fails_its_checksum(tmp_path: Path) -> None:
    path = _plan(tmp_path)
    data = path.read_bytes()
    # "capacity_tokens_per_rank":16 -> 17 in both copies: still valid JSON, still a number.
    key = b'"capacity_tokens_per_rank":16'
    assert data.count(key) == 2
    edited = tmp_path / "e.arrow"
    edited.write_bytes(data.replace(key, b'"capacity_tokens_per_rank":17'))
    with pytest.raises(ValueError, match="header checksum mismatch"):
        PlanFile(edited)


def test_damaged_first_header_copy_is_detected(tmp_path: Path) -> None:
    path = _plan(tmp_path)
    data = bytearray(path.read_bytes())
    first = data.find(b'"layout":"zigzag"')
    assert first < len(data) // 2 < data.rfind(b'"layout":"zigzag"')
    data[first + 10] ^= 0x01  # the stream-start copy only; the footer copy stays intact
    bad = tmp_path / "first.arrow"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="schema at the start of the file differs"):
        PlanFile(bad)


def _flip_in_step_1(tmp_path: Path) -> Path:
    path = _plan(tmp_path)
    with PlanFile(path) as f:
        ref = f.step(1)
    data = bytearray(path.read_bytes())
    # Step 1's num_tokens column holds 16, 0, 0 (int32): change 16 into 48.
    needle = (16).to_bytes(4, "little") + (0).to_bytes(4, "little") * 2
    at = data.rfind(needle)
    assert at > 0
    data[at] ^= 0x20
    bad = tmp_path / "step.arrow"
    bad.write_bytes(bytes(data))
    assert ref.num_rows == 3
    return bad


def test_runtime_reader_checks_step_checksums_even_without_validate(tmp_path: Path) -> None:
    bad = _flip_in_step_1(tmp_path)
    reader = PlanReader(bad, validate=False)  # trusted plans skip validate, not checksums
    reader.step(0)
    with pytest.raises(ValueError, match="step 1 checksum mismatch"):
        reader.step(1)
    with pytest.raises(ValueError, match="step 1 checksum mismatch"):
        PlanReader(bad)


def test_validate_and_show_refuse_a_damaged_plan(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = _flip_in_step_1(tmp_path)
    assert main(["validate", str(bad)]) == 2
    assert "step 1 checksum mismatch" in capsys.readouterr().err
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "step 1 checksum mismatch" in err
    assert no_traceback(err)


def test_show_step_out_of_range_and_negative_ranges(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``IndexError`` tracebacks. Now an error naming the plan's range, exit 2; a
    negative range is a Python slice (``-3:`` of 2 steps is both; more in test_input_errors)."""
    path = _plan(tmp_path)
    for argv, want in ((["--step", "999"], "--step 999 is out of range; the plan has 2 steps "
                        "(0..1, or -2..-1 from the end)"),
                       (["--steps", "5:"], "--steps 5: selects no step; the plan has 2 steps")):
        assert main(["show", str(path), *argv]) == 2
        err = capsys.readouterr().err
        assert want in err
        assert no_traceback(err)
    with pytest.raises(SystemExit) as e:
        main(["show", str(path), "--steps", "a:b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected a step range A:B" in err
    assert no_traceback(err)
    assert main(["show", str(path), "--steps=-3:"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [r.split()[0] for r in rows if not r.startswith(SUMMARY)] == ["0", "1"]
    assert main(["show", str(path), "--steps", "1:"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [r.split()[0] for r in rows if not r.startswith(SUMMARY)] == ["1"]
