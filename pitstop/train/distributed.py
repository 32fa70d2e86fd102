"""Data parallelism: process-group set-up, the `--nproc` relauncher, DDP/FSDP2 wrapping.

How a multi-process run starts:

- ``torchrun --nproc-per-node N -m pitstop train ...`` (or any launcher that sets
  RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT): every process runs
  the trainer; `init()` joins the process group (nccl on CUDA, gloo on CPU).
- ``pitstop train --nproc N`` on one machine: `launch()` writes the run's config to a
  temporary YAML file and starts ``python -m torch.distributed.run --standalone
  --nproc-per-node N -m pitstop train --config FILE`` (an argv list, no shell), waits,
  and returns the summary rank 0 wrote. torchrun's --standalone picks a free port.

Multi-node runs use torchrun's own rendezvous; pitstop adds nothing to it. On each of
the M machines (same code, same data path, a shared filesystem for --output so that
every rank can read the checkpoint to resume from)::

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id RUN_ID -m pitstop train ...

Strategies: ``ddp`` (default) replicates the model and all-reduces gradients;
``fsdp`` shards parameters, gradients and optimizer state with FSDP2
(`torch.distributed.fsdp.fully_shard`), one group per transformer block plus the root.
Both work with gloo on CPU (checked with torch 2.13) and nccl on CUDA, and with LoRA:
FSDP2 shards the frozen base too, and checkpoints gather only the adapter (FSDP2 + LoRA
needs torch >= 2.8 unless the base is fp32: `probe.strategy_problems` refuses it).

The loss math: the loader divides each micro-batch's summed CE by the step's target
count over *all* ranks, so the wanted gradient is the *sum* of the ranks' gradients.
DDP and FSDP2 average instead (divide by world size), so each rank multiplies its
loss by the world size before backward. Logged losses are all-reduced sums.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pitstop.core import log, run_record
from pitstop.core.config import RunConfig
from pitstop.core.errors import ConfigError, PitstopError
from pitstop.core.runlock import HELD_ENV
from pitstop.probe import Choice, DeviceInfo, strategy_problems
from pitstop.train.checkpoint import CheckpointError
from pitstop.train.model_io import is_peft

__all__ = [
    "DistEnv",
    "LaunchError",
    "all_reduce_sum",
    "broadcast_object",
    "env_world",
    "init",
    "launch",
    "shutdown",
]


class LaunchError(PitstopError):
    """A `--nproc` worker process failed; its own message was printed above."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the run (a single process is rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# How long a collective waits for the slowest rank before the process group gives up.
# torch's default is 10 minutes (gloo and nccl alike; NCCL's watchdog then aborts the
# communicator and kills the rank). Rank 0 writes checkpoints and the final model alone
# while the others wait in a barrier or the next collective, and writing a large model to
# a slow or network filesystem can take longer than that: a healthy run would be killed.
# A rank that really hangs is still stopped, an hour later.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=60)


def env_world() -> int:
    """WORLD_SIZE as set by torchrun (1 when not launched by a distributed launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def init(device: DeviceInfo) -> tuple[DistEnv, DeviceInfo]:
    """Join the process group torchrun described in the environment, if any.

    Returns the environment and the device this rank trains on (cuda:LOCAL_RANK on GPUs).
    """
    import torch.distributed as dist

    world = env_world()
    if world <= 1:
        return DistEnv(), device
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if local >= n:
            raise ConfigError(
                f"local rank {local} has no GPU: this machine has {n} CUDA device(s); "
                f"use --nproc-per-node {n} or fewer"
            )
        device = dataclasses.replace(device, index=local)
        torch.cuda.set_device(local)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        # device_id binds NCCL's communicator to this rank's GPU at once (no lazy guessing).
        kw: dict[str, Any] = {"device_id": torch.device("cuda", local)} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=PROCESS_GROUP_TIMEOUT, **kw)
    return DistEnv(rank, world, local, backend), device


def shutdown(env: DistEnv) -> None:
    import torch.distributed as dist

    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum `t` over ranks in place (a no-op in a single process)."""
    if env.distributed:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flags: tuple[bool, ...], device: torch.device) -> tuple[bool, ...]:
    """Each flag true on any rank; every rank must call it at the same point (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def broadcast_object(obj: Any, env: DistEnv, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (picklable objects only)."""
    if not env.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        import torch.distributed as dist

        dist.barrier()


# --- wrapping -----------------------------------------------------------------------


def check_strategy(cfg: RunConfig, env: DistEnv) -> list[str]:
    """Combinations pitstop does not run (reported before anything is written)."""
    return strategy_problems(cfg, distributed=env.distributed)


# DDP copies every gradient into its all-reduce buckets unless the gradients are views into
# the buckets. As views the buckets are the gradients: one copy fewer (12 GB for a 3B full
# fine-tune in fp32), and what the micro-batch sizer measures on the bare model is what DDP
# holds, provided the views live through a step's no_sync micro-batches too (`wrap` makes
# them views at once; `zero_grad` keeps them). The sizer counts a copy only where this is
# off (`ddp_gradient_copy_bytes`).
GRADIENT_AS_BUCKET_VIEW = True


def ddp_gradient_copy_bytes(
    params: list[torch.nn.Parameter], *, bucket_view: bool = GRADIENT_AS_BUCKET_VIEW
) -> int:
    """Device bytes DDP holds beyond the gradients a one-process measurement sees."""
    if bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def fsdp_mixed_precision(precision: str | None) -> Any:
    """FSDP2's mixed-precision policy for a run's precision (None: FSDP2's default, fp32).

    bf16: parameters are all-gathered and computed in bf16 (half the traffic of fp32; the
    matmuls ran in bf16 under autocast anyway), gradients reduce-scattered in fp32 into the
    fp32 master shards the optimizer updates. A LoRA model's bf16 base and fp32 adapter
    then gather as one dtype too.
    """
    if precision != "bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def wrap(
    model: torch.nn.Module, cfg: RunConfig, env: DistEnv, *, precision: str | None = None
) -> tuple[Any, Choice]:
    """The module the loop calls forward on, and the `strategy` choice for the banner.

    DDP returns a wrapper (the unwrapped `model` stays the one to save); FSDP2 shards
    `model` in place and returns it (with `fsdp_mixed_precision(precision)`).
    """
    if not env.distributed:
        why = "single process" + (
            " (--strategy fsdp needs several)" if cfg.strategy == "fsdp" else ""
        )
        return model, Choice("none", why)
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        on_cuda = next(model.parameters()).device.type == "cuda"
        dev_ids = [torch.cuda.current_device()] if on_cuda else None
        if GRADIENT_AS_BUCKET_VIEW:
            # DDP points a gradient at its bucket only when one exists: at construction or
            # at the first synced backward. Without this, step 1's no_sync micro-batches
            # would allocate gradients beside the buckets (a second copy). Each bucket DDP
            # builds takes over its parameters' zeros, which are freed as it goes: about
            # one gradient copy throughout, before the optimizer has any state.
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        ddp = DDP(model, device_ids=dev_ids, gradient_as_bucket_view=GRADIENT_AS_BUCKET_VIEW)
        return ddp, Choice(
            "ddp",
            f"{env.world_size} processes ({env.backend}): model replicated, gradients all-reduced "
            "(gradients are views into the all-reduce buckets, zeroed in place between steps: "
            "no second copy, also while micro-batches accumulate)",
        )
    from torch.distributed.fsdp import fully_shard

    mp = fsdp_mixed_precision(precision)
    kw = {"mp_policy": mp} if mp is not None else {}
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    n = 0
    for m in model.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, **kw)  # one all-gather per block: memory holds one block's full weights
            n += 1
    fully_shard(model, **kw)
    # FSDP2 shards each parameter on its own, so a LoRA block holds its frozen base weights
    # and its trainable adapter in one group; only the adapter has gradients and optimizer state.
    saved = "the adapter" if is_peft(model) else "full state"
    return model, Choice(
        "fsdp",
        f"{env.world_size} processes ({env.backend}): FSDP2, parameters/gradients/optimizer "
        f"state sharded ({n} block groups + root); {saved} gathered on rank 0 to save"
        + ("; bf16 all-gather and compute, fp32 gradient reduce-scatter" if mp else ""),
    )


def no_sync(wrapped: Any, strategy: str, last: bool) -> AbstractContextManager[Any]:
    """DDP: gradient all-reduce only on a step's last micro-batch (accumulate locally before).

    FSDP2: every micro-batch reduce-scatters (gradient sync stays on, as in torchtitan).
    With sync off, each rank would keep the *unsharded* gradients of the whole model (in
    fp32 under bf16 mixed precision) until the last micro-batch: a full model's gradients
    per GPU, the memory FSDP exists to shard. Sharded gradients accumulate instead; the
    price is one reduce-scatter per micro-batch rather than per step.
    """
    if strategy == "ddp" and hasattr(wrapped, "no_sync"):
        return nullcontext() if last else wrapped.no_sync()
    return nullcontext()


def zero_grad(optimizer: torch.optim.Optimizer, wrapped: Any) -> None:
    """Clear the gradients after an optimizer step.

    DDP with bucket views: zeroed in place, so each `.grad` stays a view into its bucket
    and the next step's no_sync backwards accumulate into the bucket. Set to None, the
    no_sync micro-batches would allocate fresh gradients beside the buckets, a second
    copy (4 bytes a parameter in fp32) the micro-batch sizer does not reserve. Every
    trainable parameter gets a gradient in every DDP step (find_unused_parameters is
    off), so zeros instead of None change no update. Otherwise: set to None (freed).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    in_place = isinstance(wrapped, DDP) and wrapped.gradient_as_bucket_view
    optimizer.zero_grad(set_to_none=not in_place)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """FSDP: what a checkpoint holds (`model_io.trainable_state`: a LoRA model's adapter,
    else the whole state), unsharded on rank 0's CPU (empty on others). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # LoRA: the frozen base is dropped before the gather, so no rank ever holds it whole.
    opts = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=is_peft(model)
    )
    return get_model_state_dict(model, options=opts)


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """FSDP: the full optimizer state keyed by parameter name, on rank 0's CPU. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_state(
    model: torch.nn.Module,
    optimizer: Any,
    read: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
    env: DistEnv,
) -> None:
    """FSDP: load a checkpoint's full (unsharded) model and optimizer state. Collective.

    Only rank 0 calls `read()` (-> model state by name, optimizer state) and so holds the
    full state in host memory; FSDP2 broadcasts it one tensor at a time and every rank
    keeps its shard. Every rank reading it would hold weights + optimizer state (12 bytes
    a parameter for AdamW in fp32) once per GPU of the machine at the same time. A failed
    read stops every rank (the others would otherwise wait in the broadcast).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    failed: BaseException | None = None
    if env.rank == 0:
        try:
            model_sd, optim_sd = read()
            optim_sd = optimizer_state_by_name(model, optimizer, optim_sd)
        except Exception as e:
            failed = e
    problem = broadcast_object(None if failed is None else str(failed), env)
    if failed is not None:
        raise failed
    if problem is not None:
        raise CheckpointError(f"rank 0 could not read the checkpoint: {problem}")
    # LoRA: the checkpoint holds the adapter only (rank 0 checked it matches the model:
    # model_io.read_weights); the frozen base keeps what was loaded from --model.
    opts = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=not is_peft(model)
    )
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_sd, options=opts)


def optimizer_state_by_name(
    model: torch.nn.Module, optimizer: Any, optim_sd: dict[str, Any]
) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, as FSDP2 loads it.

    A checkpoint of a one-process or DDP run keys it by position (`Optimizer.state_dict()`);
    the positions pair with this optimizer's parameters group by group, as
    `Optimizer.load_state_dict` pairs them, so such a checkpoint resumes with --strategy fsdp.
    """
    groups = optim_sd.get("param_groups", [])
    if all(isinstance(i, str) for g in groups for i in g["params"]):
        return optim_sd  # written by an FSDP run: already by name
    sizes = [len(g["params"]) for g in groups]
    own = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != own:
        raise CheckpointError(
            f"the checkpoint's optimizer state has parameter groups of {sizes} tensors where "
            f"this run's optimizer has {own}; resume with the --model and --lora-r the run "
            "started with, or delete this checkpoint"
        )
    name_of = {id(p): n for n, p in model.named_parameters()}
    name = {
        i: name_of[id(p)]
        for saved, mine in zip(groups, optimizer.param_groups)
        for i, p in zip(saved["params"], mine["params"])
    }
    return {
        "state": {name[i]: v for i, v in optim_sd.get("state", {}).items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in groups],
    }


# --- the --nproc relauncher -----------------------------------------------------------


def launch_argv(config_file: Path, nproc: int) -> list[str]:
    """The torchrun command line of `--nproc N` (an argv list, never a shell string).

    torchrun's log directory goes beside the config file, in the launch's own temporary
    directory: left to itself, torchrun makes a /tmp/torchelastic_* directory per run and
    never removes it."""
    log_dir = config_file.parent / "torchrun-logs"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--log-dir", str(log_dir)]
    train = ["-m", "pitstop", "train", "--config", str(config_file)]
    return [*torchrun, "--nproc-per-node", str(nproc), *train]


def launch(cfg: RunConfig) -> run_record.RunSummary:
    """Run `cfg` as `cfg.nproc` processes on this machine; returns rank 0's summary.

    The config travels as a YAML file rather than re-quoted flags, so a run started from
    Python (`pitstop.train.run(cfg)`) relaunches exactly like one started from the CLI.
    """

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count()
        if cfg.nproc > n:
            raise ConfigError(
                f"--nproc {cfg.nproc} asks for more processes than the {n} visible GPU(s); "
                f"use --nproc {n} or fewer (or --device cpu)"
            )
    with tempfile.TemporaryDirectory(prefix="pitstop-launch-") as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(cfg.to_yaml(), encoding="utf-8")
        argv = launch_argv(path, cfg.nproc)
        env = dict(os.environ)
        env[HELD_ENV] = str(os.getpid())  # run() holds OUT/.lock for the ranks it launches
        # torchrun sets OMP_NUM_THREADS=1 and prints a banner about it when unset; on a CPU
        # run split the cores between the ranks instead (torch's default would oversubscribe).
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.nproc))
        log.info(f"pitstop: launching {cfg.nproc} processes: {' '.join(argv[1:])}")
        proc = subprocess.Popen(argv, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            rc = proc.wait()  # torchrun forwards the signal; the ranks save and stop
    out = Path(str(cfg.output))
    if rc != 0:
        raise LaunchError(
            f"the {cfg.nproc} training processes stopped with exit code {rc} (their messages are above)",
            exit_code=rc if 0 < rc < 256 else 1,
        )
    return run_record.read_summary(out)  # rank 0's, validated
