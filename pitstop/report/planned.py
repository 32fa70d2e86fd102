"""`estimate_planned_run`: the estimate of a planned run from what a user knows about it.

The library behind `pitstop estimate` (and the demo): a model directory or a parameter
count, a dataset/store or a token count, a GPU name or a measured profile. Every
problem with the request is reported at once (`estimate_problems`), before anything
is read or prepared.
"""

from __future__ import annotations

from collections.abc import Sequence

from pitstop.errors import ConfigError
from pitstop.report.estimate import (
    DEFAULT_HEADROOM,
    DEFAULT_SCALING,
    Estimate,
    data_tokens,
    estimate,
    load_measured,
)
from pitstop.report.gpus import Gpu, custom_gpu, find_gpu, get_gpu
from pitstop.report.memory import shape_from_model_dir, shape_from_params

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
    micro_batch_size: int = 1,
    precision: str | None = None,
    attention: str = "sdpa",
    gradient_checkpointing: bool = False,
    headroom: float = DEFAULT_HEADROOM,
    cache_dir: str | None = None,
    gpu_tflops: float | None = None,
    gpu_memory_gib: float | None = None,
    optimizer: str = "adamw",
) -> Estimate:
    """Memory, time and cost of a planned run (ConfigError listing every problem first).

    `precision` None picks bf16 (fp16 on a GPU without bf16, fp32 for a CPU profile,
    where pitstop trains in fp32)."""
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
    if precision is None:
        dev = device or (find_gpu(profile.device) if profile else None)
        if dev is not None:
            precision = "bf16" if dev.bf16 else "fp16"
        elif profile is not None:
            precision = "fp32"  # a CPU profile: pitstop trains in fp32 there
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
    )
