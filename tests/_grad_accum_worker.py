"""One rank of tests/test_grad_accum_memory.py, started by torchrun (2 processes, gloo).

    torchrun --nproc-per-node 2 tests/_grad_accum_worker.py {ddp|fsdp|resume} OUT_DIR

Trains a small block model for STEPS optimizer steps of MICRO micro-batches per rank
through pitstop's own wrap / no_sync / zero_grad, beside a one-process reference that
sees the same rows in one batch, and writes what it observed to OUT_DIR/rank-R.json:
where each micro-batch's gradients live (DDP), how many gradient bytes a rank holds
after a micro-batch that is not the step's last (FSDP2), and the largest difference
from the reference in loss, gradient and parameters at every step. `resume`: an FSDP2
model restored from a full state only rank 0 reads continues bit-identically.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from pitstop.cli import leave
from pitstop.core.config import RunConfig
from pitstop.train import distributed

STEPS = 3
MICRO = 2  # micro-batches per rank and step
ROWS = 2  # rows per micro-batch
WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]  # wrap shards one group per Block

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds: its sharded `.grad`s plus any unsharded gradient
    FSDP2 keeps between micro-batches (the parameter's or the accumulated fp32 one)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            if fp.sharded_param.grad is not None:
                g = _local(fp.sharded_param.grad)
                total += g.numel() * g.element_size()
            acc = getattr(fp, "unsharded_accumulated_grad", None)
            if acc is not None:
                total += acc.numel() * acc.element_size()
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                total += unsharded.grad.numel() * unsharded.grad.element_size()
    return total


def main(strategy: str, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = distributed.DistEnv(rank, world, rank, "gloo")
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)  # one process, the whole step's rows at once
    cfg = RunConfig(model="m", data="d", output="o", strategy=strategy)
    wrapped, _ = distributed.wrap(model, cfg, env)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    n_rows = world * MICRO * ROWS  # the step's rows over all ranks
    xs = torch.randn(STEPS, n_rows, 8, generator=g)
    ys = torch.randn(STEPS, n_rows, 1, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    sharded_bytes = sum(_local(p).numel() * p.element_size() for p in params)
    full_bytes = sum(p.numel() * p.element_size() for p in params)
    steps: list[dict[str, Any]] = []
    for s in range(STEPS):
        mine_x, mine_y = xs[s, rank::world], ys[s, rank::world]  # this rank's rows
        loss_sum = torch.zeros(())
        storages: list[list[int]] = []
        grad_bytes: list[list[int]] = []
        held_not_last: list[int] = []
        for m in range(MICRO):
            last = m == MICRO - 1
            x, y = mine_x[m * ROWS : (m + 1) * ROWS], mine_y[m * ROWS : (m + 1) * ROWS]
            with distributed.no_sync(wrapped, strategy, last):
                # The trainer's math: summed loss over the step's rows on all ranks, times
                # the world size to undo the wrappers' gradient averaging.
                loss = ((wrapped(x) - y) ** 2).sum() / n_rows
                (loss * world).backward()
            loss_sum += loss.detach()
            if strategy == "ddp":
                storages.append([p.grad.untyped_storage().data_ptr() for p in params])
                grad_bytes.append([p.grad.numel() * p.grad.element_size() for p in params])
            elif not last:
                held_not_last.append(fsdp_grad_bytes(model))
        dist.all_reduce(loss_sum)
        grads = [_full(p.grad).clone() for p in params]
        opt.step()
        distributed.zero_grad(opt, wrapped)

        ref_loss = ((ref(xs[s]) - ys[s]) ** 2).sum() / n_rows
        ref_loss.backward()
        ref_grads = [p.grad.clone() for p in ref.parameters()]
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        rec: dict[str, Any] = {
            "loss_diff": abs(float(loss_sum) - float(ref_loss.detach())),
            "grad_max_diff": max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)),
            "param_max_diff": max(
                float((_full(p.detach()) - q.detach()).abs().max())
                for p, q in zip(params, ref.parameters())
            ),
        }
        if strategy == "ddp":
            synced = storages[-1]  # the buckets the all-reduce used
            rec["micro_batches_in_bucket"] = [st == synced for st in storages]
            # Gradient bytes held outside the buckets (which DDP keeps all the time).
            rec["bytes_beside_buckets"] = [
                sum(n for ptr, ref_ptr, n in zip(st, synced, nb) if ptr != ref_ptr)
                for st, nb in zip(storages, grad_bytes)
            ]
            rec["zeroed_grads_in_bucket"] = [
                p.grad is not None and p.grad.untyped_storage().data_ptr() == ptr
                for p, ptr in zip(params, synced)
            ]
            rec["grads_zero_after_step"] = all(
                p.grad is not None and not p.grad.any() for p in params
            )
        else:
            rec["held_grad_bytes_not_last"] = held_not_last
        steps.append(rec)
    res = {"steps": steps, "sharded_grad_bytes": sharded_bytes, "full_grad_bytes": full_bytes}
    (out / f"rank-{rank}.json").write_text(json.dumps(res), encoding="utf-8")
    # Leave together: a rank tearing gloo down while its peer still works was seen to
    # abort the peer ("terminate called without an active exception", exit -6).
    dist.barrier()
    dist.destroy_process_group()


def _train_step(wrapped: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, rank: int, world: int) -> None:  # fmt: skip
    mine_x, mine_y = x[rank::world], y[rank::world]
    ((wrapped(mine_x) - mine_y) ** 2).sum().div(x.shape[0]).mul(world).backward()
    opt.step()
    distributed.zero_grad(opt, wrapped)


def resume(out: Path) -> None:
    """FSDP2 resume from a full state that only rank 0 reads (`load_full_state`): a fresh
    model continues bit-identically to the one that was saved."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = distributed.DistEnv(rank, world, rank, "gloo")
    cfg = RunConfig(model="m", data="d", output="o", strategy="fsdp")
    g = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(3, 8, 8, generator=g), torch.randn(3, 8, 1, generator=g)

    def fresh(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model, _ = distributed.wrap(Net(), cfg, env)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    a, opt_a = fresh(0)
    _train_step(a, opt_a, xs[0], ys[0], rank, world)
    model_sd = distributed.full_state(a)  # what a checkpoint holds (rank 0; others empty)
    optim_sd = distributed.full_optimizer_state(a, opt_a)
    reads: list[int] = []

    def read() -> tuple[dict[str, Any], dict[str, Any]]:
        reads.append(rank)
        # Copies, as a checkpoint read from disk is: the gathered state shares tensors
        # with model `a` (AdamW's step counts), which keeps training beside `b`.
        return copy.deepcopy(model_sd), copy.deepcopy(optim_sd)

    b, opt_b = fresh(1)  # other initial weights: all of them must come from the checkpoint
    distributed.load_full_state(b, opt_b, read, env)
    for s in (1, 2):
        _train_step(a, opt_a, xs[s], ys[s], rank, world)
        _train_step(b, opt_b, xs[s], ys[s], rank, world)
    same = all(
        torch.equal(_local(p.detach()), _local(q.detach()))
        for p, q in zip(a.parameters(), b.parameters())
    )
    res = {"reads": reads, "held_full_state": bool(model_sd), "bit_identical": same}
    (out / f"rank-{rank}.json").write_text(json.dumps(res), encoding="utf-8")
    # Leave together: a rank tearing gloo down while its peer still works was seen to
    # abort the peer ("terminate called without an active exception", exit -6).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume(Path(sys.argv[2]))
    else:
        main(sys.argv[1], Path(sys.argv[2]))
    # As pitstop's own workers leave (pitstop.cli.entry): FSDP2's device mesh keeps gloo alive
    # past destroy_process_group, and the interpreter's teardown of it aborted a rank after
    # both had written their results (exit -6, seen in CI).
    leave(0)
