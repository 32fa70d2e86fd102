"""Write constraints.txt from a freshly installed virtual environment (`make lock`).

    python scripts/write_constraints.py VENV_PYTHON constraints.txt

The file pins every package `pip install -e ".[dev]"` put into that environment, so `make
test` and `make demo` on a fresh clone install exactly what the last green run tested. Left
out: pitstop itself (editable), torch (the Makefile pins the CPU build; a GPU machine keeps
its own) and the CUDA-only packages that come with a CUDA torch (nvidia-*, triton). Each pin
holds for the Python version it was resolved on (an environment marker): on another Python,
pip resolves the ranges in pyproject.toml as before (numpy 2.4 has no Python 3.10 wheel). The
published package keeps its loose ranges (pyproject.toml); `make test-newest` tries the
newest torch and transformers against them.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from pathlib import Path

SKIP = re.compile(r"^(torch|triton|nvidia-[\w.-]+)==", re.IGNORECASE)


def pins(python: str) -> list[str]:
    """`name==version; python_version == "X.Y"` for each package installed for `python`."""
    version = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [ln.strip() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]
    bad = [ln for ln in lines if "==" not in ln]
    if bad:
        raise SystemExit(f"pip freeze gave lines that are not name==version pins: {bad}")
    kept = sorted((ln for ln in lines if not SKIP.match(ln)), key=str.lower)
    return [f'{ln}; python_version == "{version}"' for ln in kept]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    python, dest = argv
    header = [
        "# Written by `make lock` (scripts/write_constraints.py); do not edit by hand.",
        f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}; each pin holds for the Python it names.",
        "# `make install` (so `make test` and `make demo`) installs these versions; torch is",
        "# pinned by the Makefile's TORCH_PIN. Refresh: `make lock`, then `make test`.",
    ]
    Path(dest).write_text("\n".join(header + pins(python)) + "\n", encoding="utf-8")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
