"""pitstop's one cost model: a model's shape, its training FLOPs per token, its optimizer
state and the memory of a training plan. The doctor's rules, `pitstop estimate`, the
tuner and the trainer's build all call it, so they cannot disagree (docs/cost-model.md).

Shape: from config.json (`shape_from_config`, no weights are read), from a loaded
module (`flops_model`, counting its parameters), or from a parameter count alone
(`shape_from_params`, a labelled Llama-shaped guess).

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's `estimate_mfu`):
a forward pass costs 2 FLOPs per parameter per token and the backward pass twice
that, so training costs 6·N per token, N being the non-embedding parameters (an
embedding lookup is not a matmul; the output projection is, so it counts). Attention
scores and their weighted sum add 12·L·d·T per token (L layers, d model width, T the
row length attended over: forward 4·L·d·T, backward twice that). Frozen weights
(LoRA) get no weight gradient, so their backward costs 2 FLOPs per parameter
instead of 4: 4·N_frozen + 6·N_trainable. Gradient checkpointing (full recomputation
per decoder layer) runs the forward pass again in backward: + 2·N_all + 4·L·d·T.
These are hardware FLOPs; MFU counts model FLOPs only (without the recomputation).

Memory of a plan, part by part, for a Llama-style decoder. Bytes per part:

* weights: full fine-tuning keeps fp32 weights whatever the precision (pitstop
  trains with autocast; there is no separate fp32 master copy because the weights
  *are* fp32), 4 B/param. LoRA keeps the frozen base in the compute precision
  (2 B/param for bf16/fp16, 4 for fp32) and the adapters in fp32. 4-bit (NF4 with
  double quantisation, as `pitstop.train.model_io` configures bitsandbytes): the
  block linears cost 0.5 B/param + one 8-bit absmax per 64 weights + one fp32
  constant per 256 absmax blocks = 0.5159 B/param; embeddings, lm_head and norms are
  fp32 (peft's `prepare_model_for_kbit_training` upcasts them).
* gradients: fp32, 4 B per trainable parameter.
* optimizer_states: AdamW's two fp32 moments, 8 B per trainable parameter; with
  bitsandbytes' 8-bit AdamW (--optimizer adamw_8bit / paged_adamw_8bit) two 8-bit
  moments plus one fp32 scale per block of 256 values, about 2.03 B per parameter.
* autocast_weight_copies: with bf16/fp16 autocast and fp32 weights, each matmul
  weight is cast once per forward and the copy is kept for backward: 2 B per
  matmul parameter (none for fp32 or for LoRA's already-low-precision base).
* activations: the tensors autograd saves for backward. Per token and layer, for a
  Llama block (RMSNorm, RoPE, SwiGLU MLP, no dropout), with d = hidden size,
  q = heads·head_dim, k = kv_heads·head_dim, I = intermediate size, a = bytes of
  the compute dtype (2 for bf16/fp16, 4 for fp32), derived the way Korthikanti et
  al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4)
  count a GPT block, adapted to this block by listing each op's saved inputs:

  - fp32 residual stream and RMSNorm internals: 4 tensors of d (layer input,
    normalised input, attention-residual output, its normalised form), 4·4d bytes;
  - matmul inputs: with autocast each projection casts its own copy of the norm
    output (q, k, v, gate, up: 5 copies of d at a bytes); in fp32 the two norm
    outputs are shared, 2 copies of d at 4 bytes;
  - attention kernel inputs and output: q + 2k (RoPE'd query, key, value) + q (the
    output, which o_proj saves), at a bytes. SDPA/flash kernels keep only a
    per-row log-sum-exp (heads·4 B); eager attention also keeps the T×T softmax
    probabilities, heads·T per token (4 B in fp32, 4 + a B with autocast since the
    fp32 softmax output and its low-precision cast are both kept);
  - SwiGLU MLP: gate, SiLU(gate), up, and their product, 4·I at a bytes.

  => per token per layer: 16d + a·(5d + 2q + 2k + 4I) bytes with autocast,
     4·(6d + 2q + 2k + 4I) bytes in fp32, plus the eager term.
  After the last block: the final norm keeps 2·d fp32 plus the lm_head input.
  With gradient checkpointing (one checkpoint per decoder layer, as
  `gradient_checkpointing_enable` does) only each layer's input stays (4d per token
  per layer), plus one layer's full activations while it is recomputed in backward.
* logits: B·T·V values. The forward keeps the lm_head output (a bytes), the loss
  upcasts to fp32 and keeps log_softmax's output (4 B); backward then holds the
  gradient of the log-probabilities and of the logits at once (2·4 B). So the
  logits cost (a + 12) bytes per value at the start of backward: often the largest
  single activation for small models with big vocabularies.
* optimizer_temporary: torch's foreach AdamW (CPU) allocates one fp32 copy of the
  second moments for sqrt; fused AdamW (pitstop's choice on CUDA) allocates none.

Peak = weights + optimizer_states
       + max(activations + logits + autocast copies (+ gradients when gradient
             accumulation keeps them alive through the next forward),
             gradients + optimizer_temporary).
With gradient accumulation of 1 the gradients are freed (set_to_none) before the
forward, so the peak is at the start of backward, before they are allocated.

Checked against measurement on CPU in tests/test_estimate_memory_measured.py
(peak RSS of real steps; see there for how it is measured).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pitstop.catalog.model_config import ModelConfig, ModelConfigMissing
from pitstop.core.config_ranges import MAX_PARAMS
from pitstop.core.errors import DataError

GiB = 1024**3
FP32 = 4
# NF4 with double quantisation: 4 bits + an 8-bit absmax per 64 weights + an fp32
# constant per 256 absmax values (QLoRA, Dettmers et al. 2023, §2).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# bitsandbytes 8-bit AdamW: two 1-byte moments, each with an fp32 absmax per block of 256.
# The only place this constant is written (the doctor, the estimate and the trainer read it).
OPTIM_8BIT_BYTES_PER_PARAM = 2 * (1 + 4 / 256)
ADAMW_MOMENTS = 2  # AdamW keeps two moments per parameter, in the parameter's dtype
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Optimizer names that mean bitsandbytes' 8-bit AdamW: pitstop's (--optimizer) and the
# Hugging Face Trainer's `optim` values.
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def is_eight_bit(optimizer: str | None) -> bool:
    """Whether `optimizer` (pitstop's --optimizer or HF's `optim`) keeps 8-bit moments."""
    return "8bit" in (optimizer or "").lower()


def optimizer_state_bytes_per_param(optimizer: str | None, param_bytes: int = FP32) -> float:
    """Optimizer-state bytes per trainable parameter: AdamW's two moments in the parameter's
    dtype, or bitsandbytes' two 8-bit moments with their block scales."""
    if is_eight_bit(optimizer):
        return OPTIM_8BIT_BYTES_PER_PARAM
    return float(ADAMW_MOMENTS * param_bytes)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-style decoder that memory and FLOPs depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    source: str = "given"

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        return self.heads * self.hd

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.hd

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each projection in one block: q, k, v, o, gate, up, down."""
        d, q, k, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return [(d, q), (d, k), (d, k), (q, d), (d, i), (d, i), (i, d)]

    def params(self) -> ParamCounts:
        d, q, k = self.hidden, self.q_width, self.kv_width
        block_linear = sum(a * b for a, b in self.linear_shapes())
        bias = (q + 2 * k if self.attention_bias else 0) + (
            2 * self.intermediate + d if self.mlp_bias else 0
        )
        norms = 2 * d
        emb = self.vocab * d
        return ParamCounts(
            embedding=emb,
            block_linear=self.layers * block_linear,
            block_other=self.layers * (norms + bias),
            final_norm=d,
            lm_head=0 if self.tied else emb,
            tied=self.tied,
        )


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    block_linear: int  # the matmul weights of all blocks (what LoRA and 4-bit act on)
    block_other: int  # norms and biases
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    tied: bool

    @property
    def total(self) -> int:
        return (
            self.embedding + self.block_linear + self.block_other + self.final_norm + self.lm_head
        )

    @property
    def non_embedding(self) -> int:
        """N of the 6·N FLOPs formula: everything but the input lookup table; the output
        projection is a matmul and counts (a tied table counts once, as the output)."""
        return self.block_linear + self.block_other + self.final_norm + self.embedding

    @property
    def matmul(self) -> int:
        """Weights that autocast casts for matmuls: block linears and the output projection."""
        return self.block_linear + self.embedding  # lm_head is V·d, tied or not


def shape_from_config(
    config: ModelConfig | Mapping[str, Any], source: str = "config.json"
) -> ModelShape:
    """A ModelShape from a model's config (`ModelConfig`, or the dict config.json holds) of
    a Llama-style model.

    Reads the fields Llama, Mistral, Qwen2/3, Phi-3 and Gemma configs share; a
    multimodal config's `text_config` is used when present (`ModelConfig` resolves both).
    """
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_mapping(config, source)
    need = {
        "layers": ("num_hidden_layers", cfg.num_hidden_layers),
        "hidden": ("hidden_size", cfg.hidden_size),
        "intermediate": ("intermediate_size", cfg.intermediate_size),
        "heads": ("num_attention_heads", cfg.num_attention_heads),
        "vocab": ("vocab_size", cfg.vocab_size),
    }
    bad = cfg.size_problems()
    if bad:
        raise DataError(f"{cfg.source}: {'; '.join(bad)}; fix the config")
    missing = [name for name, value in need.values() if value is None]
    if missing:
        raise DataError(
            f"{cfg.source}: no {', '.join(missing)}; pitstop estimates Llama-style decoders "
            "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
            "vocab_size). For another architecture give --params N for a rough estimate"
        )
    got = {key: int(value or 0) for key, (_, value) in need.items()}
    return ModelShape(
        **got,
        kv_heads=cfg.kv_heads or got["heads"],
        tied=cfg.tie_word_embeddings,
        head_dim=cfg.head_dim,
        attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        source=cfg.source,
    )


def shape_from_model_dir(model_dir: str | Path) -> ModelShape:
    """Read MODEL_DIR/config.json (weights are not needed)."""
    try:
        config = ModelConfig.read(model_dir)
    except ModelConfigMissing:
        raise DataError(
            f"{model_dir} has no config.json; give a Hugging Face model directory or --params N"
        ) from None
    return shape_from_config(config)


def shape_from_params(n_params: float, vocab: int = 32000) -> ModelShape:
    """A rough Llama-shaped guess for a model of about `n_params` parameters.

    Llama proportions: head_dim 128, layers = hidden/128 (Llama-2 7B/13B: 4096/32,
    5120/40), intermediate = 8/3·hidden rounded up to 256, untied embeddings, so
    params ≈ 12·L·d² + 2·V·d with L = d/128. Solved for d, rounded to 128.
    """
    if not 0 < n_params <= MAX_PARAMS:  # NaN too: it fails every comparison
        raise ValueError(f"n_params must be above 0 and at most {MAX_PARAMS:g}, got {n_params}")

    def total(dd: int) -> float:
        return 12 * max(1, dd // 128) * dd * dd + 2 * vocab * dd

    # d = the largest multiple of 128 (at least 128) with total(d) <= n_params, by bisection
    # over d/128: a bounded search (a linear one took forever for 1e30 and never ended for
    # NaN). total(128 * 2**20) is ~1e27, far above MAX_PARAMS.
    lo, hi = 1, 2**20
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if total(128 * mid) <= n_params:
            lo = mid
        else:
            hi = mid
    d = 128 * lo
    # pick whichever of d, d+128 lands closer
    if abs(total(d + 128) - n_params) < abs(total(d) - n_params):
        d += 128
    inter = int(math.ceil(8 * d / 3 / 256) * 256)
    heads = max(1, d // 128)
    return ModelShape(
        layers=max(1, d // 128),
        hidden=d,
        intermediate=inter,
        heads=heads,
        kv_heads=heads,
        vocab=vocab,
        source=f"rough Llama-shaped guess for {n_params:.3g} parameters "
        "(layers = hidden/128, intermediate = 8/3·hidden, vocab 32000); give --model DIR "
        "for exact numbers",
    )


def lora_params(shape: ModelShape, r: int) -> int:
    """Adapter parameters for LoRA rank r on every block linear (peft's "all-linear",
    which leaves lm_head alone): r·(in + out) per projection."""
    return shape.layers * sum(r * (a + b) for a, b in shape.linear_shapes())


@dataclass(frozen=True)
class FlopsModel:
    """The counts the FLOPs formula needs, taken from a model once."""

    n_trainable: int  # non-embedding parameters that receive gradients
    n_frozen: int  # non-embedding parameters that do not
    n_layers: int
    d_model: int

    def per_token(self, seq_len: float) -> float:
        """Training FLOPs per token where each position attends over `seq_len` positions
        (model FLOPs): the row length for one document per row; for packed rows the mean
        document span, sum(n_i^2) / sum(n_i) (pitstop.batching.plan.Efficiency.attention_span)."""
        dense = 6 * self.n_trainable + 4 * self.n_frozen
        attention = 12 * self.n_layers * self.d_model * seq_len
        return float(dense + attention)

    def recompute_per_token(self, seq_len: float) -> float:
        """FLOPs per position that full activation recomputation adds: the forward again.

        The forward pass is 2 FLOPs per parameter (frozen or not) plus a third of the
        attention term (12·L·d·T counts forward and backward, 4·L·d·T of it forward).
        """
        return (
            2.0 * (self.n_trainable + self.n_frozen) + 4.0 * self.n_layers * self.d_model * seq_len
        )

    def recompute_share(self, seq_len: float) -> float:
        """Extra compute per step that recomputation costs, as a share of the step's FLOPs."""
        return self.recompute_per_token(seq_len) / self.per_token(seq_len)


def flops_for_shape(shape: ModelShape, lora_r: int | None = None) -> FlopsModel:
    """The FLOPs counts of a shape: all of it trains, or LoRA adapters on a frozen base."""
    pc = shape.params()
    if lora_r is not None:
        return FlopsModel(lora_params(shape, lora_r), pc.non_embedding, shape.layers, shape.hidden)
    return FlopsModel(pc.non_embedding, 0, shape.layers, shape.hidden)


def flops_model(model: Any) -> FlopsModel:
    """Count a loaded model's parameters for the FLOPs formula: a Hugging Face causal LM
    (possibly PEFT-wrapped), or any `nn.Module` that trains on tokens (a nanoGPT `GPT`, a
    LightningModule holding a model).

    Lookup tables are left out: the input embeddings (Hugging Face's `get_input_embeddings`,
    else every `nn.Embedding`), unless a table is also an output matmul (tied weights). The
    layers and width come from the model's config (`num_hidden_layers` / `n_layer`,
    `hidden_size` / `n_embd`), else from its outermost attention modules and its widest
    embedding table."""
    hf = _hf_model(model)
    if hf is not None:
        emb = hf.get_input_embeddings()
        tables = {id(p) for p in emb.parameters()} if emb is not None else set()
        out = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
        matmuls = {id(p) for p in out.parameters()} if out is not None else set()
    else:
        tables, matmuls = _embedding_tables(model)
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in tables and id(p) not in matmuls:
            continue  # a lookup table; a tied table is also the output matmul, which counts
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    layers, width = depth_and_width(hf if hf is not None else model)
    return FlopsModel(n_trainable=trainable, n_frozen=frozen, n_layers=layers, d_model=width)


def _hf_model(model: Any) -> Any:
    """The model itself or the first module inside it with Hugging Face's embeddings API and
    a config (a LightningModule's model), else None."""
    import torch

    mods = model.modules() if isinstance(model, torch.nn.Module) else [model]
    for m in mods:
        if hasattr(m, "get_input_embeddings") and hasattr(m, "config"):
            try:
                m.get_input_embeddings()
            except (NotImplementedError, AttributeError):
                continue
            return m
    return None


def _embedding_tables(model: Any) -> tuple[set[int], set[int]]:
    """(ids of every nn.Embedding's parameters, ids of every nn.Linear's parameters)."""
    import torch

    tables, matmuls = set(), set()
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            tables |= {id(p) for p in m.parameters()}
        elif isinstance(m, torch.nn.Linear):
            matmuls |= {id(p) for p in m.parameters()}
    return tables, matmuls


def depth_and_width(model: Any) -> tuple[int, int]:
    """(layers, width) of a model: from its config, else counted off its modules."""
    cfg = getattr(model, "config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = int(getattr(text_cfg, "num_hidden_layers", 0) or getattr(text_cfg, "n_layer", 0) or 0)
    width = int(getattr(text_cfg, "hidden_size", 0) or getattr(text_cfg, "n_embd", 0) or 0)
    if layers and width:
        return layers, width
    import torch

    # No config: the outermost modules named like attention are the layers, and the widest
    # embedding table's width is the model's.
    inside: set[int] = set()
    found = 0
    for m in model.modules():
        if id(m) not in inside and "attention" in type(m).__name__.lower():
            found += 1
            inside |= {id(x) for x in m.modules()}
    widths = [m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return layers or found, width or max(widths, default=0)


@dataclass
class MemoryEstimate:
    """Bytes per part, the peak, and every assumption behind them."""

    weights: int
    gradients: int
    optimizer_states: int
    autocast_weight_copies: int
    activations: int
    logits: int
    optimizer_temporary: int
    peak: int
    trainable_params: int
    total_params: int
    micro_batch_size: int
    seq_len: int
    precision: str
    layers: int
    grad_accum: int
    assumptions: list[str] = field(default_factory=list)

    def parts(self) -> dict[str, int]:
        keys = (
            "weights",
            "gradients",
            "optimizer_states",
            "autocast_weight_copies",
            "activations",
            "logits",
            "optimizer_temporary",
        )
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class Plan:
    """What a training step's cost depends on (what estimate_memory reads, named once)."""

    micro_batch_size: int = 1
    seq_len: int = 1024
    precision: str = "bf16"
    attention: str = "sdpa"
    gradient_checkpointing: bool = False
    lora_r: int | None = None
    load_in_4bit: bool = False
    grad_accum: int = 1
    fused_optimizer: bool = True
    optimizer: str = "adamw"


def activation_bytes_per_token_layer(
    shape: ModelShape, precision: str, attention: str, seq_len: int
) -> int:
    """Bytes autograd keeps per token for one decoder layer (see the module docstring)."""
    d, q, k, i = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate
    a = COMPUTE_BYTES[precision]
    mixed = a != FP32
    residual = 4 * d * FP32
    matmul_inputs = 5 * d * a if mixed else 2 * d * FP32
    attn = (2 * q + 2 * k) * a + shape.heads * FP32  # q, k, v, output; log-sum-exp
    if attention == "eager":
        attn += shape.heads * seq_len * (FP32 + (a if mixed else 0))
    mlp = 4 * i * a
    return residual + matmul_inputs + attn + mlp + 2 * FP32  # + two RMSNorm rsqrt values


def estimate_memory(shape: ModelShape, plan: Plan | None = None) -> MemoryEstimate:
    """Training memory per part for one data-parallel rank (formulas in the module docstring).

    `plan`: the settings the memory depends on; None is `Plan()`'s defaults. Each step
    appends the assumptions behind its parts to `notes`, in the order of the parts."""
    plan = plan or Plan()
    if plan.precision not in COMPUTE_BYTES:
        raise ValueError(f"precision must be one of {sorted(COMPUTE_BYTES)}")
    if plan.load_in_4bit and plan.lora_r is None:
        raise ValueError("4-bit base weights need LoRA (lora_r)")
    notes: list[str] = [f"model: {shape.source}"]
    trainable, weights, copies = _weight_bytes(shape, plan, notes)
    grads, states, opt_tmp = _optimizer_bytes(plan, trainable, notes)
    activations, logits, per_layer = _activation_bytes(shape, plan, notes)
    kept = activations + copies + (grads if plan.grad_accum > 1 else 0)
    forward_peak = _forward_peak(shape, plan, kept, logits, per_layer)
    peak = weights + states + max(forward_peak, grads + opt_tmp)
    return MemoryEstimate(
        weights=int(weights),
        gradients=int(grads),
        optimizer_states=int(states),
        autocast_weight_copies=int(copies),
        activations=int(activations),
        logits=int(logits),
        optimizer_temporary=int(opt_tmp),
        peak=int(peak),
        trainable_params=int(trainable),
        total_params=int(shape.params().total),
        micro_batch_size=plan.micro_batch_size,
        seq_len=plan.seq_len,
        precision=plan.precision,
        layers=shape.layers,
        grad_accum=plan.grad_accum,
        assumptions=notes,
    )


def _weight_bytes(shape: ModelShape, plan: Plan, notes: list[str]) -> tuple[int, int, int]:
    """(trainable parameters, weight bytes, autocast copy bytes): the full model in fp32
    with a compute-precision copy of each matmul weight under autocast, or a frozen base
    (compute precision, or NF4) with fp32 LoRA adapters."""
    pc = shape.params()
    a = COMPUTE_BYTES[plan.precision]
    other = pc.embedding + pc.lm_head + pc.block_other + pc.final_norm  # not block linears
    if plan.lora_r is None:
        notes.append(
            "full fine-tuning: fp32 weights (autocast computes in "
            f"{plan.precision}; no separate master copy)"
        )
        copies = pc.matmul * a if a != FP32 else 0
        if copies:
            notes.append(
                f"autocast keeps a {plan.precision} copy of each matmul weight for backward"
            )
        return pc.total, pc.total * FP32, copies
    trainable = lora_params(shape, plan.lora_r)
    if plan.load_in_4bit:
        base = pc.block_linear * NF4_BYTES_PER_PARAM + other * FP32
        notes.append(
            f"4-bit: block linears NF4 with double quantisation ({NF4_BYTES_PER_PARAM:.4f} "
            "B/param), embeddings/lm_head/norms fp32 (peft upcasts them)"
        )
    else:
        base = pc.total * a
        notes.append(f"LoRA: frozen base weights in {plan.precision} ({a} B/param)")
    notes.append(
        f"LoRA r={plan.lora_r} on every block linear: {trainable:,} trainable parameters in "
        "fp32; only they get gradients and AdamW states. Activations are counted as for "
        "full fine-tuning (the adapters save the same layer inputs); an approximation"
    )
    return trainable, int(base) + trainable * FP32, 0


def _optimizer_bytes(plan: Plan, trainable: int, notes: list[str]) -> tuple[int, float, int]:
    """(gradient bytes, optimizer state bytes, the step's temporary bytes) for `trainable`
    parameters: fp32 gradients, AdamW's moments (8-bit or fp32), and foreach AdamW's
    copy of the second moments (none when fused or 8-bit)."""
    grads = trainable * FP32
    states = trainable * optimizer_state_bytes_per_param(plan.optimizer)
    fused = plan.fused_optimizer
    if is_eight_bit(plan.optimizer):
        notes.append(
            f"8-bit AdamW (bitsandbytes): two 8-bit moments + an fp32 scale per 256 values, "
            f"{OPTIM_8BIT_BYTES_PER_PARAM:.2f} B per trainable parameter; fp32 gradients"
        )
        fused = True  # updates each tensor in place: no foreach temporaries
    else:
        notes.append("AdamW: two fp32 moments per trainable parameter; fp32 gradients")
    if not fused:
        notes.append("foreach AdamW: one fp32 temporary of the second moments during the step")
    return grads, states, 0 if fused else trainable * FP32


def _activation_bytes(shape: ModelShape, plan: Plan, notes: list[str]) -> tuple[int, int, int]:
    """(activation bytes, logits bytes, activation bytes per token per layer) of one
    micro-batch: what autograd keeps for backward (each layer's input only, under gradient
    checkpointing, plus the one layer rebuilt), and the logits at the start of backward."""
    a = COMPUTE_BYTES[plan.precision]
    tokens = plan.micro_batch_size * plan.seq_len
    per_layer = activation_bytes_per_token_layer(
        shape, plan.precision, plan.attention, plan.seq_len
    )
    final = 2 * shape.hidden * FP32 + shape.hidden * a  # the final norm, the lm_head input
    if plan.gradient_checkpointing:
        blocks = tokens * (shape.layers * shape.hidden * FP32 + per_layer)
        notes.append(
            "gradient checkpointing per decoder layer: each layer's input is kept, one "
            "layer's activations are rebuilt at a time in backward"
        )
    else:
        blocks = tokens * shape.layers * per_layer
    kernel = (
        "eager attention keeps the T×T probabilities"
        if plan.attention == "eager"
        else (f"{plan.attention} attention keeps no T×T matrix")
    )
    notes.append(
        f"activations: {per_layer:,} B per token per layer ({plan.precision}, {kernel}); "
        "Korthikanti et al. 2022 accounting adapted to a Llama block"
    )
    logits = tokens * shape.vocab * (a + 3 * FP32)
    notes.append(
        f"logits: B·T·V·{a + 3 * FP32} B (lm_head output, fp32 log-softmax, two fp32 "
        "gradients at the start of backward)"
    )
    return blocks + tokens * final, logits, per_layer


def _forward_peak(shape: ModelShape, plan: Plan, kept: int, logits: int, per_layer: int) -> int:
    """The peak of forward and the start of backward: what is `kept` plus the logits, or
    under gradient checkpointing the larger of the logits and the layer being rebuilt."""
    if not plan.gradient_checkpointing:
        return kept + logits
    # The recomputed layer only exists after the logits' gradients are freed; until
    # then only the lm_head output (a bytes per value) of the logits is still held.
    tokens = plan.micro_batch_size * plan.seq_len
    recomputed = tokens * per_layer
    a = COMPUTE_BYTES[plan.precision]
    return kept - recomputed + max(logits, recomputed + tokens * shape.vocab * a)


def sharded(est: MemoryEstimate, n: int) -> int:
    """Peak per GPU with FSDP full sharding over n GPUs: weights, gradients, optimizer
    states and autocast copies are split n ways; activations and logits are not; one
    layer is gathered whole while it runs and the next is prefetched (2/L of the weights)."""
    if n <= 1:
        return est.peak
    grads_fwd = est.gradients / n if est.grad_accum > 1 else 0
    forward = est.activations + est.logits + est.autocast_weight_copies / n + grads_fwd
    step = (est.gradients + est.optimizer_temporary) / n
    gathered = 2 * est.weights / max(est.layers, 1)
    return int((est.weights + est.optimizer_states) / n + gathered + max(forward, step))


def peak_at(shape: ModelShape, plan: Plan, rows: int) -> int:
    """The estimated peak bytes of `plan` with micro-batches of `rows` rows."""
    return estimate_memory(shape, replace(plan, micro_batch_size=rows)).peak


def max_micro_batch(
    shape: ModelShape, usable_bytes: int, plan: Plan | None = None, *, limit: int = 4096
) -> int:
    """The largest micro-batch whose estimated peak fits in `usable_bytes` (0 if none);
    `plan`'s own micro_batch_size is ignored, its other settings hold."""
    base = plan or Plan()

    def peak(rows: int) -> int:
        return estimate_memory(shape, replace(base, micro_batch_size=rows)).peak

    if peak(1) > usable_bytes:
        return 0
    lo, hi = 1, 2
    while hi <= limit and peak(hi) <= usable_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # peak is monotonic in the batch size
        mid = (lo + hi) // 2
        if peak(mid) <= usable_bytes:
            lo = mid
        else:
            hi = mid
    return lo


# --- a plan, its fit on a device -------------------------------------------------------------

CUDA_CONTEXT_BYTES = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator
DEFAULT_HEADROOM = 0.10  # allocator fragmentation and transient buffers


def usable_bytes(
    device_bytes: int, *, cuda: bool = True, headroom: float = DEFAULT_HEADROOM
) -> int:
    """The memory a plan may fill: a GPU's less the CUDA context, less the headroom."""
    context = CUDA_CONTEXT_BYTES if cuda else 0
    return int(max(device_bytes - context, 0) * (1 - headroom))


@dataclass(frozen=True)
class PlanCost:
    """A plan's memory, FLOPs per token and recomputation cost, and its fit on a device."""

    plan: Plan
    memory: MemoryEstimate
    flops: FlopsModel
    flops_per_token: float  # model FLOPs per position (6·N + 12·L·d·T, LoRA-aware)
    recompute_per_token: float  # added by gradient checkpointing (0 without it)
    recompute_share: float  # what recomputation costs (or would cost) as a share of the FLOPs
    usable_bytes: int | None  # None: no device given
    fits: bool | None

    @property
    def hardware_flops_per_token(self) -> float:
        return self.flops_per_token + self.recompute_per_token


def plan_cost(
    shape: ModelShape,
    plan: Plan,
    device_bytes: int | None = None,
    *,
    cuda: bool = True,
    headroom: float = DEFAULT_HEADROOM,
) -> PlanCost:
    """Everything the doctor and the estimate say about a plan's cost, from one place."""
    mem = estimate_memory(shape, plan)
    fm = flops_for_shape(shape, plan.lora_r)
    usable = usable_bytes(device_bytes, cuda=cuda, headroom=headroom) if device_bytes else None
    recompute = fm.recompute_per_token(plan.seq_len)
    return PlanCost(
        plan=plan,
        memory=mem,
        flops=fm,
        flops_per_token=fm.per_token(plan.seq_len),
        recompute_per_token=recompute if plan.gradient_checkpointing else 0.0,
        recompute_share=fm.recompute_share(plan.seq_len),
        usable_bytes=usable,
        fits=None if usable is None else mem.peak <= usable,
    )


# --- checkpoints --------------------------------------------------------------------------

# A checkpoint's write speed when nothing measured it: an ASSUMPTION (a local NVMe SSD
# writes 1-3 GB/s sequentially; network volumes of GPU clouds often 0.2-0.5 GB/s). Stated
# wherever it is used; --disk-write-gbps replaces it.
ASSUMED_WRITE_BYTES_PER_SECOND = 0.5e9


def checkpoint_bytes(shape: ModelShape, plan: Plan) -> int:
    """Bytes one checkpoint writes: the trained weights (the adapter under LoRA, in fp32) and
    the optimizer state (pitstop saves both so `--resume` continues exactly)."""
    if plan.lora_r is not None:
        trainable = lora_params(shape, plan.lora_r)
    else:
        trainable = shape.params().total
    return int(trainable * (FP32 + optimizer_state_bytes_per_param(plan.optimizer)))
