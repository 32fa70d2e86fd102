"""Every GPU card pitstop knows, one `GpuSpec` each: adding a card touches this file only.

- Peaks: dense (no structured sparsity) tensor-core FLOP/s by precision from NVIDIA's and
  AMD's datasheets, the denominator of MFU and of the estimate's time. A card without a
  bf16 peak has no bf16 tensor cores (`GpuSpec.bf16`).
- Memory: the capacity `torch.cuda.get_device_properties(i).total_memory` reports
  (slightly below the marketed "80 GB", since part of the HBM holds ECC/firmware
  reservations), rounded down to 0.1 GiB.
- Prices: EXAMPLES ONLY, written down on PRICES_DATE from public on-demand price pages of
  GPU clouds (Lambda, RunPod, Google Cloud and similar) as typical single-GPU hourly
  prices. They differ between providers, regions and weeks; every output that uses one
  says it is an example. None: no example noted (pass --price-per-gpu-hour).
- Compute capability: NVIDIA's CUDA GPU list (developer.nvidia.com/cuda-gpus); None for a
  card that is not a CUDA device (MI300X: flash-attn for ROCm is a separate build).

`find_spec` reads a name a user typed or torch reported: the card's name, an alias, the
longest card name inside it as a whole word ("NVIDIA H100 PCIe" is the PCIe card, "NVIDIA
L40" is not the L4, "NVIDIA GH200 480GB" is not the H200), else the longest family name
("NVIDIA A100-SXM4-40GB": the A100 whose memory the name gives).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

GiB = 1024**3
PRICES_DATE = "2026-11"
PRICES_SOURCE = (
    f"example on-demand prices noted {PRICES_DATE} from public GPU-cloud price pages "
    "(Lambda, RunPod, Google Cloud); yours will differ: pass --price-per-gpu-hour"
)


@dataclass(frozen=True)
class GpuSpec:
    """One card: what it is called, its dense peaks, memory, example price, capability."""

    name: str  # what users type and outputs print
    family: str  # the name fragment its torch device names carry ("A100" for both A100s)
    peaks: Mapping[str, float]  # dense FLOP/s by precision: bf16, fp16, tf32, fp32
    peak_source: str
    memory_gib: float
    price: float | None  # example USD per GPU-hour (PRICES_DATE); None: none noted
    capability: tuple[int, int] | None  # CUDA compute capability; None: not a CUDA card
    aliases: tuple[str, ...] = ()  # other spellings people type

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores (Ampere and newer, MI300X): the datasheet gives a bf16 peak."""
        return "bf16" in self.peaks

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    def peak(self, precision: str) -> tuple[float | None, str]:
        """(dense FLOP/s, where it comes from) for `precision`; None when the card has no
        tensor cores for it (a V100's bf16)."""
        if precision in self.peaks:
            return self.peaks[
                precision
            ], f"{self.family} {precision} dense peak, {self.peak_source}"
        return None, f"{self.family} has no {precision} tensor-core peak in the catalogue"


def _peaks(bf16: float | None, tf32: float | None, fp32: float) -> dict[str, float]:
    """A card's dense peaks in TFLOP/s (fp16 tensor cores run at the bf16 rate where both exist)."""
    out = {"fp32": fp32 * 1e12}
    if bf16 is not None:
        out |= {"bf16": bf16 * 1e12, "fp16": bf16 * 1e12}
    if tf32 is not None:
        out["tf32"] = tf32 * 1e12
    return out


_NV = "https://www.nvidia.com/en-us/data-center/"
_HALF = "dense = half the sparse figure"
# The SXM H100's peaks, which the H200 SXM and Grace Hopper's GPU (SXM clocks) share.
_HOPPER_SXM = _peaks(989.4, 494.7, 66.9)
# The NVL cards are PCIe boards of the same GH100 die at a lower power limit (350-600 W):
# 1,671 TFLOPS bf16 and 835 TF32 with sparsity per GPU, not the SXM's 1,979 and 989.
_HOPPER_NVL = _peaks(835.5, 417.5, 60.0)
_A100 = _peaks(312.0, 156.0, 19.5)
_V100 = {"fp16": 125e12, "fp32": 15.7e12}

GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("B200", "B200", _peaks(2250.0, 1100.0, 75.0),
            f"{_NV}hgx/ (HGX B200 per GPU, {_HALF})", 179.0, 5.99, (10, 0)),  # 180 GB HBM3e
    GpuSpec("H200", "H200", _HOPPER_SXM, f"{_NV}h200/ (SXM, {_HALF})", 139.8, 3.50, (9, 0)),
    GpuSpec("H200 NVL", "H200 NVL", _HOPPER_NVL, f"{_NV}h200/ (H200 NVL, {_HALF})", 139.8,
            None, (9, 0), ("h200-nvl", "h200nvl")),  # 141 GB HBM3e, as the H200 SXM
    # GH200: torch names it "NVIDIA GH200 480GB" (96 GB HBM3; the 480 GB is the Grace CPU's
    # LPDDR5X) or "NVIDIA GH200 144G HBM3e". Not read from a card: the marketed size less
    # what the H100 rows lose (0.5% reserved, then 0.5 GiB).
    GpuSpec("GH200", "GH200", _HOPPER_SXM, f"{_NV}grace-hopper-superchip/ ({_HALF})", 95.0,
            None, (9, 0), ("gh200 96gb", "gh200-96gb", "gh200 480gb")),
    GpuSpec("GH200 144G", "GH200", _HOPPER_SXM, f"{_NV}grace-hopper-superchip/ ({_HALF})",
            142.9, None, (9, 0), ("gh200 144gb", "gh200-144gb")),
    GpuSpec("H20", "H20", _peaks(148.0, 74.0, 44.0), "NVIDIA H20 product brief (dense)", 95.0,
            1.50, (9, 0)),  # 96 GB HBM3
    GpuSpec("MI300X", "MI300X", _peaks(1307.4, 653.7, 163.4),
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (dense)",
            191.5, 2.49, None, ("mi300", "instinct mi300x")),  # 192 GB HBM3
    GpuSpec("H100", "H100", _HOPPER_SXM, f"{_NV}h100/ (SXM, {_HALF})", 79.1, 2.99, (9, 0),
            ("h100 sxm", "h100-sxm", "h100 sxm5")),
    GpuSpec("H100 PCIe", "H100 PCIe", _peaks(756.5, 378.0, 51.2), f"{_NV}h100/ (PCIe, {_HALF})",
            79.1, 2.49, (9, 0), ("h100-pcie",)),
    GpuSpec("H100 NVL", "H100 NVL", _HOPPER_NVL, f"{_NV}h100/ (H100 NVL per GPU, {_HALF})",
            93.0, None, (9, 0), ("h100-nvl", "h100nvl")),  # nvidia-smi reports 95830 MiB
    GpuSpec("A100 80GB", "A100", _A100, f"{_NV}a100/", 79.1, 1.79, (8, 0),
            ("a100", "a100-80gb", "a100 80g")),
    GpuSpec("A100 40GB", "A100", _A100, f"{_NV}a100/", 39.4, 1.29, (8, 0),
            ("a100-40gb", "a100 40g")),
    GpuSpec("L40S", "L40S", _peaks(362.05, 183.2, 91.6), f"{_NV}l40s/", 44.4, 0.99, (8, 9)),
    GpuSpec("L40", "L40", _peaks(181.05, 90.5, 90.5), f"{_NV}l40/ ({_HALF})", 44.4, 0.89,
            (8, 9)),  # 48 GB GDDR6 with ECC
    GpuSpec("L4", "L4", _peaks(121.0, 60.0, 30.3), f"{_NV}l4/", 22.0, 0.80, (8, 9)),
    GpuSpec("A10", "A10", _peaks(125.0, 62.5, 31.2), f"{_NV}products/a10-gpu/", 22.0, 0.75,
            (8, 6), ("a10g",)),
    GpuSpec("RTX 5090", "RTX 5090", _peaks(209.5, 104.8, 104.8),
            "NVIDIA RTX Blackwell GPU architecture whitepaper, table 1 (fp32 accumulate, dense)",
            31.4, 0.89, (12, 0), ("5090", "rtx5090")),  # 32 GB GDDR7
    GpuSpec("RTX 4090", "RTX 4090", _peaks(165.2, 82.6, 82.6),
            "NVIDIA Ada Lovelace architecture whitepaper, table 2 (fp32 accumulate)", 23.6, 0.69,
            (8, 9), ("4090", "rtx4090")),
    GpuSpec("RTX A6000", "RTX A6000", _peaks(154.8, 77.4, 38.7),
            "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/ datasheet "
            f"({_HALF})", 47.5, 0.49, (8, 6), ("a6000",)),  # 48 GB GDDR6
    GpuSpec("RTX 3090", "RTX 3090", _peaks(71.0, 35.6, 35.6),
            "NVIDIA Ampere GA102 whitepaper, table 9 (fp32 accumulate)", 23.6, 0.43, (8, 6),
            ("3090", "rtx3090")),
    GpuSpec("V100 32GB", "V100", _V100, f"{_NV}v100/ (SXM2)", 31.7, 0.55, (7, 0), ("v100",)),
    GpuSpec("V100 16GB", "V100", _V100, f"{_NV}v100/ (SXM2)", 15.8, 0.45, (7, 0)),
    GpuSpec("T4", "T4", {"fp16": 65e12, "fp32": 8.1e12}, f"{_NV}tesla-t4/", 14.6, 0.35, (7, 5)),
)  # fmt: skip


def _norm(s: str) -> str:
    return " ".join(s.lower().replace("_", " ").split())


def _inside(fragment: str, name: str) -> bool:
    """`fragment` in `name` as a whole word: not after a letter or digit, not before a digit
    (so "A100" is not taken for "A10" and "GH200" not for "H200")."""
    return re.search(r"(?<![a-z0-9])" + re.escape(_norm(fragment)) + r"(?![0-9])", name) is not None


def find_spec(name: str) -> GpuSpec | None:
    """The card a name a user typed or torch reported means, or None (module docstring)."""
    n = _norm(name)
    for g in GPUS:
        if n == _norm(g.name) or n in g.aliases:
            return g
    by_name = [g for g in GPUS if _inside(g.name, n)]
    if by_name:
        return max(by_name, key=lambda g: len(g.name))
    by_family = [g for g in GPUS if _inside(g.family, n)]
    if not by_family:
        return None
    longest = max(len(g.family) for g in by_family)
    family = [g for g in by_family if len(g.family) == longest]
    # "NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-16GB": the card whose memory the name gives.
    sized = [g for g in family if re.search(rf"(?<![0-9]){round(g.memory_gib / 8) * 8}\s*g", n)]
    return (sized or family)[0]
