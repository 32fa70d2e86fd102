"""`sdpa_docs` on a CPU computes each row as matrix products where that was timed faster
(train/attention_rows.py): the same attention, a measured choice made once.

The truth for the math is the per-document kernel and transformers' eager attention
(tests/test_attention_families.py runs every family's model both ways); here the two
kernels are compared in bf16 and with windows and grouped heads, the choice's rules, its
cache and payoff, and a training run that takes it: the same losses as the per-document
path, recorded in choices.json, kept by --resume.
"""

from __future__ import annotations

import json

import pytest
import torch

from pitstop.train import attention_rows, doc_attention
from pitstop.train.attention_rows import (
    ROWS_MAX_LEN,
    RowsRequest,
    RowsSpeed,
    choose_rows,
    cpu_rows_speed,
    decide_rows,
    packed_offsets,
    ruled_rows,
)
from pitstop.train.doc_kernel import per_document_sdpa, row_matmul_attention

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (2, 4, 2, 32, 8)  # rows, heads, key/value heads, length, head dim


def _grads(fn, q, k, v, cu, window):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, cu, window=window)
    out.float().square().sum().backward()
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_products_equal_a_call_per_document(window, dtype) -> None:
    torch.manual_seed(0)
    b, h, h_kv, t, d = SHAPE
    q = torch.randn(b, h, t, d).to(dtype)
    k, v = (torch.randn(b, h_kv, t, d).to(dtype) for _ in range(2))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    for cu in ([0, 7, 32, 40, 51, 64], [0, 32, 64]):  # packed rows; one document a row
        cu = torch.tensor(cu, dtype=torch.int32)
        docs = _grads(per_document_sdpa, q, k, v, cu, window)
        rows = _grads(row_matmul_attention, q, k, v, cu, window)
        for name, a, r in zip(("out", "dq", "dk", "dv"), docs, rows, strict=True):
            torch.testing.assert_close(r.float(), a.float(), **tol, msg=f"{name} {cu.tolist()}")


def test_a_document_never_sees_another() -> None:
    """The truth without either kernel: a document's output is unchanged when every other
    document's keys and values change."""
    torch.manual_seed(1)
    b, h, h_kv, t, d = SHAPE
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, h_kv, t, d), torch.randn(b, h_kv, t, d)
    cu = torch.tensor([0, 10, 32, 64], dtype=torch.int32)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 10:], v2[0, :, 10:] = 7.0, -3.0  # the second document of row 0
    a = row_matmul_attention(q, k, v, cu).view(b, t, h, d)
    c = row_matmul_attention(q, k2, v2, cu).view(b, t, h, d)
    torch.testing.assert_close(a[0, :10], c[0, :10])
    assert not torch.allclose(a[0, 10:], c[0, 10:])


def test_the_layout_timed_packs_documents_of_the_median_length() -> None:
    assert packed_offsets(2, 10, 4).tolist() == [0, 4, 8, 10, 14, 18, 20]
    assert packed_offsets(2, 10, 10).tolist() == [0, 10, 20]
    assert packed_offsets(1, 10, 50).tolist() == [0, 10]  # longer documents fill a row


def _speed(docs_s: float, rows_s: float) -> RowsSpeed:
    return RowsSpeed(docs_s, rows_s, (8, 4, 4, 128, 64), "bfloat16", 128, "measured on this CPU")


def test_only_an_eager_cpu_run_of_sdpa_docs_at_short_rows_is_timed() -> None:
    base = {"device_type": "cpu", "attention": "sdpa_docs", "compiled": False, "length": 256}
    assert ruled_rows(**base) is None
    for over, why in (
        ({"device_type": "cuda"}, "GPU"),
        ({"attention": "flash_attention_2"}, "not sdpa_docs"),
        ({"compiled": True}, "compiled"),
        ({"length": ROWS_MAX_LEN + 1}, "not timed"),
    ):
        choice = ruled_rows(**{**base, **over})
        assert choice is not None and choice.value is False and why in choice.reason, over
    assert ruled_rows(**{**base, "length": ROWS_MAX_LEN}) is None
    unknown = RowsRequest("cpu", "sdpa_docs", False, None, torch.bfloat16, 128, 3600.0)
    assert "heads are unknown" in decide_rows(unknown, None).reason


def test_rows_are_taken_only_when_timed_faster_by_the_margin() -> None:
    fast = choose_rows(_speed(0.02, 0.01))
    assert fast.value is True and "2.00x" in fast.reason and fast.measured["rows_speedup"] == 2
    even = choose_rows(_speed(0.0105, 0.01))  # 1.05x: within the margin
    assert even.value is False and "were not 1.10x faster" in even.reason
    assert even.measured is not None  # recorded either way


def test_the_timing_is_cached_per_shape_dtype_and_layout(tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        attention_rows, "measure_rows_speed", lambda s, dt, n: calls.append(s) or (0.02, 0.01)
    )
    first = cpu_rows_speed(tmp_path, (8, 4, 4, 128, 64), torch.bfloat16, 64)
    again = cpu_rows_speed(tmp_path, (8, 4, 4, 128, 64), torch.bfloat16, 64)
    assert len(calls) == 1 and first.source == "measured on this CPU"
    assert again.source.startswith("reused") and again.gain == first.gain == 2
    cpu_rows_speed(tmp_path, (8, 4, 4, 128, 64), torch.float32, 64)
    cpu_rows_speed(tmp_path, (8, 4, 4, 128, 64), torch.bfloat16, 128)
    assert len(calls) == 3 and len(list(tmp_path.glob("attention_rows-*.json"))) == 3
    assert cpu_rows_speed(tmp_path, (4, 4, 4, 128, 64), torch.bfloat16, 64, measure=False) is None


def test_a_short_run_does_not_pay_for_the_timing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: pytest.fail("timed"))
    req = RowsRequest("cpu", "sdpa_docs", False, (8, 4, 4, 128, 64), torch.bfloat16, 128, 5.0)
    choice = decide_rows(req, tmp_path)
    assert choice.value is False and "not timed" in choice.reason
    # Recorded with the payoff's numbers, so a resumed run keeps it.
    assert set(choice.measured) == {"timing"} and not choice.measured["timing"]["worth"]
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: (0.03, 0.01))
    long = decide_rows(RowsRequest(**{**req.__dict__, "run_s": 3600.0}), tmp_path)
    assert long.value is True and long.measured["rows_speedup"] == 3
    # Once timed, even a short run reads the cache.
    assert decide_rows(req, tmp_path).value is True


def test_rows_whose_scores_would_crowd_the_memory_are_not_timed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: pytest.fail("timed"))
    shape = (4, 32, 32, 512, 64)  # a 1B-class model: 32 heads at rows of 512
    kept = attention_rows.scores_bytes(shape, 24)
    assert kept == 4 * 32 * 512 * 512 * 7 * 24  # fp32 softmax, its bf16 copy, the mask
    req = RowsRequest("cpu", "sdpa_docs", False, shape, torch.bfloat16, 512, 3600.0, 24, kept)
    choice = decide_rows(req, tmp_path)
    assert (
        choice.value is False and "GiB of scores" in choice.reason and "24 layers" in choice.reason
    )
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: (0.03, 0.01))
    roomy = RowsRequest(**{**req.__dict__, "available_bytes": 8 * kept})
    assert decide_rows(roomy, tmp_path).value is True


def test_a_run_of_several_processes_does_not_time(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: pytest.fail("timed"))
    req = RowsRequest("cpu", "sdpa_docs", False, (8, 4, 4, 128, 64), torch.bfloat16, 128, 3600.0)
    two = decide_rows(RowsRequest(**{**req.__dict__, "processes": 2}), tmp_path)
    assert two.value is False and "2 processes share this CPU" in two.reason


def test_the_real_timing_times_both_paths() -> None:
    speed = cpu_rows_speed(None, (2, 2, 2, 32, 8), torch.float32, 8)
    assert speed.documents_s > 0 and speed.rows_s > 0
    assert "documents of 8" in speed.describe()


def _run(tiny_model_dir, store, out, **over):
    from _train_util import train_config

    import pitstop.train

    s = pitstop.train.run(train_config(tiny_model_dir, store, out, **over))
    return s, [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = doc_attention.row_matmul_attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(doc_attention, "row_matmul_attention", counted)
    return calls


def test_a_run_that_takes_rows_trains_the_same_losses_and_keeps_the_choice_on_resume(
    tiny_model_dir, store, tmp_path, monkeypatch
) -> None:
    from _train_util import stopped_run

    calls = _counting(monkeypatch)
    monkeypatch.setattr(attention_rows, "TIMING_COST_S", 0.0)  # every run repays it
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: (0.01, 0.03))
    kw = {"max_steps": 4, "save_steps": 2}
    s, docs = _run(tiny_model_dir, store, tmp_path / "docs", **kw)
    assert s["choices"]["attention_rows"]["value"] is False and not calls

    for f in (tmp_path / "cache").glob("attention_rows-*.json"):
        f.unlink()
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: (0.03, 0.01))
    s, rows = _run(tiny_model_dir, store, tmp_path / "rows", **kw)
    choice = s["choices"]["attention_rows"]
    assert choice["value"] is True and choice["measured"]["rows_speedup"] == 3 and calls
    assert rows == pytest.approx(docs, rel=1e-5, abs=1e-5)  # the same attention

    out = tmp_path / "cut"
    record = stopped_run(tiny_model_dir, store, out, monkeypatch, **kw)
    assert record is not None and record.values["attention_rows"] is True
    for f in (tmp_path / "cache").glob("attention_rows-*.json"):
        f.unlink()  # the cache is gone, and the machine now times the documents faster
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: (0.01, 0.03))
    s, resumed = _run(tiny_model_dir, store, out, resume=True, **kw)
    assert s["choices"]["attention_rows"]["value"] is True
    assert "kept from this run" in s["choices"]["attention_rows"]["reason"]
    assert resumed == rows  # bit-identical to the run never stopped


def test_rows_that_fail_the_start_up_self_check_are_not_used(
    tiny_model_dir, store, tmp_path, monkeypatch
) -> None:
    """Rows whose attention differs from the model's eager attention (here: documents seeing
    each other) are caught before step 1 and the run keeps the checked per-document call."""
    monkeypatch.setattr(attention_rows, "TIMING_COST_S", 0.0)
    monkeypatch.setattr(attention_rows, "measure_rows_speed", lambda *a: (0.03, 0.01))

    def leaky(q, k, v, cu, **kw):
        b, _, t, _ = q.shape
        whole = torch.arange(0, b * t + 1, t, dtype=torch.int32)
        return row_matmul_attention(q, k, v, whole, **kw)

    monkeypatch.setattr(doc_attention, "row_matmul_attention", leaky)
    s, _ = _run(tiny_model_dir, store, tmp_path / "out", max_steps=2)
    choice = s["choices"]["attention_rows"]
    assert choice["value"] is False
    assert "failed the start-up self-check" in choice["reason"], choice["reason"]
    assert "DIFFER from the model's eager attention" in choice["reason"]  # caught, not raised
