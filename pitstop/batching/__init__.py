"""Batching: the epoch plan (pack / bucket / pad), micro-batches, the loader, and `auto`.

Import from the module that defines a name (`pitstop.batching.plan.build_plan`,
`pitstop.batching.loader.MicroBatchLoader`): the package re-exports nothing, so the
plan's pure-numpy modules load without the loader's torch.
"""
