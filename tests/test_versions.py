"""The supported torch/transformers floor and the known-bad pairs, with faked version strings.

Each trap of pitstop/core/versions.py is checked on both sides of its range (so a wrong bound
fails here), and a run on a refused pair stops in build_run before anything is written.
"""

from __future__ import annotations

import pytest

from pitstop.core import versions
from pitstop.core.errors import ConfigError
from pitstop.core.versions import parse_version, version_problems


def test_parse_version_reads_local_and_dev_suffixes() -> None:
    assert parse_version("2.13.0+cpu") == (2, 13, 0)
    assert parse_version("4.56.0.dev0") == (4, 56, 0)
    assert parse_version("2.6.0a0+git1234") == (2, 6, 0)
    assert parse_version("5") == (5, 0, 0)
    with pytest.raises(ValueError):
        parse_version("nightly")


@pytest.mark.parametrize(
    ("torch_v", "hf_v"),
    [("2.6.0", "4.56.0"), ("2.13.0+cpu", "5.23.0"), ("2.7.1+cu126", "4.57.6"), ("2.6.0", "5.0.0")],
)
def test_supported_pairs_pass(torch_v: str, hf_v: str) -> None:
    for attn in (None, "sdpa", "eager", "flex_attention", "flash_attention_2"):
        assert version_problems(torch_v, hf_v, attention=attn, model_type="mistral") == []


def test_transformers_below_456_crashes_at_load_and_is_refused() -> None:
    (p,) = version_problems("2.6.0", "4.55.4", attention="sdpa")
    assert "dtype" in p and "4.56" in p and "transformers 4.55.4" in p
    assert "pip install -U" in p


@pytest.mark.parametrize("hf_v", ["4.56.0", "4.57.6"])
def test_packed_mask_needs_torch_26_on_456_to_457(hf_v: str) -> None:
    probs = version_problems("2.5.1", hf_v, attention="sdpa")
    assert any("attend to each other" in p and "torch >= 2.6" in p for p in probs)
    # flash reads cu_seq_lens itself: only the floor applies there
    (flash,) = version_problems("2.5.1", hf_v, attention="flash_attention_2")
    assert "older than the oldest" in flash and "torch >= 2.6" in flash


def test_flash_on_4530_leaks_and_4531_does_not_trip_that_trap() -> None:
    leak = version_problems("2.6.0", "4.53.0", attention="flash_attention_2")
    assert any("4.53.0 ignores cu_seq_lens" in p for p in leak)
    assert not any(
        "cu_seq_lens" in p for p in version_problems("2.6.0", "4.53.0", attention="sdpa")
    )
    fixed = version_problems("2.6.0", "4.53.1", attention="flash_attention_2")
    assert not any("cu_seq_lens" in p for p in fixed) and fixed  # still below the floor


def test_flex_448_to_452_is_bidirectional() -> None:
    for v, hit in (("4.47.1", False), ("4.48.0", True), ("4.52.4", True), ("4.53.0", False)):
        probs = version_problems("2.6.0", v, attention="flex_attention")
        assert any("bidirectional" in p for p in probs) is hit, v


def test_mistral_446_447_with_flash_only() -> None:
    probs = version_problems("2.6.0", "4.47.0", attention="flash_attention_2", model_type="mistral")
    assert any("Mistral" in p for p in probs)
    llama = version_problems("2.6.0", "4.47.0", attention="flash_attention_2", model_type="llama")
    assert not any("Mistral" in p for p in llama)
    # unknown kernel/model: every trap of the versions is named
    assert any("Mistral" in p for p in version_problems("2.6.0", "4.46.0"))


def test_check_versions_raises_config_error_with_the_versions(monkeypatch) -> None:
    monkeypatch.setattr(versions, "installed_versions", lambda: ("2.5.1", "4.56.2"))
    with pytest.raises(ConfigError) as e:
        versions.check_versions(attention="sdpa")
    msg = str(e.value)
    assert "torch 2.5.1" in msg and "transformers 4.56.2" in msg and "docs/versions.md" in msg
    monkeypatch.setattr(versions, "installed_versions", lambda: ("2.13.0", "5.23.0"))
    versions.check_versions(attention="sdpa")  # no error


def test_model_type_of(tmp_path) -> None:
    assert versions.model_type_of(tmp_path) is None
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    assert versions.model_type_of(tmp_path) == "mistral"
    (tmp_path / "config.json").write_text("[1]")
    assert versions.model_type_of(tmp_path) is None


def test_a_run_on_a_refused_pair_stops_before_writing(monkeypatch, tmp_path) -> None:
    from pitstop.core.config import RunConfig
    from pitstop.train.build import build_run

    monkeypatch.setattr(versions, "installed_versions", lambda: ("2.13.0", "4.55.0"))
    out = tmp_path / "out"
    cfg = RunConfig(model=str(tmp_path / "model"), data=str(tmp_path / "d.jsonl"), output=str(out),
                    device="cpu", max_steps=1)  # fmt: skip
    with pytest.raises(ConfigError, match=r"4\.56"):
        build_run(cfg)
    assert not out.exists()
