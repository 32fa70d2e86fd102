"""Target audits that stay consistent (issue 24, item 4): the capability table covers the
estimate's GPUs by exact name, a profile of another device is set aside, the input-bound
fix never lowers the workers, packing-off needs padding, no sync advice on a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from pitstop.advise.doctor import doctor, make_setup
from pitstop.advise.rules import Context, run_rules
from pitstop.advise.target import make_target
from pitstop.catalog.gpus import GPUS
from pitstop.core.config import RunConfig
from pitstop.measure.schema import make_profile
from pitstop.probe import DeviceInfo

CPU = DeviceInfo(type="cpu", name="AMD EPYC", cpu_count=2)
ENV = {"transformers": "5.23.0", "flash_attn": {"installed": None}, "tf32": {}, "compile": {}}


def test_every_catalogued_gpu_is_a_target_with_its_own_facts() -> None:
    for g in GPUS:
        dev = make_target(CPU, gpu=g.name).device
        assert (dev.name, dev.capability, dev.bf16) == (g.name, g.capability, g.bf16)
        assert dev.total_memory_bytes == g.memory_bytes


@pytest.mark.parametrize(
    ("typed", "cap"),
    [("RTX A6000", (8, 6)), ("a6000", (8, 6)), ("B200", (10, 0)), ("H20", (9, 0)),
     ("RTX 5090", (12, 0)), ("L40", (8, 9)), ("L4", (8, 9)), ("L40S", (8, 9)),
     ("V100", (7, 0)), ("MI300X", None)],
)  # fmt: skip
def test_target_capability_by_exact_name_or_alias(typed: str, cap) -> None:
    assert make_target(CPU, gpu=typed).device.capability == cap


def test_flash_attn_finding_for_an_rtx_a6000() -> None:
    """The issue: `--gpu "RTX A6000"` silently dropped the flash-attn finding (prefix match)."""
    target = make_target(CPU, gpu="RTX A6000")
    report = doctor(
        config=RunConfig(batching="pack"), environment=ENV, device=CPU, target=target,
        compile_check=False, disk_check=False,
    )  # fmt: skip
    assert "flash-attn-missing" in {f["id"] for f in report["findings"]}


def _cpu_input_bound_profile() -> dict:
    per = [{"data_wait": 0.08, "forward": 0.01, "backward": 0.01}] * 10
    return make_profile(
        per, [0.1] * 10, warmup=1, source="pitstop", trained_tokens=1e4, peak_memory_bytes=2**30,
        device=CPU.to_dict(), config={"loader_workers": 2},
    )  # fmt: skip


def test_a_cpu_profile_is_not_measured_for_an_h100() -> None:
    prof = _cpu_input_bound_profile()
    target = make_target(CPU, gpu="H100")
    report = doctor(
        profile=prof, environment=ENV, device=CPU, target=target, compile_check=False,
        disk_check=False,
    )  # fmt: skip
    found = {f["id"]: f for f in report["findings"]}
    assert "profile-other-target" in found
    assert "cpu" in found["profile-other-target"]["evidence"]["why"]
    # Nothing measured on the CPU is used as "measured" for the H100.
    assert all(
        f["basis"] != "measured in this profile"
        for i, f in found.items()
        if i != "profile-other-target"
    )
    # Without a target, the same profile audits the machine it ran on.
    local = doctor(profile=prof, environment=ENV, device=CPU, compile_check=False, disk_check=False)
    ids = {f["id"] for f in local["findings"]}
    assert "input-bound" in ids and "profile-other-target" not in ids


def test_a_profile_of_another_model_is_set_aside(tmp_path: Path) -> None:
    prof = _cpu_input_bound_profile()
    prof["config"]["model"] = str(tmp_path / "other-model")
    report = doctor(
        profile=prof, model=tmp_path / "this-model", environment=ENV, device=CPU,
        compile_check=False, disk_check=False,
    )  # fmt: skip
    found = {f["id"]: f for f in report["findings"]}
    assert (
        "profile-other-target" in found
        and "other-model" in found["profile-other-target"]["evidence"]["why"]
    )


def _ctx(
    source: str, values: dict, profile: dict | None = None, device: DeviceInfo = CPU
) -> Context:
    setup = make_setup(RunConfig(**values) if source == "pitstop" else None,
                       values if source == "hf" else None)  # fmt: skip
    return Context(setup=setup, device=device, env=ENV, profile=profile)


def test_input_bound_fix_never_lowers_the_workers() -> None:
    """The issue: 79.7% input-bound with 2 workers on 2 cores was told num_workers=1."""
    prof = _cpu_input_bound_profile()
    hf = {"dataloader_num_workers": 2, "per_device_train_batch_size": 1}
    fired = {x.id: x for x in run_rules(_ctx("hf", hf, prof))}
    f = fired["input-bound"]
    assert "dataloader_num_workers=1" not in f.fix and "keep dataloader_num_workers=2" in f.fix
    assert "loader-workers-exceed-cores" not in fired  # no finding contradicts it
    # Sized from the profile (issue 36): 2 workers and 0.08 s of wait per 0.02 s of compute
    # load 0.2 s per step, so 10 workers hide it; 6 workers load 0.6 s, 30 > 15 cores.
    big = DeviceInfo(type="cpu", name="EPYC", cpu_count=16)
    f = {x.id: x for x in run_rules(_ctx("hf", hf, prof, big))}["input-bound"]
    assert f.fix.startswith("dataloader_num_workers=10,")
    f = {x.id: x for x in run_rules(_ctx("pitstop", {"loader_workers": 6}, prof, big))}[
        "input-bound"
    ]
    assert "meanwhile --loader-workers 15" in f.fix and f.evidence["workers_needed"] == 30


def test_packing_off_needs_padding() -> None:
    one_row = {"per_device_train_batch_size": 1}
    assert "packing-off" not in {x.id for x in run_rules(_ctx("hf", one_row))}
    assert "packing-off" in {
        x.id for x in run_rules(_ctx("hf", {"per_device_train_batch_size": 8}))
    }
    # A measured padding share decides: 0% is quiet, 40% is a measured finding.
    prof = _cpu_input_bound_profile()
    prof.update(seen_tokens=1000, padded_tokens=1000)
    assert "packing-off" not in {
        x.id for x in run_rules(_ctx("hf", {"per_device_train_batch_size": 8}, prof))
    }
    prof.update(seen_tokens=600, padded_tokens=1000)
    f = {x.id: x for x in run_rules(_ctx("hf", {"per_device_train_batch_size": 8}, prof))}[
        "packing-off"
    ]
    assert f.basis == "measured in this profile" and f.evidence["padding_fraction"] == 0.4


def test_no_host_device_sync_advice_on_a_cpu() -> None:
    per = [{"other": 0.04, "forward": 0.02, "backward": 0.04}] * 10
    prof = make_profile(per, [0.1] * 10, warmup=1, source="hf", trained_tokens=1e4,
                        device=CPU.to_dict())  # fmt: skip
    f = {x.id: x for x in run_rules(_ctx("hf", {}, prof))}["sync-bound"]
    text = f.title + f.effect + f.fix
    assert "host-device" not in text and "device waits" not in text and "cuda" not in text
