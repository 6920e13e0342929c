"""A dataset whose tokens sit under another name: the error names the one list-of-integers field
or column and the flag that reads it (``--field NAME``); none when there are zero or several."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from planner.sources.lengths import read_lengths


@pytest.mark.parametrize(("record", "hint"), [
    ({"ids": [1, 2, 3], "n": 3, "text": "a b c"},
     "; 'ids' is the only list-of-integers field: give --field ids"),
    ({"ids": [1, 2], "mask": [1, 1]}, None),
    ({"words": ["a", "b"]}, None),
    ({"ids": [True, False]}, None),  # booleans are not token ids
])
def test_jsonl_suggests_the_one_token_list(tmp_path: Path, record: dict[str, object],
                                           hint: str | None) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:1: no usable field") as e:
        read_lengths(path)
    if hint is None:
        assert "only list-of-integers" not in str(e.value)
    else:
        assert hint in str(e.value)
    with pytest.raises(ValueError, match="no 'input_ids' field") as e:
        read_lengths(path, field="input_ids")
    if hint is None:
        assert "only list-of-integers" not in str(e.value)
    else:
        assert hint in str(e.value)


def test_columnar_suggests_the_one_token_column(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"ids": [[1, 2], [3]], "name": ["a", "b"]}), path)
    with pytest.raises(ValueError, match=r"d\.parquet: no column input_ids; columns are \['ids', "
                                         r"'name'\]; 'ids' is the only list-of-integers column: "
                                         "give --field ids"):
        read_lengths(path, field="input_ids")
    assert read_lengths(path, field="ids").lengths.tolist() == [2, 1]
    pq.write_table(pa.table({"a": [[1]], "b": [[2]]}), path)
    with pytest.raises(ValueError, match="no column input_ids, tokens") as e:
        read_lengths(path)
    assert "only list-of-integers" not in str(e.value)
