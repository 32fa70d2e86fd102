"""The bundled corpus and the offline tiny-model builder the demo, tests and benches rely on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pitstop.core.corpus import instruction_records, load_sample_corpus


def test_corpus_is_the_whole_kjv_with_a_long_tail() -> None:
    recs = load_sample_corpus()
    assert len(recs) == 1189  # chapters of the King James Bible
    assert recs[0]["text"].startswith("Genesis 1\n\n1 In the beginning God created")
    assert recs[-1]["book"] == "Revelation" and recs[-1]["chapter"] == 22
    lengths = np.array([len(r["text"]) for r in recs])
    # Long-tailed: the longest chapter is several times the median.
    assert lengths.max() > 3 * np.median(lengths)


def test_instruction_records_are_real_text() -> None:
    recs = instruction_records(limit=5)
    assert recs and all(r["prompt"] and r["completion"] for r in recs)
    assert "2 And the earth was without form" in recs[0]["completion"]


def test_tiny_model_dir_loads_offline(tiny_model_dir: Path, tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert tiny_tokenizer.eos_token_id is not None and tiny_tokenizer.chat_template
    ids = tiny_tokenizer("In the beginning")["input_ids"]
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "In the beginning"
