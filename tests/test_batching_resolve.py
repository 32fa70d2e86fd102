"""The batch shape is decided in one module: pitstop/batching/resolve.py.

An AST scan of the package: outside resolve.py (and settings.py, which translates a
config into settings), no module sizes a micro-batch (`choose_micro_rows`) or sets a
micro-batch field on settings or a config with a `replace(...)`
or a `BatchSettings(...)` call. The scan is run on a planted module too, so it could
fail. The resolver itself: no config rewrite leaks out, halving keeps whole rows.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from pitstop.batching.settings import BatchSettings

ROOT = Path(__file__).resolve().parents[1] / "pitstop"
HOME = {"batching/resolve.py", "batching/settings.py"}
# Writes candidate *configs* (what a user would set on the command line); each trial's
# shape is then decided by the resolver like any run's.
CONFIG_WRITERS = {"tune/space.py"}
# Prices hypothetical micro-batches on the cost model's own `Plan` (what `pitstop estimate`
# reports as the largest that would fit); no run's settings or config are touched.
ESTIMATORS = {"measure/cost_model.py"}
FIELDS = {"micro_batch_size", "tokens_per_micro_batch"}
DECIDERS = {"choose_micro_rows"}  # (`halve`, the OOM back-off, is defined in resolve.py)


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def decisions(source: str) -> list[str]:
    """Calls in `source` that decide a micro-batch size (see the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        sets = {k.arg for k in node.keywords} & FIELDS
        if name in DECIDERS or (name in ("replace", "BatchSettings") and sets):
            found.append(f"{name}() line {node.lineno}")
    return found


def test_only_the_resolver_decides_the_micro_batch():
    outside = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in HOME | CONFIG_WRITERS | ESTIMATORS:
            continue
        found = decisions(path.read_text(encoding="utf-8"))
        if found:
            outside[rel] = found
    assert not outside, outside


def test_the_scan_finds_a_planted_decision():
    planted = (
        "import dataclasses\n"
        "def f(s):\n"
        "    return dataclasses.replace(s, tokens_per_micro_batch=64)\n"
        "def g(run):\n"
        "    return choose_micro_rows(run, max_rows=4)\n"
    )
    assert len(decisions(planted)) == 2
    assert decisions("def f(cfg):\n    return replace(cfg, lr=1.0)\n") == []
    # The resolver is where they are found today.
    assert decisions((ROOT / "batching" / "resolve.py").read_text(encoding="utf-8"))


def test_halve_keeps_whole_rows_and_stops_at_one():
    from pitstop.batching.resolve import halve

    s = BatchSettings("pack", 64, 512, tokens_per_micro_batch=4 * 64)
    half, rows = halve(s)
    assert half.tokens_per_micro_batch == 2 * 64 and rows == "2 rows"
    assert dataclasses.replace(half, tokens_per_micro_batch=s.tokens_per_micro_batch) == s
    one = BatchSettings("pack", 64, 512, micro_batch_size=1)
    assert halve(one) is None
    assert halve(BatchSettings("pack", 64, 512, micro_batch_size=3))[0].micro_batch_size == 1
    assert halve(BatchSettings("pack", 64, 512, tokens_per_micro_batch=64)) is None


def test_the_shape_comes_back_and_the_config_is_not_rewritten(
    tmp_path, tiny_tokenizer, tiny_model_dir
):
    from _train_util import make_store, train_config

    from pitstop.batching.resolve import BatchRequest, MicroSizer, resolve_batch_shape

    store_dir = make_store(tmp_path / "s", tiny_tokenizer)
    from pitstop.data.store import TokenStore

    store = TokenStore(store_dir)
    cfg = dataclasses.replace(
        train_config(tiny_model_dir, store_dir, tmp_path / "out"),
        micro_batch_size=None, tokens_per_micro_batch=None, grad_accum=None,
        tokens_per_step=8 * 64, batching="pack",
    )  # fmt: skip
    before = cfg.to_dict()

    def measure(mb):  # a device where every micro-batch of up to 2 rows fits
        rows = mb["input_ids"].shape[0]
        return (float(rows), 0.01 * rows) if rows <= 2 else (float("inf"), float("inf"))

    shape = resolve_batch_shape(
        BatchRequest(
            cfg, store, device_name="test-gpu", out=tmp_path / "out",
            cache_dir=str(tmp_path / "cache"),
            sizer=MicroSizer(measure, capacity_bytes=1e12, reserved_bytes=0.0),
        )
    )  # fmt: skip
    assert cfg.to_dict() == before  # the run's config is what the user gave
    assert shape.settings.strategy == "pack" and shape.settings.tokens_per_step == 8 * 64
    assert shape.settings.tokens_per_micro_batch is not None
    assert shape.choices["batching"].value == "pack" and "micro_batch" in shape.choices
    assert shape.measured is not None


@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_loader_for_takes_settings_not_a_config(tmp_path, tiny_tokenizer, strategy):
    import inspect

    from _train_util import make_store

    from pitstop.batching.loader import MicroBatchLoader

    params = inspect.signature(MicroBatchLoader).parameters
    assert "cfg" not in params and "settings" in params
    store_dir = make_store(tmp_path / "s", tiny_tokenizer)
    settings = BatchSettings(strategy, 64, 4 * 64, micro_batch_size=2)
    loader = MicroBatchLoader(store_dir, settings)
    assert loader.settings is settings and loader.steps_in_epoch(0) == loader.steps_per_epoch


def test_a_cpu_micro_batch_holds_about_2048_positions_in_whole_rows():
    from pitstop.batching.resolve import cpu_micro_rows

    assert cpu_micro_rows(8, 256) == 8  # 2,048 positions, not the default 2 rows
    assert cpu_micro_rows(16, 256) == 8
    assert cpu_micro_rows(6, 256) == 6  # the whole step: 1,536 positions
    assert cpu_micro_rows(12, 256) == 6  # a divisor, so every micro-batch is the same size
    assert cpu_micro_rows(8, 1024) is None  # the default already holds 2,048
    assert cpu_micro_rows(8, 512) == 4
    assert cpu_micro_rows(7, 256) == 7  # 1,792 positions, the whole step
    assert cpu_micro_rows(11, 256) is None  # 11 is prime: 11 rows are over the budget
    assert cpu_micro_rows(2, 64) is None  # nothing larger than the default in the step


@pytest.mark.parametrize(
    ("device_type", "micro", "rows"),
    [("cpu", None, 8), ("cpu", 2, None), ("cuda", None, None), ("unknown", None, None)],
)
def test_a_cpu_run_splits_short_rows_in_larger_micro_batches(
    tmp_path, tiny_tokenizer, tiny_model_dir, device_type, micro, rows
):
    """Without a sizer: a CPU run's default split grows to ~2,048 positions and the banner
    says why; a set micro-batch and other devices keep theirs. The step is the same."""
    from _train_util import make_store, train_config

    from pitstop.batching.resolve import BatchRequest, resolve_batch_shape
    from pitstop.data.store import TokenStore

    store_dir = make_store(tmp_path / "s", tiny_tokenizer)
    cfg = dataclasses.replace(
        train_config(tiny_model_dir, store_dir, tmp_path / "out"),
        micro_batch_size=micro, tokens_per_micro_batch=None, grad_accum=None,
        tokens_per_step=16 * 64, batching="pack",
    )  # fmt: skip
    shape = resolve_batch_shape(BatchRequest(cfg, TokenStore(store_dir), device_type=device_type))
    assert shape.settings.tokens_per_step == 16 * 64
    if rows is None:
        assert "micro_batch" not in shape.choices
        assert shape.settings.tokens_per_micro_batch in (None, 2 * 64)
    else:
        # rows of 64: 2,048 positions would be 32 rows; the step holds 16, all in one.
        assert shape.settings.tokens_per_micro_batch == 16 * 64
        assert shape.choices["micro_batch"].value == "16 rows"
        assert "short rows run small, slow kernels" in shape.choices["micro_batch"].reason


def test_a_micro_batch_in_rows_or_in_positions_reads_as_rows() -> None:
    rows = BatchSettings("pack", 256, 4096, micro_batch_size=8)
    positions = BatchSettings("bucket", 256, 4096, tokens_per_micro_batch=1024)
    assert (rows.micro_rows, positions.micro_rows) == (8, 4)


def test_a_recorded_micro_batch_value_reads_back_as_its_rows() -> None:
    """The "micro_batch" choice's value is written in one place and read by the tuner's
    baseline and `estimate --from-profile`: what is written reads back; nothing else does."""
    from pitstop.batching.resolve import halve
    from pitstop.batching.settings import rows_value, value_rows

    assert value_rows(rows_value(16)) == 16
    halved = halve(BatchSettings("pack", 256, 4096, tokens_per_micro_batch=2048))
    assert halved is not None and value_rows(halved[1]) == 4
    for other in ("default", "0 rows", "-2 rows", "8 rows of 256", "eight rows", None, 8, ""):
        assert value_rows(other) is None
