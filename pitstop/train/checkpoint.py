"""Atomic, asynchronous checkpoints with retention and newest-complete discovery.

Layout of `OUT_DIR/checkpoints/step-N/`:

    config.json, model.safetensors (or a LoRA adapter), tokenizer files
                        a Hugging Face model directory (from_pretrained loads it)
    optimizer.pt        {"optimizer": ..., "scaler": ...}: torch.save, read with weights_only=True
    trainer_state.json  step, epoch, token counters, cumulative seconds, loss scale...
    rng.json            torch CPU/CUDA, numpy and python RNG states
    loader_state.json   the batching loader's state_dict (loader_state.pt if not JSON-able)
    COMPLETE.json       written last: the step and every file's size

Atomicity: everything is written into `checkpoints/.step-N.partial-<hex>/`, fsynced,
the marker last, and the directory renamed to `step-N` in one `os.replace`.
Discovery only accepts directories whose marker exists and whose files have the
sizes it lists, so a crash at any moment leaves the previous checkpoint valid.

Retention keeps the newest `--save-total-limit` checkpoints. With held-out
evaluation, the checkpoint with the lowest eval loss (a checkpoint taken at a step
that was evaluated records `eval_loss` in trainer_state.json; align --eval-steps
with --save-steps so they coincide) is kept too, even when older, and
`checkpoints/best.json` names it: {"step", "path", "eval_loss"}.

Asynchrony: the loop pauses only to queue a copy of the state into host buffers
(`HostStaging`: allocated at the first checkpoint, reused by every later one; pinned
and filled on a side CUDA stream on a GPU, so the host does not wait for the copy);
a background thread waits for the copy to complete, then writes. A new save, and the
end of the run, first wait for the previous write (so the buffers are never refilled
while being written). A failed write (disk full...) raises `CheckpointError` at the
next wait: the run stops cleanly (policy: a run that can no longer save would
otherwise keep spending money on work it cannot keep), the previous checkpoint
stays valid, and the partial directory is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import pickle
import random
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch

from pitstop.core import log
from pitstop.core.atomic import fsync_dir, write_json_atomic
from pitstop.core.errors import PitstopError
from pitstop.core.faults import NO_FAULTS, Faults
from pitstop.core.run_record import BestCheckpoint

# The loader state beside the weights: JSON when it is plain values, else tensors.
LOADER_STATE_JSON, LOADER_STATE_PT = "loader_state.json", "loader_state.pt"

MARKER = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(PitstopError):
    """A checkpoint could not be written or read."""

    exit_code = 1


# --- discovery ---------------------------------------------------------------


def incomplete_reason(path: Path) -> str | None:
    """Why `path` (a step-N directory) is not a complete checkpoint, or None if it is."""
    marker = path / MARKER
    if not marker.is_file():
        return f"{MARKER} is missing (the write did not finish)"
    try:
        rec = json.loads(marker.read_text(encoding="utf-8"))
        for name, size in rec["files"].items():
            p = path / name
            if not p.is_file():
                return f"{name} is missing"
            if p.stat().st_size != size:
                return f"{name} has {p.stat().st_size} bytes, {size} were written"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MARKER} is damaged ({type(e).__name__})"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def _is_complete(path: Path) -> bool:
    return incomplete_reason(path) is None


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-N directory under `root`, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(x for x in found if x[1].is_dir())


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    return [(step, p) for step, p in step_dirs(root) if _is_complete(p)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (an OUT_DIR/checkpoints dir), or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def remove_debris(root: str | Path) -> None:
    """Delete partial and half-deleted checkpoint directories a dead process left."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".step-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True)


# --- host snapshots ------------------------------------------------------------


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The same key for two tensor objects that are the same values in memory.

    `state_dict()` detaches every entry into a new tensor object, so tied weights (an
    embedding and the LM head) are two objects over one storage: keyed by id() they were
    copied, staged and counted twice."""
    if t.device.type == "meta":
        return ("meta", id(t))
    return (
        t.device,
        t.dtype,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
    )


def to_host(obj: Any, memo: dict[Any, torch.Tensor] | None = None) -> Any:
    """Deep-copy every tensor in `obj` to CPU memory (clones: training may go on mutating).

    Tensors sharing storage (tied weights) stay shared in the copy.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = tensor_key(obj)
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        return {k: to_host(v, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_host(v, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_host(v, memo) for v in obj)
    return obj


class RngState(TypedDict):
    """Every RNG the run uses, as rng.json holds them (JSON lists, not tensors)."""

    torch_cpu: list[int]
    numpy: list[Any]  # numpy's get_state() tuple: name, keys, pos, has_gauss, cached
    python: list[Any]  # random.getstate(): version, state, gauss_next
    torch_cuda: NotRequired[list[list[int]]]  # one per CUDA device, when CUDA was used


def rng_state() -> RngState:
    """Every RNG the run uses, as JSON-able values."""
    np_state = np.random.get_state()
    st: RngState = {
        "torch_cpu": torch.get_rng_state().tolist(),
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: RngState) -> None:
    torch.set_rng_state(torch.tensor(st["torch_cpu"], dtype=torch.uint8))
    n = st["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = st["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "torch_cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["torch_cuda"]])


class HostStaging:
    """Reused host buffers a checkpoint's tensors are copied into (no clone per checkpoint).

    A buffer is allocated the first time its place in the state (its key path) is
    staged and reused while the shape and dtype stay the same. For a CUDA tensor the
    buffer is pinned and the copy is queued on a side stream after the work already
    queued on the training stream, so the host returns at once; `stage` hands back a
    CUDA event that completes with the copy. The training stream must wait on that
    event before it next changes the copied tensors (the optimizer step: see
    `Trainer.optimizer_step`), and the writer waits on it before reading the buffers.
    CPU tensors are copied synchronously: the same buffers, minus the stream.

    The caller must not stage again while a previous staging is still being written
    (`CheckpointWriter.stage` waits for the writer first).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._stream: Any = None  # a torch.cuda.Stream, made at the first CUDA copy
        self.allocations = 0  # buffers allocated so far (a test checks they are reused)

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold (pinned on a GPU run)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, obj: Any) -> tuple[Any, Any]:
        """(a copy of `obj` whose tensors are the host buffers, the CUDA event or None)."""
        cuda = _first_cuda_tensor(obj)
        if cuda is None:
            return self._copy(obj, (), {}), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=cuda.device)
        # The copy must see every update already queued on the training stream.
        self._stream.wait_stream(torch.cuda.current_stream(cuda.device))
        with torch.cuda.stream(self._stream):
            out = self._copy(obj, (), {})
            event = torch.cuda.Event()
            event.record(self._stream)
        return out, event

    def _copy(self, obj: Any, path: tuple[Any, ...], memo: dict[Any, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = tensor_key(obj)
            if key not in memo:  # tied weights stay one tensor in the copy
                memo[key] = self._into_buffer(obj.detach(), path)
            return memo[key]
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), memo) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v, (*path, i), memo) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy(v, (*path, i), memo) for i, v in enumerate(obj))
        return obj

    def _into_buffer(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # Pinned memory lets the copy run asynchronously; it only exists with CUDA.
            buf = (
                pinned_empty(t.shape, t.dtype) if t.is_cuda else torch.empty(t.shape, dtype=t.dtype)
            )
            self._buffers[path] = buf
            self.allocations += 1
        if t.is_cuda:  # the training stream must not reuse its memory before the copy ends
            t.record_stream(self._stream)
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf


def pinned_empty(
    shape: Any, dtype: torch.dtype, *, register: Callable[[int, int], bool] | None = None
) -> torch.Tensor:
    """A host tensor of exactly its size, page-locked for asynchronous copies.

    `torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which
    rounds every block up to a power of two: up to twice the memory the banner reports
    (a 9 GB state took 16 GB). Here the memory is an ordinary allocation of the exact size,
    registered with CUDA (`cudaHostRegister`) and unregistered when the tensor is freed
    (rounded to whole 4 KiB pages, not to a power of two).
    If registering fails, the buffer stays pageable (the copy is then synchronous, the
    checkpoint the same) and a warning names the failure.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # Whole pages of its own, from an anonymous mapping (page-aligned): CUDA registers
    # pages, a page shared with another registered buffer would fail to register, and
    # torch's `is_pinned()` (so its non-blocking copies) asks CUDA about the storage's
    # first byte, which must be the first registered one. An aligned slice of a larger
    # torch.empty was registered but read as pageable (the H200 self-test, 2026-11-26).
    span = -(-nbytes // _PAGE) * _PAGE
    page_aligned = torch.frombuffer(mmap.mmap(-1, span), dtype=torch.uint8)
    buf = page_aligned[:nbytes].view(dtype).view(shape)
    reg = register or _cuda_host_register
    try:
        ok = reg(page_aligned.data_ptr(), span)
    except Exception as e:  # a failed optimisation never stops the run
        ok, why = False, f"{type(e).__name__}: {e}"
    else:
        why = "cudaHostRegister returned an error"
    if ok:
        if register is None:
            weakref.finalize(buf, _cuda_host_unregister, page_aligned.data_ptr())
    else:
        global _PIN_WARNED
        if not _PIN_WARNED:
            _PIN_WARNED = True
            log.warning(
                f"pitstop: warning: pinning checkpoint buffers failed ({why}); they stay in "
                "ordinary host memory (copies to them are synchronous; checkpoints are the same)"
            )
    return buf


_PIN_WARNED = False
_PAGE = 4096


def _cuda_host_register(ptr: int, nbytes: int) -> bool:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def _cuda_host_unregister(ptr: int) -> None:
    # At interpreter exit CUDA may be gone already: the OS frees the memory then.
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _first_cuda_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_cuda else None
    values = (
        obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    )
    for v in values:
        found = _first_cuda_tensor(v)
        if found is not None:
            return found
    return None


def state_bytes(obj: Any) -> int:
    """Bytes of the distinct tensors in `obj` (tied weights counted once)."""
    seen: dict[Any, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            seen[tensor_key(o)] = o.numel() * o.element_size()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sum(seen.values())


@dataclass
class Snapshot:
    """A checkpoint's content in host memory, ready for the writer thread.

    `ready`: a CUDA event the copy into host memory completes with (None: already done).
    """

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer_state: dict[str, Any]
    rng: RngState
    loader_state: Any
    extra: dict[str, Any] = field(default_factory=dict)
    ready: Any = None


# --- writing -------------------------------------------------------------------


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj), encoding="utf-8")


class CheckpointWriter:
    """Writes snapshots in a background thread, one at a time, keeping the newest `keep`."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int,
        save_model: Callable[[Path, dict[str, torch.Tensor]], None],
        enabled: bool = True,
        keep_best: bool = False,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.root = Path(root)
        self.faults = faults  # tests' fault points in the write (pitstop/core/faults.py)
        self.keep = keep
        self.save_model = save_model
        self.enabled = enabled  # False on ranks other than 0
        self.keep_best = keep_best
        self.best: BestCheckpoint | None = None  # the lowest-eval-loss checkpoint, when kept
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # set by the write thread as its last act
        self._error: BaseException | None = None
        self.last_written: Path | None = None
        self.write_seconds = 0.0
        self._write_bytes = 0  # tensor bytes of the write in progress (for a disk-full message)
        self.staging = HostStaging()

    def stage(self, obj: Any) -> tuple[Any, Any]:
        """Copy `obj`'s tensors into the reused host buffers (`HostStaging.stage`), after the
        previous write has finished with them (so it raises that write's `CheckpointError`)."""
        self.wait()
        return self.staging.stage(obj)

    def submit(self, snap: Snapshot, *, blocking: bool = False) -> None:
        """Start writing `snap` (after the previous write has finished)."""
        self.wait()
        if not self.enabled:
            return
        self._done.clear()
        self._thread = threading.Thread(
            target=self._run, args=(snap,), name=f"pitstop-ckpt-{snap.step}", daemon=True
        )
        self._thread.start()
        if blocking:
            self.wait()

    def busy(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def wait(self) -> None:
        """Block until the current write ends; raise `CheckpointError` if it failed.

        It waits on an Event, not on `Thread.join()`: on Python < 3.13 a KeyboardInterrupt
        (a second Ctrl-C) raised inside `join()` marks the still-running thread as stopped
        (CPython's handling in `Thread._wait_for_tstate_lock`), so the next `wait()` returned
        at once, the interpreter exited under a thread inside `torch.save`, and the process
        aborted ("terminate called without an active exception"). An interrupted
        `Event.wait()` leaves the event as it was, so waiting again really waits.
        """
        if self._thread is not None:
            self._done.wait()
            self._thread.join()  # its work is done; only the thread's return is left
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            intact = self.last_written is not None and _is_complete(self.last_written)
            # Only a checkpoint still on disk and whole is called intact (the run
            # directory may have been deleted or damaged: that is what failed).
            kept = (
                f"the previous complete checkpoint ({self.last_written}) is intact: free space "
                "or fix the cause, then rerun with --resume"
                if intact
                else f"no complete checkpoint remains under {self.root}: fix the cause, then "
                "rerun (it starts from the beginning)"
            )
            raise CheckpointError(
                f"writing a checkpoint under {self.root} failed: {_one_line(err)}"
                f"{self._disk_full_note(err)}. The run stopped so no "
                f"more unsaved work is paid for; {kept}"
            ) from err

    def _disk_full_note(self, err: BaseException) -> str:
        """'; the disk holding ROOT is full (N MB free)' when that is the likely cause."""
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            return ""
        enospc = any(
            isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(err)
        ) or "No space left" in str(err)
        # Low: less room than the checkpoint being written needs (the partial one is deleted).
        if enospc or free < max(self._write_bytes, _LOW_FREE_BYTES):
            return f"; the disk holding {self.root} is full ({free / 1e6:.0f} MB free)"
        return ""

    def _run(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        self._write_bytes = state_bytes((snap.model_state, snap.optimizer, snap.loader_state))
        tmp = self.root / f".step-{snap.step}.partial-{secrets.token_hex(4)}"
        try:
            if snap.ready is not None:  # the device-to-host copy must be complete before reading
                snap.ready.synchronize()
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            self.save_model(tmp, snap.model_state)
            torch.save(snap.optimizer, tmp / "optimizer.pt")
            _write_json(tmp / "trainer_state.json", snap.trainer_state)
            _write_json(tmp / "rng.json", snap.rng)
            try:
                _write_json(tmp / LOADER_STATE_JSON, snap.loader_state)
            except TypeError:
                torch.save(snap.loader_state, tmp / LOADER_STATE_PT)
            if self.faults.fails_checkpoint(snap.step):
                raise OSError(28, "No space left on device (injected by a test fault)")
            self.faults.reached("ckpt-write", snap.step)
            files = {
                str(p.relative_to(tmp)): p.stat().st_size
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            _fsync_tree(tmp)
            marker = tmp / MARKER
            _write_json(marker, {"step": snap.step, "files": files, "time": time.time()})
            with open(marker, "rb") as f:
                os.fsync(f.fileno())
            dest = self.root / f"step-{snap.step}"
            if dest.exists():  # a stale copy of this step (e.g. re-saved after a resume)
                trash = self.root / f".trash-{dest.name}-{secrets.token_hex(4)}"
                os.replace(dest, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, dest)
            fsync_dir(self.root)
            self.last_written = dest
            self.faults.reached("ckpt-renamed", snap.step)
            self._retain()
        except BaseException as e:  # reported to the training thread by wait()
            self._error = e
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            self.write_seconds += time.perf_counter() - t0
            self._done.set()

    def _retain(self) -> None:
        found = complete_checkpoints(self.root)
        best = _best_by_eval(found) if self.keep_best else None
        if best is not None:
            self.best = best
            write_json_atomic(self.root / "best.json", best)
        for _, path in found[: max(0, len(found) - self.keep)]:
            if best is not None and path.name == Path(best["path"]).name:
                continue
            trash = self.root / f".trash-{path.name}-{secrets.token_hex(4)}"
            try:
                os.replace(path, trash)  # atomic: discovery never sees half a deletion
            except OSError:
                continue
            shutil.rmtree(trash, ignore_errors=True)


_LOW_FREE_BYTES = 1 << 20  # below this, a failed write is blamed on the disk whatever the size


def _causes(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and len(out) < 10:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _best_by_eval(found: list[tuple[int, Path]]) -> BestCheckpoint | None:
    """The complete checkpoint with the lowest recorded eval loss (the earliest on a tie)."""
    best: BestCheckpoint | None = None
    for step, path in found:
        try:
            ts = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        loss = ts.get("eval_loss")
        if (
            isinstance(loss, (int, float))
            and loss == loss
            and (best is None or loss < best["eval_loss"])
        ):
            best = {"step": step, "path": str(path), "eval_loss": float(loss)}
    return best


# --- reading -------------------------------------------------------------------


def read_loader_state(path: Path) -> Any:
    """A checkpoint's loader state: loader_state.json, else loader_state.pt (tensors and
    plain values only); None when the checkpoint holds neither. The one reader of both."""
    import torch

    if (path / LOADER_STATE_JSON).is_file():
        return json.loads((path / LOADER_STATE_JSON).read_text(encoding="utf-8"))
    if (path / LOADER_STATE_PT).is_file():
        return torch.load(path / LOADER_STATE_PT, weights_only=True)
    return None


@dataclass
class CheckpointContents:
    """What `read_checkpoint` returns: everything in a checkpoint but the model weights."""

    optimizer: dict[str, Any]  # optimizer.pt: {"optimizer": state dict, "scaler": ...}
    trainer_state: dict[str, Any]  # trainer_state.json, read by RunState.from_trainer_state
    rng: RngState
    loader_state: Any  # the loader's own state_dict (batching/loader.py)


def read_checkpoint(path: Path, *, mmap: bool = False) -> CheckpointContents:
    """Everything but the model weights: optimizer, trainer state, RNG, loader state.

    `mmap`: optimizer.pt's tensors are mapped from the file, not read: host memory only
    for what is touched (an FSDP rank whose optimizer state comes from rank 0).
    """
    current = path / "optimizer.pt"
    try:
        optimizer = torch.load(current, weights_only=True, map_location="cpu", mmap=mmap)
        trainer_state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        rng = json.loads((path / "rng.json").read_text(encoding="utf-8"))
        current = path / LOADER_STATE_PT
        loader_state = read_loader_state(path)
        if loader_state is None:  # neither file: the error below names the checkpoint
            raise FileNotFoundError(f"{current} (nor {LOADER_STATE_JSON}) does not exist")
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {path}: {current.name} is not a pitstop checkpoint file (it holds "
            "objects other than tensors and plain values, so it may have been tampered with) "
            "and was not loaded; "
            "delete this checkpoint to resume from an older one, or start again with --overwrite"
        ) from None
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({e}); delete it to resume from an older one"
        ) from e
    return CheckpointContents(optimizer, trainer_state, rng, loader_state)
