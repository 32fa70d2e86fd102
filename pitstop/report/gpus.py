"""GPU memory sizes and example prices for `pitstop estimate`.

Peak FLOP/s come from `pitstop.measure.peak.GPU_PEAKS` (one table for MFU and for
estimates); this module only adds what the estimate needs besides: how much memory
a card has, and an *example* price per GPU-hour.

Memory: the capacity `torch.cuda.get_device_properties(i).total_memory` reports
(slightly below the marketed "80 GB", since part of the HBM holds ECC/firmware
reservations), rounded down to 0.1 GiB. Source: NVIDIA datasheets for the marketed
size; reported sizes as commonly seen from torch on these cards.

Prices: EXAMPLES ONLY, written down on PRICES_DATE from public on-demand price pages
of GPU clouds (Lambda, RunPod, Google Cloud and similar) as typical single-GPU
hourly prices. They differ between providers, regions and weeks; pass your own
with `--price-per-gpu-hour`. Every output that uses one says it is an example.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from pitstop.errors import ConfigError
from pitstop.measure.peak import gpu_peak

GiB = 1024**3
PRICES_DATE = "2026-11"
PRICES_SOURCE = (
    f"example on-demand prices noted {PRICES_DATE} from public GPU-cloud price pages "
    "(Lambda, RunPod, Google Cloud); yours will differ: pass --price-per-gpu-hour"
)


@dataclass(frozen=True)
class Gpu:
    """One card: the name users type, the name fragment `gpu_peak` matches, memory, example price."""

    name: str
    peak_key: str  # the row of pitstop.measure.peak.GPU_PEAKS (matched as in `gpu_peak`)
    memory_bytes: int
    example_price_per_hour: float | None
    bf16: bool = True  # bf16 tensor cores (Ampere and newer)
    peak_override: float | None = None  # the user's own dense peak FLOP/s (--gpu-tflops)

    def peak_flops(self, precision: str) -> tuple[float | None, str]:
        """Dense peak FLOP/s for `precision`: the user's, else from the shared peak table."""
        if self.peak_override is not None:
            return (
                self.peak_override,
                f"{self.peak_override / 1e12:g} TFLOP/s (yours, --gpu-tflops)",
            )
        return gpu_peak(self.peak_key, precision)


def _g(gib: float) -> int:
    return int(gib * GiB)


GPUS: list[Gpu] = [
    Gpu("B200", "B200", _g(179.0), 5.99),  # 180 GB HBM3e (HGX B200 datasheet)
    Gpu("H200", "H200", _g(139.8), 3.50),
    # The three below have no example price noted: pass --price-per-gpu-hour.
    Gpu("H200 NVL", "H200 NVL", _g(139.8), None),  # 141 GB HBM3e, as the H200 SXM
    # GH200: torch names it "NVIDIA GH200 480GB" (96 GB HBM3; the 480 GB is the Grace CPU's
    # LPDDR5X) or "NVIDIA GH200 144G HBM3e". Not read from a card: the marketed size less
    # what the H100 rows lose (0.5% reserved, then 0.5 GiB).
    Gpu("GH200", "GH200", _g(95.0), None),
    Gpu("GH200 144G", "GH200", _g(142.9), None),
    Gpu("H20", "H20", _g(95.0), 1.50),  # 96 GB HBM3
    Gpu("MI300X", "MI300X", _g(191.5), 2.49),  # 192 GB HBM3 (AMD datasheet)
    Gpu("H100", "H100", _g(79.1), 2.99),  # SXM
    Gpu("H100 PCIe", "H100 PCIe", _g(79.1), 2.49),
    Gpu("H100 NVL", "H100 NVL", _g(93.0), None),  # 94 GB HBM3; nvidia-smi reports 95830 MiB
    Gpu("A100 80GB", "A100", _g(79.1), 1.79),
    Gpu("A100 40GB", "A100", _g(39.4), 1.29),
    Gpu("L40S", "L40S", _g(44.4), 0.99),
    Gpu("L40", "L40", _g(44.4), 0.89),  # 48 GB GDDR6 with ECC
    Gpu("L4", "L4", _g(22.0), 0.80),
    Gpu("A10", "A10", _g(22.0), 0.75),
    Gpu("RTX 5090", "RTX 5090", _g(31.4), 0.89),  # 32 GB GDDR7
    Gpu("RTX 4090", "RTX 4090", _g(23.6), 0.69),
    Gpu("RTX A6000", "RTX A6000", _g(47.5), 0.49),  # 48 GB GDDR6
    Gpu("RTX 3090", "RTX 3090", _g(23.6), 0.43),
    Gpu("V100 32GB", "V100", _g(31.7), 0.55, bf16=False),
    Gpu("V100 16GB", "V100", _g(15.8), 0.45, bf16=False),
    Gpu("T4", "T4", _g(14.6), 0.35, bf16=False),
]

# Spellings people type for the same card.
_ALIASES = {
    "h100 sxm": "H100",
    "h100-sxm": "H100",
    "h100 sxm5": "H100",
    "h100-pcie": "H100 PCIe",
    "h100-nvl": "H100 NVL",
    "h100nvl": "H100 NVL",
    "h200-nvl": "H200 NVL",
    "h200nvl": "H200 NVL",
    "gh200 96gb": "GH200",
    "gh200-96gb": "GH200",
    "gh200 480gb": "GH200",
    "gh200 144gb": "GH200 144G",
    "gh200-144gb": "GH200 144G",
    "a100": "A100 80GB",
    "a100-80gb": "A100 80GB",
    "a100 80g": "A100 80GB",
    "a100-40gb": "A100 40GB",
    "a100 40g": "A100 40GB",
    "4090": "RTX 4090",
    "rtx4090": "RTX 4090",
    "3090": "RTX 3090",
    "rtx3090": "RTX 3090",
    "v100": "V100 32GB",
    "a10g": "A10",
    "a6000": "RTX A6000",
    "rtx a6000": "RTX A6000",
    "5090": "RTX 5090",
    "rtx5090": "RTX 5090",
    "mi300": "MI300X",
    "instinct mi300x": "MI300X",
}


def _norm(s: str) -> str:
    return " ".join(s.lower().replace("_", " ").split())


def find_gpu(name: str) -> Gpu | None:
    """The table entry for a name a user typed or torch reported, or None."""
    n = _norm(name)
    by_name = {_norm(g.name): g for g in GPUS}
    if n in by_name:
        return by_name[n]
    if n in _ALIASES:
        return by_name[_norm(_ALIASES[n])]
    # A device name as torch reports it ("NVIDIA H100 80GB HBM3"): the longest table
    # name contained in it as a whole word wins, so "H100 PCIe" beats "H100" and
    # "A100" is not taken for "A10".
    hits = [
        g for g in GPUS if re.search(r"(?<![a-z0-9])" + re.escape(_norm(g.name)) + r"(?![0-9])", n)
    ]
    if not hits and "a100" in n:
        hits = [by_name["a100 40gb" if "40" in n else "a100 80gb"]]
    return max(hits, key=lambda g: len(g.name)) if hits else None


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
        peak_key=base.peak_key if base else "",
        memory_bytes=_g(memory_gib) if memory_gib is not None else base.memory_bytes,  # type: ignore[union-attr]
        example_price_per_hour=price
        if price is not None
        else (base.example_price_per_hour if base else None),
        bf16=base.bf16 if base else True,
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
