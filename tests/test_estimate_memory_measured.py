"""The memory estimate against the measured peak of real training steps on this CPU.

How it is measured (honest on a CPU, where torch has no allocator statistics):
each case runs in a fresh Python process with glibc's mmap threshold pinned at
64 KiB (MALLOC_MMAP_THRESHOLD_), so every tensor buffer is its own mapping that
goes back to the OS when freed and the resident set tracks live tensor bytes
instead of heap the allocator keeps. The process first trains one step of a tiny
model of the same kind, so the runtime's one-off memory (modules imported on first
use, BLAS threads, autograd's own buffers) is in the baseline, not the peak: without
it that ~30-90 MB, varying by machine and load, put the checkpointing case at 0.80 on
CI. Then it records its resident set, builds the model, trains one warm-up step,
resets the kernel's high-water mark (/proc/self/clear_refs, 5), trains one more step,
and reports VmHWM minus the baseline: weights + AdamW states + the step's peak.

The loop is a bare transformers + AdamW(foreach) loop in fp32 (what pitstop runs
on a CPU), since it measures the estimate's arithmetic rather than the trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pitstop.measure.cost_model import Plan, estimate_memory, shape_from_config

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    cfg = LlamaConfig(**spec["config"])
    ids = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))

    def build(config):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=spec["attention"])
        model.train()
        if spec["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(model, opt, ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # The runtime's own one-off memory (modules imported on first use, BLAS threads, autograd)
    # is not the model's: a tiny model of the same kind trains one step before the baseline.
    tiny = LlamaConfig(**{**spec["config"], "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 1, "vocab_size": 128})
    step(*build(tiny), torch.randint(0, 128, (2, 16)))
    gc.collect()
    base = status("VmRSS")
    model, opt = build(cfg)
    step(model, opt, ids)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step(model, opt, ids)
    print(json.dumps({"peak_bytes": status("VmHWM") - base}))
    """
)

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "use_cache": False,
}


def measure(batch: int, seq: int, attention: str, checkpointing: bool) -> int:
    spec = {"config": CONFIG, "batch": batch, "seq": seq, "attention": attention,
            "checkpointing": checkpointing}  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    ("attention", "checkpointing"),
    [
        ("sdpa", False),
        pytest.param("eager", False, marks=[pytest.mark.slow, pytest.mark.long]),
        pytest.param("sdpa", True, marks=[pytest.mark.slow, pytest.mark.long]),
    ],
)
def test_estimate_within_20_percent_of_measured_peak(attention: str, checkpointing: bool) -> None:
    measured = measure(8, 512, attention, checkpointing)
    plan = Plan(
        micro_batch_size=8,
        seq_len=512,
        precision="fp32",
        attention=attention,
        gradient_checkpointing=checkpointing,
        fused_optimizer=False,  # torch's CPU AdamW is the foreach one
    )
    est = estimate_memory(shape_from_config(CONFIG), plan)
    ratio = est.peak / measured
    print(f"{attention} checkpointing={checkpointing}: estimate {est.peak / 1e6:.1f} MB, "
          f"measured {measured / 1e6:.1f} MB, ratio {ratio:.3f}")  # fmt: skip
    # Seen on the 2-core dev box: 0.98 (sdpa), 0.98 (eager), 0.96 (checkpointing).
    assert 0.8 <= ratio <= 1.2
