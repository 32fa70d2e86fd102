"""The data side of a first run's start-up, in one process: `batching: auto`, the loader's
plan and its first micro-batch (issue 32).

    .venv/bin/python -m bench.plan_startup STORE [--attention sdpa_docs]

STORE is a prepared token store (e.g. one `python -m bench.scale --work DIR` kept). This
runs what `pitstop train` runs between opening the store and its first step on the data
side: `choose_batching` with the given attention kernel (sdpa_docs, the CPU default: the
cost model decides, nothing is timed), the loader of the chosen layout with its epoch
efficiency (the banner's), then its first micro-batch, with bench/scale's step shape. It
prints the seconds of each part and the process's peak resident memory, so a change to
planning can be measured at 10M documents in seconds instead of a whole `bench.scale`.
"""

from __future__ import annotations

import argparse
import resource
import time

from bench.scale import MSL, TPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--attention", default="sdpa_docs")
    args = ap.parse_args()
    from pitstop.batching.auto import choose_batching
    from pitstop.batching.loader import LoaderOptions, MicroBatchLoader
    from pitstop.batching.settings import BatchSettings
    from pitstop.core.config import RunConfig
    from pitstop.data.store import TokenStore

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store = TokenStore(args.store)  # checked here, outside the timings
    cfg = RunConfig(max_seq_len=MSL, tokens_per_step=TPS, tokens_per_micro_batch=2 * MSL)

    def run(batch: object) -> None:  # never called where the cost model decides
        raise SystemExit("the layouts were timed: pass an attention kernel the cost model covers")

    run.attention = args.attention  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    choice = choose_batching(store, cfg, run)
    t1 = time.perf_counter()
    loader = MicroBatchLoader(
        store, BatchSettings.from_config(cfg, strategy=choice.strategy), LoaderOptions(workers=0)
    )
    eff = loader.efficiency(0)
    t2 = time.perf_counter()
    next(iter(loader))
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"sequences {len(store.lengths):,}; chose {choice.strategy}, {eff.steps:,} steps")
    print(
        f"auto {t1 - t0:.2f} s, loader plan + efficiency {t2 - t1:.2f} s, first batch {t3 - t2:.2f} s"
    )
    print(
        f"total {t3 - t0:.2f} s; peak RSS {peak / 2**20:.2f} GB ({(peak - base) / 2**20:.2f} GB above the imports)"
    )


if __name__ == "__main__":
    main()
