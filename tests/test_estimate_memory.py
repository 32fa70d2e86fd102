"""Memory and FLOPs arithmetic of `pitstop estimate` against hand-computed cases."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pitstop.core.errors import DataError
from pitstop.measure.cost_model import (
    ModelShape,
    Plan,
    estimate_memory,
    lora_params,
    max_micro_batch,
    shape_from_config,
    shape_from_model_dir,
    shape_from_params,
    sharded,
)

# 2 layers, d=64, I=256, 4 heads of 16, 2 KV heads (q width 64, kv width 32), V=1000, untied.
SHAPE = ModelShape(layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, vocab=1000)
CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}


def test_parameter_count_by_hand() -> None:
    pc = SHAPE.params()
    # per layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate/up/down 3·64·256 = 61,440
    assert pc.block_linear == 2 * 61_440
    assert pc.block_other == 2 * 128  # two RMSNorm weights per layer
    assert pc.total == 64_000 + 2 * (61_440 + 128) + 64 + 64_000 == 251_200
    assert pc.non_embedding == 251_200 - 64_000  # the lookup table is not a matmul


def test_parameter_count_matches_transformers() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pitstop.measure.flops import flops_model

    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    assert sum(p.numel() for p in model.parameters()) == shape_from_config(CONFIG).params().total
    fm = flops_model(model)
    assert fm.n_trainable == SHAPE.params().non_embedding
    tied = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "tie_word_embeddings": True}))
    shape_t = shape_from_config({**CONFIG, "tie_word_embeddings": True})
    assert sum(p.numel() for p in tied.parameters()) == shape_t.params().total == 187_200
    assert flops_model(tied).n_trainable == shape_t.params().non_embedding


def test_flops_per_token_by_hand() -> None:
    from pitstop.measure.flops import FlopsModel

    n = SHAPE.params().non_embedding
    fm = FlopsModel(n, 0, SHAPE.layers, SHAPE.hidden)
    assert fm.per_token(128) == 6 * 187_200 + 12 * 2 * 64 * 128 == 1_319_808


def test_bf16_full_finetune_parts_by_hand() -> None:
    m = estimate_memory(SHAPE, Plan(micro_batch_size=2, seq_len=128, precision="bf16"))
    assert m.weights == 251_200 * 4  # fp32 weights, no extra master copy
    assert m.gradients == 251_200 * 4
    assert m.optimizer_states == 251_200 * 8
    assert m.autocast_weight_copies == (2 * 61_440 + 64_000) * 2
    # per token per layer: 16d + 2·(5d + 2q + 2k + 4I) + 4·heads + 8 = 1024 + 3072 + 16 + 8
    per_layer = 16 * 64 + 2 * (5 * 64 + 2 * 64 + 2 * 32 + 4 * 256) + 16 + 8
    assert per_layer == 4120
    final = 2 * 64 * 4 + 64 * 2  # final RMSNorm (fp32) + lm_head input (bf16)
    assert m.activations == 256 * (2 * per_layer + final) == 2_273_280
    assert m.logits == 256 * 1000 * 14
    assert m.optimizer_temporary == 0  # fused AdamW on CUDA
    assert m.peak == 1_004_800 + 2_009_600 + 2_273_280 + 3_584_000 + 373_760 == 9_245_440


def test_fp32_eager_and_checkpointing_by_hand() -> None:
    sdpa = estimate_memory(SHAPE, Plan(micro_batch_size=1, seq_len=100, precision="fp32"))
    per_layer = 4 * (6 * 64 + 2 * 64 + 2 * 32 + 4 * 256) + 16 + 8
    assert sdpa.activations == 100 * (2 * per_layer + 3 * 64 * 4)
    assert sdpa.autocast_weight_copies == 0
    assert sdpa.logits == 100 * 1000 * 16
    eager = estimate_memory(
        SHAPE, Plan(micro_batch_size=1, seq_len=100, precision="fp32", attention="eager")
    )
    # eager keeps the softmax probabilities: heads·T fp32 per token per layer
    assert eager.activations - sdpa.activations == 100 * 2 * 4 * 100 * 4
    gc = estimate_memory(
        SHAPE, Plan(micro_batch_size=1, seq_len=100, precision="fp32", gradient_checkpointing=True)
    )
    # each layer's fp32 input + one layer rebuilt in backward + the final norm
    assert gc.activations == 100 * (2 * 64 * 4 + per_layer + 3 * 64 * 4)
    cpu = estimate_memory(SHAPE, Plan(precision="fp32", fused_optimizer=False))
    assert cpu.optimizer_temporary == 251_200 * 4


def test_lora_and_4bit_by_hand() -> None:
    r = 8
    n_lora = 2 * r * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 256))
    assert lora_params(SHAPE, r) == n_lora == 22_528
    m = estimate_memory(SHAPE, Plan(seq_len=64, precision="bf16", lora_r=r))
    assert m.trainable_params == n_lora
    assert m.weights == 251_200 * 2 + n_lora * 4  # frozen bf16 base + fp32 adapters
    assert m.gradients == n_lora * 4 and m.optimizer_states == n_lora * 8
    assert m.autocast_weight_copies == 0
    q = estimate_memory(SHAPE, Plan(seq_len=64, precision="bf16", lora_r=r, load_in_4bit=True))
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)
    other = 251_200 - 2 * 61_440
    assert q.weights == int(2 * 61_440 * nf4 + other * 4) + n_lora * 4
    with pytest.raises(ValueError):
        estimate_memory(SHAPE, Plan(load_in_4bit=True))


def test_grad_accumulation_keeps_gradients_in_the_peak() -> None:
    one = estimate_memory(SHAPE, Plan(seq_len=64, grad_accum=1))
    many = estimate_memory(SHAPE, Plan(seq_len=64, grad_accum=4))
    assert many.peak - one.peak == one.gradients


def test_max_micro_batch_is_the_largest_that_fits() -> None:
    plan = Plan(seq_len=128, precision="bf16")
    usable = estimate_memory(SHAPE, replace(plan, micro_batch_size=5)).peak + 10
    assert max_micro_batch(SHAPE, usable, plan) == 5
    assert max_micro_batch(SHAPE, 1000, plan) == 0


def test_fsdp_shards_states_not_activations() -> None:
    m = estimate_memory(SHAPE, Plan(micro_batch_size=2, seq_len=128))
    s = sharded(m, 4)
    assert s < m.peak
    assert s > m.activations + m.logits  # activations are not sharded
    assert sharded(m, 1) == m.peak


def test_shape_from_model_dir(tmp_path: Path, tiny_model_dir: Path) -> None:
    shape = shape_from_model_dir(tiny_model_dir)
    assert (shape.layers, shape.hidden, shape.heads) == (2, 64, 4)
    with pytest.raises(DataError, match=r"no config\.json"):
        shape_from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "vocab_size": 3}))
    with pytest.raises(DataError, match="num_hidden_layers"):
        shape_from_model_dir(tmp_path)


def test_params_guess_is_llama_shaped() -> None:
    s = shape_from_params(7e9)
    assert (s.layers, s.hidden, s.intermediate) == (32, 4096, 11008)
    assert abs(s.params().total - 7e9) / 7e9 < 0.1
    assert "rough" in s.source
    small = shape_from_params(1e8)
    assert abs(small.params().total - 1e8) / 1e8 < 0.35
