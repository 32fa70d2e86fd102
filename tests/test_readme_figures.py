"""The README's benchmark figures are the bench/results files' own, not hand-copied ones.

- the Benchmarks section has a table with one line per benchmark, each row linking the
  bench/results file it quotes;
- every figure in a row's "what is measured" and "result" cells (3,859 / 1.33× / 107.1% /
  22.2 s / 10,000,000 / 0.1M ...) is a number of that file: thousands separators, × or x,
  units and a k/M suffix may differ, the value may not (107 does not match 107.1);
- the row's date is the file's `date:` line, or, for a file without one, the day git last
  changed it;
- every figure in the section's prose is a number of a results file its paragraph links;
- no sentence of the README speaks of work not done (that is the issue tracker's).

Each extractor is also run on planted rows, so a check that could never fail fails.
"""

from __future__ import annotations

import re
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = "bench/results/"
COLUMNS = ["benchmark", "what is measured", "result", "goal", "date"]
CHECKED = ("what is measured", "result")  # the goal is a target, not a measurement
LONGEST_ROW = 320  # characters: a row is a line, its detail lives in docs/benchmarks.md

# A figure: digits with optional thousands separators and decimals, not glued to a word
# (bf16, H200, fp32 are names) and not the tail of another number; an optional k/M suffix.
FIGURE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([kM](?![A-Za-z]))?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)")
DATE_LINE = re.compile(r"^- date: (\d{4}-\d{2}-\d{2})", re.M)
NOT_DONE = re.compile(
    r"not yet|not done|\bTODO\b|\bTBD\b|\bFIXME\b|coming soon|(?:is|are) planned|"
    r"will (?:be )?(?:add|implement|support|follow|come)|next time|in a later",
    re.I,
)
SCALE = {"": 1, "k": 1_000, "M": 1_000_000}


def figures(text: str) -> list[tuple[str, Decimal]]:
    """(as written, value) of every figure in `text`; links and their targets left out."""
    text = re.sub(r"\]\([^)]*\)", "]", text)  # a link's target is a path, not a figure
    out = []
    for m in FIGURE.finditer(text):
        whole, frac, suffix = m.group(1), m.group(2) or "", m.group(3) or ""
        value = Decimal(whole.replace(",", "") + frac) * SCALE[suffix]
        out.append((m.group(0), value))
    return out


def values(text: str) -> set[Decimal]:
    return {v for _, v in figures(text)}


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in `text` whose header is COLUMNS."""
    lines = text.splitlines()
    header = "| " + " | ".join(COLUMNS) + " |"
    assert header in lines, f"no table headed {header}"
    at = lines.index(header)
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == len(COLUMNS), f"a row of {len(cells)} cells, not 5: {line}"
        rows.append({**dict(zip(COLUMNS, cells, strict=True)), "line": line})
    return rows


def cited(cell: str) -> Path:
    links = [t for t in LINK.findall(cell) if t.startswith(RESULTS)]
    assert len(links) == 1, f"the benchmark cell must link one {RESULTS} file: {cell}"
    return ROOT / links[0]


def git_day(path: Path) -> str | None:
    """The day git last changed `path` (None without git or history)."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ad", "--date=short", "--", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def row_problems(row: dict[str, str], day_of: dict[Path, str | None]) -> list[str]:
    """What is wrong with one table row: figures its file lacks, a wrong date, a paragraph."""
    path = cited(row["benchmark"])
    if not path.is_file():
        return [f"{row['benchmark']}: {path.relative_to(ROOT)} does not exist"]
    source = path.read_text(encoding="utf-8")
    have = values(source)
    bad = []
    for column in CHECKED:
        for written, value in figures(row[column]):
            if value not in have:
                bad.append(f"{path.name}: {written!r} ({column}) is not in the file")
    dated = DATE_LINE.search(source)
    day = dated.group(1) if dated else day_of.get(path)
    if day is not None and row["date"] != day:
        bad.append(f"{path.name}: the row says {row['date']}, the file was measured {day}")
    if len(row["line"]) > LONGEST_ROW:
        bad.append(f"{path.name}: a row of {len(row['line'])} characters (at most {LONGEST_ROW})")
    return bad


def prose_problems(text: str) -> list[str]:
    """Figures of the section's prose paragraphs that no results file they link holds."""
    bad = []
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith(("|", "#", "```")):
            continue
        files = [ROOT / t for t in LINK.findall(para) if t.startswith(RESULTS)]
        have: set[Decimal] = set()
        for f in files:
            have |= values(f.read_text(encoding="utf-8"))
        for written, value in figures(para):
            if value not in have:
                bad.append(f"{written!r} in a paragraph linking {[f.name for f in files]}")
    return bad


@pytest.fixture(scope="module")
def benchmarks() -> str:
    return section(README.read_text(encoding="utf-8"), "Benchmarks")


def test_every_table_figure_is_in_the_file_its_row_cites(benchmarks: str) -> None:
    rows = table_rows(benchmarks)
    assert len(rows) >= 10, "the README's benchmark table lost its rows"
    names = [cited(r["benchmark"]) for r in rows]
    assert len(set(names)) == len(names), "one line per benchmark: a results file cited twice"
    day_of = {p: None if DATE_LINE.search(p.read_text("utf-8")) else git_day(p) for p in names}
    bad = [b for r in rows for b in row_problems(r, day_of)]
    assert not bad, "README figures that bench/results does not hold:\n" + "\n".join(bad)


def test_every_figure_in_the_benchmark_prose_is_in_a_file_it_links(benchmarks: str) -> None:
    bad = prose_problems(benchmarks)
    assert not bad, "figures in the Benchmarks prose without a results file:\n" + "\n".join(bad)


def test_the_readme_speaks_of_no_work_not_done() -> None:
    hits = [m.group(0) for m in NOT_DONE.finditer(README.read_text(encoding="utf-8"))]
    assert not hits, f"sentences about work not done belong in the issue tracker: {hits}"


# --- the checks themselves fail on planted mistakes ---------------------------------------


def test_figures_are_read_as_values() -> None:
    got = figures("**1.33×** (3,859 vs 2,899 tok/s); 107.1%; bf16 on H200; 0.1M and 10M; 2.67x")
    assert [w for w, _ in got] == ["1.33", "3,859", "2,899", "107.1", "0.1M", "10M", "2.67"]
    assert [float(v) for _, v in got] == [1.33, 3859, 2899, 107.1, 100_000, 10_000_000, 2.67]
    assert values("1.00× and 0.940") == {Decimal("1"), Decimal("0.94")}
    assert figures("[headline](bench/results/headline.md)") == []


def _row(benchmark: str, measured: str, result: str, date: str) -> dict[str, str]:
    cells = [benchmark, measured, result, "≥ 1.5×", date]
    return {**dict(zip(COLUMNS, cells, strict=True)), "line": "| " + " | ".join(cells) + " |"}


HEADLINE = "[headline](bench/results/headline.md)"


def test_a_planted_wrong_figure_or_date_fails() -> None:
    good = _row(HEADLINE, "2 workers", "**1.93×** (7,468 vs 3,873)", "2026-11-29")
    assert row_problems(good, {}) == []
    for wrong in ("**1.96×** (7,468 vs 3,873)", "**1.93×** (7,469 vs 3,873)", "1.9×"):
        bad = row_problems(_row(HEADLINE, "2 workers", wrong, "2026-11-29"), {})
        assert len(bad) == 1 and "is not in the file" in bad[0], (wrong, bad)
    assert "measured 2026-11-29" in row_problems(_row(HEADLINE, "", "1.93×", "2026-11-22"), {})[0]
    long = _row(HEADLINE, "x" * LONGEST_ROW, "1.93×", "2026-11-29")
    assert "characters" in row_problems(long, {})[0]


def test_an_undated_file_takes_its_day_from_git() -> None:
    undated = ROOT / RESULTS / "huge_record.md"
    row = _row("[huge_record](bench/results/huge_record.md)", "", "**596 MiB**", "2026-11-21")
    assert "measured 2026-11-22" in row_problems(row, {undated: "2026-11-22"})[0]


def test_a_planted_prose_figure_fails() -> None:
    ok = "in the [headline](bench/results/headline.md) run 2.04× beside 1.93×"
    assert prose_problems(ok) == []
    assert len(prose_problems(ok + "; other days 1.88×")) == 1
    assert len(prose_problems("the spread is 48.8% here")) == 1  # no file linked


def test_a_planted_promise_is_found() -> None:
    assert NOT_DONE.search("1.5× not yet by the defaults")
    assert NOT_DONE.search("the ceiling should follow them (not done yet)")
    assert not NOT_DONE.search(
        "the precision `pitstop train` will pick, and what the run will cost"
    )
