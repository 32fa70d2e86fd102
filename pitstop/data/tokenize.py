"""Turning chunks of raw records into token arrays: the work done in each worker process.

For every record: parse and validate (records.py), render to one string with the
character spans that are loss targets, tokenize the whole string once with the
fast tokenizer (so BPE boundaries are those of the real text), mark as targets the
tokens whose offset span overlaps a target character span, end the document with
EOS, and apply the long-document policy. A chunk comes back as flat numpy arrays
(tokens, mask, sequence lengths, ...) plus its bad records *as data*: exceptions
never cross the process boundary, so a message is never lost in pickling.

Masking rules (store semantics: mask[i] = 1 iff token i is a loss target):
- text: every token is a target except the document's first (nothing predicts it).
- prompt/completion and instruction: the completion/output tokens and EOS are
  targets, the prompt is context, unless --train-on-prompt. A token straddling the
  prompt/completion boundary is a target (it carries completion text).
- chat: each assistant message's content and what the template puts after it up to
  the next message (its end-of-turn token(s), not trailing whitespace) are targets; everything else is
  context. Prefixes of the conversation are rendered with the chat template and each
  rendering must extend the previous one, else the record is rejected with a reason.
- EOS is appended unless the rendered document already ends with it (templates that
  end a turn with the EOS token and a newline are cut after the EOS).
- split: chunks of max_seq_len; a chunk's first token cannot be a target (nothing in
  the chunk predicts it), the targets this costs are counted and reported.
- truncate keeps the first max_seq_len tokens (the EOS goes with the tail).

Memory per record is bounded: a text longer than PIECE_CHARS is tokenized in pieces
(`tokenizers` holds ~150 bytes per character of what it encodes at once: 8 GB for one
64 MB record), cut only where the cut is verified to give the same ids (`_cut`).
A record over MAX_RECORD_BYTES (readers.py) is a bad record with its size and the fix.
A record that takes SLOW_RECORD_SECONDS is named on stderr while it runs (`_Watch`), and
one whose rendering passes --max-record-seconds is skipped and counted (`time_limit.py`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np

from pitstop.core import log
from pitstop.core.errors import ConfigError
from pitstop.data import readers
from pitstop.data.readers import Chunk
from pitstop.data.records import BadRecord, Fields, Record, parse_json_line, parse_record
from pitstop.data.store import target_free_documents
from pitstop.data.time_limit import RecordTimeout, RenderLimit

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
MAX_BAD_EXAMPLES = 10
# Texts longer than this (characters) are tokenized in pieces of about this size: ~40 MB
# of `tokenizers` working memory per piece, whatever the record's size.
PIECE_CHARS = 1 << 18
# Characters each side of a cut that are tokenized both whole and cut, to verify the cut.
_CUT_CONTEXT = 256
# Where a text may be cut: a single space between two letters (the piece after starts with
# the space, or after it for tokenizers that put a space marker before every input: Llama 2's
# Prepend("▁") normalizer), a line break before a letter, or CJK sentence punctuation before
# a letter. Every cut is verified on its context before use (Worker._cut).
_CUT = re.compile(r"(?<=[^\W\d_])( )(?=[^\W\d_])|(?<=\n)(?=[^\W\d_])|(?<=[。！？；])(?=[^\W\d_])")
# A record still being rendered or tokenized after this long is named on stderr.
SLOW_RECORD_SECONDS = 60.0


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs; picklable, so it travels to spawned processes too."""

    tokenizer: str
    trust_remote_code: bool
    fields: Fields
    template: str
    max_seq_len: int
    long_docs: str
    train_on_prompt: bool
    skip_bad: bool
    token_dtype: str
    max_record_seconds: float = 0.0  # rendering one record longer: skipped (0: no limit)


class ChunkResult(TypedDict, total=False):
    """What a worker returns for one chunk (`process_chunk`): the arrays to append, its
    counts, and the records it skipped with where and why; or `fatal` with the first bad
    record (when bad records are not skipped); or `crash`, a worker's traceback."""

    tokens: np.ndarray
    mask: np.ndarray
    seq_len: np.ndarray  # tokens per sequence
    seq_doc: np.ndarray  # each sequence's document, within the chunk
    doc_len: np.ndarray  # tokens per document
    targets: int
    long: int
    extra_chunks: int
    targets_lost: int
    tokens_removed: int
    targets_removed: int
    bad: list[tuple[str, str]]  # (where, reason), the first MAX_BAD_EXAMPLES
    n_bad: int
    slow: list[tuple[str, str]]  # (where, what): rendering passed --max-record-seconds
    n_slow: int
    n_records: int
    kinds: dict[str, int]
    docs_held: int
    eos_only: dict[str, int]
    fatal: bool
    crash: str


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The fast Hugging Face tokenizer in local directory `path` (no downloads)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"tokenizer directory {p} does not exist; give --model DIR or --tokenizer DIR "
            "(a local Hugging Face directory)"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            str(p), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as e:  # transformers raises many types here; all mean "not loadable"
        hint = "" if trust_remote_code else " (if it needs custom code, pass --trust-remote-code)"
        raise ConfigError(f"cannot load a tokenizer from {p}: {e}{hint}") from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"the tokenizer in {p} is not a fast (Rust) tokenizer; pitstop needs its offset "
            "mapping to mask prompts: add a tokenizer.json to the directory"
        )
    if tok.eos_token_id is None:
        raise ConfigError(
            f"the tokenizer in {p} has no EOS token; set eos_token in its tokenizer_config.json"
        )
    return tok


def instruction_prompt(template: str, instruction: str, inp: str) -> str:
    if template == "alpaca":
        t = ALPACA_WITH_INPUT if inp else ALPACA_NO_INPUT
    else:
        t = template
    # str.replace, not str.format: user templates may contain other braces.
    return t.replace("{instruction}", instruction).replace("{input}", inp)


class Worker:
    """Renders and tokenizes chunks; one per process, holding the loaded tokenizer."""

    def __init__(self, s: Settings, tok: Any = None) -> None:
        self.s = s
        self.tok = tok if tok is not None else load_tokenizer(s.tokenizer, s.trust_remote_code)
        self.backend = self.tok.backend_tokenizer
        # A tokenizer.json may carry truncation or padding settings (transformers keeps
        # them on the backend, and applies its own only through its own calls): here they
        # would cut every document to max_length tokens, or pad it, without a word.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.eos = int(self.tok.eos_token_id)
        self.eos_text = self.tok.eos_token
        bos = self.tok.bos_token_id
        probe = self.backend.encode("a").ids
        self.adds_bos = bos is not None and bool(probe) and probe[0] == bos
        self.bos_text = self.tok.bos_token
        self.dtype = np.dtype(s.token_dtype)

    # --- records -------------------------------------------------------------
    def records(self, chunk: Chunk) -> list[tuple[str, Record | BadRecord]]:
        path, fields, out = chunk.path, self.s.fields, []
        limit = readers.MAX_RECORD_BYTES
        if chunk.kind == "block":
            for start, block in chunk.items:
                lines = block.split(b"\n")
                for k, line in enumerate(lines):
                    if len(line) > limit:  # only when a block holds more than the limit
                        # A block ends without a newline only at the end of the file.
                        ended = k < len(lines) - 1
                        out.append((f"{path}:{start + k}", too_long(len(line), ended=ended)))
                    elif line.strip():
                        out.append((f"{path}:{start + k}", _try(parse_json_line, line, fields)))
        elif chunk.kind == "toolong":
            for ln, size, ended in chunk.items:
                out.append((f"{path}:{ln}", too_long(size, ended=ended)))
        elif chunk.kind == "lines":
            for ln, raw in chunk.items:
                out.append((f"{path}:{ln}", _try(parse_json_line, raw, fields)))
        elif chunk.kind == "rows":
            for loc, obj in chunk.items:
                where = f"{path}:{loc}" if loc.isdigit() else f"{path}: {loc}"
                if isinstance(obj, dict) and "__csv_columns__" in obj:
                    got, want = obj["__csv_columns__"]
                    out.append(
                        (
                            where,
                            BadRecord(
                                f"the row has {got} fields but the header has {want}; quote fields "
                                "that contain commas or newlines"
                            ),
                        )
                    )
                else:
                    out.append((where, _try(parse_record, obj, fields)))
        elif chunk.kind == "arrow":
            for start, batch in chunk.items:
                for k, obj in enumerate(batch.to_pylist()):
                    out.append((f"{path}: row {start + k}", _try(parse_record, obj, fields)))
        else:  # text
            for loc, raw in chunk.items:
                where = path if loc is None else f"{path}:{loc}"
                out.append((where, _try(_text_record, raw)))
        return out

    # --- rendering -----------------------------------------------------------
    def render(self, rec: Record) -> tuple[str, list[tuple[int, int]] | None]:
        """The document text and its target character spans (None: all targets)."""
        kind, v = rec
        full = self.s.train_on_prompt
        if kind == "text":
            return v[0], None
        if kind == "prompt_completion":
            text = v[0] + v[1]
            return text, None if full else [(len(v[0]), len(text))]
        if kind == "instruction":
            prompt = instruction_prompt(self.s.template, v[0], v[1])
            text = prompt + v[2]
            return text, None if full else [(len(prompt), len(text))]
        return self._render_chat(v, full)

    def _apply(self, msgs: list[dict[str, Any]], gen: bool, tools: list | None = None) -> str:
        if not self.tok.chat_template:
            raise BadRecord(
                f"chat records need a chat template, and the tokenizer in {self.s.tokenizer} has "
                "none; add one (chat_template in tokenizer_config.json) or use prompt/completion records"
            )
        try:
            out = self.tok.apply_chat_template(
                msgs, tools=tools, tokenize=False, add_generation_prompt=gen
            )
        except Exception as e:  # jinja raises TemplateError or whatever the template raises
            raise BadRecord(f"the chat template rejected the conversation: {e}") from None
        if not isinstance(out, str):
            raise BadRecord("the chat template did not render a string")
        return out

    def _render_chat(self, value: tuple, full: bool) -> tuple[str, list[tuple[int, int]] | None]:
        msgs, tools_json = value
        tools = json.loads(tools_json) if tools_json else None
        messages = []
        for role, content, _target, extra in msgs:
            m: dict[str, Any] = {"role": role, "content": content}
            if extra:
                m.update(json.loads(extra))
            messages.append(m)
        spans: list[tuple[int, int]] | None
        text = self._apply(messages, False, tools)
        if full:
            spans = None
        else:
            spans = self._chat_spans_linear(messages, msgs, tools, text)
            if spans is None:
                text, spans = self._chat_spans_by_prefix(messages, msgs, tools)
        return self._trim_chat(text, spans)

    def _chat_spans_linear(
        self, messages: list[dict[str, Any]], msgs: tuple, tools: list | None, text: str
    ) -> list[tuple[int, int]] | None:
        """Target spans from three renders whatever the number of turns; None: cannot tell.

        Each message's content is replaced by a unique marker and the conversation rendered
        once: the markers give every content's position in `text` (the rebuilt text must
        equal `text`, else the template looks at the content). What a template writes after
        an assistant message (its end of turn) is taken from a render that ends at the first
        trained assistant message, and must follow every trained assistant message.
        Rendering every prefix instead (the fallback) costs time quadratic in the turns.
        """
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        if any("\ue000" in m["content"] or "\ue001" in m["content"] for m in messages):
            return None
        marked = [dict(m, content=k) for m, k in zip(messages, marks)]
        mtext = self._apply(marked, False, tools)
        # Templates that trim contents (Llama 3's) show them stripped.
        for contents in (
            [m["content"] for m in messages],
            [m["content"].strip() for m in messages],
        ):
            starts = self._place(mtext, marks, contents, text)
            if starts is not None:
                break
        else:
            return None
        trained = [i for i, m in enumerate(msgs) if m[0] == "assistant" and m[2]]
        if not trained:
            return []
        first = trained[0]
        head = self._apply(marked[: first + 1], False, tools)
        if marks[first] not in head:
            return None
        closing = head[head.rindex(marks[first]) + len(marks[first]) :].rstrip()
        spans = []
        for i in trained:
            content = contents[i]
            end = starts[i] + len(content)
            if not text.startswith(closing, end):
                return None
            body = content.strip()
            start = starts[i] + (len(content) - len(content.lstrip()) if body else 0)
            stop = len(text[: end + len(closing)].rstrip())
            spans.append((start, max(start, stop)))
        return spans

    @staticmethod
    def _place(mtext: str, marks: list[str], contents: list[str], text: str) -> list[int] | None:
        """Where each content starts in `text`, if putting them in for the markers gives it."""
        starts, rebuilt, at, shift = [], [], 0, 0
        for k, content in zip(marks, contents):
            pos = mtext.find(k, at)
            if pos < 0:
                return None
            rebuilt += [mtext[at:pos], content]
            starts.append(pos + shift)
            shift += len(content) - len(k)
            at = pos + len(k)
        rebuilt.append(mtext[at:])
        return starts if "".join(rebuilt) == text else None

    def _chat_spans_by_prefix(
        self, messages: list[dict[str, Any]], msgs: tuple, tools: list | None
    ) -> tuple[str, list[tuple[int, int]]]:
        """Target spans by rendering every prefix of the conversation (quadratic in turns)."""
        prev, spans = "", []
        for i, (role, content, target, _extra) in enumerate(msgs):
            cur = self._apply(messages[: i + 1], False, tools)
            if not cur.startswith(prev):
                raise BadRecord(
                    f"the chat template does not render message {i} as a continuation of the "
                    "messages before it, so prompt tokens cannot be masked by position; "
                    "use --train-on-prompt or prompt/completion records"
                )
            if role == "assistant" and target:
                start = len(prev)
                try:
                    head = self._apply(messages[:i], True, tools) if i else prev
                except BadRecord:
                    head = prev
                if head.startswith(prev) and cur.startswith(head):
                    start = len(head)  # skip the assistant header the template adds
                body = content.strip()
                k = cur.find(body, start) if body else -1
                if k >= 0:
                    start = k
                # Up to the end of the turn, without the template's trailing newline(s).
                spans.append((start, max(start, len(cur.rstrip()))))
            prev = cur
        return prev, spans

    def _trim_chat(
        self, text: str, spans: list[tuple[int, int]] | None
    ) -> tuple[str, list[tuple[int, int]] | None]:
        stripped = text.rstrip()
        if self.eos_text and stripped.endswith(self.eos_text) and len(stripped) < len(text):
            text = stripped  # "...</s>\n": end the document at the EOS token
            if spans is not None:
                spans = [(a, min(b, len(text))) for a, b in spans if a < len(text)]
        if self.adds_bos and self.bos_text and text.startswith(self.bos_text):
            # The template writes BOS and the tokenizer adds one too: keep one.
            n = len(self.bos_text)
            text = text[n:]
            if spans is not None:
                spans = [(max(0, a - n), b - n) for a, b in spans]
        return text, spans

    # --- one chunk -------------------------------------------------------------
    def process(self, chunk: Chunk) -> ChunkResult:
        bad: list[tuple[str, str]] = []
        slow: list[tuple[str, str]] = []  # rendering passed --max-record-seconds: skipped
        n_bad = n_slow = 0
        texts: list[str] = []
        spans: list[list[tuple[int, int]] | None] = []
        kinds: dict[str, int] = {}
        doc_kinds: list[str] = []
        locs: list[str] = []
        recs = self.records(chunk)
        limit_s = self.s.max_record_seconds
        with RenderLimit(limit_s) as limit:
            for loc, rec in recs:
                try:
                    if isinstance(rec, BadRecord):
                        raise rec
                    with _WATCH.record(loc, rec, "rendering it", limit_s), limit.record():
                        text, sp = self.render(rec)
                    if (
                        len(text) > readers.MAX_RECORD_BYTES
                    ):  # from a format read whole: Parquet, CSV...
                        raise too_long(len(text), unit="characters")
                except RecordTimeout:
                    n_slow += 1
                    if len(slow) < MAX_BAD_EXAMPLES:
                        slow.append((loc, _WATCH.describe(rec)))
                    continue
                except BadRecord as e:
                    n_bad += 1
                    if len(bad) < MAX_BAD_EXAMPLES:
                        bad.append((loc, e.reason))
                    if not self.s.skip_bad:
                        return {"fatal": True, "bad": bad, "n_records": len(recs)}
                    continue
                kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
                doc_kinds.append(rec.kind)
                texts.append(text)
                spans.append(sp)
                locs.append(loc)
        out = cast(ChunkResult, self.tokenize(texts, spans, locs))
        out.update(bad=bad, n_bad=n_bad, slow=slow, n_slow=n_slow, n_records=len(recs))
        out.update(kinds=kinds)
        offsets = np.r_[0, np.cumsum(out["seq_len"])]
        held, free = target_free_documents(out["mask"], offsets, out["seq_doc"])
        eos_only: dict[str, int] = {}
        for d in held[free]:  # documents that teach only where to stop: few, or a mistake
            eos_only[doc_kinds[d]] = eos_only.get(doc_kinds[d], 0) + 1
        out.update(docs_held=len(held), eos_only=eos_only)
        return out

    def tokenize(
        self,
        texts: list[str],
        spans: list[list[tuple[int, int]] | None],
        locs: list[str] | None = None,
    ) -> dict[str, Any]:
        n = len(texts)
        ids: list[Any] = [[] for _ in range(n)]  # a list of ids, or an array for a long text
        masks: dict[int, np.ndarray] = {}
        long = [i for i in range(n) if len(texts[i]) > PIECE_CHARS]
        short = [i for i in range(n) if len(texts[i]) <= PIECE_CHARS]
        plain = [i for i in short if spans[i] is None]
        masked = [i for i in short if spans[i] is not None]
        with _WATCH.chunk(locs, "tokenizing"):
            if plain:
                # No offsets needed: the fast path skips computing them.
                for i, e in zip(plain, self.backend.encode_batch_fast([texts[i] for i in plain])):
                    ids[i] = e.ids
            if masked:
                for i, e in zip(masked, self.backend.encode_batch([texts[i] for i in masked])):
                    ids[i] = e.ids
                    masks[i] = _target_mask(e.offsets, spans[i], 0)  # type: ignore[arg-type]
        for i in long:
            where = locs[i] if locs else f"text {i}"
            with _WATCH.one(where, f"{len(texts[i]):,} characters", "tokenizing it"):
                ids[i], m = self._encode_long(texts[i], spans[i], where)
            if m is not None:
                masks[i] = m
        eos = self.eos
        for i, seq in enumerate(ids):
            if isinstance(seq, np.ndarray):
                if not len(seq) or seq[-1] != eos:
                    ids[i] = np.append(seq, np.asarray(eos, dtype=self.dtype))
            elif not seq or seq[-1] != eos:
                seq.append(eos)
        lengths = np.fromiter((len(s) for s in ids), dtype=np.int64, count=n)
        total = int(lengths.sum())
        starts = np.zeros(n, dtype=np.int64)
        if n:
            starts[1:] = np.cumsum(lengths)[:-1]
        tokens = np.empty(total, dtype=self.dtype)
        i = 0
        while i < n:  # runs of short documents in one pass; a long one's array copied as is
            if isinstance(ids[i], np.ndarray):
                tokens[starts[i] : starts[i] + lengths[i]] = ids[i]
                ids[i] = None  # its memory goes now, not at the end of the chunk
                i += 1
                continue
            j = i
            while j < n and not isinstance(ids[j], np.ndarray):
                j += 1
            a, b = starts[i], starts[j - 1] + lengths[j - 1]
            tokens[a:b] = np.fromiter(chain.from_iterable(ids[i:j]), dtype=self.dtype, count=b - a)
            i = j
        del ids
        mask = np.ones(total, dtype=np.uint8)
        for i, m in masks.items():
            mask[starts[i] : starts[i] + len(m)] = m
        mask[starts] = 0  # a document's first token has nothing before it to predict it
        return self.apply_long_docs(tokens, mask, lengths, starts)

    # --- long texts, in pieces ---------------------------------------------------
    def _bare(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def _special_ids(self) -> tuple[list[int], list[int]] | None:
        """The ids the tokenizer adds before and after any text (BOS...); None: not a frame."""
        if not hasattr(self, "_specials"):
            probe = "Pitstop checks which special tokens frame a text."
            full, bare = self.backend.encode(probe).ids, self._bare(probe)
            self._specials: tuple[list[int], list[int]] | None = None
            for k in range(len(full) - len(bare) + 1):
                if full[k : k + len(bare)] == bare:
                    self._specials = (full[:k], full[k + len(bare) :])
                    break
        return self._specials

    def _cut_ok(self, text: str, c: int, nxt: int) -> bool:
        """Whether cutting `text` at `c` (the next piece starting at `nxt`) keeps the ids.

        The text around the cut is tokenized whole and as the two pieces: equal ids there
        mean the cut falls on a boundary the tokenizer itself keeps (a pre-token boundary
        that no merge crosses), since nothing further away reaches across it.
        """
        lo, hi = max(0, c - _CUT_CONTEXT), min(len(text), nxt + _CUT_CONTEXT)
        return self._bare(text[lo:hi]) == self._bare(text[lo:c]) + self._bare(text[nxt:hi])

    def _cut(self, text: str, a: int) -> tuple[int, int] | None:
        """(end of the piece that starts at `a`, start of the next): a verified cut, or None.

        Candidates are tried from PIECE_CHARS back to half of it, then forward to four times
        it; a space is tried as the start of the next piece, then as dropped (tokenizers
        that mark every input's start with a space). The mode that worked is tried first.
        """
        for lo, hi, backward in (
            (a + PIECE_CHARS // 2, a + PIECE_CHARS, True),
            (a + PIECE_CHARS, a + 4 * PIECE_CHARS, False),
        ):
            found = list(_CUT.finditer(text, lo, min(hi, len(text) - 1)))
            # 16 candidates at most: a cut that fails is rare (a tokenizer that merges
            # across spaces), and one that fails 16 times will not pass later either.
            for m in islice(reversed(found) if backward else found, 16):
                c = m.start()
                modes = [0, 1] if m.group(1) else [0]
                if m.group(1) and getattr(self, "_drop_space", False):
                    modes = [1, 0]
                for skip in modes:
                    if self._cut_ok(text, c, c + skip):
                        self._drop_space = bool(skip)
                        return c, c + skip
        return None

    def _encode_long(
        self, text: str, spans: list[tuple[int, int]] | None, where: str
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Ids (and the target mask) of a long text, tokenized piece by piece.

        Memory: the pieces' ids and masks (3 bytes per token at most) plus one piece's
        working set, instead of the whole text's.
        """
        frame = self._special_ids()
        parts: list[np.ndarray] = []
        mparts: list[np.ndarray] = []
        a, n = 0, len(text)
        if frame is not None:
            parts.append(np.asarray(frame[0], dtype=self.dtype))
            mparts.append(np.zeros(len(frame[0]), dtype=bool))
        while a < n:
            cut = self._cut(text, a) if frame is not None and n - a > PIECE_CHARS else None
            if cut is None and frame is not None and n - a > 4 * PIECE_CHARS:
                raise BadRecord(
                    f"the text ({n:,} characters) has no place within {4 * PIECE_CHARS:,} "
                    f"characters after character {a:,} where this tokenizer can cut it into "
                    "pieces with the same tokens (a space between two words or a line break), "
                    "and tokenizing it whole would take gigabytes; split it into several records"
                )
            if frame is None:  # the tokenizer adds something other than a prefix and suffix
                if n > 4 * PIECE_CHARS:
                    raise BadRecord(
                        f"the text is {n:,} characters, and this tokenizer's special tokens "
                        "do not let pitstop tokenize it in pieces; a record over "
                        f"{4 * PIECE_CHARS:,} characters would take gigabytes to tokenize "
                        "whole: split it into several records"
                    )
                b = nxt = n
            else:
                b, nxt = cut if cut is not None else (n, n)
            piece = text[a:b]
            add = frame is None
            if spans is None:
                e = self.backend.encode_batch_fast([piece], add_special_tokens=add)[0]
            else:
                e = self.backend.encode(piece, add_special_tokens=add)
                mparts.append(_target_mask(e.offsets, spans, a))
            parts.append(np.asarray(e.ids, dtype=self.dtype))
            del e, piece
            a = nxt
        if frame is not None:
            parts.append(np.asarray(frame[1], dtype=self.dtype))
            mparts.append(np.zeros(len(frame[1]), dtype=bool))
        ids = np.concatenate(parts)
        return ids, (np.concatenate(mparts) if spans is not None else None)

    def apply_long_docs(
        self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray, starts: np.ndarray
    ) -> dict[str, Any]:
        L, n = self.s.max_seq_len, len(lengths)
        long = lengths > L
        info = {
            "long": int(long.sum()),
            "extra_chunks": 0,
            "targets_lost": 0,
            "tokens_removed": 0,
            "targets_removed": 0,
        }
        docs = np.arange(n, dtype=np.int64)
        if self.s.long_docs == "split" or not long.any():
            nseq = np.maximum(1, -(-lengths // L))
            seq_doc = np.repeat(docs, nseq)
            first = np.repeat(np.cumsum(nseq) - nseq, nseq)
            k = np.arange(len(seq_doc), dtype=np.int64) - first
            seq_len = np.minimum(L, lengths[seq_doc] - k * L)
            cut = starts[seq_doc[k > 0]] + k[k > 0] * L
            info["extra_chunks"] = len(cut)
            info["targets_lost"] = int(mask[cut].sum())
            mask[cut] = 0
        elif self.s.long_docs == "truncate":
            # One byte per token: a position array (np.repeat of the starts) was 16 bytes.
            keep = np.ones(len(tokens), dtype=bool)
            for i in np.flatnonzero(long):
                keep[starts[i] + L : starts[i] + lengths[i]] = False
            info["tokens_removed"] = int((~keep).sum())
            info["targets_removed"] = int(mask[~keep].sum())
            tokens, mask = tokens[keep], mask[keep]
            seq_len, seq_doc = np.minimum(lengths, L), docs
        else:  # drop
            keep = np.ones(len(tokens), dtype=bool)
            for i in np.flatnonzero(long):
                keep[starts[i] : starts[i] + lengths[i]] = False
            info["tokens_removed"] = int(lengths[long].sum())
            info["targets_removed"] = int(mask[~keep].sum())
            tokens, mask = tokens[keep], mask[keep]
            seq_len, seq_doc = lengths[~long], docs[~long]
        return {
            "tokens": tokens,
            "mask": mask,
            "seq_len": seq_len.astype(np.int64),
            "seq_doc": seq_doc,
            "doc_len": lengths,
            "targets": int(mask.sum()),
            **info,
        }


def _target_mask(offsets: Any, spans: list[tuple[int, int]], shift: int) -> np.ndarray:
    """Which tokens overlap a target character span; `shift`: where the text's offsets start."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if shift:
        off += shift
    m = np.zeros(len(off), dtype=bool)
    if not len(off):
        return m
    lo, hi = off[:, 0].min(), off[:, 1].max()  # special tokens have (0, 0) anywhere
    for a, b in spans:
        if a < hi and b > lo:  # spans away from this piece cost nothing
            m |= (off[:, 0] < b) & (off[:, 1] > a)
    return m


def _size(n: int, unit: str) -> str:
    if unit == "bytes":
        return f"{n:,} bytes ({n / 2**20:,.1f} MiB)"
    return f"{n:,} {unit}"


def too_long(size: int, *, ended: bool = True, unit: str = "bytes") -> BadRecord:
    """The bad record for a record over MAX_RECORD_BYTES: its size, the limit and the fix."""
    limit = readers.MAX_RECORD_BYTES
    tail = "" if ended else ", running to the end of the file without a newline"
    return BadRecord(
        f"the record is {_size(size, unit)}{tail}, over the limit of {_size(limit, unit)} for "
        "one record (tokenizing it would take gigabytes of memory); split it into several "
        "records (a document longer than --max-seq-len is cut into rows anyway), or, if it "
        "should be many records, check that the export kept its line breaks"
    )


def _try(fn: Any, *args: Any) -> Record | BadRecord:
    try:
        return fn(*args)
    except BadRecord as e:
        return e


def _text_record(raw: bytes) -> Record:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise BadRecord(
            f"invalid UTF-8 at line {line} of the text; re-encode it as UTF-8"
        ) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise BadRecord(f"NUL byte at line {line}: this looks like a binary file, not text")
    if not text.strip():
        raise BadRecord("the text is empty")
    return Record("text", (text,))


# --- naming a slow record ---------------------------------------------------------
class _Watch:
    """Names on stderr the record a worker has spent SLOW_RECORD_SECONDS on, while it runs.

    A chat template whose rendering grows with the cube of the turns can take minutes on
    one long conversation, while the progress bar (which counts finished chunks) shows
    nothing; the record's file, line and size say what to look at. A daemon thread of the
    process checks four times a second; it is started when a record starts and ends after a few
    idle seconds, so a process that forks tokenizer workers later holds no extra thread.
    """

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):  # a lock held at fork would stay held in the child
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._now: list[Any] | None = None  # [where, what, stage, start, warned, limit_s]
        self._running = False

    def _begin(self, state: list[Any]) -> None:
        with self._lock:  # one lock for both, so the thread cannot end between them
            self._now = state
            start, self._running = not self._running, True
        if start:
            threading.Thread(target=self._loop, name="pitstop-slow-record", daemon=True).start()

    def _loop(self) -> None:
        idle = 0.0
        while True:
            step = min(0.25, SLOW_RECORD_SECONDS / 4)  # a few wake-ups a second, while busy
            time.sleep(step)
            with self._lock:
                now = self._now
                idle = idle + step if now is None else 0.0
                if idle >= 5:
                    self._running = False
                    return
                if now is None or now[4] or time.monotonic() - now[3] < _warn_after(now[5]):
                    continue
                now[4] = True
            where, what, stage, start, _, limit_s = now
            what = self.describe(what)
            hint = ""
            if limit_s:
                hint += f" It is skipped if still {stage} at {limit_s:g} s (--max-record-seconds)."
            if stage == "rendering it" and what.startswith("a chat"):
                hint += (
                    " A chat template that loops over the messages inside a loop over the "
                    "messages takes time growing with the cube of the turns: simplify the "
                    "template, or split or drop very long conversations."
                )
            _say(
                f"pitstop: warning: {where}: one record ({what}) has taken "
                f"{time.monotonic() - start:.0f} s so far, {stage}; prepare is still working "
                f"on it, not stuck.{hint}"
            )

    class _Span:
        def __init__(self, watch: _Watch, state: list[Any] | None) -> None:
            self.watch, self.state = watch, state

        def __enter__(self) -> None:
            if self.state is None:
                return
            self.state[3] = time.monotonic()
            self.watch._begin(self.state)

        def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
            if self.state is None:
                return
            with self.watch._lock:
                self.watch._now = None
            if self.state[4]:
                seconds = time.monotonic() - self.state[3]
                if exc_type is RecordTimeout:
                    _say(f"pitstop: {self.state[0]}: skipped after {seconds:.0f} s")
                else:
                    _say(f"pitstop: {self.state[0]}: done after {seconds:.0f} s")

    def one(self, where: str, what: str, stage: str) -> _Watch._Span:
        return self._Span(self, [where, what, stage, 0.0, False, 0.0])

    def record(self, where: str, rec: Record, stage: str, limit_s: float = 0.0) -> _Watch._Span:
        # The record itself: described only if it turns out slow (cheap per record).
        return self._Span(self, [where, rec, stage, 0.0, False, limit_s])

    @staticmethod
    def describe(what: Any) -> str:
        if isinstance(what, str):
            return what
        if what.kind == "chat":
            msgs = what.values[0]
            size = sum(len(m[1]) for m in msgs)
            return f"a chat of {len(msgs):,} messages, {size:,} characters of content"
        return f"a {what.kind} record of {sum(map(len, what.values)):,} characters"

    def chunk(self, locs: list[str] | None, stage: str) -> _Watch._Span:
        if not locs:
            return self._Span(self, None)
        where = locs[0] if len(locs) == 1 else f"{locs[0]} to {locs[-1].rsplit(':', 1)[-1]}"
        return self.one(where, f"one of {len(locs):,} records tokenized together", stage)


def _warn_after(limit_s: float) -> float:
    """When a record is named: SLOW_RECORD_SECONDS, or half its limit if that comes first
    (so it is named before it is skipped)."""
    return min(SLOW_RECORD_SECONDS, limit_s / 2) if limit_s > 0 else SLOW_RECORD_SECONDS


_WATCH = _Watch()


def _say(message: str) -> None:
    """A warning on its own line, not glued to the progress bar's (in a worker process,
    the bar copied at fork is only cleared: the parent redraws its own)."""
    from tqdm import tqdm

    with tqdm.external_write_mode(file=sys.stderr):
        log.warning(message)


# --- process-pool plumbing ------------------------------------------------------
_WORKER: Worker | None = None


def init_worker(settings: Settings) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _exit_with_parent(os.getppid())
    global _WORKER
    if _WORKER is None or _WORKER.s != settings:
        _WORKER = Worker(settings)


PARENT_POLL_SECONDS = 0.5


def _exit_with_parent(parent: int) -> None:
    """End this worker when the process that started it is gone. A SIGKILLed prepare runs
    no cleanup, and its workers would wait on the executor's queue forever (an interrupted
    command must leave no process behind). A parent-pid poll, not prctl's PDEATHSIG: that
    fires when the *thread* that forked exits, which in a process pool may be any thread."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="pitstop-parent-watch", daemon=True).start()


def process_chunk(chunk: Chunk) -> ChunkResult:
    """Worker entry point: never raises, so the parent always gets a readable message."""
    try:
        assert _WORKER is not None, "init_worker was not called"
        return _WORKER.process(chunk)
    except BaseException:
        return {"crash": traceback.format_exc()}
