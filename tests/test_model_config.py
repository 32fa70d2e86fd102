"""`ModelConfig` (pitstop/catalog/model_config.py), the one reader of a model's config.json.

Real configs written by transformers (Llama, Mistral with a sliding window, GPT-2's
names, a Llava whose language model is nested under `text_config`), the errors of a
broken file, the callers reading the same facts through it, and a scan of `pitstop/`
that no other module reads or parses a config.json (checked against planted readers).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import GPT2Config, LlamaConfig, LlavaConfig, MistralConfig

from pitstop.advise.facts import model_facts
from pitstop.catalog.model_config import ModelConfig, ModelConfigError, ModelConfigMissing
from pitstop.core.errors import DataError
from pitstop.core.positions import position_limit
from pitstop.core.versions import model_type_of
from pitstop.data.store import check_vocab
from pitstop.measure.cost_model import shape_from_config, shape_from_model_dir
from pitstop.measure.peak import model_matmul_shapes

PITSTOP = Path(__file__).resolve().parents[1] / "pitstop"
THE_READER = "catalog/model_config.py"

LLAMA = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 256,
}


def saved(config: object, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(d)  # type: ignore[attr-defined]
    return d


def test_a_llama_config(tmp_path: Path) -> None:
    d = saved(LlamaConfig(**LLAMA, architectures=["LlamaForCausalLM"]), tmp_path / "llama")
    c = ModelConfig.read(d)
    assert c.model_type == "llama" and c.architectures == ("LlamaForCausalLM",)
    sizes = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size)
    assert sizes == (64, 2, 4, 128)
    assert (c.vocab_size, c.max_position_embeddings) == (300, 256)
    assert c.kv_heads == 4  # no num_key_value_heads of its own: one per head
    assert c.attention_head_dim == 16 and c.sliding_window is None
    assert not c.tie_word_embeddings and not c.has_text_config and not c.learned_positions
    assert c.source == str(d / "config.json")
    assert c.raw["rms_norm_eps"] == LlamaConfig().rms_norm_eps  # rare fields stay readable
    with pytest.raises(TypeError):
        c.raw["hidden_size"] = 1  # type: ignore[index]  # read-only: one truth per file


def test_a_mistral_config_with_a_sliding_window(tmp_path: Path) -> None:
    cfg = MistralConfig(**LLAMA, num_key_value_heads=2, sliding_window=32, head_dim=32)
    c = ModelConfig.read(saved(cfg, tmp_path))
    assert (c.model_type, c.sliding_window, c.kv_heads) == ("mistral", 32, 2)
    assert c.attention_head_dim == 32  # the config's head_dim, not hidden / heads
    shape = shape_from_config(c)
    assert (shape.kv_heads, shape.head_dim, shape.kv_width) == (2, 32, 64)


def test_a_multimodal_config_reads_its_text_config(tmp_path: Path) -> None:
    d = saved(LlavaConfig(text_config=LlamaConfig(**LLAMA).to_dict()), tmp_path)
    assert "hidden_size" not in json.loads((d / "config.json").read_text())  # nested only
    c = ModelConfig.read(d)
    assert c.model_type == "llava" and c.has_text_config
    assert (c.hidden_size, c.vocab_size, c.max_position_embeddings) == (64, 300, 256)
    # Every caller sees the language model's sizes, not a top level without them.
    assert shape_from_model_dir(d).hidden == 64
    assert position_limit(d) == (256, False)
    facts = model_facts(d)
    assert facts is not None and (facts.d_model, facts.vocab_size) == (64, 300)
    assert model_matmul_shapes(c, 64) == ((64, 64, 128), (64, 64, 300))


def test_gpt2_names_and_a_learned_position_table(tmp_path: Path) -> None:
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=300)
    c = ModelConfig.read(saved(cfg, tmp_path))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (64, 2, 4)
    assert c.max_position_embeddings == 128 and c.learned_positions
    assert c.intermediate_size is None  # n_inner null: each caller has its default
    assert position_limit(tmp_path) == (128, True)


def test_values_that_are_not_sizes_read_as_absent() -> None:
    c = ModelConfig.from_mapping(
        {"hidden_size": "64", "num_hidden_layers": 0, "vocab_size": True, "head_dim": 16.0}
    )
    assert c.hidden_size is None and c.num_hidden_layers is None and c.vocab_size is None
    assert c.head_dim == 16  # a whole float is a size
    # A number that is no size is named with its value, not reported as absent.
    assert c.size_problems() == ["num_hidden_layers is 0, not a whole number above 0"]
    with pytest.raises(DataError, match="num_hidden_layers is 0, not a whole number above 0"):
        shape_from_config(c)
    with pytest.raises(DataError, match="no num_hidden_layers, hidden_size, intermediate_size"):
        shape_from_config(ModelConfig.from_mapping({"num_attention_heads": 4}))
    # What real configs hold: a window of 0 or null (none), a size per layer (Gemma 3n).
    for fine in ({"sliding_window": 0}, {"sliding_window": None}, {"intermediate_size": [8, 8]}):
        assert ModelConfig.from_mapping({**LLAMA, **fine}).size_problems() == []
    half = ModelConfig.from_mapping({**LLAMA, "text_config": {"hidden_size": 63.5}})
    assert half.size_problems() == ["hidden_size is 63.5, not a whole number above 0"]


def test_a_config_with_an_impossible_size_is_refused_by_every_command(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """hidden_size -64: train refused it with torch's "negative dimension" RuntimeError,
    estimate called it absent and the doctor found nothing. Now each names it."""
    import shutil

    from pitstop.core.errors import ConfigError
    from pitstop.train.model_io import check_model_dir

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": -64}))
    said = "hidden_size is -64, not a whole number above 0"
    with pytest.raises(ConfigError, match=f"--model {d}: its config.json's {said}"):
        check_model_dir(d, trust_remote_code=False)
    with pytest.raises(DataError, match=said):
        shape_from_model_dir(d)
    with pytest.raises(DataError, match=said):
        model_facts(d)


def test_dtype_and_tie_and_remote_code() -> None:
    old = ModelConfig.from_mapping({"torch_dtype": "bfloat16", "auto_map": {"A": "m.A"}})
    assert old.dtype == "bfloat16" and old.has_auto_map
    both = ModelConfig.from_mapping({"dtype": "float16", "torch_dtype": "bfloat16"})
    assert both.dtype == "float16" and not both.has_auto_map
    # The top level's tie flag wins over a nested one; unset reads as untied.
    nested = {"text_config": {"tie_word_embeddings": True}}
    assert ModelConfig.from_mapping(nested).tie_word_embeddings
    assert not ModelConfig.from_mapping(
        {**nested, "tie_word_embeddings": False}
    ).tie_word_embeddings
    assert not ModelConfig.from_mapping({}).tie_word_embeddings


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{bad", r"config\.json is not valid JSON .*re-download"),
        (b"[1, 2]", r"holds a JSON list, not an object of settings"),
        (b'{"a": "\xff"}', r"is not UTF-8 text"),
    ],
)
def test_a_broken_config_says_what_is_wrong(tmp_path: Path, content: bytes, error: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ModelConfigError, match=error):
        ModelConfig.read(tmp_path)
    assert ModelConfig.read_optional(tmp_path) is None  # the tolerant callers' reading
    assert model_type_of(tmp_path) is None and position_limit(tmp_path) == (None, False)


def test_a_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigMissing, match=r"has no config\.json.*the folder that holds"):
        ModelConfig.read(tmp_path)
    assert isinstance(ModelConfigMissing("x"), DataError)  # the CLI prints it, exit 1
    assert ModelConfig.read_optional(tmp_path) is None
    assert ModelConfig.read_optional(None) is None
    with pytest.raises(DataError, match=r"no config\.json; .*--params N"):
        shape_from_model_dir(tmp_path)  # the estimate keeps its own hint


def test_the_store_checks_against_the_nested_vocabulary(tmp_path: Path) -> None:
    d = saved(LlavaConfig(text_config=LlamaConfig(**LLAMA).to_dict()), tmp_path / "m")

    # check_vocab reads these three attributes of a store.
    store = SimpleNamespace(path=tmp_path / "store", max_token_id=300, manifest={})
    with pytest.raises(DataError, match="embedding of 300 rows"):
        check_vocab(store, d)  # type: ignore[arg-type]


# --- one reader: no other module under pitstop/ reads or parses a config.json -------------

CONFIG_FILE = re.compile(r"(^|[/\\])config\.json$")
# The reader's own handles on the file: a module that reads through them is a second reader.
HANDLES = {"CONFIG_NAME", "path_in"}


def _mentions(node: ast.AST, tainted: set[str]) -> bool:
    """Whether `node` names a config.json: the file name, a name bound to it, a handle."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and CONFIG_FILE.search(n.value):
            return True
        if isinstance(n, ast.Name) and (n.id in tainted or n.id in HANDLES):
            return True
        if isinstance(n, ast.Attribute) and n.attr in HANDLES:
            return True
    return False


def _bindings(stmts: list[ast.AST]) -> list[tuple[list[ast.AST], ast.AST]]:
    """(targets, value) of the assignments, walrus and `with ... as` among `stmts`."""
    out: list[tuple[list[ast.AST], ast.AST]] = []
    for node in (n for s in stmts for n in ast.walk(s)):
        if isinstance(node, ast.Assign):
            out.append((node.targets, node.value))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            out.append(([node.target], node.value))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            out.append(([node.optional_vars], node.context_expr))
    return out


def _taint(stmts: list[ast.AST], tainted: set[str]) -> set[str]:
    """Names bound, directly or through other such names, to a config.json path or file."""
    tainted = set(tainted)
    bindings = _bindings(stmts)
    while True:
        new = {
            t.id
            for targets, value in bindings
            if _mentions(value, tainted)
            for target in targets
            for t in ast.walk(target)
            if isinstance(t, ast.Name) and t.id not in tainted
        }
        if not new:
            return tainted
        tainted |= new


def _is_read_of(call: ast.Call, tainted: set[str]) -> bool:
    """json.load(s) of, open() of, or .read_text/.read_bytes/.open() on a config.json."""
    f = call.func
    args: list[ast.AST] = [*call.args, *(k.value for k in call.keywords)]
    if isinstance(f, ast.Name) and f.id == "open":
        return any(_mentions(a, tainted) for a in args)
    if not isinstance(f, ast.Attribute):
        return False
    if f.attr in ("load", "loads") and isinstance(f.value, ast.Name) and f.value.id == "json":
        return any(_mentions(a, tainted) for a in args)
    if f.attr in ("read_text", "read_bytes", "open"):
        return _mentions(f.value, tainted) or any(_mentions(a, tainted) for a in args)
    return False


def config_json_readers(root: Path) -> set[str]:
    """Modules under `root` (relative paths) that read or parse a config.json themselves.

    A name bound at module level to the file is seen in every function; one bound in a
    function only there (and in the functions inside it)."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.ClassDef))]
        module_names = _taint(top, set())
        scopes: list[list[ast.AST]] = [list(top)]
        scopes += [
            list(n.body)
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for stmts in scopes:
            tainted = _taint(stmts, module_names)
            calls = (n for s in stmts for n in ast.walk(s) if isinstance(n, ast.Call))
            if any(_is_read_of(c, tainted) for c in calls):
                found.add(path.relative_to(root).as_posix())
    return found


def test_config_json_is_read_by_one_module() -> None:
    # The reader itself is found (the scan is not blind), and nothing else is.
    assert config_json_readers(PITSTOP) == {THE_READER}, (
        "read a model's config.json through pitstop.catalog.model_config.ModelConfig "
        "(read / read_optional; `.raw` for a field it has no attribute for)"
    )


def test_the_scan_finds_planted_readers(tmp_path: Path) -> None:
    plants = {
        "direct.py": 'import json\ndef f(d):\n    return json.loads((d / "config.json").read_text())\n',
        "via_name.py": (
            "import json\n"
            "def f(d):\n"
            '    path = d / "config.json"\n'
            "    with open(path) as fh:\n"
            "        return json.load(fh)\n"
        ),
        "module_name.py": (
            'import json\nNAME = "config.json"\n'
            "def f(d):\n    return json.loads((d / NAME).read_bytes())\n"
        ),
        "handle.py": (
            "import json\nfrom pitstop.catalog.model_config import ModelConfig\n"
            "def f(d):\n    return json.loads(ModelConfig.path_in(d).read_text())\n"
        ),
        "fstring.py": 'import json\ndef f(d):\n    return json.load(open(f"{d}/config.json"))\n',
    }
    innocent = (
        "import json\n"
        "def ok(d, manifest):\n"
        '    if not (d / "config.json").is_file():\n'
        '        raise ValueError(f"{d} has no config.json")\n'
        '    adapter = json.loads((d / "adapter_config.json").read_text())\n'
        "    return adapter, json.loads(manifest.read_text())\n"
        "def writes(d, raw):\n"
        '    (d / "config.json").write_text(json.dumps(raw))\n'
    )
    for name, text in {**plants, "innocent.py": innocent}.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert config_json_readers(tmp_path) == set(plants)
