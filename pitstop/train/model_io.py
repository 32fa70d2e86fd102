"""Loading the model and tokenizer from a local Hugging Face directory, and saving them.

Nothing is downloaded (local_files_only); code from the model directory runs only
with --trust-remote-code. Full fine-tuning keeps fp32 master weights (autocast
computes in bf16/fp16); LoRA keeps the frozen base in the compute precision and
the adapter in fp32.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from pitstop.errors import ConfigError, MissingDependencyError
from pitstop.probe import Choice, DeviceInfo

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_tokenizer(cfg: Any) -> Any:
    from transformers import AutoTokenizer

    src = cfg.tokenizer or cfg.model
    try:
        return AutoTokenizer.from_pretrained(
            src, local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {src}: {e}") from None


def load_model(
    cfg: Any, dev: DeviceInfo, precision: str, attention: Choice
) -> tuple[torch.nn.Module, Choice, Choice | None]:
    """The model on `dev`, ready to train; returns (model, attention actually used, lora choice)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(cfg.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"--model {model_dir} is not a Hugging Face model directory (no config.json); "
            "give a local directory with config.json, weights and tokenizer files"
        )
    weights_dtype = torch.float32 if cfg.lora_r is None else _DTYPES[precision]
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "trust_remote_code": cfg.trust_remote_code,
        "dtype": weights_dtype,
    }
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = _four_bit_config(dev, precision)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation=attention.value, **kwargs
        )
    except (ValueError, ImportError) as e:
        if attention.value == "eager" or cfg.attention != "auto":
            raise ConfigError(
                f"cannot load {model_dir} with attention {attention.value}: {e}"
            ) from None
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="eager", **kwargs
        )
        attention = Choice(
            "eager", f"the model does not support {attention.value} ({e}); eager attention"
        )
    if not cfg.load_in_4bit:
        model.to(dev.torch_device)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = None
    if cfg.lora_r is not None:
        model, lora = _apply_lora(model, cfg)
    model.train()
    return model, attention, lora


def _four_bit_config(dev: DeviceInfo, precision: str) -> Any:
    if dev.type != "cuda":
        raise ConfigError(
            "--load-in-4bit needs a CUDA GPU (bitsandbytes 4-bit kernels); this run is on the CPU"
        )
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise MissingDependencyError(
            "--load-in-4bit needs bitsandbytes: pip install bitsandbytes"
        ) from None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=_DTYPES[precision],
        bnb_4bit_use_double_quant=True,
    )


def _apply_lora(model: torch.nn.Module, cfg: Any) -> tuple[torch.nn.Module, Choice]:
    try:
        import peft
    except ImportError:
        raise MissingDependencyError(
            "--lora-r needs the peft package: pip install 'pitstop[lora]'"
        ) from None
    if cfg.load_in_4bit:
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.gradient_checkpointing
        )
    elif cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    targets = list(cfg.lora_target_modules) or "all-linear"
    lcfg = peft.LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_r,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, lcfg)
    for p in model.parameters():  # adapters train in fp32 whatever the base precision
        if p.requires_grad:
            p.data = p.data.float()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    return model, Choice(
        f"r={cfg.lora_r}",
        f"LoRA on {targets if isinstance(targets, str) else ','.join(targets)}: "
        f"{n_train:,} of {n_all:,} parameters train ({100 * n_train / n_all:.2f}%)",
    )


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config")


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: the adapter for LoRA, else the whole state dict."""
    if is_peft(model):
        return {n: p for n, p in model.named_parameters() if p.requires_grad}
    return model.state_dict()


def save_model_dir(
    model: Any, tokenizer: Any, dest: Path, state: dict[str, torch.Tensor] | None
) -> None:
    """Save weights (safetensors) + config + tokenizer into `dest` (an existing directory)."""
    model.save_pretrained(dest, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)


def load_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Load a checkpoint's weights into `model` in place, exactly (no dtype round trip)."""
    from safetensors.torch import load_file

    if is_peft(model):
        import peft

        peft.set_peft_model_state_dict(model, load_file(ckpt / "adapter_model.safetensors"))
        return
    state: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(ckpt / "*.safetensors"))):
        state.update(load_file(f))
    result = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    missing = [k for k in result.missing_keys if not _tied_to_loaded(model, k, state, own)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def read_weights(ckpt: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's full model state by parameter name (CPU), tied weights filled in.

    For loading into a sharded (FSDP2) model, which takes a full state dict by name.
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(ckpt / "*.safetensors"))):
        state.update(load_file(f))
    # save_pretrained writes a tied tensor once; the state dict names it twice.
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    for names in by_param.values():
        have = [n for n in names if n in state]
        for n in names:
            if n not in state and have:
                state[n] = state[have[0]]
    return state


def _tied_to_loaded(model: Any, key: str, state: dict, own: dict) -> bool:
    """A key absent from the file is fine when it shares storage with a loaded tensor."""
    ptr = own[key].data_ptr()
    return any(own[k].data_ptr() == ptr for k in state if k in own)


def publish_dir(tmp: Path, dest: Path) -> None:
    """Replace `dest` by the finished directory `tmp` (rename; the old one is deleted after)."""
    if dest.exists():
        trash = dest.parent / f".{dest.name}.old-{secrets.token_hex(4)}"
        os.replace(dest, trash)
        os.replace(tmp, dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, dest)
