"""`estimate_planned_run`: the estimate of a planned run from what a user knows about it.

The library behind `pitstop estimate` (and the demo): a model directory or a parameter
count, a dataset/store or a token count, a GPU name or a measured profile. Every
problem with the request is reported at once (`estimate_problems`), before anything
is read or prepared.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pitstop.errors import ConfigError
from pitstop.measure.cost_model import shape_from_model_dir, shape_from_params
from pitstop.report.estimate import (
    DEFAULT_HEADROOM,
    DEFAULT_SCALING,
    Estimate,
    data_tokens,
    estimate,
)
from pitstop.report.gpus import Gpu, custom_gpu, find_gpu, get_gpu
from pitstop.report.measured import Measured, load_measured

PRECISIONS = ("bf16", "fp16", "fp32")
ATTENTIONS = ("sdpa", "flash_attention_2", "flex_attention", "eager")


def estimate_problems(
    *,
    model: str | None,
    params: float | None,
    data: str | None,
    tokens: int | None,
    gpu: str | None,
    from_profile: str | None,
    precision: str | None,
    attention: str,
    lora_r: int | None,
    load_in_4bit: bool,
    gpu_tflops: float | None = None,
    gpu_memory_gib: float | None = None,
) -> list[str]:
    """Every problem with an estimate request, each naming the flag that fixes it."""
    problems: list[str] = []
    if not model and params is None:
        problems.append("give --model DIR (exact) or --params N (a rough Llama-shaped guess)")
    if data and tokens is not None:
        problems.append("give --data or --tokens, not both")
    if not data and tokens is None:
        problems.append("give --data FILE_OR_STORE or --tokens T: how much data the run sees")
    custom = gpu_tflops is not None or gpu_memory_gib is not None
    if not gpu and not from_profile and not custom:
        problems.append("give --gpu NAME (with an optional --mfu) or --from-profile PROFILE")
    if precision is not None and precision not in PRECISIONS:
        problems.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if attention not in ATTENTIONS:
        problems.append(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if load_in_4bit and lora_r is None:
        problems.append(
            "--load-in-4bit trains a LoRA adapter on frozen 4-bit weights; add --lora-r R"
        )
    if gpu or custom:
        try:
            _device(gpu, gpu_tflops, gpu_memory_gib, None)
        except ConfigError as e:
            problems += e.problems
    return problems


def _device(
    gpu: str | None, tflops: float | None, memory_gib: float | None, price: float | None
) -> Gpu | None:
    """The table's --gpu, or the user's own card (--gpu-tflops / --gpu-memory-gib)."""
    if tflops is not None or memory_gib is not None:
        return custom_gpu(gpu, tflops, memory_gib, price)
    return get_gpu(gpu) if gpu else None


def profile_settings(profile: Measured | None) -> dict[str, Any]:
    """The plan a measured run ran with (its config: pitstop's RunConfig or HF arguments):
    gradient checkpointing, micro-batch rows, row length, LoRA rank, 4-bit, optimizer.
    Only what the run recorded; `estimate --from-profile` keeps these unless told otherwise."""
    cfg = profile.config if profile else None
    if not isinstance(cfg, dict):
        return {}
    out: dict[str, Any] = {}
    ck = cfg.get("gradient_checkpointing", cfg.get("activation_checkpointing"))
    if ck is not None:
        out["gradient_checkpointing"] = bool(ck)
    seq = next(
        (cfg[k] for k in ("max_seq_len", "max_length", "max_seq_length") if cfg.get(k)), None
    )
    if isinstance(seq, int) and seq > 0:
        out["max_seq_len"] = seq
    rows = cfg.get("micro_batch_size") or cfg.get("per_device_train_batch_size")
    if not rows and cfg.get("tokens_per_micro_batch") and seq:
        rows = max(1, int(cfg["tokens_per_micro_batch"]) // int(seq))
    if not rows:  # pitstop's auto micro-batch: the choice the run recorded ("2 rows")
        got = (profile.choices if profile else {}).get("micro_batch") or {}
        m = re.match(r"(\d+) rows", str(got.get("value", "")) if isinstance(got, dict) else "")
        rows = int(m.group(1)) if m else None
    if isinstance(rows, int) and rows > 0:
        out["micro_batch_size"] = rows
    if isinstance(cfg.get("lora_r"), int):
        out["lora_r"] = cfg["lora_r"]
        out["load_in_4bit"] = bool(cfg.get("load_in_4bit"))
    optim = str(cfg.get("optimizer") or cfg.get("optim") or "")
    if optim:
        out["optimizer"] = "adamw_8bit" if "8bit" in optim else "adamw"
    return out


def _describe_kept(kept: dict[str, Any]) -> str:
    names = {
        "gradient_checkpointing": lambda v: f"gradient checkpointing {'on' if v else 'off'}",
        "micro_batch_size": lambda v: f"micro-batch {v} rows",
        "max_seq_len": lambda v: f"rows of {v} tokens",
        "lora_r": lambda v: f"LoRA r={v}",
        "load_in_4bit": lambda v: "4-bit base" if v else "",
        "optimizer": lambda v: f"optimizer {v}",
    }
    parts = [names[k](v) for k, v in kept.items() if k in names and names[k](v)]
    return (
        "kept from the measured run: " + ", ".join(parts) + " (flags such as --micro-batch-size, "
        "--max-seq-len, --no-gradient-checkpointing, --optimizer change them)"
    )


def estimate_planned_run(
    *,
    model: str | None = None,
    params: float | None = None,
    data: str | None = None,
    tokens: int | None = None,
    epochs: float = 1.0,
    max_seq_len: int | None = None,
    from_profile: str | None = None,
    gpu: str | None = None,
    mfu: float | None = None,
    gpu_counts: Sequence[int] = (1, 2, 4, 8),
    scaling: float = DEFAULT_SCALING,
    price: float | None = None,
    lora_r: int | None = None,
    load_in_4bit: bool = False,
    micro_batch_size: int | None = None,
    precision: str | None = None,
    attention: str = "sdpa",
    gradient_checkpointing: bool | None = None,
    headroom: float = DEFAULT_HEADROOM,
    cache_dir: str | None = None,
    gpu_tflops: float | None = None,
    gpu_memory_gib: float | None = None,
    optimizer: str | None = None,
    save_steps: int | None = None,
    tokens_per_step: int | None = None,
    disk_write_gbps: float | None = None,
) -> Estimate:
    """Memory, time and cost of a planned run (ConfigError listing every problem first).

    `precision` None picks bf16 (fp16 on a GPU without bf16; for a CPU profile, the
    precision that run recorded, else fp32). With `from_profile`, a setting left None (micro-batch,
    row length, gradient checkpointing, LoRA, optimizer) is the measured run's own."""
    problems = estimate_problems(
        model=model,
        params=params,
        data=data,
        tokens=tokens,
        gpu=gpu,
        from_profile=from_profile,
        precision=precision,
        attention=attention,
        lora_r=lora_r,
        load_in_4bit=load_in_4bit,
        gpu_tflops=gpu_tflops,
        gpu_memory_gib=gpu_memory_gib,
    )
    if problems:
        raise ConfigError(problems, header=f"invalid estimate ({len(problems)} problem(s)):")
    device = _device(gpu, gpu_tflops, gpu_memory_gib, price)
    profile = load_measured(from_profile) if from_profile else None
    given = {"gradient_checkpointing": gradient_checkpointing, "micro_batch_size": micro_batch_size,
             "max_seq_len": max_seq_len, "lora_r": lora_r, "optimizer": optimizer}  # fmt: skip
    kept = {k: v for k, v in profile_settings(profile).items() if given.get(k) is None}
    if "lora_r" not in kept:
        kept.pop("load_in_4bit", None)
    gradient_checkpointing = bool(kept.get("gradient_checkpointing", gradient_checkpointing))
    micro_batch_size = int(kept.get("micro_batch_size", micro_batch_size or 1))
    max_seq_len = kept.get("max_seq_len", max_seq_len)
    lora_r = kept.get("lora_r", lora_r)
    load_in_4bit = bool(kept.get("load_in_4bit", load_in_4bit))
    optimizer = kept.get("optimizer", optimizer or "adamw")
    if precision is None:
        dev = device or (find_gpu(profile.device) if profile else None)
        if dev is not None:
            precision = "bf16" if dev.bf16 else "fp16"
        elif profile is not None:  # a CPU profile: the precision that run trained in
            ran = profile.choices.get("precision")
            ran = ran.get("value") if isinstance(ran, dict) else None
            precision = ran if ran in ("bf16", "fp32") else "fp32"
        else:
            precision = "bf16"
    assert model is not None or params is not None  # estimate_problems checked it
    shape = shape_from_model_dir(model) if model else shape_from_params(float(params or 0))
    toks = data_tokens(data, tokens, model_dir=model, max_seq_len=max_seq_len, cache_dir=cache_dir)
    return estimate(
        shape,
        tokens=toks,
        epochs=epochs,
        seq_len=max_seq_len,
        micro_batch_size=micro_batch_size,
        precision=precision,
        attention=attention,
        gradient_checkpointing=gradient_checkpointing,
        lora_r=lora_r,
        load_in_4bit=load_in_4bit,
        gpu=device,
        mfu=mfu,
        profile=profile,
        gpu_counts=list(gpu_counts),
        scaling=scaling,
        price=price,
        headroom=headroom,
        optimizer=optimizer,
        save_steps=save_steps,
        tokens_per_step=tokens_per_step,
        disk_write_gbps=disk_write_gbps,
        kept_from_profile=_describe_kept(kept) if kept else None,
    )
