"""The catalogue: named things whose facts several packages need, each kept in one place.

`gpus`: every GPU card pitstop knows (peaks, memory, example price, compute capability,
aliases). It sits on the ground floor (imports nothing of pitstop's but `errors`), so MFU
(`measure`), the estimate (`report`) and the doctor's targets (`advise`) read the same entry.
"""
