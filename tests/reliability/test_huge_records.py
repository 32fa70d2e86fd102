"""Issue 33 items 5 and 6: one huge record, a line that never ends, a record that takes long.

- A text longer than `tokenize.PIECE_CHARS` is tokenized in pieces, cut only where the
  cut is verified to keep the ids: the ids (and the loss mask) equal whole-text
  tokenization on real prose, for each kind of tokenizer pitstop meets (byte-level BPE as
  GPT-2, Llama 3's split regex, Llama 2's "▁"-prepending normalizer, SentencePiece-style
  Metaspace, WordPiece), and for one that merges across spaces either equal or refused.
- Memory: preparing one record grows the process by at most 16 bytes per byte of the
  record, what "1 GB for a 64 MB record" allows (before: ~125x). Measured at 2 MB with
  the pieces scaled down as much; `python -m bench.huge_record` gives the 64 MB figure.
- A JSONL line over `readers.MAX_RECORD_BYTES` is read to its end without being kept
  and reported as a bad record naming the line, its size, the limit and the fix (skipped
  and counted with --on-bad-record skip); with or without a newline at the end (the
  2 GiB line of the earlier trial, here with the limit patched down).
- A record still rendering after `tokenize.SLOW_RECORD_SECONDS` is named on stderr
  while prepare runs (a chat template cubic in the turns).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from _rel import env, no_traceback
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.core.config import RunConfig
from pitstop.core.corpus import sample_texts
from pitstop.data import readers
from pitstop.data import tokenize as T
from pitstop.data.prepare import prepare_data
from pitstop.data.readers import iter_chunks
from pitstop.data.records import BadRecord, Fields
from pitstop.data.store import TokenStore, is_store

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _prose() -> str:
    """Real text with the whitespace real data has: paragraphs, CRLF, tabs, runs of spaces,
    numbers, punctuation, CJK without spaces, and a literal special token."""
    chapters = sample_texts()[200:230]
    odd = "Tab\there,  two spaces,   three;\r\nCRLF line.\n\n\n12345 67 8.9 — ‘quoted’ </s> end"
    cjk = "日本語の文章です。次の文です！終わり。中文句子，没有空格。"
    return "\n\n".join(c + (" " + odd if i % 3 == 0 else "") + (cjk if i % 4 == 0 else "")
                       for i, c in enumerate(chapters))  # fmt: skip


def _bpe(kind: str):
    from tokenizers import (
        Regex,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    texts = sample_texts()[:150]
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        specials = ["[UNK]", "[CLS]", "[SEP]"]
        trainer = trainers.WordPieceTrainer(
            vocab_size=800, special_tokens=specials, show_progress=False
        )
        tok.train_from_iterator(texts, trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind == "gpt2")
    pre = {
        "gpt2": byte_level,
        "llama3": pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3), "isolated"), byte_level]
        ),
        "metaspace": pre_tokenizers.Metaspace(prepend_scheme="first"),
        "llama2": pre_tokenizers.Metaspace(prepend_scheme="first"),
        "no-split": None,  # BPE over whole texts: merges cross spaces
    }[kind]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=kind == "llama2"))
    tok.pre_tokenizer = pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind in ("gpt2", "llama3") else []
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<s>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=alphabet,
    )  # fmt: skip
    tok.train_from_iterator(texts if pre else [t[:2000] for t in texts[:40]], trainer=trainer)
    if kind == "llama2":
        # Llama 2 / Mistral's tokenizer.json: no pre-tokenizer, "▁" prepended to every input.
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _worker(tok) -> T.Worker:
    s = T.Settings(
        tokenizer="-", trust_remote_code=False, fields=Fields(), template="alpaca",
        max_seq_len=1024, long_docs="split", train_on_prompt=False, skip_bad=False,
        token_dtype="uint32",
    )  # fmt: skip
    return T.Worker(s, tok)


@pytest.fixture()
def small_pieces(monkeypatch) -> int:
    monkeypatch.setattr(T, "PIECE_CHARS", 2048)
    return 2048


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "llama2", "metaspace", "wordpiece"])
def test_pieces_give_the_ids_and_mask_of_the_whole_text(kind, small_pieces, monkeypatch):
    w = _worker(_bpe(kind))
    cuts = []
    real_cut = w._cut
    monkeypatch.setattr(w, "_cut", lambda text, a: cuts.append(real_cut(text, a)) or cuts[-1])
    text = _prose()
    whole = w.backend.encode(text)
    spans = [(300, 9000), (20_000, 20_050), (len(text) - 500, len(text))]
    ids, mask = w._encode_long(text, spans, "t")
    assert len(cuts) >= len(text) // small_pieces - 1 and all(cuts)  # it really was cut
    assert ids.tolist() == whole.ids
    assert mask.tolist() == T._target_mask(whole.offsets, spans, 0).tolist()
    plain, none = w._encode_long(text, None, "t")
    assert plain.tolist() == whole.ids and none is None
    if kind == "llama2":  # the space goes with the marker every input gets, not the piece
        assert w._drop_space


def test_a_tokenizer_that_merges_across_spaces_is_exact_or_refused(small_pieces):
    """BPE trained without pre-tokenization learns tokens spanning words, so some cuts
    change the ids: those are found by the check and never used."""
    w = _worker(_bpe("no-split"))
    text = _prose()[:60_000]
    whole = w.backend.encode(text).ids
    try:
        ids, _ = w._encode_long(text, None, "t")
    except BadRecord as e:
        assert "split it into several records" in e.reason
    else:
        assert ids.tolist() == whole


def test_text_without_any_cut_is_refused_not_tokenized_whole(small_pieces):
    w = _worker(_bpe("gpt2"))
    blob = "x" * (5 * small_pieces)  # one token run, no space or line break anywhere
    with pytest.raises(BadRecord, match=r"no place within 8,192 characters .* split it"):
        w._encode_long(blob, None, "t")
    ids, _ = w._encode_long(blob[: 3 * small_pieces], None, "t")  # short enough: whole
    assert ids.tolist() == w.backend.encode(blob[: 3 * small_pieces]).ids


def _cfg(tmp: Path, model: Path, data: Path, **kw) -> RunConfig:
    return RunConfig(
        data=[str(data)], model=str(model), cache_dir=str(tmp / "c"), workers=1,
        max_seq_len=128, **kw,
    )  # fmt: skip


def test_prepare_of_long_records_equals_whole_tokenization(
    tiny_model_dir, tiny_tokenizer, tmp_path, small_pieces
):
    """The store of long text, completion and chat records is the same, cut or not."""
    text = _prose()[:40_000]
    recs = [
        {"text": text},
        {"prompt": "Summarise:\n", "completion": text},
        {"messages": [{"role": "user", "content": "Recite."},
                      {"role": "assistant", "content": text}]},
    ]  # fmt: skip
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cut = TokenStore(
        prepare_data(_cfg(tmp_path / "a", tiny_model_dir, data), progress=False).store_path
    )
    T.PIECE_CHARS = 1 << 40  # (monkeypatched: restored after the test)
    whole = TokenStore(
        prepare_data(_cfg(tmp_path / "b", tiny_model_dir, data), progress=False).store_path
    )
    assert np.array_equal(np.asarray(cut.tokens), np.asarray(whole.tokens))
    assert np.array_equal(np.asarray(cut.mask), np.asarray(whole.mask))
    ids = tiny_tokenizer(text)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert np.asarray(cut.tokens)[: len(ids)].tolist() == ids


# --- memory -------------------------------------------------------------------------

# In a fresh process: warm up (imports, tokenizer, one small prepare), then reset the peak
# and prepare the one record. VmHWM after a reset covers only the record's work.
_MEASURE = """
import json, sys
from pitstop.cli import main
from pitstop.data import tokenize
from pitstop.measure.memory import peak_memory, reset_peak_memory
model, data, small, cache, piece = sys.argv[1:6]
tokenize.PIECE_CHARS = int(piece)
args = ["prepare", "--model", model, "--cache-dir", cache, "--workers", "1", "--json"]
assert main([*args, "--data", small]) == 0
rss = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
assert reset_peak_memory("cpu")
rc = main([*args, "--data", data])
print(json.dumps({"rc": rc, "base": rss, "peak": peak_memory("cpu")}))
"""


def _one_record(path: Path, mb: float) -> int:
    prose = " ".join(sample_texts())
    text = (prose * (1 + int(mb * 2**20) // len(prose)))[: int(mb * 2**20)]
    path.write_text(json.dumps({"text": text}) + "\n")
    return path.stat().st_size


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux VmHWM reset")
def test_one_big_record_grows_memory_by_at_most_16_bytes_per_byte(tiny_model_dir, tmp_path):
    """1 GB for a 64 MB record is 16 bytes per byte. Scaled: a 2 MB record, with pieces
    32x smaller than the 256K characters of a real run (a 64 MB record is 32x bigger)."""
    size = _one_record(tmp_path / "one.jsonl", 2)
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": sample_texts()[0]}) + "\n")
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tiny_model_dir), str(tmp_path / "one.jsonl"),
         str(tmp_path / "small.jsonl"), str(tmp_path / "c"), str(T.PIECE_CHARS // 32)],
        env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    no_traceback(r.stderr)
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["rc"] == 0, r.stderr[-2000:]
    growth = m["peak"] - m["base"]
    assert growth <= 16 * size, f"{growth / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB record"
    print(f"{growth / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB record")


# --- a line over the limit ------------------------------------------------------------

GOOD = b'{"text": "fine words"}\n'


def _prepare_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from pitstop.cli import main

    rc = main(["prepare", "--workers", "1", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


@pytest.mark.parametrize("ended", [True, False], ids=["newline", "to-end-of-file"])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_a_line_over_the_limit_is_named_with_its_size_and_the_fix(
    tiny_model_dir, tmp_path, capsys, monkeypatch, ended, gz
):
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 64 << 10)
    long = b'{"text": "' + b"word " * 60_000 + b'"}'  # 300,012 bytes
    raw = GOOD * 3 + long + (b"\n" + GOOD * 2 if ended else b"")
    f = tmp_path / ("big.jsonl.gz" if gz else "big.jsonl")
    f.write_bytes(gzip.compress(raw) if gz else raw)
    cache = tmp_path / "c"
    argv = ["--model", str(tiny_model_dir), "--cache-dir", str(cache), "--data", str(f)]
    rc, _, err = _prepare_cli(argv, capsys)
    assert rc == 1
    tail = "" if ended else ", running to the end of the file without a newline"
    assert (
        f"{f}:4: the record is {len(long):,} bytes (0.3 MiB){tail}, over the limit of "
        "65,536 bytes (0.1 MiB) for one record" in err
    ), err
    assert "split it into several records" in err and "--on-bad-record skip" in err
    assert not (cache / "stores").is_dir() or not any(map(is_store, (cache / "stores").iterdir()))
    rc, out, err = _prepare_cli([*argv, "--on-bad-record", "skip", "--json"], capsys)
    s = json.loads(out)
    assert rc == 0 and s["bad_records"] == 1 and s["documents"] == (5 if ended else 3)
    assert s["bad_examples"][0]["where"] == f"{f}:4"


def test_a_line_without_end_is_read_in_bounded_memory(tmp_path, monkeypatch):
    """The 2 GiB line without a newline, scaled: 32 MiB against a 1 MiB limit; the reader
    holds about the limit, never the line."""
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 1 << 20)
    f = tmp_path / "endless.jsonl"
    with open(f, "wb") as out:
        out.write(GOOD + b'{"text": "')
        for _ in range(32):
            out.write(b"x" * (1 << 20))
    tracemalloc.start()
    try:
        chunks = list(iter_chunks(f, "jsonl", None, Fields()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [c.kind for c in chunks] == ["block", "toolong"]
    assert chunks[1].items == [(2, (32 << 20) + 10, False)]
    assert peak < 5 << 20, peak


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=14),
    chunk=st.integers(1, 40),
    limit=st.integers(1, 60),
    final_newline=st.booleans(),
)
def test_any_mix_of_line_lengths_is_read_line_for_line(lengths, chunk, limit, final_newline):
    """Whatever the read size and the limit: every line up to the limit reaches the worker
    whole, with its number; every longer one is reported with its exact size."""
    import tempfile

    lines = [(b"x" * n) for n in lengths]
    raw = b"\n".join(lines) + (b"\n" if final_newline else b"")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "f.jsonl"
        f.write_bytes(raw)
        old = readers.MAX_RECORD_BYTES
        readers.MAX_RECORD_BYTES = limit
        try:
            got: list[tuple[int, str, int]] = []
            for c in readers._jsonl(f, None, Fields(), chunk):
                if c.kind == "toolong":
                    got += [(ln, "long", size) for ln, size, _ in c.items]
                else:
                    for start, block in c.items:
                        got += [(start + k, "line", len(x)) for k, x in enumerate(block.split(b"\n"))
                                if x.strip()]  # fmt: skip
        finally:
            readers.MAX_RECORD_BYTES = old
    want = []
    for i, n in enumerate(lengths, 1):
        if n > limit:
            want.append((i, "long", n))
        elif n:
            want.append((i, "line", n))
    # A line the parent did not have to gather (it fit one read) may reach the worker
    # over the limit; the worker then reports it (tokenize.Worker.records).
    got = [(i, "long", n) if kind == "line" and n > limit else (i, kind, n) for i, kind, n in got]
    assert got == want


# --- a record that takes long ---------------------------------------------------------

# Renders every message once per pair of messages: time grows with the cube of the turns.
_CUBIC = (
    "{% for m in messages %}{% for a in messages %}{% for b in messages %}{% endfor %}"
    "{% endfor %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_slow_record_is_named_while_it_runs(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = _CUBIC
    cfg_path.write_text(json.dumps(tc))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    # 300 turns render in ~0.8 s with plain jinja2 on the 2-core dev box (230 took 0.35 s,
    # under the old 0.5 s threshold on a quick moment: a flaky CI run): 3x the threshold.
    monkeypatch.setattr(T, "SLOW_RECORD_SECONDS", 0.25)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
             for i in range(300)]  # fmt: skip
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"text": "quick"}) + "\n" + json.dumps({"messages": turns}) + "\n")
    rc, _, err = _prepare_cli(
        ["--model", str(model), "--cache-dir", str(tmp_path / "c"), "--data", str(data)], capsys
    )
    assert rc == 0, err[-2000:]
    warned = [ln for ln in err.splitlines() if "has taken" in ln]
    assert len(warned) == 1, err[-2000:]  # once per record, on a line of its own
    assert warned[0].startswith(f"pitstop: warning: {data}:2: one record (a chat of 300 messages")
    assert "rendering it" in warned[0] and "cube of the turns" in warned[0]
    assert f"pitstop: {data}:2: done after" in err
