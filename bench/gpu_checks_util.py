"""What the GPU self-test's checks share (bench/gpu_selftest.py): the row type, the tiny
models and packed micro-batches they run, a process group of one, timing, and the
isolation that keeps one check's global torch settings out of the next."""

from __future__ import annotations

import contextlib
import gc
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 256


@dataclass
class Row:
    check: str
    status: str  # pass / FAIL / skip
    detail: str


def short_error(e: BaseException, limit: int = 300) -> str:
    """One line naming an exception (its type and message), for a FAIL row."""
    line = traceback.format_exception_only(type(e), e)[-1].strip()
    line = " ".join(line.split())
    return line if len(line) <= limit else line[:limit] + " ..."


def where_raised(e: BaseException, *, prefer: str = "pitstop") -> str:
    """Where `e` was raised: the innermost frame, and the innermost frame under `prefer`
    (a path fragment) when that is another one."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "unknown place"

    def fmt(f: traceback.FrameSummary) -> str:
        parts = f.filename.replace("\\", "/").split("/")
        tail = "/".join(parts[-3:])
        return f"{tail}:{f.lineno} in {f.name}"

    inner = frames[-1]
    own = [f for f in frames if f"/{prefer}/" in f.filename.replace("\\", "/")]
    if own and own[-1] is not inner:
        return f"{fmt(inner)} (called from {fmt(own[-1])})"
    return fmt(inner)


def tiny_llama(
    attn: str, dev: torch.device, *, seed: int = 0, tied: bool = False, **shape: Any
) -> Any:
    """A Llama built from a config (random weights, fp32) on `dev` with kernel `attn`.
    Default shape: 2 layers, width 128, 4 heads over 2 key/value heads."""
    from transformers import AutoModelForCausalLM

    from pitstop.tiny import llama_config
    from pitstop.train import doc_attention

    doc_attention.register()  # sdpa_docs is selected by name, like transformers' kernels
    kw = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, **shape}
    cfg = llama_config(VOCAB, **kw)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dev)


def batch(dev: torch.device, rows: int = 2, width: int = 64) -> dict[str, torch.Tensor]:
    """Two documents per row (position ids restarting at the half), on `dev`."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    half = width // 2
    pos = torch.cat([torch.arange(half), torch.arange(width - half)]).repeat(rows, 1)
    return {"input_ids": ids.to(dev), "labels": ids.clone().to(dev), "position_ids": pos.to(dev)}


def packed_rows(
    rows: Sequence[Sequence[int]], vocab: int = VOCAB, *, seed: int = 0
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """(a loader-shaped host micro-batch of `rows`, each row's documents by length, the
    token ids of each document in row-major order). Every row must have the same width."""
    g = torch.Generator().manual_seed(seed)
    width = sum(rows[0])
    ids, pos, docs = [], [], []
    for row in rows:
        if sum(row) != width:
            raise ValueError(f"rows of different widths: {[sum(r) for r in rows]}")
        for n in row:
            docs.append(torch.randint(1, vocab, (n,), generator=g))
        ids.append(torch.cat(docs[len(docs) - len(row) :]))
        pos.append(torch.cat([torch.arange(n) for n in row]))
    ids_t = torch.stack(ids)
    return {"input_ids": ids_t, "labels": ids_t.clone(), "position_ids": torch.stack(pos)}, docs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorldOfOne:
    """A process group of one process (nccl on CUDA, gloo on the CPU) for DDP and FSDP2."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev

    def __enter__(self) -> WorldOfOne:
        import torch.distributed as dist

        backend = "nccl" if self.dev.type == "cuda" else "gloo"
        kw: dict[str, Any] = {}
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
            kw["device_id"] = self.dev
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kw
        )
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_seconds(
    fn: Callable[[], object], dev: torch.device, *, warmup: int = 2, repeats: int = 5
) -> float:
    """The median wall time of `fn` (device work included) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def relative_difference(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| relative to the largest |ref| (NaN counts as infinite)."""
    diff = float((got.float() - ref.float()).abs().max())
    scale = max(float(ref.float().abs().max()), 1e-6)
    rel = diff / scale
    return rel if rel == rel else float("inf")


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """fp32 matmuls in full fp32 (a run's TF32 choice would move fp32 logits by ~1e-3)."""
    cuda_mm, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    prec = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = cuda_mm, cudnn
        torch.set_float32_matmul_precision(prec)


@contextlib.contextmanager
def isolated(dev: torch.device) -> Iterator[None]:
    """Whatever global torch state a check changes (TF32 flags, the sync debug mode, grad
    mode, a process group it failed to leave) is put back before the next one."""
    import torch.distributed as dist

    cuda_mm, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    prec = torch.get_float32_matmul_precision()
    grad = torch.is_grad_enabled()
    cuda = dev.type == "cuda"
    debug = torch.cuda.get_sync_debug_mode() if cuda else 0
    try:
        yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(debug)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = cuda_mm, cudnn
        torch.set_float32_matmul_precision(prec)
        torch.set_grad_enabled(grad)
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        gc.collect()
        if cuda:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
