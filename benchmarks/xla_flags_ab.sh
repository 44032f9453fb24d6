#!/usr/bin/env bash
# XLA:GPU flags against the TP decode step's host cost (issue 20): the same serving workload
# (SGLang's 1000 in / 2000 out at concurrency 8, async scheduling) in one fresh process per flag
# set, on the machine at hand, first at a few layers (a cheap probe: a flag XLA rejects fails
# there), then the full 48 layers for the first of the named sets whose probe completed.
#   bash benchmarks/xla_flags_ab.sh OUT_DIR TP PROBE_LAYERS "NAME=FLAGS" ... [-- FULL_NAME ...]
# e.g. bash benchmarks/xla_flags_ab.sh /tmp/ab 2 12 default= \
#          coll=--xla_gpu_enable_command_buffer=+COLLECTIVES -- coll
# AB_EXTRA: more serving_throughput flags for every run (e.g. "--profile-steps 8"; with
# --xla_enable_command_buffers_during_profiling=true in a flag set, the profile keeps the graphs).
# A set's own serving_throughput flags follow its XLA flags after "::", e.g. the step without
# conditionals, with the collectives inside the CUDA graphs:
#   "bfcc=--xla_gpu_enable_command_buffer=+COLLECTIVES::--branch-free-step"
set -u
out=$1 tp=$2 layers=$3
shift 3
declare -A flags
order=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    flags[${1%%=*}]=${1#*=}
    order+=("${1%%=*}")
    shift
done
[ $# -gt 0 ] && shift
full=("$@")
run() {  # name layers seconds
    local name=$1 n=$2 s=$3
    local set=${flags[$name]} extra=
    [[ $set == *::* ]] && extra=${set#*::} && set=${set%%::*}
    XLA_FLAGS="$set" timeout $((s + 15)) python -m benchmarks.serving_throughput \
        --model qwen3-next-80b --layers "$n" --tp "$tp" --concurrency 8 --min-seq-bucket 8 \
        --max-seconds "$s" ${AB_EXTRA:-} $extra --out "$out/ab_${name}_${n}l.json" \
        > "$out/ab_${name}_${n}l.log" 2>&1
    echo "$name ${n}l rc=$? $(grep -o '"output_tok_per_s": [0-9.]*' "$out/ab_${name}_${n}l.json" | tail -1)"
}
for name in "${order[@]}"; do run "$name" "$layers" 100; done
for name in "${full[@]}"; do
    if grep -q '"completed": 8' "$out/ab_${name}_${layers}l.json" 2>/dev/null; then
        run "$name" 48 230
        break
    else
        echo "$name: skipped at 48 layers (the probe did not complete)"
    fi
done
