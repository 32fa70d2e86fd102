"""The GPU catalogue is the one home of a card's facts (issue 34).

Every card resolves by its name and aliases to itself, no alias is ambiguous, and no
module outside `pitstop/catalog/` writes a datasheet peak: adding a card touches one file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pitstop.catalog.gpus import GPUS, find_spec

PITSTOP = Path(__file__).resolve().parents[1] / "pitstop"
# A FLOP/s figure written as a datasheet number (989.4e12, 2250e12), not a unit (1e12).
PEAK_LITERAL = re.compile(r"(?<![\w.])(?!1e1[2-5]\b)\d+(?:\.\d+)?e1[2-5]\b")


def test_every_card_and_alias_finds_itself() -> None:
    seen: dict[str, str] = {}
    for g in GPUS:
        for spelling in (g.name, *g.aliases):
            assert find_spec(spelling) is g, spelling
            assert spelling.lower() not in seen, (
                f"{spelling} names {seen.get(spelling.lower())} too"
            )
            seen[spelling.lower()] = g.name
        assert g.peaks and g.peak_source and g.memory_gib > 0
        # bf16 follows from the datasheet: a card with a bf16 peak has bf16 tensor cores.
        assert g.bf16 == ("bf16" in g.peaks)
        if g.capability is not None:  # CUDA: bf16 from compute capability 8.0 (Ampere) on
            assert g.bf16 == (g.capability >= (8, 0)), g.name


@pytest.mark.parametrize(
    ("torch_name", "card"),
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
     ("Tesla V100-SXM2-16GB", "V100 16GB"), ("NVIDIA L40", "L40"), ("NVIDIA A10G", "A10"),
     ("NVIDIA GH200 480GB", "GH200"), ("AMD Instinct MI300X", "MI300X"), ("Tesla T4", "T4")],
)  # fmt: skip
def test_torch_device_names_find_their_card(torch_name: str, card: str) -> None:
    spec = find_spec(torch_name)
    assert spec is not None and spec.name == card


def test_no_peak_is_written_outside_the_catalogue() -> None:
    assert PEAK_LITERAL.findall("peaks = {'bf16': 989.4e12, 'x': 2250e12}") == [
        "989.4e12",
        "2250e12",
    ]
    assert PEAK_LITERAL.findall("tflops * 1e12, peak / 1e12") == []
    found = {
        str(p.relative_to(PITSTOP)): hits
        for p in PITSTOP.rglob("*.py")
        if "catalog" not in p.parts
        and (hits := PEAK_LITERAL.findall(p.read_text(encoding="utf-8")))
    }
    assert found == {}, f"GPU peaks outside pitstop/catalog/gpus.py: {found}"
