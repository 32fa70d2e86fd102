"""The catalogue: named things whose facts several packages need, each kept in one place.

`gpus`: every GPU card pitstop knows (peaks, memory, example price, compute capability,
aliases). It sits on the ground floor, under `core` (imports nothing of pitstop's but
`pitstop.errors`), so MFU (`measure`), the estimate (`report`) and the doctor's targets
(`advise`) read the same entry.

`model_config`: a model's config.json, read by one function (`ModelConfig.read`) into one
typed record, so the cost model, the token store's vocabulary check, the position limit,
the version traps, the loader and the doctor read the same sizes under the same names.
"""
