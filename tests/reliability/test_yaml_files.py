"""Hostile YAML config files (issue 33, never tried): duplicate keys, a BOM, CRLF lines.

A key given twice kept the last value without a word (`lr: 1e-3` above `lr: 5e-2`
trained at 5e-2); a UTF-8 BOM and Windows line endings are ordinary files and must read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pitstop.core.config import build_config, load_yaml
from pitstop.core.errors import ConfigError
from pitstop.core.yaml_load import parse_yaml


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    p = tmp_path / "run.yaml"
    p.write_text("model: m\ndata: d.jsonl\nlr: 1e-3\nlr: 5e-2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"key 'lr' given twice \(lines 3 and 4\)"):
        load_yaml(str(p))


def test_nested_and_aliased_duplicates_are_found_and_merge_keys_are_not_duplicates() -> None:
    with pytest.raises(ConfigError, match="key 'b' given twice"):
        parse_yaml("a:\n  b: 1\n  c: 2\n  b: 3\n", "x.yaml")
    with pytest.raises(ConfigError, match="key 'k' given twice"):
        parse_yaml("base: &b {k: 1, k: 2}\nuse: *b\n", "x.yaml")
    # A merge key then an override: YAML's way to reuse a block, not a mistake.
    assert parse_yaml("base: &b {lr: 1}\nrun:\n  <<: *b\n  lr: 2\n", "x.yaml")["run"] == {"lr": 2}


def test_a_bom_and_crlf_lines_read_as_the_same_config(tmp_path: Path) -> None:
    text = "model: m\ndata: d.jsonl\nlr: 0.002\nmax_steps: 7\n"
    plain, windows = tmp_path / "plain.yaml", tmp_path / "windows.yaml"
    plain.write_text(text, encoding="utf-8")
    windows.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    a = build_config(load_yaml(str(plain)), command="doctor")
    b = build_config(load_yaml(str(windows)), command="doctor")
    assert (a.lr, a.max_steps, a.data) == (b.lr, b.max_steps, b.data) == (0.002, 7, ["d.jsonl"])


@pytest.mark.parametrize("value", ["!custom 0.1", "!!python/object/apply:os.system ['touch ran']"])
def test_a_tag_is_refused_by_name_and_never_constructed(
    tmp_path: Path, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tag YAML's safe loader cannot build: one error naming the file and the tag (it was a
    ConstructorError traceback from `pitstop train --config`); nothing is run."""
    monkeypatch.chdir(tmp_path)  # where `touch ran` would leave its file
    p = tmp_path / "tag.yaml"
    p.write_text(f"model: m\nlr: {value}\n", encoding="utf-8")
    refused = r"tag\.yaml, line 2: could not determine a constructor"
    with pytest.raises(ConfigError, match=refused) as e:
        load_yaml(str(p))
    assert value.split()[0].lstrip("!") in e.value.render() and "remove the tag" in e.value.render()
    assert not (tmp_path / "ran").exists()
