"""Fixtures of the reliability suite: one token store and uninterrupted reference runs.

Every test here carries the `reliability` marker: `make test-reliability` runs the suite,
`make test` leaves it out, and CI (`.ci/run`) runs both (issue 45: a real CLI process per run,
half of the whole suite's time). The `soak` marker is registered here (until pyproject.toml
lists it) and soak tests are deselected unless `-m` mentions `soak`, so neither target runs
the long kill loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _rel import BASE_STEPS, reference_run


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: long crash/kill loops, run by `make soak` only")


HERE = Path(__file__).resolve().parent


# First, so that `-m "not reliability"` (pytest's own hook) sees the marker.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.reliability)
    if "soak" in (config.getoption("markexpr") or ""):
        return
    keep = [i for i in items if i.get_closest_marker("soak") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.fixture(scope="session")
def rel_store(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> Path:
    from _train_util import make_store

    return make_store(tmp_path_factory.mktemp("rel_store") / "s", tiny_tokenizer)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_model_dir, rel_store) -> Path:
    """An uninterrupted CLI run of BASE_STEPS steps: what every interrupted run must equal."""
    return reference_run(
        tmp_path_factory.mktemp("ref") / "out", tiny_model_dir, rel_store, BASE_STEPS
    )
