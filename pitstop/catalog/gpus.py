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
    GpuSpec(
        name="B200",
        family="B200",
        peaks=_peaks(2250.0, 1100.0, 75.0),
        peak_source=f"{_NV}hgx/ (HGX B200 per GPU, {_HALF})",
        memory_gib=179.0,  # 180 GB HBM3e
        price=5.99,
        capability=(10, 0),
    ),
    GpuSpec(
        name="H200",
        family="H200",
        peaks=_HOPPER_SXM,
        peak_source=f"{_NV}h200/ (SXM, {_HALF})",
        memory_gib=139.8,
        price=3.50,
        capability=(9, 0),
    ),
    GpuSpec(
        name="H200 NVL",
        family="H200 NVL",
        peaks=_HOPPER_NVL,
        peak_source=f"{_NV}h200/ (H200 NVL, {_HALF})",
        memory_gib=139.8,  # 141 GB HBM3e, as the H200 SXM
        price=None,
        capability=(9, 0),
        aliases=("h200-nvl", "h200nvl"),
    ),
    # GH200: torch names it "NVIDIA GH200 480GB" (96 GB HBM3; the 480 GB is the Grace CPU's
    # LPDDR5X) or "NVIDIA GH200 144G HBM3e". Not read from a card: the marketed size less
    # what the H100 rows lose (0.5% reserved, then 0.5 GiB).
    GpuSpec(
        name="GH200",
        family="GH200",
        peaks=_HOPPER_SXM,
        peak_source=f"{_NV}grace-hopper-superchip/ ({_HALF})",
        memory_gib=95.0,
        price=None,
        capability=(9, 0),
        aliases=("gh200 96gb", "gh200-96gb", "gh200 480gb"),
    ),
    GpuSpec(
        name="GH200 144G",
        family="GH200",
        peaks=_HOPPER_SXM,
        peak_source=f"{_NV}grace-hopper-superchip/ ({_HALF})",
        memory_gib=142.9,
        price=None,
        capability=(9, 0),
        aliases=("gh200 144gb", "gh200-144gb"),
    ),
    GpuSpec(
        name="H20",
        family="H20",
        peaks=_peaks(148.0, 74.0, 44.0),
        peak_source="NVIDIA H20 product brief (dense)",
        memory_gib=95.0,  # 96 GB HBM3
        price=1.50,
        capability=(9, 0),
    ),
    GpuSpec(
        name="MI300X",
        family="MI300X",
        peaks=_peaks(1307.4, 653.7, 163.4),
        peak_source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (dense)",
        memory_gib=191.5,  # 192 GB HBM3
        price=2.49,
        capability=None,
        aliases=("mi300", "instinct mi300x"),
    ),
    GpuSpec(
        name="H100",
        family="H100",
        peaks=_HOPPER_SXM,
        peak_source=f"{_NV}h100/ (SXM, {_HALF})",
        memory_gib=79.1,
        price=2.99,
        capability=(9, 0),
        aliases=("h100 sxm", "h100-sxm", "h100 sxm5"),
    ),
    GpuSpec(
        name="H100 PCIe",
        family="H100 PCIe",
        peaks=_peaks(756.5, 378.0, 51.2),
        peak_source=f"{_NV}h100/ (PCIe, {_HALF})",
        memory_gib=79.1,
        price=2.49,
        capability=(9, 0),
        aliases=("h100-pcie",),
    ),
    GpuSpec(
        name="H100 NVL",
        family="H100 NVL",
        peaks=_HOPPER_NVL,
        peak_source=f"{_NV}h100/ (H100 NVL per GPU, {_HALF})",
        memory_gib=93.0,  # nvidia-smi reports 95830 MiB
        price=None,
        capability=(9, 0),
        aliases=("h100-nvl", "h100nvl"),
    ),
    GpuSpec(
        name="A100 80GB",
        family="A100",
        peaks=_A100,
        peak_source=f"{_NV}a100/",
        memory_gib=79.1,
        price=1.79,
        capability=(8, 0),
        aliases=("a100", "a100-80gb", "a100 80g"),
    ),
    GpuSpec(
        name="A100 40GB",
        family="A100",
        peaks=_A100,
        peak_source=f"{_NV}a100/",
        memory_gib=39.4,
        price=1.29,
        capability=(8, 0),
        aliases=("a100-40gb", "a100 40g"),
    ),
    GpuSpec(
        name="L40S",
        family="L40S",
        peaks=_peaks(362.05, 183.2, 91.6),
        peak_source=f"{_NV}l40s/",
        memory_gib=44.4,
        price=0.99,
        capability=(8, 9),
    ),
    GpuSpec(
        name="L40",
        family="L40",
        peaks=_peaks(181.05, 90.5, 90.5),
        peak_source=f"{_NV}l40/ ({_HALF})",
        memory_gib=44.4,  # 48 GB GDDR6 with ECC
        price=0.89,
        capability=(8, 9),
    ),
    GpuSpec(
        name="L4",
        family="L4",
        peaks=_peaks(121.0, 60.0, 30.3),
        peak_source=f"{_NV}l4/",
        memory_gib=22.0,
        price=0.80,
        capability=(8, 9),
    ),
    GpuSpec(
        name="A10",
        family="A10",
        peaks=_peaks(125.0, 62.5, 31.2),
        peak_source=f"{_NV}products/a10-gpu/",
        memory_gib=22.0,
        price=0.75,
        capability=(8, 6),
        aliases=("a10g",),
    ),
    GpuSpec(
        name="RTX 5090",
        family="RTX 5090",
        peaks=_peaks(209.5, 104.8, 104.8),
        peak_source="NVIDIA RTX Blackwell GPU architecture whitepaper, table 1 (fp32 accumulate, dense)",
        memory_gib=31.4,  # 32 GB GDDR7
        price=0.89,
        capability=(12, 0),
        aliases=("5090", "rtx5090"),
    ),
    GpuSpec(
        name="RTX 4090",
        family="RTX 4090",
        peaks=_peaks(165.2, 82.6, 82.6),
        peak_source="NVIDIA Ada Lovelace architecture whitepaper, table 2 (fp32 accumulate)",
        memory_gib=23.6,
        price=0.69,
        capability=(8, 9),
        aliases=("4090", "rtx4090"),
    ),
    GpuSpec(
        name="RTX A6000",
        family="RTX A6000",
        peaks=_peaks(154.8, 77.4, 38.7),
        peak_source="https://www.nvidia.com/en-us/design-visualization/rtx-a6000/ datasheet "
        f"({_HALF})",
        memory_gib=47.5,  # 48 GB GDDR6
        price=0.49,
        capability=(8, 6),
        aliases=("a6000",),
    ),
    GpuSpec(
        name="RTX 3090",
        family="RTX 3090",
        peaks=_peaks(71.0, 35.6, 35.6),
        peak_source="NVIDIA Ampere GA102 whitepaper, table 9 (fp32 accumulate)",
        memory_gib=23.6,
        price=0.43,
        capability=(8, 6),
        aliases=("3090", "rtx3090"),
    ),
    GpuSpec(
        name="V100 32GB",
        family="V100",
        peaks=_V100,
        peak_source=f"{_NV}v100/ (SXM2)",
        memory_gib=31.7,
        price=0.55,
        capability=(7, 0),
        aliases=("v100",),
    ),
    GpuSpec(
        name="V100 16GB",
        family="V100",
        peaks=_V100,
        peak_source=f"{_NV}v100/ (SXM2)",
        memory_gib=15.8,
        price=0.45,
        capability=(7, 0),
    ),
    GpuSpec(
        name="T4",
        family="T4",
        peaks={"fp16": 65e12, "fp32": 8.1e12},
        peak_source=f"{_NV}tesla-t4/",
        memory_gib=14.6,
        price=0.35,
        capability=(7, 5),
    ),
)


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
