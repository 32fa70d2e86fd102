"""The HTML report: self-contained, charts with data in the DOM, rendered by headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from test_report_compare import make_run, run_cli

from pitstop.report import write_report
from pitstop.report.html import render
from pitstop.report.runs import load_run

FINDINGS = [
    {"id": "data-wait", "severity": "high", "title": "The GPU waits for data",
     "evidence": "data_wait is 40% of step time", "effect": "up to 1.6x faster",
     "basis": "measured on this run", "fix": "--loader-workers 4"},
]  # fmt: skip
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    """Path of a Chromium binary; installs Debian's package when missing and root, else skips."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Chromium is not installed and we are not root to `apt-get install chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
            pytest.skip(f"`{' '.join(cmd)}` failed; install chromium to run this test")
    path = shutil.which("chromium")
    if not path:
        pytest.skip("apt-get installed no chromium binary")
    return path


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit non-interlaced PNG: a tiny reader."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, "unsupported PNG"
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


@pytest.fixture()
def two_runs(tmp_path: Path) -> list[Path]:
    a = make_run(tmp_path / "baseline", step_seconds=0.5, data_wait=0.2, findings=FINDINGS)
    b = make_run(tmp_path / "tuned", step_seconds=0.3, data_wait=0.01, config={"batching": "pack"},
                 flat_phases=True)  # fmt: skip
    return [a, b]


def test_report_is_self_contained_with_charts(two_runs: list[Path], tmp_path: Path) -> None:
    out = write_report(two_runs, tmp_path / "r" / "report.html", price=2.0)
    text = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "no network to view"
    assert "<script" not in text
    for chart in (
        "loss",
        "tokens_per_second",
        "breakdown-baseline",
        "breakdown-tuned",
        "peak_memory",
        "memory",
    ):
        assert f'data-chart="{chart}"' in text
    assert text.count('class="series" data-series="baseline" data-points="40"') == 3
    assert "The GPU waits for data" in text and "Comparison" in text and "USD" in text
    one = render([load_run(two_runs[1])])
    assert "Comparison" not in one and "no findings.json" in one


def test_report_cli(
    two_runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.html"
    assert run_cli(["report", *map(str, two_runs), "--output", str(out)]) == 0
    assert out.is_file() and "report written" in capsys.readouterr().out
    assert run_cli(["report", str(tmp_path / "nope"), "--output", str(out)]) == 1


def test_report_renders_in_headless_chromium(two_runs: list[Path], tmp_path: Path) -> None:
    exe = chromium()
    out = write_report(two_runs, tmp_path / "report.html", price=2.0)
    url = out.resolve().as_uri()
    png = tmp_path / "shot.png"
    base = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    subprocess.run([*base, f"--screenshot={png}", "--window-size=1200,2000", url],
                   capture_output=True, timeout=180, check=True)  # fmt: skip
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                         timeout=180, check=True).stdout  # fmt: skip
    # The browser parsed the charts: one polyline per run in each line chart, stacked bars.
    for chart in ("loss", "tokens_per_second", "memory"):
        svg = re.search(rf'<svg[^>]*data-chart="{chart}".*?</svg>', dom, re.S)
        assert svg, f"chart {chart} missing from the DOM"
        pts = re.findall(r'<polyline[^>]*data-points="(\d+)"', svg.group(0))
        assert len(pts) == 2 and all(int(p) == 40 for p in pts)
    bars = re.search(r'<svg[^>]*data-chart="breakdown-tuned".*?</svg>', dom, re.S).group(0)
    assert bars.count('class="bar"') >= 40 * 4
    # The screenshot is not blank: many colours and a fair share of non-white pixels.
    width, height, rows = png_pixels(png.read_bytes())
    assert (width, height) == (1200, 2000)
    bpp = len(rows[0]) // width
    colours, ink = set(), 0
    for row in rows[::8]:
        for x in range(0, width * bpp, bpp * 4):
            px = row[x : x + 3]
            colours.add(px)
            ink += px != b"\xff\xff\xff"
    sampled = len(rows[::8]) * len(range(0, width * bpp, bpp * 4))
    assert len(colours) > 30, f"only {len(colours)} colours: a blank page?"
    assert ink / sampled > 0.05


def test_long_runs_are_bucketed(tmp_path: Path) -> None:
    run = make_run(tmp_path / "long", steps=300)
    text = render([load_run(run)])
    bars = re.search(r'<svg[^>]*data-chart="breakdown-long".*?</svg>', text, re.S).group(0)
    assert "mean of 3 per bar" in bars
    assert bars.count('class="bar"') == 100 * 5  # 100 buckets x 5 phases
