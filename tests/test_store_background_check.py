"""The training path checks the token and mask arrays on a thread (verify="background"):
damage is still refused by name, before the first batch, and the small arrays at open."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_batching_support import long_tailed_lengths, make_store

from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
from pitstop.batching.settings import BatchSettings
from pitstop.core.errors import DataError
from pitstop.data.store import TokenStore

MSL = 64


def _damage(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    i = len(raw) // 2
    raw[i], raw[i + 1] = raw[i + 1], raw[i]  # same size, same values, another order
    if raw == p.read_bytes():
        raw[i] ^= 1
    p.write_bytes(bytes(raw))


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    path = make_store(tmp_path / "s", long_tailed_lengths(200, MSL), max_seq_len=MSL).path
    return Path(path)


def _loader(store: TokenStore) -> MicroBatchLoader:
    return MicroBatchLoader(
        store, BatchSettings("pack", MSL, 4 * MSL, micro_batch_size=2), LoaderOptions(workers=0)
    )


def test_an_intact_store_trains_after_its_background_check(store: Path) -> None:
    s = TokenStore(store, verify="background")
    s.verified()
    assert next(iter(_loader(s)))["input_ids"].shape[1] == MSL


@pytest.mark.parametrize("name", ["tokens.bin", "mask.bin"])
def test_damaged_bulk_array_is_refused_before_the_first_batch(store: Path, name: str) -> None:
    _damage(store / name)
    s = TokenStore(store, verify="background")  # opens: the check runs on its thread
    loader = _loader(s)  # planning reads the per-sequence facts only
    with pytest.raises(DataError, match=rf"{name} does not match the checksum"):
        next(iter(loader))
    with pytest.raises(DataError, match=rf"{name} does not match the checksum"):
        s.verified()


def test_damaged_small_array_is_refused_at_open(store: Path) -> None:
    _damage(store / "offsets.bin")
    with pytest.raises(DataError, match=r"offsets.bin does not match the checksum"):
        TokenStore(store, verify="background")
