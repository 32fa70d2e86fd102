"""Loading the model and tokenizer from a local Hugging Face directory, and saving them.

Nothing is downloaded (local_files_only); code from the model directory runs only
with --trust-remote-code. Full fine-tuning keeps fp32 master weights (autocast
computes in bf16/fp16); LoRA keeps the frozen base in the compute precision and
the adapter in fp32.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from pitstop.catalog.model_config import ModelConfig, ModelConfigError
from pitstop.core.errors import ConfigError, MissingDependencyError
from pitstop.core.quiet_imports import without_bitsandbytes
from pitstop.data import tokenize
from pitstop.probe import Choice, DeviceInfo, four_bit_problem
from pitstop.train.checkpoint import CheckpointError
from pitstop.train.doc_attention import DOC_ATTENTION
from pitstop.train.doc_attention import register as register_doc_attention

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_tokenizer(cfg: Any) -> Any:
    """The run's tokenizer (saved with the final model): the one `prepare` checks and uses."""
    return tokenize.load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)


def load_model(
    cfg: Any, dev: DeviceInfo, precision: str, attention: Choice
) -> tuple[torch.nn.Module, Choice, Choice | None]:
    """The model on `dev`, ready to train; returns (model, attention actually used, lora choice)."""

    model_dir = check_model_dir(Path(cfg.model), cfg.trust_remote_code)
    weights_dtype = torch.float32 if cfg.lora_r is None else _DTYPES[precision]
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "trust_remote_code": cfg.trust_remote_code,
        "dtype": weights_dtype,
        "use_safetensors": True,  # never unpickle pytorch_model.bin
    }
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = _four_bit_config(dev, precision)
    try:
        model = _from_pretrained(model_dir, attention.value, kwargs)
    except (ValueError, ImportError) as e:
        if attention.value == "eager" or cfg.attention != "auto":
            raise ConfigError(
                f"cannot load {model_dir} with attention {attention.value}: {e}"
            ) from None
        model = _from_pretrained(model_dir, "eager", kwargs)
        attention = Choice(
            "eager", f"the model does not support {attention.value} ({e}); eager attention"
        )
    # Saved adapters name their base by an absolute path (or its Hub id), so they load
    # from anywhere, not only from the directory the run was started in.
    model.name_or_path = model.config._name_or_path = base_model_name(model_dir)
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


def _remote_code_problem(model_dir: Path, model_type: Any) -> str:
    return (
        f"--model {model_dir} (model type {model_type!r}) needs code from its directory to "
        "load (its config.json names Python modules in auto_map), and pitstop runs code from "
        "a model directory only with --trust-remote-code; pass --trust-remote-code only if "
        "you trust the files in that directory"
    )


def _no_safetensors_problem(model_dir: Path) -> str:
    return (
        f"--model {model_dir} has no .safetensors weights; pitstop loads weights only from "
        "safetensors, never from pickle files such as pytorch_model.bin (unpickling can run "
        'code). Convert them, only if you trust the file, with: python -c "from transformers '
        "import AutoModelForCausalLM as M; "
        f"M.from_pretrained('{model_dir}').save_pretrained('{model_dir}', "
        'safe_serialization=True)"'
    )


def check_model_dir(model_dir: Path, trust_remote_code: bool) -> Path:
    """Refuse, before transformers reads anything, a model directory pitstop cannot load
    safely: no config.json, weights that are not safetensors, or an architecture that
    needs its own code without --trust-remote-code. Returns `model_dir`."""
    if not (model_dir / "config.json").is_file():
        from pitstop.core.hub import missing_hint

        raise ConfigError(
            f"--model {model_dir} is not a Hugging Face model directory (no config.json); "
            "give a local directory with config.json, weights and tokenizer files"
            + missing_hint(str(model_dir))
        )
    if not glob.glob(str(model_dir / "*.safetensors")):
        raise ConfigError(_no_safetensors_problem(model_dir))
    if trust_remote_code:
        return model_dir
    try:
        config = ModelConfig.read(model_dir)
    except ModelConfigError as e:
        raise ConfigError(f"--model {model_dir}: {e}") from None
    bad = config.size_problems()
    if bad:
        raise ConfigError(
            f"--model {model_dir}: its config.json's {'; '.join(bad)}; fix config.json "
            "(or download the model again)"
        )
    model_type = config.model_type
    from transformers import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return model_dir
    if config.has_auto_map:
        raise ConfigError(_remote_code_problem(model_dir, model_type))
    import transformers

    raise ConfigError(
        f"--model {model_dir}: model type {model_type!r} is not an architecture transformers "
        f"{transformers.__version__} knows; upgrade transformers, or fix model_type in its "
        "config.json"
    )


def _from_pretrained(model_dir: Path, attn: str, kwargs: dict[str, Any]) -> Any:
    """AutoModelForCausalLM.from_pretrained, with the errors a user can act on as ConfigError."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if attn == DOC_ATTENTION:
        register_doc_attention()  # selected by name, like transformers' own kernels
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(_remote_code_problem(model_dir, "custom")) from None
        raise
    except OSError as e:
        if "safetensors" in str(e):
            raise ConfigError(_no_safetensors_problem(model_dir)) from None
        raise
    except SafetensorError as e:  # a weights file cut short or overwritten (a failed copy)
        raise ConfigError(
            f"--model {model_dir}: a weights file is damaged and cannot be read as safetensors "
            f"({e}); download or save the model again"
        ) from None


def _four_bit_config(dev: DeviceInfo, precision: str) -> Any:
    problem = four_bit_problem(dev)
    if problem:
        raise ConfigError(problem)
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
        if cfg.load_in_4bit:
            import peft
        else:  # peft imports bitsandbytes eagerly; a LoRA run without 4-bit does not need it
            with without_bitsandbytes():
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
    if cfg.lora_target_modules:
        _check_lora_targets(model, list(cfg.lora_target_modules))
        try:
            model = peft.get_peft_model(model, lcfg)
        except ValueError as e:  # e.g. a target that is not a layer type LoRA can adapt
            raise ConfigError(
                f"--lora-target-modules {','.join(targets)}: {e} "
                f"(the model's linear layers: {', '.join(_linear_names(model))})"
            ) from None
    else:
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


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct leaf names of the model's nn.Linear modules (what LoRA can target)."""
    names = {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    return sorted(names)


def _check_lora_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """ConfigError naming every target that matches no module (peft's own matching rule:
    the module's full name, or its name ending in '.' + target)."""
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(
            f"--lora-target-modules: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not a module of this model; the model's "
            f"linear layers are: {', '.join(_linear_names(model))} (or leave the option out "
            "to adapt every linear layer)"
        )


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config")


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: the adapter for LoRA, else the whole state dict."""
    if is_peft(model):
        return {n: p for n, p in model.named_parameters() if p.requires_grad}
    return model.state_dict()


def base_model_name(model_dir: Path) -> str:
    """How a saved adapter names its base: the Hub id of a cache snapshot, else an absolute path."""
    from pitstop.core.hub import hub_id_of

    return hub_id_of(model_dir) or str(Path(model_dir).resolve())


def base_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the base model's config.json declares (float32 when it declares none)."""
    config = ModelConfig.read_optional(model_dir)
    name = config.dtype if config is not None else None
    dtype = getattr(torch, name, None) if name is not None else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def save_dtype(cfg: Any) -> torch.dtype:
    """The final model's dtype: --save-dtype, or auto: the base's."""
    if cfg.save_dtype != "auto":
        return _DTYPES[cfg.save_dtype]
    return base_dtype(Path(cfg.model))


def save_final(
    model: Any, tokenizer: Any, dest: Path, state: dict[str, torch.Tensor] | None, cfg: Any
) -> None:
    """final/: a full fine-tune in --save-dtype (default the base's, so a bf16 base is not
    saved at twice its size from the fp32 master weights); a LoRA adapter as trained."""
    if is_peft(model):
        save_model_dir(model, tokenizer, dest, state)
        return
    dtype = save_dtype(cfg)
    if state is None:
        state = model.state_dict()
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_model_dir(model, tokenizer, dest, state)
    set_config_dtype(dest, dtype)


def set_config_dtype(model_dir: Path, dtype: torch.dtype) -> None:
    """Make config.json declare the dtype the weights were written in (save_pretrained
    writes the in-memory parameters' dtype, fp32 for master weights)."""
    raw = dict(ModelConfig.read(model_dir).raw)  # save_pretrained just wrote it
    name = str(dtype).removeprefix("torch.")
    raw["dtype"] = name
    if "torch_dtype" in raw:
        raw["torch_dtype"] = name
    ModelConfig.path_in(model_dir).write_text(
        json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


def save_model_dir(
    model: Any, tokenizer: Any, dest: Path, state: dict[str, torch.Tensor] | None
) -> None:
    """Save weights (safetensors) + config + tokenizer into `dest` (an existing directory)."""
    if is_peft(model):
        # peft's default ("auto") asks the Hub whether the base's vocabulary changed when the
        # adapter names its base by Hub id: an offline machine waits for time-outs. pitstop
        # never resizes the embeddings, so they are saved exactly when LoRA trains them.
        model.save_pretrained(
            dest,
            state_dict=state,
            safe_serialization=True,
            save_embedding_layers=_lora_on_embeddings(model),
        )
    else:
        model.save_pretrained(dest, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)


def _lora_on_embeddings(model: Any) -> bool:
    """Whether a peft model adapts an embedding layer (its adapter then holds embeddings)."""
    from peft.tuners.lora import Embedding as LoraEmbedding

    return any(isinstance(m, LoraEmbedding) for m in model.modules())


def load_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Load a checkpoint's weights into `model` in place, exactly (no dtype round trip)."""

    if is_peft(model):
        import peft

        peft.set_peft_model_state_dict(model, _adapter_state(ckpt))
        return
    state = _safetensors_state(ckpt)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # same names, other shapes: another architecture or size
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e))
        raise CheckpointError(
            f"checkpoint {ckpt} does not match the model ({first[:300]}); resume with the "
            "--model the run started from, or delete this checkpoint"
        ) from None
    own = model.state_dict()
    missing = [k for k in result.missing_keys if not _tied_to_loaded(model, k, state, own)]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}; resume with the --model the run "
            "started from, or delete this checkpoint"
        )


def _adapter_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapter tensors, named as peft saves them."""
    adapter = ckpt / "adapter_model.safetensors"
    if not adapter.is_file():
        raise CheckpointError(
            f"checkpoint {ckpt}: no safetensors weights in it (adapter_model.safetensors "
            "is missing); pitstop loads weights only from safetensors. Delete this "
            "checkpoint to resume from an older one"
        )
    return _load_safetensors(adapter, ckpt)


def _adapter_by_parameter_name(model: Any, ckpt: Path) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapter under the model's own parameter names.

    peft saves `...q_proj.lora_A.weight` for the parameter `...q_proj.lora_A.default.weight`;
    an FSDP2 model loads a full state by parameter name. peft's own save-time renaming,
    run on the trainable parameters themselves, pairs the two names (no rule copied here).
    """
    import peft

    saved = _adapter_state(ckpt)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    name_of = {id(p): n for n, p in trainable.items()}
    renamed = peft.get_peft_model_state_dict(
        model, state_dict=trainable, save_embedding_layers=False
    )
    param_name = {k: name_of[id(v)] for k, v in renamed.items() if id(v) in name_of}
    missing = sorted(set(param_name) - set(saved))
    unexpected = sorted(set(saved) - set(param_name))
    if missing or unexpected or len(param_name) != len(trainable):
        raise CheckpointError(
            f"checkpoint {ckpt}: its adapter does not match this LoRA model (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}); resume with the --model, --lora-r "
            "and --lora-target-modules the run started with, or delete this checkpoint"
        )
    return {param_name[k]: saved[k] for k in param_name}


def _safetensors_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's *.safetensors files; CheckpointError when there are none."""

    files = sorted(glob.glob(str(ckpt / "*.safetensors")))
    if not files:
        raise CheckpointError(
            f"checkpoint {ckpt}: no safetensors weights in it (no *.safetensors file); "
            "pitstop loads weights only from safetensors and never from pickle files such "
            "as pytorch_model.bin. Delete this checkpoint to resume from an older one"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_load_safetensors(Path(f), ckpt))
    return state


def _load_safetensors(path: Path, ckpt: Path) -> dict[str, torch.Tensor]:
    """One weights file; a damaged one (zeroed, cut, garbage) is a CheckpointError naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:  # SafetensorError, OSError...: the file is unreadable as weights
        raise CheckpointError(
            f"checkpoint {ckpt}: {path.name} is damaged and cannot be read as safetensors "
            f"weights ({type(e).__name__}: {str(e)[:200]}); delete this checkpoint to resume "
            "from an older one"
        ) from None


def read_weights(ckpt: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's full model state by parameter name (CPU), tied weights filled in;
    for a LoRA model, its adapter by parameter name (the frozen base is not in checkpoints).

    For loading into a sharded (FSDP2) model, which takes a full state dict by name.
    """
    if is_peft(model):
        return _adapter_by_parameter_name(model, ckpt)
    state = _safetensors_state(ckpt)
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


def set_attention(model: Any, attention: str) -> None:
    """Switch a loaded model's attention kernel (a PEFT model: its base's)."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(attention)
            return
        except Exception:  # older transformers, or a wrapper without it: set the config
            pass
    model.config._attn_implementation = attention
