"""The self-test's attention checks (bench/gpu_selftest.py; docs/gpu.md says what each
protects against):

- `check_packed`: per kernel, pitstop's own start-up self-check (train/packcheck.py);
- `check_window`: `sdpa_docs` (and flash_attention_2 where it runs) on models with sliding
  windows, a packed micro-batch against each document alone under eager attention;
- `check_backends`: `sdpa_docs` forward+backward with SDPA's math backend ruled out, so a
  silent fallback to the math kernel (every T x T score materialised) is an error;
- `check_model`: the start-up self-check on the user's own model directory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_checks_util import (
    VOCAB,
    Row,
    no_tf32,
    packed_rows,
    relative_difference,
    short_error,
    tiny_llama,
)

WINDOW = 8
# Largest |packed - alone| relative to the largest |alone| logit, per precision of the
# packed forward (the reference is always eager fp32).
WINDOW_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def kernels_here(dev: torch.device) -> list[tuple[str, str | None]]:
    """(kernel, why it cannot run here or None), for every kernel pitstop can train with."""
    from pitstop import probe

    if dev.type != "cuda":
        return [("sdpa_docs", None), ("sdpa", None), ("eager", None),
                ("flex_attention", "CPU: checked on GPUs only"),
                ("flash_attention_2", "needs a CUDA GPU")]  # fmt: skip
    info, _ = probe.detect_device("cuda")
    flex_ok, flex_why = probe.flex_attention_status(info)
    flash_ok, flash_why = probe.flash_attn_status(info, "bf16")
    return [("sdpa_docs", None), ("sdpa", None), ("eager", None),
            ("flex_attention", None if flex_ok else flex_why),
            ("flash_attention_2", None if flash_ok else flash_why)]  # fmt: skip


def check_packed(dev: torch.device, precision: str) -> list[Row]:
    from pitstop.train.attention_check import packed_attention_check

    rows = []
    autocast = torch.bfloat16 if precision == "bf16" else None
    for kernel, why_not in kernels_here(dev):
        name = f"packed attention: {kernel}"
        if why_not:
            rows.append(Row(name, "skip", why_not))
            continue
        try:
            model = tiny_llama(kernel, dev)
            check, fallback = packed_attention_check(model, dev, kernel, autocast, precision)
        except Exception as e:  # one kernel failing does not hide the others' rows
            rows.append(Row(name, "FAIL", f"raised {short_error(e)}"))
            continue
        if fallback is not None:
            rows.append(Row(name, "FAIL", f"did not run: {fallback.reason}"))
            continue
        rows.append(Row(name, "pass" if check.ok else "FAIL", check.summary()))
    return rows


# --- sliding windows -------------------------------------------------------------------


def window_configs(window: int = WINDOW) -> dict[str, tuple[Any, bool]]:
    """name -> (a tiny config with sliding windows, whether sdpa_docs must compute it).
    The last one has a logit softcap: sdpa_docs may refuse it but must not differ."""
    from transformers import AutoConfig

    common = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0,
    }  # fmt: skip
    both = ["sliding_attention", "full_attention"]
    return {
        "mistral": (AutoConfig.for_model("mistral", sliding_window=window, **common), True),
        "gemma3_text": (
            AutoConfig.for_model(
                "gemma3_text", sliding_window=window, layer_types=both, head_dim=16, **common
            ),
            True,
        ),
        "phi3": (AutoConfig.for_model("phi3", sliding_window=window, **common), True),
        "gemma2 (logit softcap)": (
            AutoConfig.for_model(
                "gemma2",
                sliding_window=window,
                layer_types=both,
                head_dim=16,
                attn_logit_softcapping=50.0,
                **common,
            ),
            False,
        ),
    }


def window_batches(dev: torch.device, window: int = WINDOW) -> list[list[tuple[int, ...]]]:
    """Packed micro-batches (rows of document lengths) around a window's edges: documents
    shorter than, equal to, one over and far over the window, and one longer than
    sdpa_docs' query block (several blocks). On a GPU also a micro-batch with more distinct
    lengths than sdpa_docs' call limit (its masked per-row path; a CPU has no such path)."""
    from pitstop.train import doc_attention

    block = int(getattr(doc_attention, "BAND_BLOCK", 256))
    calls = int(getattr(doc_attention, "MAX_CALLS", 32))
    long = block + 5 * window
    width = long + 3 * window
    few = [
        (long, width - long),
        (5, 27, width - 32),
        (window, window + 1, width - 2 * window - 1),
    ]
    if dev.type != "cuda":
        return [few]
    many_row = (*range(1, calls + 3), 3 * window)  # calls + 2 distinct lengths, and more
    return [few, [many_row, tuple(reversed(many_row))]]


def _window_kernels(dev: torch.device) -> list[tuple[str, list[str], str | None]]:
    """(kernel, precisions it runs in here, why it cannot run or None)."""
    if dev.type != "cuda":
        return [("sdpa_docs", ["fp32"], None),
                ("flash_attention_2", [], "needs a CUDA GPU")]  # fmt: skip
    from pitstop import probe

    info, _ = probe.detect_device("cuda")
    try:
        import flash_attn  # noqa: F401

        ok, why = probe.flash_attn_status(info, "bf16")
    except Exception as e:  # absent, or a build that does not load here
        ok, why = False, f"flash_attn not importable ({short_error(e, 120)})"
    return [("sdpa_docs", ["fp32", "bf16"], None),
            ("flash_attention_2", ["bf16"], None if ok else why)]  # fmt: skip


def _refused(e: BaseException) -> bool:
    """An exception that is sdpa_docs refusing an attention it does not compute."""
    return type(e).__name__ == "KernelMismatch" or "cannot compute" in str(e)


def window_results(
    cfg: Any, dev: torch.device, cases: list[tuple[str, str]], batches: list[Any]
) -> dict[tuple[str, str], float | Exception]:
    """For each (kernel, precision) case: the worst relative difference, over `batches`'
    documents, between a packed forward with that kernel in that precision (pitstop's
    to_device + forward_kwargs; bf16 = autocast over fp32 weights, as a full fine-tune)
    and each document alone under eager fp32; or the exception the packed forward raised."""
    from transformers import AutoModelForCausalLM

    from pitstop.train import doc_attention
    from pitstop.train.forward import forward_kwargs, to_device
    from pitstop.train.model_io import set_attention

    doc_attention.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dev).eval()
    out: dict[tuple[str, str], float | Exception] = dict.fromkeys(cases, 0.0)
    with no_tf32(), torch.no_grad():
        for seed, rows in enumerate(batches):
            mb, docs = packed_rows(rows, seed=seed)
            set_attention(model, "eager")
            refs = [
                model(
                    input_ids=d[None].to(dev), position_ids=torch.arange(len(d))[None].to(dev),
                    use_cache=False,
                ).logits[0].float()
                for d in docs
            ]  # fmt: skip
            for case in cases:
                if isinstance(out[case], Exception):
                    continue
                kernel, precision = case
                autocast = torch.bfloat16 if precision == "bf16" else None
                try:
                    set_attention(model, kernel)
                    with torch.autocast(
                        dev.type, dtype=autocast or torch.float32, enabled=autocast is not None
                    ):
                        logits = model(**forward_kwargs(to_device(mb, dev, kernel))).logits
                except Exception as e:
                    out[case] = e
                    continue
                k = 0
                for b, row in enumerate(rows):
                    col = 0
                    for n in row:
                        rel = relative_difference(logits[b, col : col + n], refs[k])
                        out[case] = max(float(out[case]), rel)  # type: ignore[arg-type]
                        col += n
                        k += 1
    return out


def check_window(
    dev: torch.device, precision: str, *, kernel: str = "sdpa_docs",
    configs: dict[str, tuple[Any, bool]] | None = None,
) -> list[Row]:  # fmt: skip
    """One row per windowed config: `kernel` (and flash_attention_2 where it runs) on a
    packed micro-batch gives each document its eager logits alone. `kernel` and `configs`
    let a test plant a kernel that ignores the window."""
    batches = window_batches(dev)
    n_docs = sum(len(r) for rows in batches for r in rows)
    kernels = [(kernel if k == "sdpa_docs" else k, p, w) for k, p, w in _window_kernels(dev)]
    cases = [(k, p) for k, precisions, why_not in kernels if not why_not for p in precisions]
    skipped = [f"{k} skip ({why_not})" for k, _, why_not in kernels if why_not]
    tols = ", ".join(f"{p} {t:.0e}" for p, t in WINDOW_TOLERANCE.items())
    rows = []
    for name, (cfg, must_compute) in (configs or window_configs()).items():
        try:
            results = window_results(cfg, dev, cases, batches)
        except Exception as e:  # the model or its eager reference did not run
            rows.append(Row(f"sliding window: {name}", "FAIL", f"raised {short_error(e)}"))
            continue
        parts, failed = [], False
        for (kern, prec), got in results.items():
            if isinstance(got, Exception):
                if kern == kernel and not must_compute and _refused(got):
                    parts.append(f"{kern} {prec} refused ({short_error(got, 160)})")
                else:
                    failed = True
                    parts.append(f"{kern} {prec} raised {short_error(got, 200)}")
                continue
            ok = got <= WINDOW_TOLERANCE[prec]
            failed |= not ok
            parts.append(f"{kern} {prec} {got:.1e}" + ("" if ok else " TOO LARGE"))
        rows.append(Row(
            f"sliding window: {name}", "FAIL" if failed else "pass",
            "packed vs each document alone under eager fp32, largest relative difference: "
            f"{'; '.join(parts + skipped)} (tolerance {tols}; window {WINDOW}, "
            f"{len(batches)} micro-batch(es), {n_docs} documents)",
        ))  # fmt: skip
    return rows


# --- no math fallback --------------------------------------------------------------------

FUSED_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _gqa_models(dev: torch.device) -> dict[str, Callable[[], Any]]:
    """name -> builder of a grouped-query model (8 heads over 2 key/value heads; head
    width 32 on a GPU, 16 on a CPU's dry run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden = 256 if dev.type == "cuda" else 128
    common = {
        "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0,
    }  # fmt: skip

    def build(kind: str, **extra: Any) -> Callable[[], Any]:
        def make() -> Any:
            torch.manual_seed(0)
            cfg = AutoConfig.for_model(kind, **common, **extra)
            return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa_docs").to(dev)

        return make

    return {
        "llama": build("llama"),
        f"mistral window {WINDOW}": build("mistral", sliding_window=WINDOW),
    }


def backends_case(model: Any, dev: torch.device, autocast: torch.dtype | None) -> None:
    """A forward+backward of `model` (sdpa_docs) on packed rows with SDPA's math backend
    ruled out; raises what it raises."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pitstop.train.forward import to_device, token_loss_sum

    backends = [b for b in (getattr(SDPBackend, n, None) for n in FUSED_BACKENDS) if b is not None]
    # Documents around the window, one longer than a query block; on a GPU also more
    # distinct lengths than the call limit (the masked per-row path).
    for seed, rows in enumerate(window_batches(dev)):
        mb, _ = packed_rows(rows, seed=seed)
        with sdpa_kernel(backends):
            loss = token_loss_sum(model, to_device(mb, dev, "sdpa_docs"), dev.type, autocast)
            loss.backward()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise RuntimeError(f"the loss is {value}")


def check_backends(dev: torch.device, precision: str) -> list[Row]:
    """`sdpa_docs` in bf16 (fp32 weights under autocast, as a full fine-tune; bf16 weights, as
    a LoRA base) and in fp32 with only SDPA's fused backends allowed."""
    from pitstop.train import doc_attention

    doc_attention.register()
    modes: list[tuple[str, torch.dtype | None, torch.dtype]] = [
        ("bf16 autocast", torch.bfloat16, torch.float32),
        ("bf16 weights", None, torch.bfloat16),
        ("fp32", None, torch.float32),
    ]
    where = "" if dev.type == "cuda" else " (CPU dry run: the CPU's fused kernel)"
    rows = []
    for mode, autocast, weights in modes:
        failures, ran = [], []
        for name, make in _gqa_models(dev).items():
            try:
                model = make().to(weights)
                with no_tf32():
                    backends_case(model, dev, autocast)
                ran.append(name)
            except RuntimeError as e:
                if "No available kernel" in str(e):
                    failures.append(
                        f"{name}: no fused kernel takes it, the math fallback would run"
                    )
                else:
                    failures.append(f"{name}: raised {short_error(e, 200)}")
            except Exception as e:
                failures.append(f"{name}: raised {short_error(e, 200)}")
        detail = "; ".join(
            [f"forward+backward with only {'/'.join(FUSED_BACKENDS)}{where}: ran for "
             + (", ".join(ran) or "none"), *failures]
        )  # fmt: skip
        rows.append(Row(f"no math fallback: sdpa_docs {mode}", "FAIL" if failures else "pass",
                        detail))  # fmt: skip
    return rows


# --- the user's model ----------------------------------------------------------------------


def check_model(
    dev: torch.device, precision: str, *, model_dir: str | Path, lora_r: int | None = None
) -> list[Row]:
    """pitstop's start-up packed-attention self-check on the user's model directory, loaded
    and with the kernel chosen as `pitstop train --model DIR [--lora-r R]` would."""
    from pitstop import probe
    from pitstop.core.config import RunConfig
    from pitstop.train import model_io
    from pitstop.train.attention_check import packed_attention_check

    name = f"your model: {Path(model_dir).name}" + (f" (LoRA r={lora_r})" if lora_r else "")
    cfg = RunConfig(model=str(model_dir), data=["unused"], output="unused", lora_r=lora_r)
    info, _ = probe.detect_device(dev.type)
    attention = probe.choose_attention("auto", info, precision)
    model, attention, _ = model_io.load_model(cfg, info, precision, attention)
    autocast = torch.bfloat16 if precision == "bf16" else None
    check, fallback = packed_attention_check(model, dev, attention.value, autocast, precision)
    detail = check.summary()
    if fallback is not None:
        detail += f"; the chosen kernel did not run, the run would use {fallback.value}: {fallback.reason}"
    return [Row(name, "pass" if check.ok else "FAIL", f"{precision}: {detail}")]
