"""One writer per run-directory file (issue 34): the names live in `pitstop.core.run_record`,
and summary.json and findings.json are written only by its `write_summary` and
`write_findings` (atomic, one shape), whoever produced the run."""

from __future__ import annotations

import ast
from pathlib import Path

from pitstop.core import run_record

PITSTOP = Path(__file__).resolve().parents[1] / "pitstop"
NAMES = {run_record.SUMMARY, run_record.METRICS, run_record.FINDINGS, run_record.PROFILE,
         run_record.HF_PROFILE}  # fmt: skip
# The name constants that only run_record's own writers may pass to a write.
WRITTEN_HERE_ONLY = {"SUMMARY", "FINDINGS"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            out.add(id(first.value))
    return out


def offenders(root: Path) -> list[str]:
    """'path:line: what' for a run-directory file name spelt out in code (not in a
    docstring) outside run_record.py, and for SUMMARY/FINDINGS passed to any write call."""
    out = []
    for p in sorted(root.rglob("*.py")):
        if p.name == "run_record.py":
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docs:
                out.append(f"{p.name}:{node.lineno}: the literal {node.value!r}")
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                used = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)}
                if "write" in func and used & WRITTEN_HERE_ONLY:
                    out.append(
                        f"{p.name}:{node.lineno}: {func} writes {sorted(used & WRITTEN_HERE_ONLY)}"
                    )
    return out


def test_run_directory_files_have_one_home_and_one_writer() -> None:
    assert offenders(PITSTOP) == []


def test_the_check_finds_a_planted_second_writer(tmp_path: Path) -> None:
    (tmp_path / "demo.py").write_text(
        '"""Writes summary.json."""\n'
        "import json\n"
        "from pitstop import run_record\n"
        "def f(out, report):\n"
        "    (out / 'findings.json').write_text(json.dumps(report))\n"
        "    write_json_atomic(out / run_record.SUMMARY, report)\n",
        encoding="utf-8",
    )
    found = " | ".join(offenders(tmp_path))
    assert found.count("demo.py") == 2 and "'findings.json'" in found and "['SUMMARY']" in found
