"""The measured autotuner: the fastest settings that keep tokens per optimizer step the same.

`tune(cfg)` measures the user's configuration and short trials of alternatives
(micro-batch size, batching strategy, compile, attention kernel, loader workers and
prefetch; gradient checkpointing only when nothing fits without it) within a time
budget, and `write_tuned_config` writes the winner as a full RunConfig YAML. The
search (`pitstop.tune.search.search`) works against any `measure(settings) ->
TrialResult`, so it is tested with a deterministic cost model.
"""

from __future__ import annotations

from pitstop.tune.search import SearchResult, TrialResult, search
from pitstop.tune.space import Settings, Space
from pitstop.tune.tuner import TuneReport, format_report, tune, write_tuned_config

__all__ = [
    "SearchResult",
    "Settings",
    "Space",
    "TrialResult",
    "TuneReport",
    "format_report",
    "search",
    "tune",
    "write_tuned_config",
]
