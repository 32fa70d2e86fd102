"""Arrow streams and dataset folders that would read as something they are not.

An Arrow IPC stream ends with an end-of-stream marker; one cut short (at a record-batch
boundary, or anywhere inside a message) must be refused, not read as a shorter dataset.
A `save_to_disk` folder's state.json, a DatasetDict's split list and a Hub cache's
`refs/main` are files anyone can write: none may make pitstop read data or a model from
outside the folder the user named, nor read one file twice.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from pitstop.core.config import RunConfig, build_config
from pitstop.core.errors import ConfigError, DataError
from pitstop.data.readers import hf_dataset_files, iter_chunks
from pitstop.data.records import Fields

FIELDS = Fields.from_config(RunConfig())


def _stream(n: int = 120, batches: int = 2, **options) -> tuple[bytes, list[int]]:
    """An IPC stream of `n` documents in `batches` record batches, and where each batch ends."""
    sink = io.BytesIO()
    per = n // batches
    schema = pa.schema([("text", pa.string())])
    writer = pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(**options))
    ends = []
    for b in range(batches):
        writer.write_batch(
            pa.record_batch({"text": [f"document {i}" for i in range(b * per, (b + 1) * per)]})
        )
        ends.append(sink.tell())
    writer.close()
    return sink.getvalue(), ends


def _rows(path: Path) -> int:
    return sum(p.num_rows for c in iter_chunks(path, "arrow", None, FIELDS) for _, p in c.items)


def _prepare(args: list[str], capsys) -> tuple[int, str]:
    from pitstop.cli import main

    rc = main(["prepare", "--workers", "1", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_a_stream_cut_at_a_batch_boundary_is_refused(tmp_path):
    raw, ends = _stream()
    assert raw.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    whole = tmp_path / "whole.arrow"
    whole.write_bytes(raw)
    assert _rows(whole) == 120
    for batches, (end, rows) in enumerate([(ends[0], 60), (ends[1], 120)], 1):
        cut = tmp_path / f"cut{batches}.arrow"
        cut.write_bytes(raw[:end])
        plural = "es" if batches > 1 else ""
        with pytest.raises(DataError) as e:
            _rows(cut)
        assert str(e.value) == (
            f"{cut}: truncated: no end-of-stream marker after {batches} record batch{plural} "
            f"({rows} rows); the write or copy was cut short: write the file again "
            "(or copy it whole)"
        )


def test_a_stream_cut_anywhere_is_a_clear_error(tmp_path):
    raw, ends = _stream(n=40, batches=4)
    src = pa.BufferReader(raw)
    pa.ipc.MessageReader.open_stream(src).read_next_message()
    schema_end = src.tell()
    f = tmp_path / "cut.arrow"
    for cut in range(1, len(raw)):
        f.write_bytes(raw[:cut])
        with pytest.raises(DataError) as e:
            _rows(f)
        message = str(e.value)
        if cut < schema_end:  # not even a schema: not an Arrow stream
            assert "not a readable Arrow file" in message, (cut, message)
        else:
            done = sum(end <= cut for end in ends)
            assert message.startswith(f"{f}: truncated"), (cut, message)
            assert f"after {done} record batch" in message and "write the file again" in message


def test_a_legacy_stream_ends_with_four_zero_bytes_and_its_cut_is_refused(tmp_path):
    raw, ends = _stream(use_legacy_format=True)
    assert raw.endswith(b"\x00\x00\x00\x00") and not raw.endswith(
        b"\xff\xff\xff\xff\x00\x00\x00\x00"
    )
    f = tmp_path / "legacy.arrow"
    f.write_bytes(raw)
    assert _rows(f) == 120
    f.write_bytes(raw[: ends[0]])
    with pytest.raises(
        DataError, match=r"no end-of-stream marker after 1 record batch \(60 rows\)"
    ):
        _rows(f)


def test_an_arrow_file_without_its_footer_is_refused(tmp_path):
    sink = io.BytesIO()
    batch = pa.record_batch({"text": [f"document {i}" for i in range(50)]})
    with pa.ipc.new_file(sink, batch.schema) as w:
        w.write_batch(batch)
    f = tmp_path / "file.arrow"
    f.write_bytes(sink.getvalue())
    assert _rows(f) == 50
    f.write_bytes(sink.getvalue()[:-40])
    with pytest.raises(DataError, match=r"truncated: an Arrow IPC file without its footer"):
        _rows(f)
    for cut in range(1, len(sink.getvalue())):
        f.write_bytes(sink.getvalue()[:cut])
        with pytest.raises(DataError, match=r"truncated|not a readable Arrow file"):
            _rows(f)


def test_prepare_refuses_a_truncated_stream_with_a_clear_error(tiny_model_dir, tmp_path, capsys):
    raw, ends = _stream()
    f = tmp_path / "cut.arrow"
    f.write_bytes(raw[: ends[0]])
    cache = tmp_path / "cache"
    rc, err = _prepare(
        ["--model", str(tiny_model_dir), "--cache-dir", str(cache), "--data", str(f)], capsys
    )
    assert rc == DataError.exit_code and f"{f}: truncated: no end-of-stream marker" in err, err
    stores = cache / "stores"
    assert not (stores.is_dir() and any((p / "manifest.json").exists() for p in stores.iterdir()))


# --- save_to_disk folders ------------------------------------------------------------


def _folder(d: Path, files: dict[str, int], listed: list[str] | None = None) -> Path:
    """A save_to_disk-like folder: .arrow streams of `files[name]` documents each, and a
    state.json listing `listed` (default: the files, in order)."""
    d.mkdir(parents=True, exist_ok=True)
    for name, n in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(_stream(n, 1)[0])
    state = {"_data_files": [{"filename": n} for n in (listed or list(files))], "_split": None}
    (d / "state.json").write_text(json.dumps(state))
    (d / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return d


def test_a_state_json_naming_a_file_outside_the_folder_is_refused(tmp_path):
    good = _folder(
        tmp_path / "good", {"data-00000-of-00002.arrow": 30, "data-00001-of-00002.arrow": 20}
    )
    files, split = hf_dataset_files(good)
    assert [f.name for f in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert split is None and sum(map(_rows, files)) == 50

    (tmp_path / "outside.arrow").write_bytes(_stream(50, 1)[0])
    for entry in ["../outside.arrow", str(tmp_path / "outside.arrow"), "sub/../../outside.arrow"]:
        d = _folder(tmp_path / f"bad{len(entry)}", {"data.arrow": 5}, ["data.arrow", entry])
        with pytest.raises(DataError) as e:
            hf_dataset_files(d)
        msg = str(e.value)  # a long entry is shortened in the message (errors.short_repr)
        assert msg.startswith(f"{d}: state.json lists the data file '"), msg
        assert (
            "a path outside the dataset folder; everything a dataset lists must lie inside the "
            "dataset folder" in msg
        ), msg

    linked = _folder(tmp_path / "linked", {"data.arrow": 5})
    os.symlink(tmp_path / "outside.arrow", linked / "link.arrow")
    (linked / "state.json").write_text(json.dumps({"_data_files": [{"filename": "link.arrow"}]}))
    with pytest.raises(
        DataError,
        match=r"lists the data file 'link.arrow', a link to .*outside.arrow, outside the dataset folder",
    ):
        hf_dataset_files(linked)


def test_a_state_json_listing_a_file_twice_is_refused(tmp_path, tiny_model_dir, capsys):
    d = _folder(tmp_path / "twice", {"data.arrow": 50}, ["data.arrow", "./data.arrow"])
    with pytest.raises(DataError) as e:
        hf_dataset_files(d)
    assert str(e.value).startswith(
        f"{d}: state.json lists the data file './data.arrow' twice (as 'data.arrow' too), "
        "so its records would be read twice"
    )
    args = [
        "--model",
        str(tiny_model_dir),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--data",
        str(d),
    ]
    rc, err = _prepare(args, capsys)
    assert rc == DataError.exit_code and "twice" in err, err


def test_a_dataset_dict_split_outside_the_folder_is_refused(tmp_path):
    _folder(tmp_path / "elsewhere", {"data.arrow": 7})
    dd = tmp_path / "dd"
    _folder(dd / "train", {"data.arrow": 3})
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../elsewhere"]}))
    files, split = hf_dataset_files(dd)
    assert split == "train" and files == [dd / "train" / "data.arrow"]
    with pytest.raises(
        DataError, match=r"dataset_dict.json lists the split '../elsewhere', a path outside"
    ):
        hf_dataset_files(dd, "../elsewhere")


def test_a_dataset_in_a_hub_cache_snapshot_reads_through_its_blob_links(tmp_path):
    """huggingface_hub keeps a snapshot's files as links into the repo's blobs/: allowed."""
    repo = tmp_path / "hub" / "datasets--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(_stream(9, 1)[0])
    (tmp_path / "outside.arrow").write_bytes(_stream(50, 1)[0])
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    os.symlink("../../blobs/abc123", snap / "data.arrow")
    os.symlink(tmp_path / "outside.arrow", snap / "other.arrow")
    state = {"_data_files": [{"filename": "data.arrow"}]}
    (snap / "state.json").write_text(json.dumps(state))
    files, _ = hf_dataset_files(snap)
    assert sum(map(_rows, files)) == 9
    state["_data_files"].append({"filename": "other.arrow"})
    (snap / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match=r"'other.arrow', a link to .*outside.arrow, outside"):
        hf_dataset_files(snap)


# --- Hub cache refs ------------------------------------------------------------------


def _hub_model(hub: Path, model_dir: Path, ref: str, snapshot: str | None = None) -> Path:
    repo = hub / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(ref)
    (repo / "snapshots").mkdir()
    if snapshot is not None:
        import shutil

        shutil.copytree(model_dir, repo / "snapshots" / snapshot)
    return repo


@pytest.mark.parametrize("ref", ["../..", "..", "../../..", "/etc", "a/../../.."])
def test_a_hub_ref_out_of_the_snapshots_is_refused(ref, tmp_path, tiny_model_dir, monkeypatch):
    hub = tmp_path / "hub"
    repo = _hub_model(hub, tiny_model_dir, ref, snapshot="0" * 40)
    # What the ref would reach, made to look like a model, as an attacker would.
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            (hub / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(ConfigError) as e:
        build_config({"model": "org/tiny", "data": ["x.jsonl"]}, command="prepare")
    assert str(e.value).startswith(
        f"{repo}: refs/main holds {ref!r}, which is not the name of one snapshot"
    ) and "hf download org/tiny" in str(e.value)


def test_a_hub_snapshot_linked_out_of_the_cache_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    hub = tmp_path / "hub"
    repo = _hub_model(hub, tiny_model_dir, "main-branch")
    os.symlink(tiny_model_dir, repo / "snapshots" / "main-branch")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(
        ConfigError, match=r"refs/main holds 'main-branch', whose snapshot is a link to"
    ):
        build_config({"model": "org/tiny", "data": ["x.jsonl"]}, command="prepare")
    (repo / "snapshots" / "main-branch").unlink()
    (repo / "snapshots" / "main-branch").symlink_to("0" * 40)  # a link inside: fine
    import shutil

    shutil.copytree(tiny_model_dir, repo / "snapshots" / ("0" * 40))
    cfg = build_config({"model": "org/tiny", "data": ["x.jsonl"]}, command="prepare")
    assert Path(cfg.model) == (repo / "snapshots" / ("0" * 40)).resolve()


def test_prepare_exits_2_on_a_hostile_hub_ref(tmp_path, tiny_model_dir, monkeypatch, capsys):
    hub = tmp_path / "hub"
    _hub_model(hub, tiny_model_dir, "../..", snapshot="0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n')
    rc, err = _prepare(
        ["--model", "org/tiny", "--data", str(data), "--cache-dir", str(tmp_path / "c")], capsys
    )
    assert rc == 2 and "refs/main holds '../..'" in err, err
