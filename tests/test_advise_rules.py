"""Every doctor rule fires on a setup that should trigger it and stays quiet on one that should not,
for pitstop configs and Hugging Face arguments, with the fix naming the right option or field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pitstop.advise.doctor import make_setup
from pitstop.advise.facts import DataFacts, ModelFacts
from pitstop.advise.finding import Finding, format_findings, rank
from pitstop.advise.rules import RULES, Context, run_rules
from pitstop.core.config import RunConfig
from pitstop.data.stats import compute_stats
from pitstop.measure.schema import make_profile
from pitstop.probe import DeviceInfo, PrecisionSpeed

A100 = DeviceInfo(
    type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), bf16=True,
    total_memory_bytes=80 * 2**30, cpu_count=16,
)  # fmt: skip
V100 = DeviceInfo(
    type="cuda", name="Tesla V100-SXM2-32GB", capability=(7, 0), bf16=False,
    total_memory_bytes=32 * 2**30, cpu_count=16,
)  # fmt: skip
CPU = DeviceInfo(type="cpu", name="cpu", cpu_count=16)
ENV = {
    "transformers": "5.23.0",
    "flash_attn": {"installed": None},
    "tf32": {},
    "compile": {"works": True},
}
SMALL = ModelFacts(
    n_params=125_000_000, n_embedding=38_000_000, n_layers=12, d_model=768, vocab_size=50_000
)
HUGE = ModelFacts(
    n_params=70_000_000_000,
    n_embedding=1_000_000_000,
    n_layers=80,
    d_model=8192,
    vocab_size=128_000,
)


def _data() -> DataFacts:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 0.6, 4000).astype(np.int64), 8, 1000)
    stats = compute_stats(lengths, lengths, max_seq_len=4096, counts={"documents": len(lengths)})
    return DataFacts(stats=stats, lengths=lengths, store=None)


DATA = _data()
# The same data with document lengths known (a store's sequences summed by document).
DOCS = DataFacts(stats=DATA.stats, lengths=DATA.lengths, store=None, doc_lengths=DATA.lengths)


def prof(
    steps: int = 10, base: float = 0.1, events: dict | None = None, notes=(), **ph: float
) -> dict:
    """A profile of `steps` steps of `base` seconds, plus periodic phases (totals in seconds)."""
    periodic = {k: v for k, v in ph.items() if k in ("checkpoint", "eval", "logging")}
    inner = {k: v for k, v in ph.items() if k not in periodic}
    compute = steps * base - sum(inner.values())
    rec = {**{k: v / steps for k, v in {**inner, **periodic}.items()}, "forward": compute / steps / 3,
           "backward": 2 * compute / steps / 3}  # fmt: skip
    total = steps * base + sum(periodic.values())
    return make_profile([rec] * steps, [total / steps] * steps, warmup=1, source="pitstop",
                        trained_tokens=1e6, events=events, notes=notes)  # fmt: skip


def erratic(other: float = 0.0, load: float | None = None) -> dict:
    """12 steps, two of them 5x slower in compute (another process took the CPU)."""
    secs = [0.1] * 10 + [0.5, 0.5]
    recs = [{"forward": (t - other * t) / 3, "backward": 2 * (t - other * t) / 3, "other": other * t}
            for t in secs]  # fmt: skip
    p = make_profile(recs, secs, warmup=1, source="hf", trained_tokens=1e6)
    if load is not None:
        p["machine"] = {"load_average_1m": load, "cpu_cores": 2}
    return p


def faulting(per_step: float, each: float = 2.4e-6) -> dict:
    """A CPU profile of 0.1 s steps whose process faulted `per_step` pages in each step, at
    `each` seconds a fault (what the profile measured)."""
    p = prof()
    p["host_page_faults_per_step"], p["page_fault_seconds"] = per_step, each
    return p


# A CPU with native bf16, and fp32 against bf16 autocast measured 2.3x faster at its shapes.
CPU_BF16 = DeviceInfo(type="cpu", name="Xeon", bf16=True, cpu_count=8)
FAST_BF16 = PrecisionSpeed(2.3e-3, 1.0e-3, ((512, 256, 1024),), "measured on this CPU")

# (rule id, source, setup values, context extras) for firing and for quiet; "fix" must appear in the fix.
CASES: list[tuple[str, str, dict, dict, dict, dict, str]] = [
    ("input-bound", "pitstop", {}, {"profile": prof(data_wait=0.3)}, {}, {"profile": prof(data_wait=0.01)}, "--loader-workers"),
    ("input-bound", "hf", {}, {"profile": prof(data_wait=0.3)}, {}, {"profile": prof(data_wait=0.01)}, "dataloader_num_workers="),
    ("loader-main-process", "pitstop", {"loader_workers": 0}, {}, {}, {}, "--loader-workers 4"),
    ("loader-main-process", "hf", {"dataloader_num_workers": 0}, {}, {"dataloader_num_workers": 4}, {}, "dataloader_num_workers=4"),
    ("loader-workers-exceed-cores", "pitstop", {"loader_workers": 32}, {}, {"loader_workers": 4}, {}, "--loader-workers 15"),
    ("loader-workers-exceed-cores", "hf", {"dataloader_num_workers": 32}, {}, {"dataloader_num_workers": 4}, {}, "dataloader_num_workers=15"),
    ("padding-waste", "pitstop", {"batching": "pad", "max_seq_len": 1024}, {"data": DATA}, {"batching": "pack", "max_seq_len": 1024}, {"data": DATA}, "--batching pack"),
    ("padding-waste", "hf", {"packing": False, "per_device_train_batch_size": 8}, {"data": DATA}, {"packing": True}, {"data": DATA}, "packing=True"),
    ("padding-waste", "hf", {"per_device_train_batch_size": 8}, {"data": DATA}, {"per_device_train_batch_size": 1}, {"data": DATA}, 'train_sampling_strategy="group_by_length"'),
    ("packing-off", "pitstop", {"batching": "pad"}, {}, {"batching": "pack"}, {}, "--batching pack"),
    ("packing-off", "hf", {"packing": False}, {}, {"packing": True}, {}, "packing=True"),
    ("max-len-above-p99", "pitstop", {"max_seq_len": 4096, "batching": "pad"}, {"data": DATA}, {"max_seq_len": 1024}, {"data": DATA}, "--max-seq-len 1024"),
    ("max-len-above-p99", "hf", {"max_length": 4096, "packing": True}, {"data": DATA, "model": SMALL}, {"max_length": 1024, "packing": True}, {"data": DATA, "model": SMALL}, "max_length=1024"),
    ("gradient-checkpointing-unneeded", "pitstop", {"gradient_checkpointing": True, "micro_batch_size": 4}, {"model": SMALL}, {"gradient_checkpointing": True, "micro_batch_size": 4}, {"model": HUGE}, "--no-gradient-checkpointing"),
    ("gradient-checkpointing-unneeded", "hf", {"gradient_checkpointing": True, "per_device_train_batch_size": 4, "max_length": 1024}, {"model": SMALL}, {"gradient_checkpointing": False, "max_length": 1024}, {"model": SMALL}, "gradient_checkpointing=False"),
    ("fp16-on-bf16-gpu", "pitstop", {"precision": "fp16"}, {}, {"precision": "fp16"}, {"device": V100}, "--precision bf16"),
    ("fp16-on-bf16-gpu", "hf", {"fp16": True}, {}, {"bf16": True}, {}, "bf16=True, fp16=False"),
    ("fp32-on-gpu", "pitstop", {"precision": "fp32"}, {}, {"precision": "auto"}, {}, "--precision bf16"),
    ("fp32-on-gpu", "hf", {}, {}, {}, {"device": CPU}, "bf16=True"),
    ("fp32-on-bf16-cpu", "pitstop", {"precision": "fp32"}, {"device": CPU_BF16, "measured_precision": FAST_BF16}, {"precision": "auto"}, {"device": CPU_BF16, "measured_precision": FAST_BF16}, "--precision auto"),
    ("fp32-on-bf16-cpu", "hf", {}, {"device": CPU_BF16, "measured_precision": FAST_BF16}, {}, {"device": CPU}, "bf16=True"),
    ("flash-attn-missing", "pitstop", {}, {}, {}, {"env": {**ENV, "flash_attn": {"installed": "2.7.4"}}}, "pip install flash-attn"),
    ("flash-attn-missing", "hf", {"bf16": True}, {}, {"bf16": True}, {"device": V100}, "attn_implementation='flash_attention_2'"),
    ("optimizer-not-fused", "hf", {"optim": "adamw_torch"}, {}, {"optim": "adamw_torch_fused"}, {}, 'optim="adamw_torch_fused"'),
    ("compile-off", "pitstop", {"compile": "off"}, {}, {"compile": "auto"}, {}, "--compile auto"),
    ("compile-off", "hf", {"torch_compile": False}, {}, {"torch_compile": True}, {}, "torch_compile=True"),
    ("checkpoint-overhead", "pitstop", {"save_steps": 10}, {"profile": prof(checkpoint=1.0, events={"checkpoints": 1})}, {"save_steps": 10000}, {"profile": prof(checkpoint=1.0, events={"checkpoints": 1})}, "--save-steps 1000"),
    ("checkpoint-overhead", "hf", {"save_steps": 10}, {"profile": prof(checkpoint=1.0, events={"checkpoints": 1})}, {"save_steps": 10000}, {"profile": prof(checkpoint=1.0, events={"checkpoints": 1})}, "save_steps=1000"),
    ("gc-empty-cache-pauses", "hf", {}, {"profile": prof(gc_collect=0.05, events={"gc_collects": 5})}, {}, {"profile": prof(gc_collect=0.001, events={"gc_collects": 5})}, "remove the gc.collect() calls"),
    ("logging-overhead", "pitstop", {"log_steps": 1}, {"profile": prof(logging=0.05, events={"logs": 10})}, {"log_steps": 100}, {"profile": prof(logging=0.05, events={"logs": 10})}, "--log-steps"),
    ("logging-overhead", "hf", {"logging_steps": 1}, {"profile": prof(logging=0.05, events={"logs": 10})}, {"logging_steps": 100}, {"profile": prof(logging=0.05, events={"logs": 10})}, "logging_steps="),
    ("logging-overhead", "hf", {"logging_steps": 1}, {}, {"logging_steps": 10}, {}, "logging_steps=10"),
    ("eval-overhead", "pitstop", {"eval_steps": 10, "eval_data": "auto"}, {"profile": prof(eval=2.0, events={"evals": 1})}, {"eval_steps": 100000, "eval_data": "auto"}, {"profile": prof(eval=2.0, events={"evals": 1})}, "--eval-steps"),
    ("eval-overhead", "hf", {"eval_strategy": "steps", "eval_steps": 10}, {"profile": prof(eval=2.0, events={"evals": 1})}, {"eval_strategy": "steps", "eval_steps": 100000}, {"profile": prof(eval=2.0, events={"evals": 1})}, "eval_steps="),
    ("optimizer-bound", "pitstop", {}, {"profile": prof(optimizer=0.5)}, {}, {"profile": prof(optimizer=0.1)}, "--tokens-per-step"),
    ("optimizer-bound", "hf", {}, {"profile": prof(optimizer=0.5)}, {}, {"profile": prof(optimizer=0.1)}, "gradient_accumulation_steps"),
    ("sync-bound", "pitstop", {}, {"profile": prof(other=0.4)}, {}, {"profile": prof(other=0.02)}, "--log-steps"),
    ("sync-bound", "hf", {}, {"profile": prof(other=0.4)}, {}, {"profile": prof(other=0.02)}, "logging_nan_inf_filter=False"),
    ("truncation", "hf", {"max_length": 256}, {"data": DOCS}, {"max_length": 2048}, {"data": DOCS}, "a larger max_length"),
    ("truncation", "pitstop", {"max_seq_len": 256, "long_docs": "truncate"}, {"data": DOCS}, {"max_seq_len": 256}, {"data": DOCS}, "--long-docs split"),
    ("noisy-machine", "pitstop", {}, {"profile": erratic()}, {}, {"profile": prof(other=0.4)}, "quiet machine"),
    ("noisy-machine", "hf", {}, {"profile": erratic()}, {}, {"profile": prof()}, "quiet machine"),
    ("ga-loss-bug", "hf", {"gradient_accumulation_steps": 4}, {"env": {**ENV, "transformers": "4.45.2"}}, {"gradient_accumulation_steps": 4}, {"env": {**ENV, "transformers": "4.46.0"}}, "transformers>=4.46"),
    ("ga-loss-bug", "hf", {"gradient_accumulation_steps": 4}, {"env": {**ENV, "transformers": "4.44.0"}}, {"gradient_accumulation_steps": 1}, {"env": {**ENV, "transformers": "4.44.0"}}, "num_items_in_batch"),
    ("tf32-with-16-bit", "hf", {"tf32": True, "bf16": True}, {}, {"tf32": True}, {}, "no change needed"),
    ("tf32-with-16-bit", "hf", {"tf32": True, "fp16": True}, {}, {"tf32": True}, {}, "no change needed"),
    ("empty-cache", "hf", {"torch_empty_cache_steps": 10}, {}, {}, {}, "torch_empty_cache_steps=None"),
    ("empty-cache", "pitstop", {}, {"profile": prof(notes=["torch.cuda.empty_cache() called every 5 steps"])}, {}, {"profile": prof()}, "empty_cache"),
    ("host-page-faults", "pitstop", {"keep_freed_memory": "off"}, {"device": CPU, "profile": faulting(20_000)}, {}, {"device": CPU, "profile": faulting(500)}, "--keep-freed-memory auto"),
    ("host-page-faults", "hf", {}, {"device": CPU, "profile": faulting(20_000)}, {}, {"device": A100, "profile": faulting(20_000)}, "MALLOC_MMAP_THRESHOLD_=1073741824"),
    ("effective-batch-changed", "pitstop", {"tokens_per_step": 131072}, {"baseline": {"tokens_per_step": 65536}}, {"tokens_per_step": 65536}, {"baseline": {"tokens_per_step": 65536}}, "--tokens-per-step 65536"),
    ("effective-batch-changed", "hf", {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}, {"baseline": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4}}, {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2}, {"baseline": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4}}, "= 32 rows"),
]  # fmt: skip


def context(source: str, values: dict[str, Any], extra: dict[str, Any]) -> Context:
    extra = dict(extra)
    if source == "pitstop":
        setup = make_setup(config=RunConfig(**values))
        base = extra.pop("baseline", None)
        baseline = make_setup(config=RunConfig(**base)) if base is not None else None
    else:
        setup = make_setup(hf_args=values)
        base = extra.pop("baseline", None)
        baseline = make_setup(hf_args=base) if base is not None else None
    return Context(
        setup=setup,
        device=extra.pop("device", A100),
        env=extra.pop("env", ENV),
        baseline=baseline,
        **extra,
    )


def _ids(fs: list[Finding]) -> dict[str, Finding]:
    return {f.id: f for f in fs}


@pytest.mark.parametrize(
    ("rule_id", "source", "fire", "fire_ctx", "quiet", "quiet_ctx", "fix"),
    CASES,
    ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)],
)
def test_rule_fires_and_stays_quiet(
    rule_id: str, source: str, fire: dict, fire_ctx: dict, quiet: dict, quiet_ctx: dict, fix: str
) -> None:
    fired = _ids(run_rules(context(source, fire, fire_ctx)))
    assert rule_id in fired, f"{rule_id} did not fire; got {sorted(fired)}"
    f = fired[rule_id]
    assert fix in f.fix, f.fix
    assert f.evidence and f.effect and f.title
    assert rule_id not in _ids(run_rules(context(source, quiet, quiet_ctx)))


def test_every_rule_has_a_case() -> None:
    covered = {(c[0], c[1]) for c in CASES}
    for rule_id, sources, _ in RULES:
        for s in sources:
            assert (rule_id, s) in covered, f"no test case for {rule_id} ({s})"


def test_no_gpu_rules_on_cpu() -> None:
    ctx = context(
        "hf",
        {"fp16": True, "optim": "adamw_torch", "gradient_checkpointing": True},
        {"device": CPU, "model": SMALL},
    )
    ids = set(_ids(run_rules(ctx)))
    assert not ids & {"fp16-on-bf16-gpu", "fp32-on-gpu", "flash-attn-missing", "optimizer-not-fused",
                      "compile-off"}  # fmt: skip


def test_checkpointing_rule_on_cpu_uses_the_machines_memory() -> None:
    """Recomputation costs compute on a CPU too: the rule judges against physical RAM."""
    values = {"gradient_checkpointing": True, "per_device_train_batch_size": 4, "max_length": 1024}
    fired = _ids(run_rules(context("hf", values, {"device": CPU, "model": SMALL})))
    assert fired["gradient-checkpointing-unneeded"].evidence["device_memory_bytes"] > 0
    assert "gradient-checkpointing-unneeded" not in _ids(
        run_rules(context("hf", values, {"device": CPU, "model": HUGE}))
    )


def test_truncated_share_is_the_tokens_beyond_max_len() -> None:
    d = DataFacts(stats={}, lengths=None, store=None, doc_lengths=np.array([100, 300, 600]))
    assert d.truncated_share(256) == pytest.approx((44 + 344) / 1000)
    assert d.truncated_share(1000) == 0.0


def test_noisy_machine_replaces_sync_advice() -> None:
    fired = _ids(run_rules(context("hf", {}, {"profile": erratic()})))
    assert "noisy-machine" in fired and "sync-bound" not in fired
    assert "logging_steps" not in fired["noisy-machine"].fix
    # Host time that explains the step keeps the sync advice, unless the machine is busy.
    fired = _ids(run_rules(context("hf", {}, {"profile": erratic(other=0.4)})))
    assert "sync-bound" in fired and "noisy-machine" not in fired
    fired = _ids(run_rules(context("hf", {}, {"profile": erratic(other=0.4, load=5.0)})))
    assert "noisy-machine" in fired and "sync-bound" not in fired
    assert fired["noisy-machine"].evidence["busy"] is True


def test_checkpointing_effect_is_flops_arithmetic() -> None:
    f = _ids(
        run_rules(
            context(
                "pitstop", {"gradient_checkpointing": True, "micro_batch_size": 4}, {"model": SMALL}
            )
        )
    )["gradient-checkpointing-unneeded"]
    assert f.basis == "FLOPs arithmetic" and "33%" in f.effect and "2·N + 4·L·d·T" in f.effect


def test_sft_defaults_apply() -> None:
    # SFTConfig turns gradient checkpointing and bf16 on by default (TRL docs).
    s = make_setup(hf_args={"packing": False})
    assert s.hf_class == "SFTConfig" and s.gradient_checkpointing and s.precision == "bf16"
    s = make_setup(hf_args={"per_device_train_batch_size": 4})
    assert (
        s.hf_class == "TrainingArguments" and not s.gradient_checkpointing and s.precision == "fp32"
    )


def test_ranking_and_table() -> None:
    ctx = context(
        "hf",
        {"fp16": True, "dataloader_num_workers": 0, "torch_compile": False},
        {"profile": prof(data_wait=0.3)},
    )
    fs = rank(run_rules(ctx))
    sev = [f.severity for f in fs]
    assert sev == sorted(sev, key=["high", "medium", "low"].index)
    assert fs[0].id == "input-bound"
    table = format_findings(fs)
    assert "input-bound" in table and "fix:" in table and "evidence:" in table


def test_host_page_faults_effect_is_the_faults_times_their_measured_cost() -> None:
    """20,000 faults at 2.4 us are 0.048 s of a 0.1 s step: 48%, the finding's gain."""
    ctx = context("hf", {}, {"device": CPU, "profile": faulting(20_000)})
    f = _ids(run_rules(ctx))["host-page-faults"]
    assert f.gain == pytest.approx(0.048 / 0.1)
    assert f.severity == "high" and f.gain_measured
    assert f.evidence == {"page_faults_per_step": 20_000, "page_fault_us": 2.4, "step_seconds": 0.1}
    assert "48.0%" in f.effect
    low = _ids(run_rules(context("hf", {}, {"device": CPU, "profile": faulting(2_000)})))
    assert low["host-page-faults"].severity == "low"  # 4.8%: above 3%, below 8%
    unmeasured = faulting(20_000)
    unmeasured["page_fault_seconds"] = None  # no fault seen when the profile was written
    assert "host-page-faults" not in _ids(
        run_rules(context("hf", {}, {"device": CPU, "profile": unmeasured}))
    )
