"""Exactly the prompt is masked; EOS ends every document and is a target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pitstop.core.config import RunConfig
from pitstop.core.errors import DataError
from pitstop.data.prepare import open_store
from pitstop.data.tokenize import ALPACA_NO_INPUT, ALPACA_WITH_INPUT


def cfg(model: Path, cache: Path, data: list, **kw) -> RunConfig:
    return RunConfig(
        data=[str(d) for d in data], model=str(model), cache_dir=str(cache), workers=1, **kw
    )


def one_doc(tmp_path, model, cache, record, **kw):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(record) + "\n")
    s = open_store(cfg(model, cache, [f], max_seq_len=4096, **kw), progress=False)
    assert len(s) == 1
    ids, mask = s.sequence(0)
    return ids.tolist(), mask.tolist()


def segments(tok, ids, mask) -> list[str]:
    """Decoded runs of consecutive target tokens."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def expect_prompt_masked(tok, ids, mask, prompt: str, answer: str) -> None:
    p = tok(prompt)["input_ids"]  # with BOS
    a = tok(answer, add_special_tokens=False)["input_ids"]
    assert ids == p + a + [tok.eos_token_id]  # the boundary falls between tokens here
    assert mask == [0] * len(p) + [1] * (len(a) + 1)


def test_text_all_targets_but_first_and_eos(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    ids, mask = one_doc(
        tmp_path, tiny_model_dir, cache_dir, {"text": "And God said, Let there be light."}
    )
    assert ids[-1] == tiny_tokenizer.eos_token_id and ids.count(tiny_tokenizer.eos_token_id) == 1
    assert mask == [0] + [1] * (len(ids) - 1)


def test_prompt_completion(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    rec = {"prompt": "Question: who made light?\n", "completion": "God made light."}
    ids, mask = one_doc(tmp_path, tiny_model_dir, cache_dir, rec)
    expect_prompt_masked(tiny_tokenizer, ids, mask, rec["prompt"], rec["completion"])


def test_train_on_prompt(tmp_path, tiny_model_dir, cache_dir):
    rec = {"prompt": "Question: who?\n", "completion": "God."}
    ids, mask = one_doc(tmp_path, tiny_model_dir, cache_dir, rec, train_on_prompt=True)
    assert mask == [0] + [1] * (len(ids) - 1)


@pytest.mark.parametrize("inp", ["", "the first day"])
def test_instruction_alpaca(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir, inp):
    rec = {"instruction": "Say what was made.", "input": inp, "output": "Light."}
    ids, mask = one_doc(tmp_path, tiny_model_dir, cache_dir, rec)
    t = ALPACA_WITH_INPUT if inp else ALPACA_NO_INPUT
    prompt = t.replace("{instruction}", rec["instruction"]).replace("{input}", inp)
    expect_prompt_masked(tiny_tokenizer, ids, mask, prompt, rec["output"])


def test_instruction_custom_template(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    rec = {"instruction": "Name it", "output": "Day."}
    ids, mask = one_doc(
        tmp_path, tiny_model_dir, cache_dir, rec, template="Q {instruction} {{x}} {input}\nA:\n"
    )
    expect_prompt_masked(tiny_tokenizer, ids, mask, "Q Name it {{x}} \nA:\n", "Day.")


def test_chat_only_assistant_turns_are_targets(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who made light?"},
        {"role": "assistant", "content": "God did."},
        {"role": "user", "content": "When?"},
        {"role": "assistant", "content": "On the first day."},
    ]
    ids, mask = one_doc(tmp_path, tiny_model_dir, cache_dir, {"messages": msgs})
    full = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + full.rstrip()
    assert segments(tiny_tokenizer, ids, mask) == ["God did.</s>", "On the first day.</s>"]
    assert ids[-1] == tiny_tokenizer.eos_token_id and mask[-1] == 1


def _tokenizer_with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = template
    cfg_path.write_text(json.dumps(tc))
    for extra in dst.glob("chat_template.*"):
        extra.unlink()
    return dst


def test_chat_template_with_bos_keeps_one_bos(tmp_path, tiny_model_dir, tiny_tokenizer, cache_dir):
    from pitstop.tiny import CHAT_TEMPLATE

    tokdir = _tokenizer_with_template(
        tiny_model_dir, tmp_path / "tok", "{{ bos_token }}" + CHAT_TEMPLATE
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    s = open_store(
        RunConfig(data=[str(f)], model=str(tokdir), cache_dir=str(cache_dir), workers=1),
        progress=False,
    )
    ids, mask = s.sequence(0)
    assert ids.tolist().count(tiny_tokenizer.bos_token_id) == 1
    assert segments(tiny_tokenizer, ids.tolist(), mask.tolist()) == ["hello</s>"]


def test_chat_template_that_does_not_extend_is_an_error(tmp_path, tiny_model_dir, cache_dir):
    tokdir = _tokenizer_with_template(
        tiny_model_dir, tmp_path / "tok", "{{ messages[-1]['content'] }}"
    )
    f = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(DataError, match=r"c\.jsonl:1: the chat template does not render message 1"):
        open_store(
            RunConfig(data=[str(f)], model=str(tokdir), cache_dir=str(cache_dir), workers=1),
            progress=False,
        )
