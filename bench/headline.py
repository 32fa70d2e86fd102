"""The headline benchmark: pitstop against Hugging Face Trainer, TRL, and the bare-loop ceiling.

What is measured. One tiny Llama-style model built from a config (4 layers, width
256, 4 heads, an 8k byte-level BPE vocabulary trained on the corpus; random
initial weights saved once, so every system starts from the same weights) is
trained for one epoch on the same documents, with the same max length (1024),
the same learning rate and schedule (AdamW β=(0.9, 0.95), no weight decay, 5%
warm-up then cosine to 10% of the peak, gradient clipping at 1.0), the same seed,
and the same number of *trained tokens per optimizer step* (≈), by:

1. ``hf_slow`` – Hugging Face ``Trainer`` as a typical slow run is written: every
   row padded to max length, tokenized in ``Dataset.__getitem__``,
   ``dataloader_num_workers=0``.
2. ``hf_dynamic`` – ``Trainer`` with the data tokenized up front (``datasets.map``),
   dynamic padding (``DataCollatorForLanguageModeling(mlm=False)``, no
   pad_to_multiple_of), length-grouped sampling and 2 dataloader workers.
   ``hf_bf16`` – the same with ``bf16=True, use_cpu=True`` (CPU bf16 autocast, fp32
   master weights): a fair peer wherever the CPU has native bf16 (``avx512_bf16`` or
   ``amx_bf16`` in its flags, ``pitstop.probe.cpu_has_bf16``); CPU mode runs it only there
   and reports it "n/a" elsewhere (issue 23).
3. ``trl`` – TRL ``SFTTrainer`` with ``packing=True, packing_strategy="bfd",
   padding_free=True``. TRL's SFT defaults that would change the comparison are
   set back: ``gradient_checkpointing=False`` (no other system recomputes) and
   ``bf16`` only in GPU mode. Read from trl's source (1.16): padding-free
   flattens each micro-batch's packed rows into one row with restarting
   ``position_ids``; without flash-attn (CPU, SDPA) transformers then builds a
   block-diagonal mask over the whole flattened row, so attention cost grows with
   the micro-batch: it is run with one packed row per micro-batch (its fastest
   setting on CPU) and gradient accumulation (several rows per micro-batch when
   flash-attn is installed).
4. ``pitstop`` – the real CLI, ``python -m pitstop train`` with its defaults
   (plus the shared math flags), read back through ``OUT/summary.json``; a first run
   with an empty cache (its ``--cache-dir`` is made fresh), so its whole-process time
   includes every start-up measurement and the tokenizing;
   ``pitstop_tuned`` – ``pitstop tune`` then ``pitstop train --config tuned.yaml``,
   when ``pitstop tune`` exists. Either is reported "n/a" with the reason when the
   command fails, so this benchmark runs before the trainer exists.
5. ``ceiling`` – the bare forward/backward/clip/AdamW loop (same schedule) over
   pitstop's own packed micro-batches (``pitstop.batching``: best-fit decreasing
   into rows of max length, documents isolated by restarting position ids), all
   built before the clock starts and held in memory: no data loading, no
   logging, no checkpointing; pitstop's optimizer (fused AdamW) and, on a CPU, its
   kept host memory. What pitstop could reach at best on this machine.

GPU mode (``--gpu``) sets every peer up as a competent GPU user would (issue 17): bf16 and
``adamw_torch_fused`` for HF and TRL; ``hf_dynamic``, ``trl`` and the ceiling each run at
micro-batch 4, 8 and 16 (documents for HF with the accumulation rounded to keep the tokens per
step, so no prime-number accumulation forces one document per micro-batch; packed rows for TRL
and the ceiling) and each one's fastest is its row, every sweep point listed in the notes;
``hf_slow`` is left out (``--systems`` can still ask for it); ``pitstop`` runs its defaults
(it sizes its own micro-batch on CUDA), ``pitstop_mb`` adds its ``--micro-batch-size`` sweep.
The table adds peak memory (the CUDA allocator's peak), and ``--vocab 32768`` trains a second
model whose embedding and loss head have a real 32k vocabulary (results in
``headline-gpu-v32768.md``).

The corpus: chapters of the bundled King James Bible as plain-text records
(``{"text"}``; loss on every token). A fixed, seeded random subset of chapters
trains; other chapters form the held-out set. So that no system truncates or
splits differently, chapters longer than max length are cut at verse boundaries
into pieces that fit (with BOS and EOS) before any system sees them: every
system trains on exactly the same tokens, and the lengths keep the corpus's
long tail (short chapters, and pieces of long ones). Sizes: the full CPU run
trains on 64 chapters (88 documents, ~56k tokens, 4,096 tokens per step), so
that each system's epoch takes minutes on 2 cores; ``--quick`` uses a 2-layer,
64-wide model, 2 chapters and max length 256; ``--gpu`` uses every chapter but
the 40 held out and 64k tokens per step.

Timings are only as good as the machine is quiet: for each system the report
gives the CPU that *other* processes used while it ran (from /proc/stat), and
flags the run as noisy when that is more than a quarter of a core.

Tokens per optimizer step. The packed systems (TRL, pitstop, ceiling) take
``tokens_per_step / max_len`` full rows per step (≈ tokens_per_step real tokens,
less the few percent BFD leaves empty). The padded HF systems take documents, so
they are given ``round(tokens_per_step / mean document length)`` documents per
step (micro-batch × accumulation), which carries the same number of real tokens
per step on average. Every system's measured trained tokens per step is reported.

Per system: trained tokens (tokens that are a loss target) per second over the
training steps only (our own clock: from the start of the epoch's first batch
fetch to the end of the last optimizer step; pitstop's ``train_seconds``), and over
the whole process (subprocess start to final model saved: imports, loading,
tokenization, packing included); the ratio to the best peer (fastest of
hf_slow, hf_dynamic, trl by train-only throughput) and to the ceiling; MFU (model
FLOPs of the trained tokens, FLOPs per token = 6·N_non-embedding + 12·L·d·T with
T = max length, ``pitstop.measure.flops``) over the device peak (the measured
fp32 matmul peak on a CPU, ``pitstop.measure.peak.cpu_peak``; the datasheet bf16
peak on a GPU); padding efficiency (real tokens / positions computed); the mean
training loss over the last 10% of steps; and the held-out loss: per-token mean
cross-entropy over the held-out documents, each document evaluated on its own by
the same function for every trained model.

Every system runs in its own subprocess (``python -m bench.headline --system NAME``)
so none inherits another's imports, threads or allocator state.

``--long`` (issue 46): a run long enough for torch.compile to repay its compile: every
chapter but the held-out ones on a CPU, the GPU's corpus five times over; it adds
``hf_compile`` (the HF Trainer with ``torch_compile=True`` and bf16 where the CPU has native
bf16, fp32 elsewhere; always bf16 on a GPU) and ``pitstop_compiled`` (``--compile on``), and
its goal is pitstop ≥ 1.3× the compiled HF Trainer. ``--sweep 8`` runs the GPU's swept
systems at one micro-batch (a lent GPU's minutes).

Usage:
    python -m bench.headline            # full CPU run, writes bench/results/headline.md
    python -m bench.headline --long     # the long run with the compiled peers (-long.md)
    python -m bench.headline --quick    # a tiny run for the smoke test (< 1 min)
    python -m bench.headline --gpu      # bf16, a ~1B Llama, flash-attn when installed
    python -m bench.headline --gpu --vocab 32768   # the same with a 32k vocabulary
    python -m bench.headline --gpu --dry-run   # print the plan; runs without CUDA
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    cpu_model,
    describe_machine,
    fmt,
    machine,
    markdown_table,
    write_result,
)

PEERS = ("hf_slow", "hf_dynamic", "hf_bf16", "hf_compile", "trl")
SYSTEMS = (*PEERS, "pitstop", "pitstop_compiled", "pitstop_mb", "pitstop_tuned", "ceiling")
# --long (a run long enough for torch.compile to repay its compile): the compiled peer and
# pitstop compiled join; hf_slow and hf_bf16 are the short run's.
LONG_SYSTEMS = ("hf_dynamic", "hf_compile", "trl", "pitstop", "pitstop_compiled", "ceiling")
# GPU mode leaves out hf_slow (padding every row to max length and tokenizing in
# __getitem__ is no setting a competent GPU user picks); --systems can still ask for it.
GPU_SYSTEMS = ("hf_dynamic", "trl", "pitstop", "ceiling")
LABELS = {
    "hf_slow": "HF Trainer, pad to max, tokenize in __getitem__",
    "hf_dynamic": "HF Trainer, dynamic padding + group_by_length + workers",
    "hf_bf16": "HF Trainer, the same + bf16=True, use_cpu=True (bf16 autocast)",
    "hf_compile": "HF Trainer, dynamic padding + torch_compile=True + bf16 (native bf16 only)",
    "trl": "TRL SFTTrainer, packing bfd + padding_free",
    "pitstop": "pitstop train (defaults)",
    "pitstop_compiled": "pitstop train --compile on",
    "pitstop_mb": "pitstop train --micro-batch-size (swept)",
    "pitstop_tuned": "pitstop train (tuned config)",
    "ceiling": "ceiling: bare fwd/bwd/AdamW over packed batches in memory",
}
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PYTHONUNBUFFERED": "1",
}
GOAL_VS_PEER = 1.5
GOAL_VS_COMPILED_PEER = 1.3  # --long: pitstop against the HF Trainer with torch_compile
GOAL_VS_CEILING = 0.95
GOAL_LOSS_GAP = 0.05


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    vocab_size: int
    intermediate: int | None = None
    tokenizer_chapters: int | None = None  # train the BPE on the first N chapters (None: all)
    # The corpus holds fewer distinct pieces than a real 32k vocabulary: the embedding and
    # the loss head are padded to vocab_size so they cost what a real one does.
    pad_vocab: bool = False


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the full, quick and GPU runs."""

    model: ModelSpec
    max_len: int
    tokens_per_step: int
    lr: float
    train_chapters: int | None  # None: every chapter not held out
    heldout_chapters: int
    hf_micro_cap: int  # largest HF micro-batch (documents)
    hf_workers: int
    timeout_s: int
    # Micro-batch sizes (rows or documents) every swept system runs at; each one's best is
    # reported (GPU: what a competent user would try on a big card; CPU: none, as before).
    sweep: tuple[int, ...] = ()
    # --long: the training documents this many times over (shuffled), so that every system
    # trains long enough for a compile to repay itself; the same tokens for all.
    repeat: int = 1


CPU_FULL = Sizes(
    model=ModelSpec(layers=4, hidden=256, heads=4, vocab_size=8192),
    max_len=1024,
    tokens_per_step=4096,
    lr=1e-3,
    train_chapters=64,
    heldout_chapters=12,
    hf_micro_cap=8,
    hf_workers=2,
    timeout_s=1800,
)
CPU_QUICK = Sizes(
    model=ModelSpec(layers=2, hidden=64, heads=4, vocab_size=1024, tokenizer_chapters=60),
    max_len=256,
    tokens_per_step=1024,
    lr=2e-3,
    train_chapters=2,  # the smoke test's run: a few steps per system (its plumbing, not speed)
    heldout_chapters=1,
    hf_micro_cap=8,
    hf_workers=2,
    timeout_s=300,
)
# ~1.1B parameters (16 x (4·2048² + 3·2048·8192) ≈ 1.07B non-embedding).
GPU_FULL = Sizes(
    model=ModelSpec(layers=16, hidden=2048, heads=16, vocab_size=8192),
    max_len=1024,
    tokens_per_step=64 * 1024,
    lr=3e-4,
    train_chapters=None,
    heldout_chapters=40,
    hf_micro_cap=8,
    hf_workers=4,
    timeout_s=3600,
    sweep=(4, 8, 16),
)
# --long: every chapter not held out; on a GPU, five times over (~2 minutes a system on an
# H200 instead of ~21 s).
CPU_LONG = dataclasses.replace(CPU_FULL, train_chapters=None, timeout_s=4 * 3600)
GPU_LONG = dataclasses.replace(GPU_FULL, repeat=5, timeout_s=2 * 3600)
# The systems whose micro-batch is swept in GPU mode (pitstop sizes its own: its defaults
# are what is measured; --systems pitstop_mb sweeps its --micro-batch-size too).
SWEPT = ("hf_dynamic", "trl", "ceiling", "pitstop_mb")


@dataclass
class Setup:
    """The shared plan every system child reads (``WORKDIR/setup.json``)."""

    mode: str  # cpu | gpu
    quick: bool
    model_dir: str
    train_file: str
    heldout_file: str
    max_len: int
    tokens_per_step: int
    lr: float
    seed: int
    precision: str  # fp32 | bf16
    attn: str  # sdpa | flash_attention_2
    n_train_docs: int
    n_heldout_docs: int
    train_seen_tokens: int  # BOS + text + EOS over the training documents
    mean_doc_len: float
    hf_micro: int
    hf_accum: int
    hf_workers: int
    trl_micro_rows: int
    trl_accum: int
    timeout_s: int
    model_desc: str = ""
    notes: list[str] = field(default_factory=list)
    sweep: list[int] = field(default_factory=list)
    suffix: str = ""  # "-v32768" for a --vocab run: its own workdir and results file

    @property
    def rows_per_step(self) -> int:
        return self.tokens_per_step // self.max_len

    @property
    def docs_per_step(self) -> int:
        return self.hf_micro * self.hf_accum

    def save(self, workdir: Path) -> None:
        (workdir / "setup.json").write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, workdir: Path) -> Setup:
        return cls(**json.loads((workdir / "setup.json").read_text()))


def hf_micro_accum(docs_per_step: float, cap: int) -> tuple[int, int]:
    """(micro-batch, accumulation) whose product is closest to `docs_per_step`, largest micro first."""
    best: tuple[float, int, int] | None = None
    for m in range(cap, 0, -1):
        a = max(1, round(docs_per_step / m))
        err = abs(m * a - docs_per_step)
        if best is None or err < best[0] - 1e-9:
            best = (err, m, a)
    assert best is not None
    return best[1], best[2]


# --------------------------------------------------------------------------- data


def split_chapter(text: str, tok: Any, max_len: int) -> list[str]:
    """Cut a chapter at verse (line) boundaries into pieces of ≤ max_len tokens with BOS and EOS."""
    eos = tok.eos_token

    def n_tokens(piece: str) -> int:
        return len(tok(piece + eos)["input_ids"])

    if n_tokens(text) <= max_len:
        return [text]
    lines = text.split("\n")
    per_line = [
        len(ids) for ids in tok([ln + "\n" for ln in lines], add_special_tokens=False)["input_ids"]
    ]
    budget = max_len - 2 - 8  # BOS, EOS, and slack for merges across line joins
    pieces: list[list[str]] = [[]]
    used = 0
    for ln, n in zip(lines, per_line):
        if pieces[-1] and used + n > budget:
            pieces.append([])
            used = 0
        pieces[-1].append(ln)
        used += n
    out: list[str] = []
    for p in pieces:
        out.extend(_fit(p, n_tokens, max_len))
    return [p for p in out if p.strip()]


def _fit(lines: list[str], n_tokens: Any, max_len: int) -> list[str]:
    """Halve a list of lines (or one line's words) until every piece fits."""
    piece = "\n".join(lines)
    if n_tokens(piece) <= max_len:
        return [piece]
    if len(lines) == 1:
        words = lines[0].split(" ")
        if len(words) == 1:
            raise ValueError(f"a single word is longer than {max_len} tokens")
        mid = len(words) // 2
        return _fit([" ".join(words[:mid])], n_tokens, max_len) + _fit(
            [" ".join(words[mid:])], n_tokens, max_len
        )
    mid = len(lines) // 2
    return _fit(lines[:mid], n_tokens, max_len) + _fit(lines[mid:], n_tokens, max_len)


def build_setup(args: argparse.Namespace, sizes: Sizes, workdir: Path) -> Setup:
    """Build (or reuse) the model directory and the train / held-out files."""
    import numpy as np
    from transformers import AutoTokenizer

    from pitstop.core.corpus import load_sample_corpus, sample_texts
    from pitstop.tiny import build_model_dir

    spec = sizes.model
    t0 = time.perf_counter()
    model_dir = build_model_dir(
        workdir / "model",
        texts=sample_texts(spec.tokenizer_chapters) if spec.tokenizer_chapters else None,
        vocab_size=spec.vocab_size,
        pad_vocab_to=spec.vocab_size if spec.pad_vocab else None,
        layers=spec.layers,
        hidden=spec.hidden,
        heads=spec.heads,
        intermediate=spec.intermediate,
        seed=args.seed,
    )
    print(f"[headline] model directory {model_dir} ready in {time.perf_counter() - t0:.1f} s")
    tok = AutoTokenizer.from_pretrained(model_dir)
    chapters = [r["text"] for r in load_sample_corpus()]
    perm = np.random.default_rng(args.data_seed).permutation(len(chapters))
    held = [chapters[i] for i in perm[: sizes.heldout_chapters]]
    rest = perm[sizes.heldout_chapters :]
    n_train = args.train_chapters or sizes.train_chapters or len(rest)
    train = [chapters[i] for i in rest[:n_train]]

    def pieces(texts: list[str]) -> list[str]:
        return [p for t in texts for p in split_chapter(t, tok, sizes.max_len)]

    train_docs, held_docs = pieces(train), pieces(held)
    if sizes.repeat > 1:  # --long: the same documents several times over, shuffled
        order = np.random.default_rng(args.data_seed).permutation(len(train_docs) * sizes.repeat)
        train_docs = [train_docs[i % len(train_docs)] for i in order]
    lens = [len(ids) for ids in tok([d + tok.eos_token for d in train_docs])["input_ids"]]
    assert max(lens) <= sizes.max_len
    for name, docs in (("train.jsonl", train_docs), ("heldout.jsonl", held_docs)):
        with open(workdir / name, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")

    mean_len = float(np.mean(lens))
    m, a = hf_micro_accum(sizes.tokens_per_step / mean_len, sizes.hf_micro_cap)
    gpu = args.gpu
    flash = gpu and importlib.util.find_spec("flash_attn") is not None
    rows = sizes.tokens_per_step // sizes.max_len
    trl_micro = min(rows, sizes.hf_micro_cap) if flash else 1
    while rows % trl_micro:
        trl_micro -= 1
    pct = np.percentile(lens, [10, 50, 90, 100]).astype(int).tolist()
    setup = Setup(
        mode="gpu" if gpu else "cpu",
        quick=args.quick,
        model_dir=str(model_dir),
        train_file=str(workdir / "train.jsonl"),
        heldout_file=str(workdir / "heldout.jsonl"),
        max_len=sizes.max_len,
        tokens_per_step=sizes.tokens_per_step,
        lr=args.lr or sizes.lr,
        seed=args.seed,
        precision="bf16" if gpu else "fp32",
        attn="flash_attention_2" if flash else "sdpa",
        n_train_docs=len(train_docs),
        n_heldout_docs=len(held_docs),
        train_seen_tokens=int(sum(lens)),
        mean_doc_len=mean_len,
        hf_micro=m,
        hf_accum=a,
        hf_workers=sizes.hf_workers,
        trl_micro_rows=trl_micro,
        trl_accum=rows // trl_micro,
        timeout_s=sizes.timeout_s,
        sweep=list(sizes.sweep),
        suffix=_vocab_suffix(args),
        model_desc=(
            f"Llama {spec.layers} layers, width {spec.hidden}, {spec.heads} heads, "
            + (
                f"vocab {spec.vocab_size} ({len(tok)} BPE pieces trained on the corpus, the "
                "embedding and loss head padded to the full size)"
                if spec.pad_vocab and spec.vocab_size > len(tok)
                else f"vocab {len(tok)} (BPE trained on the corpus)"
            )
            + f", random init, seed {args.seed}"
        ),
        notes=[
            f"{len(train)} training chapters → {len(train_docs)} documents, "
            f"{sum(lens):,} tokens (BOS+text+EOS), lengths p10/p50/p90/max = "
            f"{pct[0]}/{pct[1]}/{pct[2]}/{pct[3]}; {len(held)} held-out chapters → "
            f"{len(held_docs)} documents (data seed {args.data_seed})",
        ],
    )
    setup.save(workdir)
    return setup


def _vocab_suffix(args: argparse.Namespace) -> str:
    """The results file's and workdir's suffix beyond the mode: the vocabulary, --long."""
    vocab = f"-v{args.vocab}" if getattr(args, "vocab", None) else ""
    return vocab + ("-long" if getattr(args, "long", False) else "")


def read_texts(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


# --------------------------------------------------------------------------- children


def _child_result(system: str, **kw: Any) -> dict[str, Any]:
    return {"system": system, "status": "ok", **kw}


def _load_model(setup: Setup, attn: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        setup.model_dir, attn_implementation=attn or setup.attn, dtype=torch.float32
    )


def _common_args(
    setup: Setup, outdir: Path, micro: int, accum: int, bf16: bool = False
) -> dict[str, Any]:
    """TrainingArguments shared by the HF and TRL systems: the same math as pitstop's defaults.
    `bf16`: bf16 autocast on the CPU too (hf_bf16)."""
    gpu = setup.mode == "gpu"
    return {
        "output_dir": str(outdir / "trainer"),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accum,
        "num_train_epochs": 1,
        "learning_rate": setup.lr,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "warmup_steps": 0.05,  # a float below 1 is a ratio of the run
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "logging_steps": 1,  # per-step losses for the final-loss column
        "save_strategy": "no",
        "report_to": "none",
        "seed": setup.seed,
        "data_seed": setup.seed,
        "bf16": gpu or bf16,
        "use_cpu": not gpu,
        "dataloader_pin_memory": gpu,
        # What a competent GPU user sets (pitstop and the ceiling use fused AdamW too).
        **({"optim": "adamw_torch_fused"} if gpu else {}),
        "disable_tqdm": True,
        # TRL defaults to recomputing activations; no other system here does.
        _checkpointing_arg(): False,
    }


def _checkpointing_arg() -> str:
    """transformers ≥ 5.2x renamed gradient_checkpointing to activation_checkpointing."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )


def _known_fields(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop (and say so) arguments this transformers/trl version does not have."""
    names = {f.name for f in dataclasses.fields(cls)}
    dropped = sorted(set(kwargs) - names)
    if dropped:
        print(f"[headline] {cls.__name__} has no {', '.join(dropped)}; not set", flush=True)
    return {k: v for k, v in kwargs.items() if k in names}


class _PadToMaxDataset:
    """The slow pattern: tokenize one text per ``__getitem__``, padded to max length."""

    def __init__(self, texts: list[str], tok: Any, max_len: int) -> None:
        self.texts, self.tok, self.max_len = texts, tok, max_len

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        enc = self.tok(
            self.texts[i] + self.tok.eos_token,
            padding="max_length",
            max_length=self.max_len,
            truncation=True,
        )
        ids = torch.tensor(enc["input_ids"])
        mask = torch.tensor(enc["attention_mask"])
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }


def _instrument(trainer_cls: Any, pad_id: int) -> Any:
    """Subclass a (HF or TRL) trainer to count tokens per micro-batch without a host sync."""

    class Counting(trainer_cls):  # type: ignore[misc, valid-type]
        bench_counts: dict[str, Any]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            c = self.__dict__.setdefault("bench_counts", {"trained": 0, "seen": 0, "positions": 0})
            ids, labels = inputs["input_ids"], inputs["labels"]
            # Targets after the model's internal shift; kept as tensors (no sync on GPU).
            c["trained"] = c["trained"] + (labels[..., 1:] != -100).sum()
            c["seen"] = c["seen"] + (ids != pad_id).sum()
            c["positions"] += ids.numel()
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return Counting


def _clock_callback() -> Any:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """Train-only clock: epoch start (before the first batch fetch) to the last step's end."""

        def __init__(self) -> None:
            self.t0: float | None = None
            self.t1: float | None = None
            self.losses: list[float] = []

        def on_epoch_begin(self, args, state, control, **kw):
            self._sync()
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.t1 = time.perf_counter()

        def on_train_end(self, args, state, control, **kw):
            self._sync()
            self.t1 = time.perf_counter() if self.t1 is None else self.t1

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

        @staticmethod
        def _sync() -> None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

    return Clock()


def run_hf(setup: Setup, system: str, outdir: Path, micro: int | None = None) -> dict[str, Any]:
    """hf_slow / hf_dynamic / trl: build, train one epoch, save; the counts and clocks.

    `micro` (a sweep point): the micro-batch in documents (HF) or packed rows (TRL), with
    the accumulation that keeps the tokens per optimizer step."""
    from transformers import AutoTokenizer

    trl_micro, trl_accum = setup.trl_micro_rows, setup.trl_accum
    hf_micro, hf_accum = setup.hf_micro, setup.hf_accum
    if micro:
        trl_micro, trl_accum = micro, max(1, setup.rows_per_step // micro)
        hf_micro = micro
        hf_accum = max(1, round(setup.tokens_per_step / setup.mean_doc_len / micro))

    tok = AutoTokenizer.from_pretrained(setup.model_dir)
    model = _load_model(setup)
    texts = read_texts(setup.train_file)
    clock = _clock_callback()
    if system == "trl":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        kw = _common_args(setup, outdir, trl_micro, trl_accum)
        kw.update(
            max_length=setup.max_len,
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            dataset_text_field="text",
        )
        names = {f.name for f in dataclasses.fields(SFTConfig)}
        if "max_length" not in names and "max_seq_length" in names:  # trl < 0.20
            kw["max_seq_length"] = kw.pop("max_length")
        missing = {"packing", "padding_free"} - names
        if missing or ("packing_strategy" not in names):
            raise SystemExit(
                f"this trl has no {sorted(missing | ({'packing_strategy'} - names))} in SFTConfig; "
                "the benchmark needs trl>=0.19 (pip install -e '.[bench]')"
            )
        args = SFTConfig(**_known_fields(SFTConfig, kw))
        trainer = _instrument(SFTTrainer, tok.pad_token_id)(
            model=model,
            args=args,
            train_dataset=Dataset.from_dict({"text": texts}),
            processing_class=tok,
            callbacks=[clock],
        )
        config = f"{trl_micro} packed row(s) × {trl_accum} accum, padding_free, attn {setup.attn}"
    else:
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        bf16 = system == "hf_bf16" or (system == "hf_compile" and _cpu_bf16())
        kw = _common_args(setup, outdir, hf_micro, hf_accum, bf16=bf16)
        if system == "hf_compile":
            kw["torch_compile"] = True
        if system == "hf_slow":
            dataset: Any = _PadToMaxDataset(texts, tok, setup.max_len)
            collator = None  # default_data_collator stacks the fixed-size rows
            kw["dataloader_num_workers"] = 0
            config = f"{hf_micro} docs × {hf_accum} accum, rows of {setup.max_len}"
        else:
            from datasets import Dataset

            eos = tok.eos_token
            dataset = Dataset.from_dict({"text": texts}).map(
                lambda b: tok([t + eos for t in b["text"]]), batched=True, remove_columns=["text"]
            )
            collator = DataCollatorForLanguageModeling(tok, mlm=False)
            kw["dataloader_num_workers"] = setup.hf_workers
            if "group_by_length" in {f.name for f in dataclasses.fields(TrainingArguments)}:
                kw["group_by_length"] = True
            else:  # transformers ≥ 5 renamed it
                kw["train_sampling_strategy"] = "group_by_length"
            config = (
                f"{hf_micro} docs × {hf_accum} accum, dynamic padding, {setup.hf_workers} workers"
                + (", bf16 autocast" if bf16 or setup.mode == "gpu" else ", fp32")
                + (", torch_compile" if system == "hf_compile" else "")
            )
        args = TrainingArguments(**_known_fields(TrainingArguments, kw))
        trainer = _instrument(Trainer, tok.pad_token_id)(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=collator,
            callbacks=[clock],
        )
    out = trainer.train()
    peak = _cuda_peak()
    final = outdir / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(final)
    done_at = time.time()
    counts = {k: int(v) for k, v in trainer.bench_counts.items()}
    assert clock.t0 is not None and clock.t1 is not None
    return _child_result(
        system,
        config=config,
        trained_tokens=counts["trained"],
        seen_tokens=counts["seen"],
        positions=counts["positions"],
        optimizer_steps=int(trainer.state.global_step),
        train_seconds=clock.t1 - clock.t0,
        trainer_train_runtime=float(out.metrics.get("train_runtime", float("nan"))),
        losses=clock.losses,
        model_dir=str(final),
        done_at=done_at,
        peak_memory_bytes=peak,
    )


def _cuda_peak() -> int | None:
    """Peak bytes the CUDA caching allocator handed out in this process (None on CPU)."""
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def run_ceiling(setup: Setup, outdir: Path, micro: int | None = None) -> dict[str, Any]:
    """The bare loop over pitstop's packed micro-batches, built before the clock starts."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    try:
        from pitstop.batching.collate import collate
        from pitstop.batching.plan import build_plan, step_micro_batches
        from pitstop.batching.settings import BatchSettings
        from pitstop.core.config import RunConfig
        from pitstop.train.schedule import default_warmup, lr_at
    except ImportError as e:  # pitstop.batching is being written alongside this benchmark
        return {"system": "ceiling", "status": "n/a", "reason": f"pitstop.batching missing: {e}"}

    tok = AutoTokenizer.from_pretrained(setup.model_dir)
    texts = read_texts(setup.train_file)
    seqs = [[*ids, tok.eos_token_id] for ids in tok(texts)["input_ids"]]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    mask = np.ones(len(tokens), dtype=bool)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    settings = BatchSettings.from_config(
        RunConfig(
            max_seq_len=setup.max_len,
            tokens_per_step=setup.tokens_per_step,
            micro_batch_size=micro,
        ),
        strategy="pack",
    )
    plan = build_plan(
        lengths,
        strategy="pack",
        max_seq_len=setup.max_len,
        tokens_per_step=setup.tokens_per_step,
        seed=setup.seed,
        epoch=0,
        trained=lengths - 1,  # every token but a document's first is a target, as in pitstop
    )
    gpu = setup.mode == "gpu"
    dev = torch.device("cuda" if gpu else "cpu")
    flash = setup.attn == "flash_attention_2"
    # The ceiling takes pitstop's device-level choices, so that it bounds pitstop's loop and
    # not its choices: the optimizer (fused AdamW on a CPU as on a GPU) and, on a CPU, freed
    # host memory kept (set before any tensor is built, as pitstop does). On a CPU it also
    # runs pitstop's kernels: per-document SDPA, bf16 autocast where the CPU has native bf16
    # (pitstop measures it; at this model's shapes it measured 2-2.5x faster on the dev box),
    # and the blocked fp32 loss.
    from pitstop.probe import apply_host_memory, choose_host_memory, choose_optimizer, detect_device

    dev_info, _ = detect_device("cuda" if gpu else "cpu")
    host_memory = apply_host_memory(choose_host_memory("auto", dev_info))
    optimizer = choose_optimizer(dev_info)
    cpu_docs = not gpu
    cpu_bf16 = False
    if cpu_docs:
        from pitstop.probe import cpu_has_bf16
        from pitstop.train.doc_attention import DOC_ATTENTION, register
        from pitstop.train.forward import token_loss_sum

        register()
        cpu_bf16 = cpu_has_bf16()
    steps: list[tuple[list[dict[str, Any]], int]] = []
    trained = seen = positions = 0
    for s in range(plan.n_steps):
        mbs = []
        n_targets = 0
        for spec in step_micro_batches(plan, s, settings):
            b = collate(tokens, mask, offsets, spec, tok.pad_token_id)
            n_targets += int((b["labels"][:, 1:] != -100).sum())
            seen += int((b["input_ids"] != tok.pad_token_id).sum())
            positions += b["input_ids"].numel()
            mb: dict[str, Any] = {k: b[k].to(dev) for k in ("input_ids", "labels", "position_ids")}
            if flash or cpu_docs:  # varlen boundaries precomputed, as pitstop passes them
                cu = b["cu_seqlens"].to(dev, dtype=torch.int32)
                mb.update(
                    cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=b["max_seqlen"], max_length_k=b["max_seqlen"],
                )  # fmt: skip
            mbs.append(mb)
        trained += n_targets
        steps.append((mbs, n_targets))

    model = _load_model(setup, DOC_ATTENTION if cpu_docs else None).to(dev)
    model.train()
    from pitstop.train.optim import build_optimizer

    opt = build_optimizer(model, lr=setup.lr, weight_decay=0.0, choice=optimizer)
    total = len(steps)
    warmup = default_warmup(total)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu)
    losses = []
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (mbs, n_targets) in enumerate(steps):
        lr = lr_at(i, peak_lr=setup.lr, total_steps=total, warmup_steps=warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        step_loss = torch.zeros((), device=dev)
        for mb in mbs:
            if cpu_docs:
                bf16 = torch.bfloat16 if cpu_bf16 else None
                loss = token_loss_sum(model, mb, "cpu", bf16) / n_targets
            else:
                with autocast:
                    loss = model(**mb, use_cache=False, num_items_in_batch=n_targets).loss
            loss.backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    if gpu:
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t0
    peak = _cuda_peak()
    final = outdir / "final"
    model.save_pretrained(final)
    tok.save_pretrained(final)
    done_at = time.time()
    m = settings.tokens_per_micro_batch or 0
    return _child_result(
        "ceiling",
        config=(
            f"pitstop packed plan: {setup.rows_per_step} rows/step, micro-batches of "
            f"{m // setup.max_len if m else settings.micro_batch_size} row(s), "
            + (
                f"attn sdpa_docs, {'bf16 autocast' if cpu_bf16 else 'fp32'}, pitstop's loss"
                if cpu_docs
                else f"attn {setup.attn}"
            )
            + f", {optimizer.value}"
            + (", freed host memory kept" if host_memory.value else "")
        ),
        trained_tokens=trained,
        seen_tokens=seen,
        positions=positions,
        optimizer_steps=total,
        train_seconds=train_seconds,
        losses=[float(x) for x in losses],
        model_dir=str(final),
        done_at=done_at,
        peak_memory_bytes=peak,
    )


def run_eval(setup: Setup, models: dict[str, str]) -> dict[str, float | str]:
    """Held-out loss of each model: per-token mean CE, every document a separate forward pass."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup.model_dir)
    docs = [
        torch.tensor([[*ids, tok.eos_token_id]])
        for ids in tok(read_texts(setup.heldout_file))["input_ids"]
    ]
    gpu = setup.mode == "gpu"
    dev = torch.device("cuda" if gpu else "cpu")
    out: dict[str, float | str] = {}
    for name, path in models.items():
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
        except (OSError, ValueError) as e:
            out[name] = f"could not load {path}: {e}"
            continue
        total, n = 0.0, 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu):
            for ids in docs:
                ids = ids.to(dev)
                loss = model(input_ids=ids, labels=ids).loss  # mean over len-1 targets
                total += float(loss) * (ids.shape[1] - 1)
                n += ids.shape[1] - 1
        out[name] = total / n
        del model
    return out


def child_main(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    setup = Setup.load(workdir)
    if setup.mode == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if args.system == "eval":
        models = dict(kv.split("=", 1) for kv in args.models)
        res: dict[str, Any] = run_eval(setup, models)
    else:
        outdir = workdir / _outname(args.system, args.micro)
        outdir.mkdir(parents=True, exist_ok=True)
        if args.system == "ceiling":
            res = run_ceiling(setup, outdir, args.micro)
        else:
            res = run_hf(setup, args.system, outdir, args.micro)
    Path(args.result).write_text(json.dumps(res, indent=1))
    return 0


# --------------------------------------------------------------------------- parent


def _busy_cpu_seconds() -> float | None:
    """CPU-seconds the whole machine has spent busy (including stolen time), from /proc/stat."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Spawned:
    rc: int
    start: float  # epoch seconds when the process was started
    seconds: float
    # Cores' worth of CPU that *other* processes used while this one ran (busy machine
    # time minus the child's own CPU time): a witness for noisy timings.
    others_cores: float | None


def _spawn(cmd: list[str], log: Path, timeout: int) -> Spawned:
    """Run a command with its output to `log`, timing it and what else ran meanwhile."""
    import resource

    env = {**os.environ, **CHILD_ENV}
    busy0 = _busy_cpu_seconds()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(
                cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = time.perf_counter() - t0
    busy1 = _busy_cpu_seconds()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    others = None
    if busy0 is not None and busy1 is not None and seconds > 0:
        mine = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        others = max(0.0, (busy1 - busy0 - mine) / seconds)
    return Spawned(rc, start, seconds, others)


def _tail(log: Path, n: int = 6) -> str:
    lines = [
        ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()
    ]
    return " / ".join(lines[-n:])[-600:]


def _outname(system: str, micro: int | None) -> str:
    return system if micro is None else f"{system}-mb{micro}"


def run_child_system(
    setup: Setup, workdir: Path, system: str, micro: int | None = None
) -> dict[str, Any]:
    outdir = workdir / _outname(system, micro)
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    result = outdir / "result.json"
    cmd = [sys.executable, "-m", "bench.headline", "--system", system, "--workdir", str(workdir)]
    cmd += ["--result", str(result)] + (["--micro", str(micro)] if micro else [])
    at = f", micro-batch {micro}" if micro else ""
    print(f"[headline] {system}: running ({LABELS[system]}{at})", flush=True)
    sp = _spawn(cmd, outdir / "log.txt", setup.timeout_s)
    if sp.rc != 0 or not result.is_file():
        why = "timed out" if sp.rc == 124 else f"exit {sp.rc}"
        return {
            "system": system,
            "status": "failed",
            "reason": f"{why}: {_tail(outdir / 'log.txt')}",
        }
    res = json.loads(result.read_text())
    if res.get("status") == "ok":
        res["wall_seconds"] = res.pop("done_at") - sp.start
        res["others_cores"] = sp.others_cores
    return res


def _pitstop_has(command: str) -> bool:
    cmd = [sys.executable, "-m", "pitstop", command, "--help"]
    try:
        r = subprocess.run(
            cmd, cwd=REPO_ROOT, capture_output=True, timeout=120, env={**os.environ, **CHILD_ENV}
        )
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def _pitstop_flags(setup: Setup, cache: Path) -> list[str]:
    """The shared math: same data, max length, one epoch, tokens per step, lr, seed."""
    return [
        "--model", setup.model_dir,
        "--data", setup.train_file,
        "--max-seq-len", str(setup.max_len),
        "--tokens-per-step", str(setup.tokens_per_step),
        "--lr", str(setup.lr),
        "--seed", str(setup.seed),
        "--cache-dir", str(cache),
    ]  # fmt: skip


def run_pitstop(
    setup: Setup,
    workdir: Path,
    tuned: bool,
    micro: int | None = None,
    system: str | None = None,
) -> dict[str, Any]:
    system = system or ("pitstop_tuned" if tuned else ("pitstop_mb" if micro else "pitstop"))
    outdir = workdir / _outname(system, micro)
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    cache = outdir / "cache"  # a cold token-store cache: the whole process includes tokenizing
    pre: list[str] = []
    notes: dict[str, Any] = {}
    if tuned:
        if not _pitstop_has("tune"):
            return {
                "system": system,
                "status": "n/a",
                "reason": "`pitstop tune` does not exist yet",
            }
        tuned_yaml = outdir / "tuned.yaml"
        cmd = [sys.executable, "-m", "pitstop", "tune", *_pitstop_flags(setup, cache)]
        cmd += ["--output", str(tuned_yaml)]
        print(f"[headline] {system}: pitstop tune", flush=True)
        sp = _spawn(cmd, outdir / "tune-log.txt", setup.timeout_s)
        if sp.rc != 0 or not tuned_yaml.is_file():
            return {
                "system": system,
                "status": "failed",
                "reason": f"pitstop tune: {_tail(outdir / 'tune-log.txt')}",
            }
        notes["tune_seconds"] = sp.seconds
        shutil.rmtree(cache, ignore_errors=True)
        pre = ["--config", str(tuned_yaml)]
    run_out = outdir / "run"
    cmd = [sys.executable, "-m", "pitstop", "train", *pre, *_pitstop_flags(setup, cache)]
    cmd += ["--output", str(run_out), "--epochs", "1"]
    cmd += ["--micro-batch-size", str(micro)] if micro else []
    cmd += ["--compile", "on"] if system == "pitstop_compiled" else []
    print(f"[headline] {system}: {LABELS[system]}" + (f" {micro}" if micro else ""), flush=True)
    sp = _spawn(cmd, outdir / "log.txt", setup.timeout_s)
    summary_path = run_out / "summary.json"
    if sp.rc != 0 or not summary_path.is_file():
        why = "timed out" if sp.rc == 124 else f"exit {sp.rc}"
        return {
            "system": system,
            "status": "n/a",
            "reason": f"`pitstop train` failed ({why}): {_tail(outdir / 'log.txt', 3)}",
        }
    s = json.loads(summary_path.read_text())
    losses: list[float] = []
    metrics = run_out / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec.get("loss"), (int, float)):
                losses.append(float(rec["loss"]))
    choices = s.get("choices") or {}
    shown = ("batching", "micro_batch", "loader_workers", "compile", "attention", "precision")
    picked = ", ".join(
        f"{k} {v.get('value') if isinstance(v, dict) else v}"
        for k, v in choices.items()
        if k in shown
    )
    return {
        "system": system,
        "status": "ok",
        "config": picked or "defaults",
        "trained_tokens": s.get("trained_tokens"),
        "seen_tokens": s.get("seen_tokens"),
        "positions": s.get("padded_tokens"),
        "optimizer_steps": s.get("optimizer_steps"),
        "train_seconds": s.get("train_seconds"),
        "pitstop_wall_seconds": s.get("wall_seconds"),
        "pitstop_mfu": s.get("mfu"),
        "losses": losses,
        "final_loss_summary": s.get("final_loss"),
        "wall_seconds": sp.seconds,
        "others_cores": sp.others_cores,
        "model_dir": str(run_out / "final"),
        "peak_memory_bytes": s.get("peak_memory_bytes") if setup.mode == "gpu" else None,
        # What pitstop measured of compile on its first steps (a compiling run without a
        # cached measurement): the compile, an eager and a compiled step.
        "compile_measured": ((choices.get("compile") or {}).get("measured") or {}).get("measured"),
        **notes,
    }


def run_sweep(setup: Setup, workdir: Path, system: str) -> dict[str, Any]:
    """Run `system` at every micro-batch of the sweep; its fastest (train clock) is its result.

    The other points stay in `sweep` for the report; their final models are deleted (a 1.1B
    model is 4 GB a copy) and only the best one is evaluated."""
    points = []
    for m in setup.sweep:
        packed = system in ("trl", "ceiling", "pitstop_mb")
        if packed and setup.rows_per_step % m:
            points.append({"micro": m, "status": "n/a",
                           "reason": f"{setup.rows_per_step} rows per step do not split into {m}"})  # fmt: skip
            continue
        if system == "pitstop_mb":
            r = run_pitstop(setup, workdir, tuned=False, micro=m)
        else:
            r = run_child_system(setup, workdir, system, micro=m)
        r["micro"] = m
        points.append(r)
        print(f"[headline] {system} micro-batch {m}: {r.get('status')} "
              + (f"{r['trained_tokens'] / r['train_seconds']:,.0f} tok/s" if _tps(r) else
                 str(r.get("reason", ""))[:200]), flush=True)  # fmt: skip
    ok = [r for r in points if _tps(r)]
    if not ok:
        why = "; ".join(f"{r['micro']}: {r.get('reason', r.get('status'))}" for r in points)
        return {"system": system, "status": "failed", "reason": f"every sweep point failed: {why}"}
    best = max(ok, key=_tps)
    for r in ok:
        if r is not best:
            shutil.rmtree(Path(r["model_dir"]), ignore_errors=True)
    out = dict(best)
    sizes = "/".join(str(m) for m in setup.sweep)
    out["config"] = f"best of micro-batch {sizes}: {best.get('config', '')}"
    out["sweep"] = [
        {k: r.get(k) for k in ("micro", "status", "reason", "config", "trained_tokens",
                               "train_seconds", "wall_seconds", "peak_memory_bytes")}
        for r in points
    ]  # fmt: skip
    return out


def _tps(r: dict[str, Any]) -> float:
    ok = r.get("status") == "ok" and r.get("train_seconds")
    return r["trained_tokens"] / r["train_seconds"] if ok else 0.0


def flops_per_token(setup: Setup) -> float:
    """6·N_non-embedding + 12·L·d·T with T = max length (pitstop.measure.flops when present)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(setup.model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    try:
        from pitstop.measure.flops import flops_model

        return flops_model(model).per_token(setup.max_len)
    except ImportError:
        emb = {id(p) for p in model.get_input_embeddings().parameters()}
        n = sum(p.numel() for p in model.parameters() if id(p) not in emb)
        return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * setup.max_len


def device_peak(setup: Setup, workdir: Path) -> tuple[float | None, str]:
    """The MFU denominator: the datasheet bf16 peak on a GPU; the measured fp32 matmul peak on a CPU.

    On a CPU, other processes can only lower a measurement, so the highest rate seen
    on this machine (same CPU, threads and torch; kept in WORKDIR/cpu_peak_best.json)
    is used, and the measurement is repeated every run.
    """
    if setup.mode == "gpu":
        import torch

        from pitstop.measure.peak import gpu_peak

        return gpu_peak(torch.cuda.get_device_name(0), "bf16")
    import torch

    from pitstop.measure.peak import measure_cpu_peak

    key = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    now = max(measure_cpu_peak(repeats=10) for _ in range(3))
    path = workdir / "cpu_peak_best.json"
    best = now
    try:
        rec = json.loads(path.read_text())
        if rec.get("key") == key:
            best = max(best, float(rec["flops"]))
    except (OSError, ValueError, KeyError):
        pass
    path.write_text(json.dumps({"key": key, "flops": best}))
    return best, (
        f"best fp32 1024³ matmul rate seen on this machine with {key['threads']} threads "
        f"(this run measured {now / 1e9:,.0f} GFLOP/s)"
    )


def final_loss(res: dict[str, Any]) -> float | None:
    """Mean training loss over the last 10% of optimizer steps (at least one)."""
    losses = res.get("losses") or []
    if not losses:
        return res.get("final_loss_summary")
    k = max(1, round(0.1 * len(losses)))
    return sum(losses[-k:]) / k


def summarize(
    setup: Setup, results: dict[str, dict[str, Any]], fpt: float, peak: float | None
) -> tuple[list[list[str]], list[str]]:
    ok = {k: r for k, r in results.items() if r.get("status") == "ok" and r.get("train_seconds")}
    for r in ok.values():
        r["tps_train"] = r["trained_tokens"] / r["train_seconds"]
        r["tps_wall"] = r["trained_tokens"] / r["wall_seconds"] if r.get("wall_seconds") else None
        r["mfu"] = r["tps_train"] * fpt / peak if peak else None
    peers = [k for k in PEERS if k in ok]
    best = max(peers, key=lambda k: ok[k]["tps_train"]) if peers else None
    ceiling = ok.get("ceiling")

    def ratio(r: dict[str, Any], ref: dict[str, Any] | None, key: str) -> str:
        if ref is None or not r.get(key) or not ref.get(key):
            return "n/a"
        return f"{r[key] / ref[key]:.2f}×"

    best_r = ok[best] if best else None
    rows = []
    for name in SYSTEMS:
        if name not in results:
            continue
        r = results[name]
        if name not in ok:
            why = r.get("reason", r.get("status", "n/a"))
            rows.append([LABELS[name], why] + ["n/a"] * (len(HEADERS) - 2))
            continue
        held = r.get("heldout_loss")
        mfu = r["mfu"]
        rows.append(
            [
                LABELS[name] + (" ★best peer" if name == best else ""),
                r.get("config", ""),
                f"{r['trained_tokens'] / max(1, r['optimizer_steps']):,.0f}",
                f"{r['tps_train']:,.0f}",
                fmt(r["tps_wall"], ",.0f"),
                f"{ratio(r, best_r, 'tps_train')} / {ratio(r, best_r, 'tps_wall')}",
                f"{r['tps_train'] / ceiling['tps_train'] * 100:.0f}%" if ceiling else "n/a",
                f"{mfu * 100:.1f}%" if mfu is not None else "n/a",
                f"{r['seen_tokens'] / r['positions'] * 100:.0f}%" if r.get("positions") else "n/a",
                fmt(final_loss(r), ".3f"),
                fmt(held, ".3f") if isinstance(held, float) else "n/a",
                f"{r['train_seconds']:.0f} / {r['wall_seconds']:.0f}"
                if r.get("wall_seconds")
                else "n/a",
                _gib(r.get("peak_memory_bytes")),
            ]
        )
    goals: list[str] = []
    for name in ("pitstop", "pitstop_compiled", "pitstop_tuned"):
        p = ok.get(name)
        if p is None and name == "pitstop_compiled" and name not in results:
            continue  # not asked for (the short run)
        if p is None:
            goals.append(
                f"- {name}: not measured ({results.get(name, {}).get('reason', 'not run')})"
            )
            continue
        parts = []
        if best:
            x = p["tps_train"] / ok[best]["tps_train"]
            parts.append(
                f"{x:.2f}× the best peer ({best}) — goal ≥ {GOAL_VS_PEER}×: {'met' if x >= GOAL_VS_PEER else 'NOT met'}"
            )
        if "hf_compile" in ok:  # --long: the compiled peer
            x = p["tps_train"] / ok["hf_compile"]["tps_train"]
            met = "met" if x >= GOAL_VS_COMPILED_PEER else "NOT met"
            parts.append(
                f"{x:.2f}× the HF Trainer with torch_compile — goal ≥ {GOAL_VS_COMPILED_PEER}×: {met}"
            )
        if ceiling:
            c = p["tps_train"] / ceiling["tps_train"]
            parts.append(
                f"{c * 100:.0f}% of the ceiling — goal ≥ {GOAL_VS_CEILING * 100:.0f}%: {'met' if c >= GOAL_VS_CEILING else 'NOT met'}"
            )
        hp, hb = p.get("heldout_loss"), ok[best].get("heldout_loss") if best else None
        if isinstance(hp, float) and isinstance(hb, float):
            gap = hp - hb
            parts.append(
                f"held-out loss {gap:+.3f} vs the best peer — goal ≤ +{GOAL_LOSS_GAP}: {'met' if gap <= GOAL_LOSS_GAP else 'NOT met'}"
            )
        goals.append(f"- {name}: " + "; ".join(parts))
    return rows, goals


def _gib(n: float | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "n/a"


def compile_notes(
    setup: Setup, results: dict[str, dict[str, Any]], fpt: float, peak: float | None
) -> list[str]:
    """The compiled pitstop row's own measurement: its eager and compiled steps as MFU (the
    step's tokens x FLOPs per token over the step's seconds and the peak), and the compile."""
    out = []
    for name in ("pitstop", "pitstop_compiled"):
        m = results.get(name, {}).get("compile_measured")
        if not m or not peak:
            continue
        steps = results[name].get("optimizer_steps") or 1
        per_step = (results[name].get("trained_tokens") or 0) / steps
        mfu = {k: per_step / m[f"{k}_step_seconds"] * fpt / peak for k in ("eager", "compiled")}
        out.append(
            f"{name}: pitstop measured compile on its first steps: a {m['compile_seconds']:.1f} s "
            f"compile, steps of {m['eager_step_seconds']:.3f} s eager and "
            f"{m['compiled_step_seconds']:.3f} s compiled ({m.get('speedup', 0):.2f}x): MFU "
            f"{mfu['eager'] * 100:.1f}% eager, {mfu['compiled'] * 100:.1f}% compiled "
            f"({per_step:,.0f} trained tokens a step)."
        )
    return out


def sweep_notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """One line per swept system: every micro-batch it ran at, and what each did."""
    out = []
    for name, r in results.items():
        if not r.get("sweep"):
            continue
        parts = []
        for p in r["sweep"]:
            if _tps(p):
                wall = p.get("wall_seconds")
                whole = f" / {p['trained_tokens'] / wall:,.0f}" if wall else ""
                parts.append(
                    f"{p['micro']}: {_tps(p):,.0f}{whole} tok/s, {_gib(p.get('peak_memory_bytes'))}"
                )
            else:
                parts.append(f"{p['micro']}: {p.get('status')} ({str(p.get('reason'))[:120]})")
        out.append(f"{name} sweep (micro-batch: train / whole-process trained tok/s, peak memory): "
                   + "; ".join(parts) + ".")  # fmt: skip
    return out


HEADERS = [
    "system",
    "configuration",
    "trained tokens / step",
    "trained tok/s (train)",
    "trained tok/s (whole process)",
    "vs best peer (train / whole)",
    "vs ceiling",
    "MFU",
    "padding efficiency",
    "train loss (last 10% steps)",
    "held-out loss",
    "train / whole s",
    "peak memory",  # GPU mode only (the caching allocator's peak)
]


def _cpu_bf16() -> bool:
    """Whether this CPU has native bf16 (the condition for the hf_bf16 peer)."""
    from pitstop.probe import cpu_has_bf16

    return cpu_has_bf16()


def parent_main(args: argparse.Namespace) -> int:
    if args.long:
        sizes = GPU_LONG if args.gpu else CPU_LONG
    else:
        sizes = GPU_FULL if args.gpu else (CPU_QUICK if args.quick else CPU_FULL)
    if args.sweep is not None:  # e.g. one point on a lent GPU with minutes to spare
        points = tuple(int(x) for x in args.sweep.split(",") if x.strip())
        sizes = dataclasses.replace(sizes, sweep=points)
    if args.vocab:
        spec = dataclasses.replace(sizes.model, vocab_size=args.vocab, pad_vocab=True)
        sizes = dataclasses.replace(sizes, model=spec)
    if args.gpu:
        import torch

        if not torch.cuda.is_available() and not args.dry_run:
            print("--gpu needs a CUDA device (torch.cuda.is_available() is False); "
                  "use --dry-run to print the GPU plan here", file=sys.stderr)  # fmt: skip
            return 2
    short_only = ("pitstop_mb", "hf_compile", "pitstop_compiled")
    default = GPU_SYSTEMS if args.gpu else tuple(s for s in SYSTEMS if s not in short_only)
    if args.long:
        default = tuple(s for s in LONG_SYSTEMS if not (args.gpu and s == "hf_slow"))
    if not args.gpu and not _cpu_bf16():
        default = tuple(s for s in default if s != "hf_bf16")
    systems = args.systems.split(",") if args.systems else list(default)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args, sizes, systems)
    suffix = ("-gpu" if args.gpu else ("-quick" if args.quick else "")) + _vocab_suffix(args)
    workdir = Path(args.workdir or REPO_ROOT / ".pitstop-cache" / "bench" / f"headline{suffix}")
    workdir.mkdir(parents=True, exist_ok=True)
    if not args.gpu:  # CPU mode: no child (pitstop included) may pick up a GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.report_only:  # re-render the last run's table (e.g. after a formatting change)
        setup = Setup.load(workdir)
        saved = json.loads((workdir / "results.json").read_text())
        if "results" not in saved:
            saved = {"command": f"python -m bench.headline{' --' + suffix[1:] if suffix else ''}",
                     "seconds": None, "results": saved}  # fmt: skip
        peak, peak_src = device_peak(setup, workdir)
        return report(args, setup, workdir, saved, peak, peak_src, flops_per_token(setup))
    t_all = time.perf_counter()
    setup = build_setup(args, sizes, workdir)
    print(f"[headline] {setup.notes[0]}", flush=True)
    peak, peak_src = device_peak(setup, workdir)
    fpt = flops_per_token(setup)

    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        if setup.sweep and system in SWEPT:
            res = run_sweep(setup, workdir, system)
        elif system == "pitstop_mb":
            res = {"system": system, "status": "n/a", "reason": "no sweep in this mode"}
        elif system == "hf_bf16" and (args.gpu or not _cpu_bf16()):
            why = "GPU mode: hf_dynamic is bf16 already" if args.gpu else "no native CPU bf16"
            res = {"system": system, "status": "n/a", "reason": why}
        elif system in ("pitstop", "pitstop_tuned", "pitstop_compiled"):
            res = run_pitstop(setup, workdir, tuned=system == "pitstop_tuned", system=system)
        else:
            res = run_child_system(setup, workdir, system)
        results[system] = res
        # Each system's result as it lands: a run cut short renders with --report-only.
        partial = {"command": command_line(), "seconds": None, "results": results}
        (workdir / "results.json").write_text(json.dumps(partial, indent=1, default=str))
        if res.get("status") == "ok":
            print(
                f"[headline] {system}: {res['trained_tokens']:,} trained tokens in "
                f"{res['train_seconds']:.1f} s train / {res.get('wall_seconds', 0):.1f} s whole",
                flush=True,
            )
        else:
            print(f"[headline] {system}: {res['status']} — {res.get('reason')}", flush=True)

    models = {k: r["model_dir"] for k, r in results.items() if r.get("status") == "ok"}
    if models and args.no_eval:
        print("[headline] --no-eval: held-out loss not evaluated", flush=True)
    elif models:
        print("[headline] evaluating held-out loss", flush=True)
        ev_path = workdir / "eval.json"
        cmd = [
            sys.executable,
            "-m",
            "bench.headline",
            "--system",
            "eval",
            "--workdir",
            str(workdir),
        ]
        cmd += ["--result", str(ev_path), "--models", *[f"{k}={v}" for k, v in models.items()]]
        sp = _spawn(cmd, workdir / "eval-log.txt", setup.timeout_s)
        evals = json.loads(ev_path.read_text()) if sp.rc == 0 and ev_path.is_file() else {}
        if sp.rc != 0:
            print(f"[headline] evaluation failed: {_tail(workdir / 'eval-log.txt')}", flush=True)
        for k, v in evals.items():
            results[k]["heldout_loss"] = v
    saved = {"command": command_line(), "seconds": time.perf_counter() - t_all, "results": results}
    (workdir / "results.json").write_text(json.dumps(saved, indent=1, default=str))
    return report(args, setup, workdir, saved, peak, peak_src, fpt)


def report(
    args: argparse.Namespace,
    setup: Setup,
    workdir: Path,
    saved: dict[str, Any],
    peak: float | None,
    peak_src: str,
    fpt: float,
) -> int:
    """Print the table and goals; write the results file."""
    results: dict[str, dict[str, Any]] = saved["results"]
    suffix = ("-gpu" if setup.mode == "gpu" else ("-quick" if setup.quick else "")) + setup.suffix
    rows, goals = summarize(setup, results, fpt, peak)
    headers = HEADERS
    if setup.mode != "gpu":  # no allocator peak on CPU: the table stays as it was
        headers, rows = HEADERS[:-1], [r[: len(HEADERS) - 1] for r in rows]
    table = markdown_table(headers, rows)
    info = machine()
    cmd_str = saved["command"]
    trained = {r["trained_tokens"] for r in results.values() if r.get("status") == "ok"}
    notes = [
        f"Model: {setup.model_desc}; {setup.precision}, attention {setup.attn}.",
        f'Data: bundled KJV chapters as plain text ({{"text"}} records, loss on every token); {setup.notes[0]}.',
        f"Math shared by all: one epoch, max length {setup.max_len}, lr {setup.lr} (5% warm-up, cosine to 10%), "
        f"AdamW β=(0.9, 0.95), no weight decay, clip 1.0, seed {setup.seed}.",
        f"Tokens per optimizer step: {setup.tokens_per_step:,} target. Packed systems: "
        f"{setup.rows_per_step} rows of {setup.max_len} per step. HF systems: "
        f"{setup.docs_per_step} documents per step ({setup.hf_micro} × {setup.hf_accum} accum) = "
        f"{setup.tokens_per_step:,} / mean document length {setup.mean_doc_len:.0f}, rounded.",
        "Trained tokens are loss targets (every token but each document's first). "
        + (
            "Every system trained on the same number of tokens."
            if len(trained) == 1
            else f"Trained-token totals differ between systems: {sorted(trained)}."
        ),
        f"MFU: trained tokens/s (train clock) × {fpt / 1e6:.1f} MFLOP/token "
        "(6·N_non-embedding + 12·L·d·T, T = max length) over the device peak "
        f"{(peak or 0) / 1e9:,.0f} GFLOP/s ({peak_src}).",
        (
            "One peak for every system, the GPU's bf16 one (every system runs bf16). "
            if setup.mode == "gpu"
            else "One peak for every system, the fp32 one, so the column compares systems: a "
            "system under bf16 autocast (hf_bf16, pitstop and the ceiling where the CPU has "
            "native bf16) can pass 100% of it (pitstop's own summary.json divides by the "
            "measured bf16 peak). "
        )
        + "The attention term uses T = max length, which overstates the FLOPs of rows "
        "shorter than that (hf_dynamic).",
        "train / whole s: the train-only clock (epoch start to last optimizer step; pitstop's "
        "train_seconds) and the whole subprocess (start to final model saved).",
        f"Machine: {describe_machine(info)}. Whole benchmark took {fmt(saved['seconds'], '.0f')} s.",
        "CPU used by other processes while each system ran, in cores of "
        f"{info['cores']} (busy machine time minus the system's own): "
        + ", ".join(
            f"{k} {r['others_cores']:.2f}"
            for k, r in results.items()
            if r.get("others_cores") is not None
        )
        + (
            " — the machine was shared: treat these timings as noisy."
            if max((r.get("others_cores") or 0.0 for r in results.values()), default=0.0) > 0.25
            else "."
        ),
    ]
    notes += sweep_notes(results)
    notes += compile_notes(setup, results, fpt, peak)
    for name in ("pitstop", "pitstop_compiled", "pitstop_tuned"):
        r = results.get(name, {})
        if r.get("status") == "ok" and r.get("pitstop_mfu") is not None:
            notes.append(
                f"{name} summary.json: mfu {r['pitstop_mfu']}, wall_seconds {r.get('pitstop_wall_seconds')} (its own accounting)."
            )
        if r.get("tune_seconds"):
            notes.append(
                f"{name}: `pitstop tune` took {r['tune_seconds']:.0f} s (not in the table's times)."
            )
    body = "\n".join(
        [
            table,
            "",
            "Goals (pitstop ≥ 1.5× the best peer, ≥ 95% of the ceiling, held-out loss within 0.05 of the best peer):",
            "",
            *goals,
            "",
            "Notes:",
            "",
            *[f"- {n}" for n in notes],
        ]
    )
    print()
    print(table)
    print()
    print("\n".join(goals))
    if not args.no_write:
        out = Path(args.out) if args.out else RESULTS_DIR / f"headline{suffix}.md"
        title = "Headline: pitstop vs Hugging Face Trainer, TRL, and the ceiling"
        path = write_result("headline", title, body, command=cmd_str, machine_info=info, path=out)
        print(f"\n[headline] wrote {path}")
    return 0


def dry_run(args: argparse.Namespace, sizes: Sizes, systems: list[str]) -> int:
    """Print the plan: model config and parameter count (built on the meta device), per-system setup."""
    import torch
    from transformers import AutoModelForCausalLM

    from pitstop.tiny import llama_config

    spec = sizes.model
    cfg = llama_config(
        spec.vocab_size, layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
        intermediate=spec.intermediate,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    flash = importlib.util.find_spec("flash_attn") is not None
    plan = {
        "mode": "gpu" if args.gpu else ("quick" if args.quick else "cpu"),
        "model": dataclasses.asdict(spec),
        "parameters": n,
        "precision": "bf16" if args.gpu else "fp32",
        "attention": "flash_attention_2" if (args.gpu and flash) else "sdpa",
        "max_len": sizes.max_len,
        "tokens_per_step": sizes.tokens_per_step,
        "lr": args.lr or sizes.lr,
        "systems": systems,
        "cuda_available": torch.cuda.is_available(),
    }
    print(json.dumps(plan, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.headline",
        description="pitstop vs HF Trainer, TRL and the bare-loop ceiling: one epoch, same math.",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny model, a few dozen docs, max length 256"
    )
    p.add_argument(
        "--gpu", action="store_true", help="bf16, a ~1B Llama, flash-attn when installed"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan (works without CUDA)")
    p.add_argument(
        "--long", action="store_true",
        help="a run long enough for compile to pay: every chapter (GPU: five times over), "
        "adding the HF Trainer with torch_compile and pitstop --compile on; results go to "
        "headline[-gpu]-long.md",
    )  # fmt: skip
    p.add_argument(
        "--sweep", help="GPU: the micro-batch sizes the swept systems try (default 4,8,16)"
    )
    p.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--train-chapters", type=int, help="training chapters (default: by mode)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: by mode)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument(
        "--vocab", type=int,
        help="model vocabulary (e.g. 32768: the loss head of a real tokenizer); results go to "
        "headline[-gpu]-vN.md",
    )  # fmt: skip
    p.add_argument("--data-seed", type=int, default=1234, help="seed of the chapter subset")
    p.add_argument("--workdir", help="scratch directory (default .pitstop-cache/bench/headline*)")
    p.add_argument("--out", help="results file (default bench/results/headline[-quick|-gpu].md)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument(
        "--no-eval", action="store_true", help="skip the held-out loss (a lent GPU's minutes)"
    )
    p.add_argument(
        "--report-only", action="store_true", help="re-render the last run's table from WORKDIR"
    )
    # child-process plumbing
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.system:
        return child_main(args)
    if not args.gpu and not args.quick:
        try:
            import torch

            args.gpu = torch.cuda.is_available()  # automatic GPU mode
        except ImportError:
            pass
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
