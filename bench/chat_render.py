"""Chat rendering cost against the number of turns: one render per record, not one per prefix.

    .venv/bin/python -m bench.chat_render [--repeats 5]

Renders one conversation of 2 and of 80 turns (user/assistant pairs of a short
sentence each) with the tiny model's chat template, finding the loss-target spans
two ways: the marker renders `prepare` uses (a fixed number of template renders) and
rendering every prefix (what `prepare` falls back to for templates the markers cannot
read; before, the only way). Median seconds per record. Writes bench/results/chat_render.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from bench.common import markdown_table, median, write_result
    from pitstop.data.records import Fields, parse_record
    from pitstop.data.tokenize import Settings, Worker
    from pitstop.tiny import build_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "model")
        w = Worker(
            Settings(
                str(model), False, Fields(), "alpaca", 1 << 20, "split", False, False, "uint16"
            )
        )
        rows = []
        for turns in (2, 80):
            msgs = [
                {"role": "user" if i % 2 == 0 else "assistant", "content": f"Sentence number {i}."}
                for i in range(turns)
            ]
            rec = parse_record({"messages": msgs}, Fields())
            value = rec.values[0]
            messages = [{"role": m[0], "content": m[1]} for m in value]

            def linear(messages: list = messages, value: tuple = value) -> None:
                text = w._apply(messages, False)
                assert w._chat_spans_linear(messages, value, None, text) is not None

            def prefix(messages: list = messages, value: tuple = value) -> None:
                w._chat_spans_by_prefix(messages, value, None)

            times = {}
            for name, fn in (("marker renders", linear), ("every prefix", prefix)):
                samples = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                times[name] = median(samples)
            rows.append([turns, f"{times['marker renders']:.4f}", f"{times['every prefix']:.4f}"])
    table = markdown_table(["turns", "marker renders (s)", "every prefix (s)"], rows)
    print(table)
    write_result("chat_render", "Chat rendering: seconds per record by turns", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
