"""Data as Hugging Face users have it: datasets directories, ShareGPT, TRL conversational
records, content parts and tool calls; and chat masking that does not render every prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data_masking import _tokenizer_with_template, segments

from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.data.prepare import open_store
from pitstop.data.records import Fields, parse_record
from pitstop.data.tokenize import Settings, Worker

CHAT = [
    {"role": "user", "content": "Who made light?"},
    {"role": "assistant", "content": "God did."},
    {"role": "user", "content": "When?"},
    {"role": "assistant", "content": "On the first day."},
]


def _store(model: Path, cache: Path, data: Path, **kw):
    return open_store(
        RunConfig(data=[str(data)], model=str(model), cache_dir=str(cache), workers=1, **kw),
        progress=False,
    )


def _doc(tok, store, i: int = 0) -> tuple[str, list[str]]:
    ids, mask = store.sequence(i)
    return tok.decode(ids.tolist()), segments(tok, ids.tolist(), mask.tolist())


def _jsonl(tmp_path: Path, *records: dict) -> Path:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    return f


def test_datasets_directory_and_arrow_file_read_like_jsonl(
    tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir
):
    datasets = pytest.importorskip("datasets")
    rows = [{"text": f"In the beginning {i}."} for i in range(50)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=2)  # two .arrow files, in order
    ref = _store(tiny_model_dir, cache_dir, _jsonl(tmp_path, *rows))
    got = _store(tiny_model_dir, cache_dir, tmp_path / "ds")
    assert len(got) == len(ref) == 50
    for i in range(50):
        assert got.sequence(i)[0].tolist() == ref.sequence(i)[0].tolist()
    one = sorted((tmp_path / "ds").glob("*.arrow"))[0]
    assert len(_store(tiny_model_dir, cache_dir, one)) == 25


def test_dataset_dict_reads_the_train_split_or_the_one_named(
    tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir, capsys
):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"text": "train text"}] * 3),
        test=datasets.Dataset.from_list([{"text": "test text"}] * 2),
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    train = _store(tiny_model_dir, cache_dir, tmp_path / "dd")
    assert len(train) == 3 and _doc(tiny_tokenizer, train)[0].startswith("<s>train text")
    test = _store(tiny_model_dir, cache_dir, tmp_path / "dd", split="test")
    assert len(test) == 2 and _doc(tiny_tokenizer, test)[0].startswith("<s>test text")

    no_train = datasets.DatasetDict(
        a=datasets.Dataset.from_list([{"text": "x"}]), b=datasets.Dataset.from_list([{"text": "y"}])
    )
    no_train.save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(
        DataError, match=r"without a 'train' split; its splits are a, b: pass --split"
    ):
        _store(tiny_model_dir, cache_dir, tmp_path / "ab")


def test_sharegpt_masks_like_messages(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    who = {"user": "human", "assistant": "gpt"}
    conv = [{"from": who[m["role"]], "value": m["content"]} for m in CHAT]
    a = _store(tiny_model_dir, cache_dir, _jsonl(tmp_path, {"conversations": conv}))
    (tmp_path / "b").mkdir()
    b = _store(tiny_model_dir, cache_dir, _jsonl(tmp_path / "b", {"messages": CHAT}))
    assert a.sequence(0)[0].tolist() == b.sequence(0)[0].tolist()
    assert a.sequence(0)[1].tolist() == b.sequence(0)[1].tolist()
    assert _doc(tiny_tokenizer, a)[1] == ["God did.</s>", "On the first day.</s>"]


def test_trl_conversational_prompt_completion_trains_only_the_completion(
    tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir
):
    rec = {"prompt": CHAT[:3], "completion": CHAT[3:]}
    s = _store(tiny_model_dir, cache_dir, _jsonl(tmp_path, rec))
    text, targets = _doc(tiny_tokenizer, s)
    assert "<|assistant|>\nGod did.</s>" in text  # the prompt's answer is context
    assert targets == ["On the first day.</s>"]


def test_content_parts_are_joined_and_images_refused(
    tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir
):
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in CHAT]
    s = _store(tiny_model_dir, cache_dir, _jsonl(tmp_path, {"messages": parts}))
    assert _doc(tiny_tokenizer, s)[1] == ["God did.</s>", "On the first day.</s>"]
    with pytest.raises(DataError, match="'image' content part; pitstop trains text-only"):
        parse_record({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, Fields())


TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_tool_calls_and_tools_reach_the_template_and_the_call_is_a_target(
    tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir
):
    tok = _tokenizer_with_template(tiny_model_dir, tmp_path / "tok", TOOL_TEMPLATE)
    call = {"type": "function", "function": {"name": "day", "arguments": {"n": 1}}}
    msgs = [
        {"role": "user", "content": "What was made on day 1?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "name": "day", "content": "light"},
        {"role": "assistant", "content": "Light."},
    ]
    tools = [{"type": "function", "function": {"name": "day"}}]
    s = _store(tok, cache_dir, _jsonl(tmp_path, {"messages": msgs, "tools": tools}))
    text, targets = _doc(tiny_tokenizer, s)
    assert text.startswith('<s><|tools|>\n[{"function": {"name": "day"}')
    assert targets == ['<call>day{"n": 1}</call></s>', "Light.</s>"]


TEMPLATES = {
    "tiny": None,
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_linear_chat_spans_equal_the_prefix_renders(tmp_path, tiny_model_dir, name):
    tok_dir = tiny_model_dir
    if TEMPLATES[name]:
        tok_dir = _tokenizer_with_template(tiny_model_dir, tmp_path / "tok", TEMPLATES[name])
    w = Worker(
        Settings(str(tok_dir), False, Fields(), "alpaca", 4096, "split", False, False, "uint16")
    )
    msgs = [{"role": "system", "content": "Be brief."}] + CHAT * 3
    msgs[4] = {"role": "assistant", "content": "  padded answer \n"}
    rec = parse_record({"messages": msgs}, Fields())
    messages = [{"role": m[0], "content": m[1]} for m in rec.values[0]]
    text = w._apply(messages, False)
    linear = w._chat_spans_linear(messages, rec.values[0], None, text)
    assert linear is not None  # the fast path applies to these templates
    assert (text, linear) == w._chat_spans_by_prefix(messages, rec.values[0], None)
    assert len(linear) == 6
