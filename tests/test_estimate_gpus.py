"""The estimate's GPU table: new cards with their datasheet sources, torch's device names
matched to the right row, the user's own card, and a floor under tiny FLOPs times."""

from __future__ import annotations

import pytest

from pitstop.cli import main
from pitstop.core.errors import ConfigError
from pitstop.measure.peak import gpu_peak
from pitstop.report.gpus import custom_gpu, find_gpu, get_gpu

NEW = ["B200", "H200", "H20", "L40", "L40S", "RTX A6000", "RTX 5090", "MI300X"]


@pytest.mark.parametrize("name", NEW)
def test_new_cards_have_memory_and_a_sourced_bf16_peak(name):
    gpu = get_gpu(name)
    peak, source = gpu.peak_flops("bf16")
    assert (
        peak and peak > 100e12 and ("http" in source or "whitepaper" in source or "brief" in source)
    )
    assert gpu.memory_bytes > 30 * 1024**3


@pytest.mark.parametrize(
    "torch_name,row",
    [
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA GeForce RTX 5090", "RTX 5090"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA A10G", "A10"),
    ],
)
def test_device_names_match_their_own_row(torch_name, row):
    assert find_gpu(torch_name).name == row
    assert gpu_peak(torch_name, "bf16")[1].startswith(f"{row} bf16")


def test_your_own_gpu():
    g = custom_gpu(None, 400.0, 64.0, 1.5)
    assert g.peak_flops("bf16")[0] == 400e12 and g.memory_bytes == 64 * 1024**3
    assert g.example_price_per_hour == 1.5
    over = custom_gpu("H100", 500.0, None, None)  # a known card with a different clock
    assert (
        over.peak_flops("bf16")[0] == 500e12 and over.memory_bytes == get_gpu("H100").memory_bytes
    )
    with pytest.raises(ConfigError, match="needs both --gpu-tflops and --gpu-memory-gib"):
        custom_gpu(None, 400.0, None, None)


def test_custom_gpu_through_the_cli(capsys):
    args = ["estimate", "--params", "1e9", "--tokens", "100000000", "--json"]
    assert main([*args, "--gpu-tflops", "500", "--gpu-memory-gib", "64"]) == 0
    slow = capsys.readouterr().out
    assert main([*args, "--gpu-tflops", "1000", "--gpu-memory-gib", "64"]) == 0
    fast = capsys.readouterr().out
    import json

    a, b = json.loads(slow), json.loads(fast)
    assert a["time"]["train_seconds"] == pytest.approx(2 * b["time"]["train_seconds"], rel=1e-6)


def test_a_small_model_on_a_large_gpu_is_not_free(capsys):
    assert main(["estimate", "--params", "10e6", "--tokens", "1000000", "--gpu", "B200"]) == 0
    out = capsys.readouterr().out
    assert "Time: 0 s" not in out and "0.00 USD" not in out
    assert "time floor:" in out and "ASSUMED floor" in out


# NVIDIA's datasheets quote Hopper's tensor-core peaks with 2:4 sparsity; the table holds
# half of them. The NVL boards are the same die at a lower power limit, so their peaks are
# not the SXM's, and a name match of "H100" alone would give an H100 NVL the SXM's 989.
@pytest.mark.parametrize(
    "torch_name,row,bf16_tflops,tf32_tflops,fp32_tflops,memory_gib",
    [
        ("NVIDIA H100 80GB HBM3", "H100", 989.4, 494.7, 66.9, 79.1),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0, 51.2, 79.1),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5, 60.0, 93.0),
        ("NVIDIA H200", "H200", 989.4, 494.7, 66.9, 139.8),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5, 60.0, 139.8),
        ("NVIDIA GH200 480GB", "GH200", 989.4, 494.7, 66.9, 95.0),
        ("NVIDIA GH200 144G HBM3e", "GH200 144G", 989.4, 494.7, 66.9, 142.9),
    ],
)
def test_hopper_variants_resolve_to_their_own_row(
    torch_name, row, bf16_tflops, tf32_tflops, fp32_tflops, memory_gib
):
    gpu = find_gpu(torch_name)
    assert gpu.name == row
    assert gpu.memory_bytes == int(memory_gib * 1024**3)
    for precision, tflops in (("bf16", bf16_tflops), ("fp16", bf16_tflops),
                              ("tf32", tf32_tflops), ("fp32", fp32_tflops)):  # fmt: skip
        # The MFU path (the device name torch reports) and the estimate's (the table row).
        assert gpu_peak(torch_name, precision)[0] == pytest.approx(tflops * 1e12)
        assert gpu.peak_flops(precision)[0] == pytest.approx(tflops * 1e12)
    assert gpu_peak(torch_name, "bf16")[1].startswith(f"{gpu.spec.family} bf16")


def test_an_nvl_card_is_not_the_sxm_row():
    assert gpu_peak("NVIDIA H100 NVL", "bf16")[0] != gpu_peak("NVIDIA H100 80GB HBM3", "bf16")[0]
    assert not gpu_peak("NVIDIA H100 NVL", "bf16")[1].startswith("H100 bf16")
    assert not gpu_peak("NVIDIA H200 NVL", "bf16")[1].startswith("H200 bf16")
    # "GH200" contains "H200" but not as a word: a GH200 is its own row, not the H200's.
    assert gpu_peak("NVIDIA GH200 480GB", "bf16")[1].startswith("GH200 bf16")
    for typed, row in (("h100-nvl", "H100 NVL"), ("H100NVL", "H100 NVL"),
                       ("h200 nvl", "H200 NVL"), ("gh200", "GH200"),
                       ("GH200 144GB", "GH200 144G")):  # fmt: skip
        assert get_gpu(typed).name == row
