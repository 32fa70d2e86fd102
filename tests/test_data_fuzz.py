"""Fuzzing: any JSON value (or any bytes) in a JSONL line is a Record or a DataError, nothing else."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pitstop.core.errors import DataError
from pitstop.data.readers import Chunk
from pitstop.data.records import Fields, Record, parse_json_line

FIELDS = Fields()
KEYS = st.sampled_from(
    [
        "text",
        "prompt",
        "completion",
        "instruction",
        "input",
        "output",
        "messages",
        "role",
        "content",
        "other",
    ]
)
SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "wizard", ""])
MESSAGE = st.fixed_dictionaries({"role": ROLES | SCALARS, "content": SCALARS})
JSON = st.recursive(
    SCALARS | st.lists(MESSAGE, max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=20,
)


def _outcome(line: bytes):
    try:
        return parse_json_line(line, FIELDS)
    except DataError as e:
        assert str(e)
        return e


@given(JSON)
@settings(max_examples=400, deadline=None)
def test_any_json_value_is_record_or_data_error(value):
    out = _outcome(json.dumps(value).encode())
    if isinstance(out, Record):
        assert out.kind in ("text", "prompt_completion", "instruction", "chat")
        assert all(isinstance(v, (str, tuple)) for v in out.values)


@given(st.binary(max_size=60))
@settings(max_examples=300, deadline=None)
def test_any_bytes_are_record_or_data_error(raw):
    _outcome(raw)


@given(st.lists(JSON, min_size=1, max_size=6))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_worker_never_crashes(tiny_model_dir, values):
    from pitstop.data.tokenize import Settings, Worker

    w = _worker(tiny_model_dir, Settings, Worker)
    lines = [(i + 1, json.dumps(v).encode()) for i, v in enumerate(values)]
    res = w.process(Chunk("lines", "f.jsonl", lines))
    assert "crash" not in res
    assert res["n_bad"] + sum(res["kinds"].values()) == len(values)
    assert len(res["tokens"]) == len(res["mask"]) == res["seq_len"].sum()


_CACHE: dict = {}


def _worker(model, Settings, Worker):
    if "w" not in _CACHE:
        s = Settings(
            tokenizer=str(model),
            trust_remote_code=False,
            fields=FIELDS,
            template="alpaca",
            max_seq_len=32,
            long_docs="split",
            train_on_prompt=False,
            skip_bad=True,
            token_dtype="uint16",
        )
        _CACHE["w"] = Worker(s)
    return _CACHE["w"]
