"""The GPU an estimate is priced for: a catalogued card, or the user's own numbers on top.

Every card's facts (peaks, memory, example price, capability, aliases) live in one place,
`pitstop.catalog.gpus`; this module adds what only the estimate needs: `--gpu-tflops`,
`--gpu-memory-gib` and `--price-per-gpu-hour` replacing a card's values or describing a
card the catalogue does not hold, and the error that lists the known names.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from pitstop.catalog.gpus import GPUS, PRICES_SOURCE, GiB, GpuSpec, find_spec
from pitstop.core.errors import ConfigError

__all__ = ["PRICES_SOURCE", "GiB", "Gpu", "custom_gpu", "find_gpu", "get_gpu"]


@dataclass(frozen=True)
class Gpu:
    """The priced card: a catalogue entry (`spec`, None for the user's own card) with the
    user's values where given."""

    name: str
    spec: GpuSpec | None
    memory_bytes: int
    example_price_per_hour: float | None
    peak_override: float | None = None  # the user's own dense peak FLOP/s (--gpu-tflops)

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores: the catalogue's answer; a card it does not hold is assumed to."""
        return self.spec.bf16 if self.spec is not None else True

    def peak_flops(self, precision: str) -> tuple[float | None, str]:
        """Dense peak FLOP/s for `precision`: the user's, else the catalogue's."""
        if self.peak_override is not None:
            return (
                self.peak_override,
                f"{self.peak_override / 1e12:g} TFLOP/s (yours, --gpu-tflops)",
            )
        assert self.spec is not None  # custom_gpu requires --gpu-tflops without a spec
        return self.spec.peak(precision)


def _priced(spec: GpuSpec) -> Gpu:
    return Gpu(spec.name, spec, spec.memory_bytes, spec.price)


def find_gpu(name: str) -> Gpu | None:
    """The card for a name a user typed or torch reported, or None."""
    spec = find_spec(name)
    return _priced(spec) if spec is not None else None


def custom_gpu(
    name: str | None, tflops: float | None, memory_gib: float | None, price: float | None
) -> Gpu:
    """A card described by the user: --gpu-tflops (dense peak at the run's precision),
    --gpu-memory-gib, --price-per-gpu-hour; on top of a known --gpu, they replace its values."""
    base = get_gpu(name) if name else None
    if base is None and (tflops is None or memory_gib is None):
        raise ConfigError(
            "a GPU that is not in the table needs both --gpu-tflops and --gpu-memory-gib"
        )
    return Gpu(
        name=base.name if base else (name or "your GPU"),
        spec=base.spec if base else None,
        memory_bytes=int(memory_gib * GiB) if memory_gib is not None else base.memory_bytes,  # type: ignore[union-attr]
        example_price_per_hour=price
        if price is not None
        else (base.example_price_per_hour if base else None),
        peak_override=tflops * 1e12 if tflops is not None else None,
    )


def get_gpu(name: str) -> Gpu:
    """Like `find_gpu`, but an unknown name is a ConfigError listing the known ones."""
    gpu = find_gpu(name)
    if gpu is not None:
        return gpu
    known = [g.name for g in GPUS]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.4)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"--gpu {name!r} is not a GPU pitstop knows{hint}; known: {', '.join(known)}. "
        "For another card, pass --gpu-tflops and --gpu-memory-gib (its datasheet's dense "
        "peak and memory), or measure a short run and pass --from-profile"
    )
