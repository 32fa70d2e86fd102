"""Model ids such as `org/name` resolved to a snapshot in the local Hugging Face cache.

pitstop never downloads at run time (docs/design.md): a --model that is not a directory
but looks like a Hub id is looked up, offline, where huggingface_hub keeps its cache
($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub). When it is not
there, the error gives the one command that downloads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pitstop.core.errors import ConfigError, short_repr

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hub_cache_dir() -> Path:
    """The cache huggingface_hub uses, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name


def hub_id_of(path: str | Path) -> str | None:
    """The Hub id of a snapshot directory of the cache (`.../models--org--name/snapshots/REV`)."""
    parts = Path(path).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/")
    return None


def _snapshot_of_ref(name: str) -> Path | None:
    """The snapshot `refs/main` of `name`'s cache folder names, refused unless it is one.

    huggingface_hub joins the ref's text to `snapshots/` as it is, so a ref holding
    `../..` would hand over any directory as the model; the cache may be shared or
    copied from elsewhere, so a ref must name a snapshot inside `snapshots/` (links
    followed). None when there is no ref (huggingface_hub then says "not cached").
    """
    repo = hub_cache_dir() / ("models--" + name.replace("/", "--"))
    try:
        ref = (repo / "refs" / "main").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    snapshots = repo / "snapshots"
    target = snapshots / ref
    if not ref or ref in (".", "..") or any(c in ref for c in "/\\\0"):
        why = "which is not the name of one snapshot (a commit hash)"
    elif not target.exists():
        return None
    elif not target.resolve().is_relative_to(snapshots.resolve()):
        why = f"whose snapshot is a link to {target.resolve()}, outside {snapshots}"
    else:
        return target.resolve()
    raise ConfigError(
        f"{repo}: refs/main holds {short_repr(ref)}, {why}; a model's files must come from "
        f"its snapshots/ folder, so it is not used: download {name} again with: hf download {name}"
    )


def resolve_model(name: str) -> str:
    """A local directory for `name`: the cached snapshot of a Hub id, else `name` unchanged
    (whoever opens it then says what is missing, with `missing_hint`). A cache entry whose
    ref points outside its snapshots is refused (ConfigError)."""
    if Path(name).expanduser().exists() or not looks_like_hub_id(name):
        return name
    expected = _snapshot_of_ref(name)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(name, cache_dir=str(hub_cache_dir()), local_files_only=True)
    except Exception:  # ImportError, LocalEntryNotFoundError and kin: not resolvable here
        return name
    if expected is None or Path(path).resolve() != expected:
        return name  # not the snapshot its checked ref names: left as given, "not cached"
    return str(expected)


def model_dir(name: str, flag: str = "--model") -> str:
    """`name` as a local model directory: a directory with config.json, or a Hub id's
    snapshot in the local cache. ConfigError naming what is missing otherwise, for commands
    that only read a model's shape (doctor, estimate), whose rules would otherwise stay
    quiet without saying why."""
    path = Path(resolve_model(name)).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{flag} {name}: no such model directory{missing_hint(name)}")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{flag} {name}: {path} has no config.json, so it is not a Hugging Face model "
            "directory; give the folder that holds config.json and the weights"
        )
    return str(path)


def missing_hint(name: str) -> str:
    """What to add to "no such model directory" when `name` could be a Hub id."""
    if Path(name).expanduser().exists() or not looks_like_hub_id(name):
        return ""
    return (
        f"; if {name} is a Hub id, it is not in the local Hugging Face cache ({hub_cache_dir()}; "
        f"set HF_HOME or HF_HUB_CACHE if yours is elsewhere): download it once with: "
        f"hf download {name}"
    )
