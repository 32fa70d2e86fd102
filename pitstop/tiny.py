"""Tiny models and tokenizers built locally, for the demo, tests and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with the
`tokenizers` library on the bundled corpus, and the model is a Llama built from a
config with random weights, saved as a normal Hugging Face directory
(config.json, model.safetensors, tokenizer files) that `pitstop train --model`
and `AutoModelForCausalLM.from_pretrained` load like any other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from pitstop.core.corpus import sample_texts

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained on `texts`, wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(
    vocab_size: int,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 4096,
):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


def build_model_dir(
    dest: str | Path,
    *,
    texts: Iterable[str] | None = None,
    vocab_size: int = 4096,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    intermediate: int | None = None,
    seed: int = 0,
    pad_vocab_to: int | None = None,
) -> Path:
    """Write a tiny Llama model directory to `dest` (skipped if one with the same spec is there).

    `pad_vocab_to`: give the model this many embedding rows and logits even when the
    tokenizer trained on `texts` has fewer pieces (a small corpus cannot fill a 32k BPE
    vocabulary; the benchmark still wants the cost of a 32k loss head)."""
    import torch
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    spec = {
        "vocab_size": vocab_size,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "intermediate": intermediate,
        "seed": seed,
        "texts": texts is None,
        **({"pad_vocab_to": pad_vocab_to} if pad_vocab_to else {}),
    }
    marker = dest / "pitstop_tiny.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts if texts is not None else sample_texts(), vocab_size=vocab_size)
    cfg = llama_config(
        max(len(tok), pad_vocab_to or 0), layers=layers, hidden=hidden, heads=heads,
        intermediate=intermediate,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    tmp = marker.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, marker)
    return dest
