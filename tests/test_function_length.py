"""A ratchet on long functions (issue 45): no function or method in `pitstop/` is over
MAX_LINES lines, except those in ALLOWED, each at most its listed length.

A function's length is `end_lineno - lineno + 1` of its `def` in the AST: the signature,
docstring, body and comments, not its decorators. Nested functions and methods count on
their own, named by where they sit (`Class.method`, `outer.inner`); an enclosing
function's length includes theirs.

The allow-list only shrinks: an entry whose function is gone, or now fits in MAX_LINES,
fails until it is removed, and a listed function may not grow. Split a long function into
named steps (docs/style.md) rather than adding it here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PITSTOP = ROOT / "pitstop"
MAX_LINES = 80

# "path:qualified name": its length when it was listed. Only shrinks (see the docstring).
ALLOWED: dict[str, int] = {}


def function_lengths(root: Path = PITSTOP) -> dict[str, int]:
    """{"path:qualified name": lines} of every function and method under `root` (paths
    relative to the parent of `root`, so `pitstop/...` for the package)."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{where}:{prefix}{child.name}"
                assert child.end_lineno is not None
                # Two definitions of one name (e.g. under `if`): the longer one counts.
                out[name] = max(out.get(name, 0), child.end_lineno - child.lineno + 1)
                walk(child, where, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, where, f"{prefix}{child.name}.")
            else:
                walk(child, where, prefix)

    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        walk(tree, path.relative_to(root.parent).as_posix(), "")
    return out


def over_the_limit(lengths: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """Every function over MAX_LINES that is not allowed, or longer than allowed."""
    problems = []
    for name, n in sorted(lengths.items()):
        if n > MAX_LINES and name not in allowed:
            problems.append(f"{name} is {n} lines (at most {MAX_LINES}): split it into named steps")
        elif name in allowed and n > allowed[name]:
            problems.append(
                f"{name} grew to {n} lines (allowed {allowed[name]}, and that only shrinks): "
                "split it into named steps"
            )
    return problems


def stale_entries(lengths: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """Allow-list entries that no longer name a function over MAX_LINES."""
    problems = []
    for name, listed in sorted(allowed.items()):
        if name not in lengths:
            problems.append(f"{name} no longer exists: remove it from the allow-list")
        elif lengths[name] <= MAX_LINES:
            problems.append(
                f"{name} is now {lengths[name]} lines (≤ {MAX_LINES}; listed at {listed}): "
                "remove it from the allow-list"
            )
    return problems


def test_no_function_over_the_limit_outside_the_allow_list() -> None:
    problems = over_the_limit(function_lengths(), ALLOWED)
    assert not problems, "\n".join(problems)


def test_the_allow_list_only_shrinks() -> None:
    problems = stale_entries(function_lengths(), ALLOWED)
    assert not problems, "\n".join(problems)


# --- the checks themselves catch planted violations ------------------------------------


def _body(n: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(n))


def test_lengths_count_the_def_to_its_last_line_without_decorators(tmp_path: Path) -> None:
    pkg = tmp_path / "pitstop"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import functools\n\n"
        "@functools.cache\n@functools.wraps(print)\n"
        f"def long(a):\n    '''doc'''\n{_body(79)}"  # def + docstring + 79 = 81 lines
        f"def short():\n{_body(79)}"  # 80 lines
        "class C:\n"
        "    async def method(self):\n"
        "        def inner():\n            return 1\n"
        "        return inner\n",
        encoding="utf-8",
    )
    lengths = function_lengths(pkg)
    assert lengths == {
        "pitstop/m.py:long": 81,
        "pitstop/m.py:short": 80,
        "pitstop/m.py:C.method": 4,
        "pitstop/m.py:C.method.inner": 2,
    }
    assert over_the_limit(lengths, {}) == [
        "pitstop/m.py:long is 81 lines (at most 80): split it into named steps"
    ]
    assert over_the_limit(lengths, {"pitstop/m.py:long": 81}) == []
    assert "grew to 81 lines" in over_the_limit(lengths, {"pitstop/m.py:long": 80})[0]


def test_a_stale_entry_says_remove_it() -> None:
    lengths = {"pitstop/a.py:f": 60, "pitstop/a.py:g": 90}
    allowed = {"pitstop/a.py:f": 95, "pitstop/a.py:g": 90, "pitstop/a.py:gone": 100}
    problems = stale_entries(lengths, allowed)
    assert len(problems) == 2
    assert all(p.endswith("remove it from the allow-list") for p in problems)
    assert problems[0].startswith("pitstop/a.py:f is now 60 lines")
    assert problems[1].startswith("pitstop/a.py:gone no longer exists")
