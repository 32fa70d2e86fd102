"""Dataset records: recognising their shape and validating their fields.

A record is one of four shapes (docs/data.md), with configurable field names:

    text                {"text": ...}
    prompt_completion   {"prompt": ..., "completion": ...}
    instruction         {"instruction": ..., "input": ... (optional), "output": ...}
    chat                {"messages": [{"role": ..., "content": ...}, ...]}, also
                        ShareGPT {"conversations": [{"from": "human", "value": ...}, ...]},
                        TRL's conversational {"prompt": [messages], "completion": [messages]},
                        content as a list of text parts, tool calls and "tools"

The first *complete* shape wins, in the order chat, instruction, prompt_completion,
text, so a record may carry unrelated extra fields (ignored). A record that has
none of the shapes complete is a bad record whose reason names the fields found,
the fields expected and the option that renames them.

Everything here is pure Python over already-decoded values, so it runs in the
tokenizer worker processes and is fuzzed by the tests: any JSON value gives a
`Record` or a `BadRecord` (a `DataError`), never another exception.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from pitstop.core.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


class BadRecord(DataError):
    """One record cannot be used; `reason` says what is wrong and how to fix it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class Record(NamedTuple):
    """A validated record. `values` depends on `kind`:

    text: (text,); prompt_completion: (prompt, completion);
    instruction: (instruction, input or "", output);
    chat: (((role, content, target, extra JSON), ...), tools JSON) where target False marks
    a message that is never a loss target (a TRL prompt) and extra holds tool_calls etc.
    """

    kind: str
    values: tuple


@dataclass(frozen=True)
class Fields:
    """The record field names in use (the --*-field options)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"
    messages: str = "messages"
    conversations: str = "conversations"

    @classmethod
    def from_config(cls, cfg: Any) -> Fields:
        return cls(
            text=cfg.text_field,
            prompt=cfg.prompt_field,
            completion=cfg.completion_field,
            instruction=cfg.instruction_field,
            input=cfg.input_field,
            output=cfg.output_field,
            messages=cfg.messages_field,
        )

    def all(self) -> list[str]:
        return [
            self.text,
            self.prompt,
            self.completion,
            self.instruction,
            self.input,
            self.output,
            self.messages,
            self.conversations,
            "tools",
        ]

    def expected(self) -> str:
        return (
            f"{self.text!r} (--text-field), {self.prompt!r}+{self.completion!r} "
            f"(--prompt-field/--completion-field), {self.instruction!r}+{self.output!r} "
            f"with optional {self.input!r} (--instruction-field/--output-field/--input-field), "
            f"or {self.messages!r} (--messages-field; ShareGPT's {self.conversations!r} too)"
        )


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(v), type(v).__name__)


def _string(rec: dict, name: str, *, allow_empty: bool = False) -> str:
    v = rec[name]
    if not isinstance(v, str):
        raise BadRecord(f"field {name!r} must be a string, got {_type_name(v)}")
    if not allow_empty and not v.strip():
        raise BadRecord(f"field {name!r} is empty; remove the record or fill it in")
    if "\x00" in v:
        raise BadRecord(f"field {name!r} contains a NUL character (\\u0000); clean the data")
    return v


# ShareGPT speakers, by the role they play in a chat template.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
# Message keys a chat template may read besides role and content (tool calls and results).
EXTRA_KEYS = ("tool_calls", "name", "tool_call_id")


def _content(value: Any, i: int) -> str:
    """A message's text: a string, or a list of content parts whose text parts are joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for part in value:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRecord(f"message {i} has a text part without a string 'text'")
                out.append(text)
            else:
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise BadRecord(
                    f"message {i} has a {kind!r} content part; pitstop trains text-only models, "
                    "so remove non-text parts from the data"
                )
        return "".join(out)
    raise BadRecord(
        f"message {i} content must be a string, got {_type_name(value)} (or a list of text parts)"
    )


def _messages(rec: dict, name: str, *, target: bool = True) -> tuple[tuple, ...]:
    """(role, content, target, extra JSON) per message; `target` False: never a loss target."""
    msgs = rec[name]
    if isinstance(msgs, str) and msgs.lstrip().startswith("["):
        # CSV cells hold strings: accept a JSON-encoded message list there.
        try:
            msgs = json.loads(msgs)
        except (ValueError, RecursionError):  # RecursionError: hostile nesting
            raise BadRecord(f"field {name!r} is a string that is not a valid JSON list") from None
    if not isinstance(msgs, list):
        raise BadRecord(
            f"field {name!r} must be a list of {{'role', 'content'}} messages, got {_type_name(msgs)}"
        )
    if not msgs:
        raise BadRecord(f"field {name!r} is an empty list; a conversation needs messages")
    out = []
    for i, m in enumerate(msgs):
        if isinstance(m, dict) and "from" in m and "value" in m and "role" not in m:
            speaker = m["from"]
            role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
            if role is None:
                raise BadRecord(
                    f"message {i} has unknown ShareGPT speaker {speaker!r}; expected one of "
                    f"{', '.join(SHAREGPT_ROLES)}"
                )
            content: Any = m["value"]
        elif isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m):
            role, content = m["role"], m.get("content")
        else:
            found = sorted(map(str, m)) if isinstance(m, dict) else _type_name(m)
            raise BadRecord(
                f"message {i} of {name!r} must be an object with 'role' and 'content' (or "
                f"ShareGPT's 'from' and 'value'), got {found}"
            )
        if role not in ROLES:
            raise BadRecord(
                f"message {i} has unknown role {role!r}; expected one of {', '.join(ROLES)}"
            )
        # An assistant turn that only calls tools has no content.
        content = "" if content is None and m.get("tool_calls") else _content(content, i)
        if "\x00" in content:
            raise BadRecord(
                f"message {i} content contains a NUL character (\\u0000); clean the data"
            )
        extra = {k: m[k] for k in EXTRA_KEYS if m.get(k) is not None}
        try:
            extra_json = json.dumps(extra, sort_keys=True) if extra else ""
        except (TypeError, ValueError):
            raise BadRecord(f"message {i} has tool fields that are not plain JSON values") from None
        out.append((role, content, target, extra_json))
    return tuple(out)


def _tools(rec: dict) -> str:
    """The record's tool definitions (TRL's "tools" column) as JSON, "" when absent."""
    tools = rec.get("tools")
    if tools is None:
        return ""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except (ValueError, RecursionError):
            raise BadRecord("field 'tools' is a string that is not valid JSON") from None
    if not isinstance(tools, list):
        raise BadRecord(
            f"field 'tools' must be a list of tool definitions, got {_type_name(tools)}"
        )
    return json.dumps(tools, sort_keys=True) if tools else ""


def parse_record(obj: Any, fields: Fields) -> Record:
    """Validate one decoded record; raise BadRecord with the reason."""
    if not isinstance(obj, dict):
        raise BadRecord(
            f"a record must be an object such as {{{fields.text!r}: ...}}, got {_type_name(obj)}"
        )
    f = fields
    if f.messages in obj:
        return Record("chat", (_messages(obj, f.messages), _tools(obj)))
    if f.conversations in obj:
        return Record("chat", (_messages(obj, f.conversations), _tools(obj)))
    if f.instruction in obj and f.output in obj:
        inp = obj.get(f.input)
        if inp is not None and not isinstance(inp, str):
            raise BadRecord(f"field {f.input!r} must be a string or absent, got {_type_name(inp)}")
        if inp and "\x00" in inp:
            raise BadRecord(f"field {f.input!r} contains a NUL character (\\u0000); clean the data")
        return Record(
            "instruction", (_string(obj, f.instruction), inp or "", _string(obj, f.output))
        )
    if f.prompt in obj and f.completion in obj:
        if isinstance(obj[f.prompt], list) and isinstance(obj[f.completion], list):
            # TRL's conversational prompt/completion: only the completion is trained on.
            msgs = _messages(obj, f.prompt, target=False) + _messages(obj, f.completion)
            return Record("chat", (msgs, _tools(obj)))
        return Record(
            "prompt_completion",
            (_string(obj, f.prompt, allow_empty=True), _string(obj, f.completion)),
        )
    if f.text in obj:
        return Record("text", (_string(obj, f.text),))
    found = sorted(map(str, obj))
    partial = ""
    if f.prompt in obj or f.completion in obj:
        partial = f" (a prompt/completion record needs both {f.prompt!r} and {f.completion!r})"
    elif f.instruction in obj or f.output in obj:
        partial = f" (an instruction record needs both {f.instruction!r} and {f.output!r})"
    raise BadRecord(
        f"no known record shape{partial}: found fields {found}; expected {f.expected()}. "
        "If your data names them differently, pass the matching --*-field option"
    )


def parse_json_line(line: bytes, fields: Fields) -> Record:
    """Decode one JSONL line (UTF-8, no trailing newline needed) into a Record."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(
            f"invalid UTF-8 at byte {e.start} of the line; re-encode the file as UTF-8"
        ) from None
    if "\x00" in text:
        raise BadRecord("the line contains a NUL byte; the file may be binary or corrupted")
    try:
        obj = json.loads(text)
    except ValueError as e:
        msg = getattr(e, "msg", str(e))
        col = getattr(e, "colno", None)
        where = f" at column {col}" if col else ""
        if msg == "Extra data" and "\r" in text.rstrip("\r"):
            # Lines ended by a lone CR (classic Mac OS) read as one line of many records.
            raise BadRecord(
                f"invalid JSON{where}: Extra data: the lines end in a lone carriage return "
                "(CR, classic Mac OS line ends), so the file reads as one line; convert them "
                "to LF, e.g. `tr '\\r' '\\n'`"
            ) from None
        raise BadRecord(f"invalid JSON{where}: {msg}") from None
    except RecursionError:
        raise BadRecord("invalid JSON: nested too deeply") from None
    return parse_record(obj, fields)
