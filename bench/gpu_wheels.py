"""The wheels a lent GPU lacks for bench/headline's Hugging Face and TRL rows, fetched here and
installed there without a network (bench/gpu_lent.sh).

The device image has torch, transformers, accelerate, pandas, pyarrow, xxhash and fsspec,
but not `datasets`, `trl`, `dill` or `multiprocess`. `download` puts those wheels (two
releases of datasets, dill and multiprocess: the newest, and one for an older pyarrow or
huggingface_hub) in `.gpu-wheels/` (git-ignored, ~3 MB; the device command carries it);
`install` picks, for each missing distribution, the newest wheel in the folder whose
requirements the machine's installed packages (or the other wheels picked) meet, and installs
it with `pip install --no-index --no-deps`: nothing already installed is replaced, nothing
is downloaded there. What it could not satisfy is printed; the rows that need it then say why.

    python -m bench.gpu_wheels download [DIR]   # here, with a network
    python -m bench.gpu_wheels install [DIR]    # on the lent machine
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

WHEELS = Path(__file__).resolve().parents[1] / ".gpu-wheels"
# What the headline's HF and TRL rows import, beyond the device image, newest first.
WANTED = (
    "datasets==5.2.0", "datasets==4.8.5", "trl==1.16.0", "dill==0.4.1", "dill==0.3.8",
    "multiprocess==0.70.19", "multiprocess==0.70.16", "psutil==7.2.2",
)  # fmt: skip
NEEDED = ("datasets", "trl", "dill", "multiprocess", "psutil")
PLATFORM = ("--python-version", "3.12", "--platform", "manylinux2014_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64")  # fmt: skip


def download(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for spec in WANTED:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
               *PLATFORM, "--no-deps", "--dest", str(dest), spec]  # fmt: skip
        subprocess.run(cmd, check=True)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"[gpu_wheels] {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MB in {dest}")


def _requires(wheel: Path) -> list[Requirement]:
    """The wheel's unconditional requirements for this Python (extras left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [
        Requirement(x.split(":", 1)[1].strip()) for x in lines if x.startswith("Requires-Dist:")
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def _unmet(wheel: Path, picked: dict[str, Version]) -> list[str]:
    out = []
    for r in _requires(wheel):
        name = canonicalize_name(r.name)
        have = picked.get(name) or _installed(name)
        if have is None or (r.specifier and have not in r.specifier):
            out.append(f"{r} (have {have or 'none'})")
    return out


def plan(
    folder: Path, names: tuple[str, ...] = ("dill", "multiprocess", "psutil", "datasets", "trl")
) -> tuple[list[Path], list[str]]:
    """(the wheels to install, what stays unmet), the newest satisfiable wheel of each of
    `names` not installed; dependencies first (dill, multiprocess, psutil, datasets, trl)."""
    wheels: dict[str, list[tuple[Version, Path]]] = {}
    for w in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(w.name)
        wheels.setdefault(canonicalize_name(name), []).append((version, w))
    picked: dict[str, Version] = {}
    chosen: list[Path] = []
    problems: list[str] = []
    for name in names:
        if _installed(name) is not None:
            continue
        options = sorted(wheels.get(name, []), reverse=True)
        if not options:
            problems.append(f"{name}: no wheel in {folder}")
            continue
        # The newest whose requirements hold; a dependency wheel picked later may still
        # narrow them (dill before multiprocess before datasets keeps that rare).
        fits = [(v, w) for v, w in options if not _unmet(w, picked)]
        v, w = fits[0] if fits else options[0]
        if not fits:
            problems.append(f"{w.name}: unmet {'; '.join(_unmet(w, picked))}")
        picked[name] = v
        chosen.append(w)
    return chosen, problems


def install(folder: Path) -> int:
    chosen, problems = plan(folder)
    for w in chosen:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(w)]
        subprocess.run(cmd, check=True)
        print(f"[gpu_wheels] installed {w.name}")
    for p in problems:
        print(f"[gpu_wheels] warning: {p}")
    missing = [n for n in NEEDED if _installed(n) is None]
    print(f"[gpu_wheels] {'missing: ' + ', '.join(missing) if missing else 'all present'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("download", "install"):
        print(__doc__)
        return 2
    folder = Path(args[1]) if len(args) > 1 else WHEELS
    if args[0] == "download":
        download(folder)
        return 0
    return install(folder)


if __name__ == "__main__":
    sys.exit(main())
