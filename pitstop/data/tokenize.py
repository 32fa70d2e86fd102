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
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from pitstop.data.readers import Chunk
from pitstop.data.records import BadRecord, Fields, Record, parse_json_line, parse_record
from pitstop.data.store import target_free_documents
from pitstop.errors import ConfigError

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
        if chunk.kind == "block":
            for start, block in chunk.items:
                for k, line in enumerate(block.split(b"\n")):
                    if line.strip():
                        out.append((f"{path}:{start + k}", _try(parse_json_line, line, fields)))
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
    def process(self, chunk: Chunk) -> dict[str, Any]:
        bad: list[tuple[str, str]] = []
        n_bad = 0
        texts: list[str] = []
        spans: list[list[tuple[int, int]] | None] = []
        kinds: dict[str, int] = {}
        doc_kinds: list[str] = []
        recs = self.records(chunk)
        for loc, rec in recs:
            try:
                if isinstance(rec, BadRecord):
                    raise rec
                text, sp = self.render(rec)
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
        out = self.tokenize(texts, spans)
        out.update(bad=bad, n_bad=n_bad, n_records=len(recs), kinds=kinds)
        offsets = np.r_[0, np.cumsum(out["seq_len"])]
        held, free = target_free_documents(out["mask"], offsets, out["seq_doc"])
        eos_only: dict[str, int] = {}
        for d in held[free]:  # documents that teach only where to stop: few, or a mistake
            eos_only[doc_kinds[d]] = eos_only.get(doc_kinds[d], 0) + 1
        out.update(docs_held=len(held), eos_only=eos_only)
        return out

    def tokenize(
        self, texts: list[str], spans: list[list[tuple[int, int]] | None]
    ) -> dict[str, Any]:
        n = len(texts)
        ids: list[list[int]] = [[] for _ in range(n)]
        masks: dict[int, np.ndarray] = {}
        plain = [i for i in range(n) if spans[i] is None]
        masked = [i for i in range(n) if spans[i] is not None]
        if plain:
            # No offsets needed: the fast path skips computing them.
            for i, e in zip(plain, self.backend.encode_batch_fast([texts[i] for i in plain])):
                ids[i] = e.ids
        if masked:
            for i, e in zip(masked, self.backend.encode_batch([texts[i] for i in masked])):
                ids[i] = e.ids
                off = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
                m = np.zeros(len(off), dtype=bool)
                for a, b in spans[i]:  # type: ignore[union-attr]
                    m |= (off[:, 0] < b) & (off[:, 1] > a)
                masks[i] = m
        eos = self.eos
        for seq in ids:
            if not seq or seq[-1] != eos:
                seq.append(eos)
        lengths = np.fromiter((len(s) for s in ids), dtype=np.int64, count=n)
        total = int(lengths.sum())
        tokens = np.fromiter(chain.from_iterable(ids), dtype=self.dtype, count=total)
        mask = np.ones(total, dtype=np.uint8)
        starts = np.zeros(n, dtype=np.int64)
        if n:
            starts[1:] = np.cumsum(lengths)[:-1]
        for i, m in masks.items():
            mask[starts[i] : starts[i] + len(m)] = m
        mask[starts] = 0  # a document's first token has nothing before it to predict it
        return self.apply_long_docs(tokens, mask, lengths, starts)

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
            pos = np.arange(len(tokens), dtype=np.int64) - np.repeat(starts, lengths)
            keep = pos < L
            info["tokens_removed"] = int((~keep).sum())
            info["targets_removed"] = int(mask[~keep].sum())
            tokens, mask = tokens[keep], mask[keep]
            seq_len, seq_doc = np.minimum(lengths, L), docs
        else:  # drop
            keep = np.repeat(~long, lengths)
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


# --- process-pool plumbing ------------------------------------------------------
_WORKER: Worker | None = None


def init_worker(settings: Settings) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _WORKER
    if _WORKER is None or _WORKER.s != settings:
        _WORKER = Worker(settings)


def process_chunk(chunk: Chunk) -> dict[str, Any]:
    """Worker entry point: never raises, so the parent always gets a readable message."""
    try:
        assert _WORKER is not None, "init_worker was not called"
        return _WORKER.process(chunk)
    except BaseException:
        return {"crash": traceback.format_exc()}
