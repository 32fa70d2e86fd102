#!/usr/bin/env bash
# One prepared command for a lent GPU (issue 46; docs/gpu.md "On a lent GPU"): the wheels the
# device image lacks, the GPU self-test, then the GPU headline (HF Trainer, TRL, pitstop eager
# and compiled, the bare loop), inside about 8 minutes. Results go to $OUT (the device tool's
# folder that comes back; default bench/results/lent): selftest.txt, headline-gpu.md,
# headline.json, wheels.txt, gpu.txt, headline.txt and logs.tgz (each system's log tail):
# 8 files at most, as the device tool brings back; the models stay outside it.
#
#   bash bench/gpu_lent.sh            # on the lent machine, from the repository root
#
# Each phase has its own time limit, so a slow one cannot take the next one's time: the
# self-test 150 s, the headline 390 s (a headline cut short still reports what finished).
# On an H200 (2026-11-27) the self-test took 115 s and pitstop's defaults 75 s of process;
# 700 chapters left 300 s too short for the compiled row and the peers.
# The headline trains 500 chapters (~8 steps of 64k tokens: enough for pitstop to measure
# its eager and compiled steps), one micro-batch size per swept system, no held-out loss.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/lent}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK="${TMPDIR:-/tmp}/pitstop-lent"
mkdir -p "$WORK"

python -m bench.gpu_wheels install .gpu-wheels 2>&1 | tee "$OUT/wheels.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"

timeout 150 python -m bench.gpu_selftest 2>&1 | tee "$OUT/selftest.txt"

timeout 390 python -m bench.headline --gpu --sweep 8 --no-eval --train-chapters 500 \
    --systems pitstop,pitstop_compiled,ceiling,hf_dynamic,trl \
    --workdir "$WORK/headline" --out "$OUT/headline-gpu.md" 2>&1 | tee "$OUT/headline.txt"
if [ ! -f "$OUT/headline-gpu.md" ] && [ -f "$WORK/headline/results.json" ]; then
    # Cut short: the systems that finished, rendered from their saved results.
    python -m bench.headline --gpu --report-only --workdir "$WORK/headline" \
        --out "$OUT/headline-gpu.md" 2>&1 | tail -20 | tee -a "$OUT/headline.txt"
fi
cp "$WORK/headline/results.json" "$OUT/headline.json" 2>/dev/null
# Each system's log tail, in one archive: the device tool brings back at most 8 files.
mkdir -p "$WORK/logs"
for d in "$WORK"/headline/*/; do
    name="$(basename "$d")"
    [ -f "$d/log.txt" ] && tail -c 20000 "$d/log.txt" > "$WORK/logs/log-$name.txt"
done
tar -czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
echo "[gpu_lent] done: $(ls "$OUT" | tr '\n' ' ')"
