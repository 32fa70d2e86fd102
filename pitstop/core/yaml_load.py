"""Reading YAML from a file anyone may have written: bounded in size and in expansion.

`yaml.safe_load` never runs code, but an alias bomb (`&a [x, x, ...]`, `&b [*a, *a, ...]`,
nine levels deep) is a few hundred bytes that stand for a billion values; loading is
cheap because the aliases share one object, and the first thing that walks it (a type
check, an error message) runs out of memory. So the document is composed first (nodes
only, aliases shared), its size as if every alias were written out is counted once per
node, and a document that stands for more than MAX_VALUES values, or that refers to
itself, is refused before anything is built from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pitstop.core.errors import ConfigError

MAX_BYTES = 1 << 20  # a run config or TrainingArguments file is a few KB
MAX_VALUES = 100_000


def read_yaml(path: str | Path, where: str) -> Any:
    """The document of the YAML file `path`; ConfigError (prefixed with `where`) when refused."""
    p = Path(path)
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise ConfigError(
            f"{where}: the file has {size:,} bytes; a YAML file of options is at most "
            f"{MAX_BYTES:,} bytes: give the right file"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not valid YAML (not UTF-8 at byte {e.start}); fix the encoding"
        ) from None
    return parse_yaml(text, where)


def parse_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)` once its expanded size is known to be small."""
    if len(text) > MAX_BYTES:
        raise ConfigError(
            f"{where}: {len(text):,} characters; a YAML file of options is at most "
            f"{MAX_BYTES:,}: give the right file"
        )
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({str(e)[:500]}); fix the syntax") from None
    except RecursionError:
        raise ConfigError(
            f"{where}: nested too deeply for a file of options; fix the file"
        ) from None
    if node is None:
        return None
    values = expanded_size(node)
    if values is None:
        raise ConfigError(
            f"{where}: an alias (*name) refers to a collection that contains it; "
            "a file of options cannot be infinite: write the values out"
        )
    if values > MAX_VALUES:
        raise ConfigError(
            f"{where}: its aliases (*name) expand to more than {MAX_VALUES:,} values; "
            "refused as an alias bomb: write the values out without anchors and aliases"
        )
    twice = duplicate_keys(node)
    if twice:
        raise ConfigError(
            f"{where}: {'; '.join(twice)}; YAML would keep only the last value silently: "
            "delete the one you did not mean"
        )
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:  # composed, but not constructed: a tag (`!custom`, `!!python/…`)
        mark = getattr(e, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())[:300]
        raise ConfigError(
            f"{where}{line}: {problem}; a file of options holds plain values (numbers, "
            "strings, lists, mappings): remove the tag"
        ) from None


def duplicate_keys(root: yaml.Node) -> list[str]:
    """ "key 'lr' given twice (lines 3 and 4)" for each key a mapping gives more than once
    (merge keys `<<` excepted: overriding a merged value is what they are for). Each node
    is visited once, so shared (aliased) mappings are checked once."""
    out: list[str] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, _ in node.value:
                if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                    continue
                line = k.start_mark.line + 1
                if k.value in first:
                    out.append(f"key {k.value!r} given twice (lines {first[k.value]} and {line})")
                else:
                    first[k.value] = line
        stack.extend(_children(node))
    return out


def expanded_size(root: yaml.Node) -> int | None:
    """Values the document stands for once every alias is expanded (capped just above
    MAX_VALUES); None when a collection contains itself. Each node is visited once."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            on_path.discard(key)
            size[key] = min(MAX_VALUES + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in size:
            continue
        if key in on_path:
            return None
        on_path.add(key)
        stack.append((node, True))
        for c in children:
            if id(c) in on_path:
                return None
            if id(c) not in size:
                stack.append((c, False))
    return size[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []
