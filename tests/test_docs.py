"""The documentation a reader is pointed to exists.

- every relative link in README.md and docs/*.md names a file that exists, and a
  `#fragment` names a heading of that file;
- every `docs/NAME.md` the code cites (pitstop/, bench/, tests/) exists;
- no production module cites DESIGN.md or STYLE.md: those briefs live outside the
  repository, so a clone cannot read them (the design is docs/design.md, the style
  docs/style.md);
- the keys docs/configuration.md lists are RunConfig's, and the layers of
  tests/test_import_graph.py are all named in docs/architecture.md;
- the README stays a front door (under 300 lines);
- every repository path the pages cite exists, docs/run-directory.md lists every field of
  the run records, and the count of deferred torch-free imports docs/architecture.md
  states is not exceeded (`deferred_light_imports` computes it).

Each extractor is also run on a planted example, so a check that could never fail fails.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from pitstop.core.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CITED = re.compile(r"docs/[a-z0-9-]+\.md")
# A name the repository cannot hold: built here so this file does not cite it itself.
OUTSIDE = ("DESIGN" + ".md", "STYLE" + ".md")


def relative_links(text: str) -> list[str]:
    """Link targets of a Markdown text outside code blocks, minus web and mail links."""
    prose = FENCE.sub("", text)
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z]+:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m) for m in re.findall(r"^#{1,6} +(.+?) *$", prose, re.M)}


def broken_links(path: Path) -> list[str]:
    """`file: target (why)` for every relative link of `path` that leads nowhere."""
    bad = []
    for target in relative_links(path.read_text(encoding="utf-8")):
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{path.name}: {target} (no heading #{fragment} in {dest.name})")
    return bad


def cited_docs(paths: list[Path]) -> dict[str, list[str]]:
    """docs/NAME.md -> the files citing it."""
    out: dict[str, list[str]] = {}
    for p in paths:
        for name in set(CITED.findall(p.read_text(encoding="utf-8"))):
            out.setdefault(name, []).append(str(p.relative_to(ROOT)))
    return out


def import_graph_layers() -> list[tuple[str, ...]]:
    """`LAYERS` of tests/test_import_graph.py, read without importing that test module."""
    tree = ast.parse((ROOT / "tests" / "test_import_graph.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "LAYERS":
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_import_graph.py has no LAYERS")


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_docs_folder_holds_the_design_architecture_and_style() -> None:
    for name in ("design.md", "architecture.md", "style.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(path: Path) -> None:
    assert broken_links(path) == []


def test_the_readme_links_into_docs() -> None:
    targets = {t.partition("#")[0] for t in relative_links(README.read_text(encoding="utf-8"))}
    docs = {t for t in targets if t.startswith("docs/")}
    for name in ("docs/design.md", "docs/architecture.md", "docs/style.md"):
        assert name in docs, f"README.md does not link {name}"
    # Every page of docs/ is reachable from the README, directly or through commands.md.
    reachable = {Path(t).name for t in docs}
    reachable |= {
        Path(t).name
        for t in relative_links((DOCS / "commands.md").read_text(encoding="utf-8"))
        if t.endswith(".md")
    }
    orphans = sorted(p.name for p in DOCS.glob("*.md") if p.name not in reachable)
    assert orphans == [], f"docs pages no README link reaches: {orphans}"


def test_every_doc_the_code_cites_exists() -> None:
    cited = cited_docs(sources("pitstop", "bench", "tests"))
    missing = {name: files for name, files in cited.items() if not (ROOT / name).is_file()}
    assert missing == {}, f"cited but not in docs/: {missing}"


def test_no_production_module_cites_a_brief_outside_the_repository() -> None:
    offenders = [
        f"{p.relative_to(ROOT)} cites {name}"
        for p in sources("pitstop", "bench", "scripts")
        for name in OUTSIDE
        if name in p.read_text(encoding="utf-8")
    ]
    assert offenders == [], offenders


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move reference text to docs/"
    text = "\n".join(lines)
    assert "make demo\nmake test" in text  # the two-command quick start


def test_configuration_page_names_only_real_keys() -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `([a-z0-9_]+)` \(`--[a-z0-9-]+`\) \|", text, re.M)
    assert len(listed) > 20, "docs/configuration.md lost its table of keys"
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    assert sorted(set(listed) - fields) == []


def test_architecture_page_names_every_layer() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([A-Za-z_][\w]*)(?:\.py|/)`", text))
    missing = [
        name for layer in import_graph_layers() for name in layer if name and name not in named
    ]
    assert missing == [], (
        f"in tests/test_import_graph.py's LAYERS but not docs/architecture.md: {missing}"
    )


# A path into the repository written in prose: tests/..., pitstop/..., bench/..., examples/...
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|pitstop|bench|examples)/[\w/.-]*\w)")
# Files a command writes when it runs (a benchmark's table): cited before they exist.
WRITTEN_BY_RUNS = ("bench/results/",)


def missing_paths(paths: list[Path]) -> dict[str, list[str]]:
    """Repository paths the pages cite that do not exist: {path: [pages]}."""
    out: dict[str, list[str]] = {}
    for page in paths:
        for cited in REPO_PATH.findall(page.read_text(encoding="utf-8")):
            if cited.startswith(WRITTEN_BY_RUNS) or _exists(cited):
                continue
            out.setdefault(cited, []).append(page.name)
    return out


def _exists(cited: str) -> bool:
    """A file or folder, a benchmark named without .py (`bench/headline`), or the stem of a
    family of files (`bench/gpu_checks_*.py`)."""
    return (
        (ROOT / cited).exists()
        or (ROOT / f"{cited}.py").is_file()
        or (cited.endswith("_") and any(ROOT.glob(f"{cited}*")))
    )


def test_every_repository_path_the_docs_cite_exists() -> None:
    """A moved test or module leaves no stale path behind in the prose (issue 34)."""
    assert missing_paths(MARKDOWN) == {}


def test_run_directory_page_lists_every_record_field() -> None:
    from pitstop.core.run_record import RunSummary, StepLine

    text = (DOCS / "run-directory.md").read_text(encoding="utf-8")
    unlisted = [
        f"{cls.__name__}.{f.name}"
        for cls in (RunSummary, StepLine)
        for f in dataclasses.fields(cls)
        if "kind" in f.metadata and f"`{f.name}`" not in text
    ]
    assert unlisted == [], f"fields docs/run-directory.md does not describe: {unlisted}"


# Packages an import inside a function may defer (docs/architecture.md): slow to load
# (torch and what loads it) or optional.
DEFERRABLE = frozenset(
    [
        "torch",
        "transformers",
        "safetensors",
        "tokenizers",
        "pyarrow",
        "huggingface_hub",
        "peft",
        "tensorboard",
        "wandb",
        "bitsandbytes",
        "pynvml",
        "datasets",
        "trl",
        "accelerate",
        "flash_attn",
    ]
)
DEFERRED_COUNT = re.compile(r"at most (\d+) of them,\s+a count `tests/test_docs.py` computes")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_targets(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """What `from X import a, b` may load: X, and X.a, X.b where those are modules."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [mod] + [f"{mod}.{a.name}" for a in node.names]


def _import_time_imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """What importing a module imports: its statements outside functions and
    `if TYPE_CHECKING:` blocks (class bodies, if/try/with blocks included)."""
    out: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                visit(n.orelse)
            elif isinstance(n, ast.Import):
                out.extend(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                out.extend(_from_targets(n, module, is_package))
            elif isinstance(n, ast.Try):
                visit([*n.body, *n.orelse, *n.finalbody, *(s for h in n.handlers for s in h.body)])
            elif isinstance(n, (ast.If, ast.With, ast.ClassDef)):
                visit([*n.body, *getattr(n, "orelse", [])])

    visit(tree.body)
    return out


def deferred_light_imports(root: Path) -> list[str]:
    """Imports inside functions of modules that load none of DEFERRABLE when imported
    (their import-time imports followed through `root`'s modules and parent packages):
    "path:line statement" each."""
    modules = {}
    for p in sorted(root.rglob("*.py")):
        modules[_module_name(p, root)] = (ast.parse(p.read_text(encoding="utf-8")), p)
    edges = {
        m: _import_time_imports(t, m, p.name == "__init__.py") for m, (t, p) in modules.items()
    }
    heavy: dict[str, bool] = {}

    def loads_heavy(mod: str, seen: frozenset[str] = frozenset()) -> bool:
        if mod.split(".")[0] in DEFERRABLE:
            return True
        if mod not in modules or mod in seen:
            return False
        if mod not in heavy:
            parents = [".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)]
            heavy[mod] = any(loads_heavy(d, seen | {mod}) for d in [*edges[mod], *parents])
        return heavy[mod]

    found = set()
    for m, (tree, p) in modules.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                if isinstance(n, ast.Import):
                    targets = [a.name for a in n.names]
                elif isinstance(n, ast.ImportFrom):
                    targets = _from_targets(n, m, p.name == "__init__.py")
                else:
                    continue
                if not any(loads_heavy(t) for t in targets):
                    found.add(f"{p.relative_to(root.parent)}:{n.lineno} {ast.unparse(n)}")
    return sorted(found)


def test_deferred_torch_free_imports_stay_within_the_architecture_pages_count() -> None:
    """docs/architecture.md: imports at module level, except slow or optional packages; the
    older torch-free exceptions are counted there, and this count may fall, never rise."""
    m = DEFERRED_COUNT.search((DOCS / "architecture.md").read_text(encoding="utf-8"))
    assert m, "docs/architecture.md no longer states how many torch-free imports are deferred"
    found = deferred_light_imports(ROOT / "pitstop")
    assert len(found) <= int(m.group(1)), (
        f"{len(found)} imports inside functions load no slow or optional package (the page "
        f"says at most {m.group(1)}); move them to the top of their module:\n" + "\n".join(found)
    )


# --- the checks themselves can fail -----------------------------------------------------


def test_deferred_import_scan_tells_light_from_heavy(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "light.py").write_text("import json\n", encoding="utf-8")
    (pkg / "heavy.py").write_text("from pkg import light\nimport torch\n", encoding="utf-8")
    (pkg / "guarded.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", encoding="utf-8"
    )
    (pkg / "user.py").write_text(
        "def f():\n    from pkg import heavy\n    import transformers\n\n"
        "def g():\n    from pkg.light import x\n    import gc\n    from . import guarded\n",
        encoding="utf-8",
    )
    assert deferred_light_imports(pkg) == [
        "pkg/user.py:6 from pkg.light import x",
        "pkg/user.py:7 import gc",
        "pkg/user.py:8 from . import guarded",
    ]


def test_path_check_finds_a_planted_stale_path(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "held by `tests/test_docs.py` and tests/no_such_test.py, run by bench/headline and "
        "bench/gpu_checks_*.py; see bench/results/x.md\n",
        encoding="utf-8",
    )
    assert missing_paths([page]) == {"tests/no_such_test.py": ["page.md"]}


def test_link_check_finds_planted_faults(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: `with code`\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere)\n"
        "```\n[in code](also-missing.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#nowhere (no heading #nowhere in there.md)",
    ]


def test_citation_scan_finds_planted_citation(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('"""See ' + "docs/" + 'no-such-page.md."""\n', encoding="utf-8")
    assert CITED.findall(src.read_text(encoding="utf-8")) == ["docs/" + "no-such-page.md"]
    assert not (ROOT / ("docs/" + "no-such-page.md")).exists()


def test_slug_matches_github() -> None:
    assert slug("Where each decision is made") == "where-each-decision-is-made"
    assert slug("Training: `pitstop train`") == "training-pitstop-train"
    assert slug("NaN/Inf") == "naninf"
