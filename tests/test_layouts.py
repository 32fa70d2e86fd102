"""The batching layouts have one home: pitstop/catalog/layouts.py (issue 34).

- An AST scan of the package: no module but the catalogue holds "pack", "bucket" or "pad"
  as a string literal (a planted module proves the scan finds one, in a comparison, a
  tuple and a `Literal[...]`); prose that mentions a name (docstrings, messages) is fine.
- The names users write still round-trip: a config YAML written and read back, a run
  record's choices.json, BatchSettings built from a name.
- `Layout.parse` names the valid choices; the config's error does too.
- The properties the code used to test by name say what the names said.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from pitstop.catalog.layouts import (
    ANY_STEP_SIZE,
    LAYOUT_NAMES,
    Layout,
    choices_text,
    worth_timing,
)
from pitstop.core.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1] / "pitstop"
HOME = "catalog/layouts.py"


def layout_literals(source: str) -> list[str]:
    """Each string constant in `source` that is exactly a layout name, as 'name line N'."""
    return [
        f"{node.value!r} line {node.lineno}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and node.value in LAYOUT_NAMES
    ]


def test_the_layout_names_are_literals_only_in_the_catalogue():
    outside = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found = layout_literals(path.read_text(encoding="utf-8"))
        if rel != HOME and found:
            outside[rel] = found
    assert not outside, outside
    assert len(layout_literals((ROOT / HOME).read_text(encoding="utf-8"))) >= len(Layout)


def test_the_scan_finds_a_planted_literal():
    planted = (
        "from typing import Literal\n"
        "Batching = Literal['auto', 'pack']\n"
        "def f(cfg):\n"
        "    return cfg.batching in ('bucket', 'pad')\n"
        '"""A docstring naming pack, bucket and pad is prose."""\n'
        "msg = f'--batching {x} pack'\n"
    )
    assert layout_literals(planted) == ["'pack' line 2", "'bucket' line 4", "'pad' line 4"]
    assert layout_literals("x = 'packed'; y = 'auto'; z = 'padding'\n") == []


def test_a_layout_is_its_name():
    for layout in Layout:
        assert layout == layout.value and str(layout) == layout.value
        assert f"{layout}" == layout.value and json.dumps(layout) == f'"{layout.value}"'
        assert Layout.parse(layout.value) is layout and Layout.parse(layout) is layout
        assert layout.description
    assert LAYOUT_NAMES == ("pack", "bucket", "pad")
    assert {"pack": 1}[Layout.PACK] == 1  # dicts keyed by name find the member


def test_parse_names_the_choices():
    with pytest.raises(ConfigError) as e:
        Layout.parse("packed")
    assert "'packed'" in str(e.value) and choices_text() in str(e.value)
    assert choices_text() == "'pack', 'bucket', 'pad'"
    assert Layout.lookup("auto") is None and Layout.lookup("dynamic") is None
    assert Layout.lookup(["pack"]) is None  # an unhashable value from a planted file


def test_the_properties_say_what_the_names_said():
    assert [m for m in Layout if m.packed] == [Layout.PACK]
    assert [m for m in Layout if m.fixed_rows] == [Layout.PACK, Layout.PAD]
    assert [m for m in Layout if m.padded_to_max_len] == [Layout.PAD]
    assert [m for m in Layout if m.step_in_whole_rows] == [Layout.PACK]
    assert Layout.PAD.dominated_by is Layout.BUCKET and Layout.PACK.dominated_by is None
    assert not ANY_STEP_SIZE.step_in_whole_rows
    # tune's space: pack only when a step is whole rows; pad never (bucket dominates it)
    assert worth_timing(True) == (Layout.PACK, Layout.BUCKET)
    assert worth_timing(False) == (Layout.BUCKET,)


def test_the_config_takes_every_layout_and_writes_names(tmp_path):
    from pitstop.core.config import build_config, describe_type, load_yaml

    assert describe_type("batching") == "one of 'auto', " + choices_text()
    for name in LAYOUT_NAMES:
        cfg = build_config({"batching": name, "data": ["d"], "model": "m"}, command="doctor")
        path = tmp_path / f"{name}.yaml"
        path.write_text(cfg.to_yaml())
        assert load_yaml(path)["batching"] == name
        assert Layout.parse(cfg.batching) is Layout(name)
    # A member set in code is written as its name (YAML's safe dumper refuses enum members).
    cfg.batching = Layout.BUCKET
    assert "batching: bucket\n" in cfg.to_yaml()
    with pytest.raises(ConfigError) as e:
        build_config({"batching": "pak"}, command="doctor")
    assert "'pack', 'bucket', 'pad'" in str(e.value) and "did you mean 'pack'" in str(e.value)


def test_whole_rows_is_checked_by_property():
    from pitstop.batching.settings import BatchSettings
    from pitstop.core.config import RunConfig, validate

    problems = validate(RunConfig(batching="pack", max_seq_len=64, tokens_per_step=100))
    assert any("whole number of packed rows" in p for p in problems)
    assert not validate(RunConfig(batching="bucket", max_seq_len=64, tokens_per_step=100))
    s = BatchSettings("pad", 64, 256, micro_batch_size=1)
    assert s.strategy is Layout.PAD and s.rows_per_step is None
    assert BatchSettings("pack", 64, 256, micro_batch_size=1).rows_per_step == 4
    with pytest.raises(ConfigError, match="is not one of 'pack', 'bucket', 'pad'"):
        BatchSettings("packed", 64, 256, micro_batch_size=1)


def test_a_run_record_round_trips_the_layout(tmp_path):
    from pitstop.core.run_record import ChoiceRecord, read_choices, write_choices

    for layout in Layout:
        rec = ChoiceRecord(
            key="k",
            key_fields={"a": 1},
            measured_at="2026-11-25T00:00:00+00:00",
            values={"batching": layout},
            reasons={"batching": "test"},
        )
        path = tmp_path / f"{layout}.json"
        write_choices(path, rec)
        assert json.loads(path.read_text())["values"]["batching"] == layout.value
        back = read_choices(path)
        assert back is not None and Layout.parse(back.values["batching"]) is layout
    path.write_text(path.read_text().replace('"pad"', '"padded"'))
    with pytest.raises(DataError, match="'pack', 'bucket', 'pad'"):
        read_choices(path)
