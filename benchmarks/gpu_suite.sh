#!/usr/bin/env bash
# The issue 19 / 20 GPU measurements in one device call, results packed into one file.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR SECTION [SECTION ...]
#
# Sections run one after another, each alone on the machine (a one-card section on card 0,
# a multi-card one (tp48, tp48c64, cbuftp) on every card): a section beside another shares the host's
# CPUs, and the engine's step is host-sensitive (2026-11-28: a 64-row decode step measured
# 8.7 ms beside a compile on the other card, 5.9 under cProfile alone). SUITE_PARALLEL=1
# runs the one-card sections as many at once as there are cards (CUDA_VISIBLE_DEVICES=0,
# 1, ...), in the order given, a multi-card section waiting for those before it. Each section has its own time
# limit (SUITE_LIMIT_S, default 280 s); its JSON and log go to a scratch folder, packed into
# OUT_DIR/suite.tgz after every section (a device call brings back a few files only: at most
# 8). A one-line summary per section is printed as it ends.
#
# Sections:
#   sampler   benchmarks.sampler_ops: the threshold sort against its sort-free candidates,
#             lax.top_k against blocked_top_k
#   route     benchmarks.moe_kernels --route-only: the sorted route plan against the pairwise
#   conv1d    benchmarks.conv1d_kernels --sweep
#   conv1dq   benchmarks.conv1d_kernels: the default tiles against XLA's reference, no sweep
#   qkvz      benchmarks.conv1d_kernels --qkvz-only: the GDN layer's conv packed by XLA around
#             the kernel against the kernel reading the projection's output in place
#   split     benchmarks.conv1d_kernels --split-only: the KDA layer's conv (Kimi-Linear-48B's
#             q, k, v apart) concatenated by XLA around the kernel against read and written apart
#   ceil      benchmarks.conv1d_kernels --ceiling-only: silu over the conv's bytes through
#             Pallas' Triton and Mosaic GPU lowerings and XLA, at the three shapes
#   gdn       benchmarks.gdn_kernels --sweep
#   gdnp      benchmarks.gdn_kernels: the default prefill at its four shapes and FLA, no sweep
#   kda       benchmarks.kda_kernels --sweep (FLA's chunk_kda beside it: its wheels in .whl);
#             with its sweep it ran past 400 s on 2026-11-29: give it a call of its own
#   mgpuscan  benchmarks.gdn_kernels --mgpu-scan: the serial launch in Mosaic GPU (TMA, wgmma,
#             the state the accumulator) against the Triton one, each on its own scratch,
#             checked against it, then each timed, at 1x4096, 8x4096, 1x16384, 1x32768
#   mgpudiag  mgpuscan at 1x4096 and 8x4096 only: the serial launch against its chain alone
#             (no o) and its copies alone (no products), per chunk of a row (what bounds it),
#             and with later chunks' tiles prefetched into L2 (prefetch 1, 2); ~200 s
#   gdnreal   FLA, then the default GDN prefill at four shapes (a bf16 model's: the intra
#             launch by blocks with bf16 products, gdn.gpu.default_intra_form) and at 8x4096
#             the whole chunk's intra launch, the default until 2026-11-29 (~70 s an entry:
#             SUITE_LIMIT_S >= 450); gdnrealtr the default at 1x4096, 8x4096, 1x16384 traced
#             (--trace: the kernels' device time); gdnckpt the default at 8x4096 with 0, 1, 4
#             checkpoints a sequence; gdncheck the default prefill (a bf16 model's: the
#             blocked intra launch's bf16 products) against the reference at f32, TF32
#             products, a bf16 pool, beside the whole chunk's launch; kdareal KDA's default prefill and FLA at three shapes;
#             kdaintra KDA's intra launch alone at 8x4096 at 2-8 warps, its diagonal blocks
#             a column at a time, in a launch of their own (DIAG_FORM launch), or by dots
#   gdnintra  benchmarks.gdn_kernels --intra-sweep: the intra launch alone at 8x4096, its six
#             forms (gdn.gpu.INTRA_FORMS: whole chunk, 16-row blocks with f32 or bf16 products,
#             split in two launches, the first by blocks or not, with bf16 products or not) at
#             2-16 warps, each an entry, beside its byte floor (~17 entries:
#             SUITE_LIMIT_S >= 330)
#   kdaintra2 kdaintra's columns at 2 warps, launch (the default) and launch_rows at 8; kdareal2 kdareal
#             without its 8x1024 (HYJAX_KDA_DIAG / HYJAX_KDA_INTRA_WARPS pick the form)
#   gdnintra3 the default intra launch alone at 8x4096 and its floor (gdnintra3@DIR: another
#             tree's, for an A/B in one call)
#   gdnintra2 gdnintra's floor, the default (blocked_bf16 at 4 warps) and the two forms with
#             bf16 products first timed in session 32 (whole_bf16, split_blocked_bf16): 7 entries
#   kdamid    KDA's diagonal blocks by two products through each block's middle row (kda.gpu
#             DIAG_FORMS "mid", the column loop where a block's decay is past MID_SPAN)
#             checked, then against the default and FLA at three shapes; kdamidintra the
#             intra launches alone at 8x4096, the default's form against it
#   gdnpairdyn the dynamic pair (gdn_prefill(serial_pair="dynamic"): both serial launches,
#             the plan picking one on the device) checked (ragged rows: unpaired; eight rows
#             of 512: paired), then against the default and the pair at 8 and 4 rows of 4096,
#             and at 2 and 1 rows of 4096 with 63 one-token rows after them (a mixed step)
#   gaps      benchmarks.prefill_gaps: the default GDN prefill's timed program traced at 1x4096
#             and 8x4096, its scalar donated or not: the device's gaps between kernels, the
#             host's thunks and graph launch, one program alone against five back to back
#   mgputrace mgpudiag's chain and copies alone, each timed program run once more under the
#             profiler (--trace): the kernels' own times beside the timed figure, and the
#             device's idle time between them; gdntrace the default prefill's the same at
#             1x4096, 8x4096, 1x16384
#   mgpuprobe the Mosaic GPU prefill's ragged cases, a process each (benchmarks.mgpu_probe)
#   mgpu      gdn_kernels' checks of the default prefill (the Mosaic GPU serial launch on its
#             token-aligned plan) against the reference, its prefill at four shapes beside the
#             Triton serial launch's (variant triton), with 0, 1, 4 checkpoints, FLA
#   mgpuserve the bench model's serving run (4 layers, c8) with HYJAX_PREFILL_SERIAL=mgpu: the
#             engine on the Mosaic GPU prefill
#   mgpukda   the same for KDA: kda_kernels' checks and prefill, default (Mosaic GPU) and
#             triton, with 0, 1, 4 checkpoints, and FLA
#   multidec  benchmarks.multi_decode: the k-token (verify) decode, Triton's and Mosaic GPU's
#             (common/multi_decode_mgpu.py) checked, then timed at 64 / 256 rows, k = 1, 2, 4
#   gdnfold   GDN's prefill with Aqk and the rows' scalings made in the serial launch
#             (gdn_prefill(fold=True), the default since session 34: nofold entries for the
#             unfolded): its GPU checks, then timed beside the default and FLA
#             at 1x4096, 8x4096, 1x16384 (~9 entries: SUITE_LIMIT_S >= 450); gdnfoldintra the
#             fold's intra launch alone at 8x4096 (4 and 8 warps) beside the default's, and
#             both floors; gdnfoldr128 / gdnfoldr168 the fold's at a register cap of 128 / 168
#             (offline: 280 / 120 B of spills at 8 warps, more programs an SM)
#   gdnfoldaqk  each chunk's Aqk made with the fold's Mosaic GPU scratch (gdn_prefill(
#             fold_aqk=True), not yet timed): its GPU checks, then timed beside the default
#             and FLA at 1x4096, 8x4096, 1x16384; foldaqkregions both launches by region
#   gdnpair    the fold's serial launch by pairs (gdn_prefill(serial_pair=True): a program a
#             (head, row), a warpgroup a Dv block) checked, and timed against one warpgroup a
#             program at 2, 4 and 8 rows of 4096, with FLA; the default at 1x4096, 1x16384
#   gdnfoldpers the fold's Mosaic GPU scratch as a persistent launch (gdn_prefill(
#             fold_persist=528 / 396), not yet timed), with Aqk and without, at 8x4096 and 1x4096
#   gpucheckbf16 benchmarks.gpu_check's bf16 Qwen3-Next with GDN head dims of 64 against
#             transformers (the bf16 default path: the fold, gdn.intra_mgpu's scratch)
#   foldregions benchmarks.mgpu_regions: the serial launch's cycles a chunk by region,
#             unfolded and fold, at 1x4096 and 8x4096, and the fold's Mosaic GPU scratch
#             launch's cycles a program (gdn.intra_mgpu, fold_intra_mgpu)
#   gdnfoldbeta  the fold's intra launch alone at 8x4096, 4 warps, with fold_beta_rows (Tm
#             diag(beta) as diag(beta) M^-1, the default since 2026-11-30) and without;
#             gdnfoldbetap the GPU check without it and the prefill at 8x4096 and 1x4096
#   multidecfirst  Triton's k-token decode as it is and with every input read before its
#             first store (multi_decode_gpu.INPUTS_FIRST), both families, k = 1, 2, 3
#             (in chains of 50 a Mosaic GPU entry takes ~30 s: the whole section runs past one
#             call, the smaller ones below do not);
#             multidec4 at k = 4 alone in chains of 50; multidec3 GDN at k = 3 (where the two
#             kernels cross); multideck KDA at k = 4; multidecbuf Mosaic GPU's at k = 4 with 3
#             and 4 tile buffers a program (GDN, 64 rows: at 256 the row plan leaves 4 no room,
#             237 KB of shared memory); each ~150-250 s
#   verifyk3  benchmarks.verify_step at 64 rows, K = 3 (4 tokens a row), 8 layers of the 80B:
#             the engine's verify step on the default k-token decode; verifyk3m on Mosaic GPU's
#   kdackpt   KDA's default prefill at 8x4096 with 0, 1 and 4 checkpoints a sequence alone
#   decmgpu   benchmarks.decode_mgpu: the Mosaic GPU decode (common/decode_mgpu.py) checked, then
#             timed beside the Triton decode and a copy, GDN and KDA at 64 and 256 rows, then
#             both on a bf16 pool (--bf16);
#             decmgpusw its sweep (programs, buffers, item rows, store lag; GDN); kimidec the
#             kimi section with HYJAX_DECODE_KERNEL=mgpu (the engine's KDA decode on it: A/B
#             against kimi)
#   ncugdn    ncu's counters (occupancy, launch statistics, warp states, memory) of the GDN
#             prefill's intra and serial launches at SUITE_NCU_BATCH (default 8) x 4096 tokens
#             (benchmarks.profile_delta_rule), in the section's log; ncukda the same for KDA
#   ncugdn1src the default (Mosaic GPU) serial launch alone at 1 x 4096, with ncu's source
#             counters and instruction statistics: the stalls of its chain by instruction (its
#             kernel replays ran past 72 s on 2026-11-29: give it ~150 s)
#   ncugdndec the same of the GDN decode kernel at SUITE_NCU_ROWS (default 256) rows;
#             ncukdadec of KDA's; ncugdnmdec / ncukdamdec of the Mosaic GPU decode's
#   decode    benchmarks.decode_variants
#   step      benchmarks.step_profile --layers 8 --decode-rows 64,256 --host-profile
#   stepdt    the same with --dispatch-thread, no host profile (the launch beside the host's
#             Python: the untraced step's host-bound share at 256 rows)
#   prefix    benchmarks.prefix_repetition --scheduling-policy fcfs lpm
#   tp48      benchmarks.serving_throughput: 80B, 48 layers, TP 2, c8 (SGLang's workload), an
#             8-step profile (its kernels summed by kind); give it SUITE_LIMIT_S >= 200: its
#             compile took 80-115 s on the hosts of 2026-11-28, its measured run ~16 s
#   tp48c64   the same at concurrency 64 (--min-seq-bucket 64)
#   kimi      benchmarks.serving_throughput: Kimi-Linear-48B, all 27 layers, one card, c8
#   kimidt    the same with --dispatch-thread; kimit with the Triton decode (HYJAX_DECODE_KERNEL)
#   benchdec  benchmarks.serving_throughput: the bench model (80B layer shapes), 8 layers, c64,
#             200 tokens in, 256 out: 64 rows decoding; benchdect the same on the Triton decode
#   q24       benchmarks.serving_throughput: 80B, 24 layers, one card, c8, an 8-step profile
#   cbuf      benchmarks.cmdbuf_updates: XLA's CUDA-graph updates a step (which allocations
#             move between launches, kernels re-recorded, their host time), sync and async
#   cbuftp    the same at TP 2 on two cards, async (the graphs between the all-reduces; with
#             --xla_gpu_enable_command_buffer=+COLLECTIVES in a flag set, the all-reduces inside)
#   cbufskip  the same, async, with --xla_gpu_command_buffer_update_mode=SKIP_TEMP
#   bufdump   XLA's buffer assignment of the cbuf workload's steps (which temporaries share the
#             result buffers), under bufdump/
#   launch    benchmarks.launch_overhead: a launch's host time by argument buffers, jit / AOT
#   hlo       XLA's optimized HLO of the step (the bench model's shapes, 4 layers: one group
#             of 3 GDN + 1 attention) at c8, text, under hlo/: which fusions a layer has
#   http      benchmarks.http_serving: hyjax serve under aiperf against the engine, the bench
#             model (80B layer shapes, 8 layers), SGLang's workload at c8 (aiperf on
#             PYTHONPATH), the server and aiperf each on half of the CPUs, 15 s of py-spy
#             of both engines (py-spy in .whl)
#   httpsplit the same with --split-cpus: the server on half of the physical cores, aiperf on
#             the other half (SMT siblings with their core: with the CPU numbers halved, aiperf
#             may run on the siblings of the engine's cores)
#
# SUITE_XLA_FLAGS: XLA flags for every section (XLA_FLAGS). NAME%SET runs section NAME with
# the XLA flags in $SUITE_FLAGS_SET besides them, and $SUITE_ARGS_SET appended to its command:
# an A/B of a flag in one call, e.g. SUITE_FLAGS_sep=--xla_gpu_temp_buffer_use_separate_color=true
# ... q24 q24%sep q24 (a benchmark's own arguments: after cmdbuf's "--", serving_throughput's).
#
# NAME@DIR runs section NAME from the tree in DIR (a worktree of another commit, e.g.
# q24@.ab/off q24@.ab/on q24@.ab/off2: an A/B in one call, the baseline before and after).
#
# SUITE_DEADLINE_S (default 560) bounds the whole suite: a section gets at most what is left
# of it, so the packed results come back before the device call's own limit.
#
# e.g. on nvidia-h200-x2, with the wheels on PYTHONPATH (BENCHMARKS.md):
#   bash benchmarks/gpu_suite.sh $OUT sampler route conv1d step tp48
set -u
out=$1
mkdir -p "$out"  # a sub-folder of $OUT: tar cannot create it, and every result would be lost
shift
limit=${SUITE_LIMIT_S:-280}
budget=$limit  # the running section's limit (command_of's --max-seconds)
deadline=${SUITE_DEADLINE_S:-560}
scratch=$(mktemp -d)
cards=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$cards" -ge 1 ] || cards=1
start=$(date +%s)

command_of() {  # section -> its command line (results to $scratch/NAME.json)
    local j=$scratch/$1.json
    local tp="--model qwen3-next-80b --layers 48 --tp 2 --min-seq-bucket"
    local n pin
    local ncu="/usr/local/cuda/bin/ncu --clock-control none"
    local sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
    # cbuf: the bench model (80B layer shapes, 8 layers), c8, short prompts, one card
    local cb="--model bench --layers 8 --concurrency 8 --min-seq-bucket 8 --input-len 200 --output-len 512"
    n=$(nproc)  # http: the server on the first half of the CPUs, aiperf on the second
    pin="--server-cpus 0-$((n / 2 - 1)) --client-cpus $((n / 2))-$((n - 1))"
    case $1 in
        sampler) echo "python -m benchmarks.sampler_ops --out $j" ;;
        route) echo "python -m benchmarks.moe_kernels --route-only --no-torch --out $j" ;;
        conv1d) echo "python -m benchmarks.conv1d_kernels --sweep --out $j" ;;
        conv1dq) echo "python -m benchmarks.conv1d_kernels --out $j" ;;
        ceil) echo "python -m benchmarks.conv1d_kernels --ceiling-only --out $j" ;;
        qkvz) echo "python -m benchmarks.conv1d_kernels --qkvz-only --out $j" ;;
        split) echo "python -m benchmarks.conv1d_kernels --split-only --out $j" ;;
        gdn) echo "python -m benchmarks.gdn_kernels --sweep --out $j" ;;
        gdnp) echo "python -m benchmarks.gdn_kernels --precisions tf32 --skip-floors --only check_prefill,prefill_B1_T4096_default,prefill_B1_T4096_mgpu,prefill_B1_T16384_default,prefill_B1_T16384_mgpu,prefill_B8_T4096_default,prefill_B8_T4096_mgpu,prefill_B1_T32768_default,prefill_B1_T32768_mgpu,prefill_B8_T4096_ckpt,fla --out $j" ;;
        kda) echo "python -m benchmarks.kda_kernels --sweep --out $j" ;;
        mgpuscan) echo "python -m benchmarks.gdn_kernels --mgpu-scan --out $j" ;;
        gdnreal) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --only fla,prefill_B1_T4096_default,prefill_B8_T4096_default,prefill_B1_T16384_default,prefill_B1_T32768_default,prefill_B8_T4096_whole --out $j" ;;
        gdnrealtr) echo "python -m benchmarks.gdn_kernels --trace --skip-floors --only prefill_B1_T4096_default,prefill_B8_T4096_default,prefill_B1_T16384_default --out $j" ;;
        gdncheck) echo "python -m benchmarks.gdn_kernels --skip-floors --only check_prefill_f32,check_prefill_tf32,check_prefill_bf16state,check_prefill_mgpu,check_prefill_whole --out $j" ;;
        gdnckpt) echo "python -m benchmarks.gdn_kernels --skip-floors --only prefill_B8_T4096_ckpt --out $j" ;;
        gdnintra) echo "python -m benchmarks.gdn_kernels --intra-sweep --out $j" ;;
        gdnintra2) echo "python -m benchmarks.gdn_kernels --intra-sweep --only intra_B8_T4096_floor,intra_B8_T4096_blocked_bf16_w4,intra_B8_T4096_whole_bf16,intra_B8_T4096_split_blocked_bf16 --out $j" ;;
        kdareal) echo "python -m benchmarks.kda_kernels --no-fla-decode --only check_prefill_default,fla,prefill_B1_T4096_default,prefill_B1_T16384_default,prefill_B8_T4096_default --out $j" ;;
        kdaintra) echo "python -m benchmarks.kda_kernels --intra-sweep --out $j" ;;
        kdaintra2) echo "python -m benchmarks.kda_kernels --intra-sweep --only intra_B8_T4096_columns_w2,intra_B8_T4096_launch_w8,intra_B8_T4096_launch_rows_w8 --out $j" ;;
        kdareal2) echo "python -m benchmarks.kda_kernels --no-fla-decode --only check_prefill_default,fla,prefill_B1_T4096_default,prefill_B8_T4096_default,prefill_B1_T16384_default --out $j" ;;
        gdnintra3) echo "python -m benchmarks.gdn_kernels --intra-sweep --only intra_B8_T4096_floor,intra_B8_T4096_blocked_bf16_w4 --out $j" ;;
        kdamid) echo "python -m benchmarks.kda_kernels --no-fla-decode --only check_prefill_default,check_prefill_mid,fla,prefill_B8_T4096_default,prefill_B8_T4096_mid,prefill_B1_T4096_default,prefill_B1_T4096_mid,prefill_B1_T16384_default,prefill_B1_T16384_mid --out $j" ;;
        kdamidintra) echo "python -m benchmarks.kda_kernels --intra-sweep --only intra_B8_T4096_launch_rows_w8_s2,intra_B8_T4096_mid_w8_s2 --out $j" ;;
        gdnpairdyn) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --shapes 8x4096,4x4096,2x4096,1x4096 --only check_prefill_pairdyn,check_prefill_pair,fla,prefill_B8_T4096_default,prefill_B8_T4096_pair,prefill_B8_T4096_pairdyn,prefill_B4_T4096_default,prefill_B4_T4096_pairdyn,prefill_B2_T4096_mixed63,prefill_B2_T4096_pairdynmixed63,prefill_B1_T4096_mixed63,prefill_B1_T4096_pairdynmixed63,again_fla --out $j" ;;
        gaps) echo "python -m benchmarks.prefill_gaps --shapes 1x4096,8x4096 --out $j" ;;
        mgputrace) echo "python -m benchmarks.gdn_kernels --mgpu-scan --trace --mgpu-variants chain_only,loads_only --only mgpu_scan_B1_T4096,mgpu_scan_B8_T4096 --out $j" ;;
        gdntrace) echo "python -m benchmarks.gdn_kernels --trace --skip-floors --only prefill_B1_T4096_default,prefill_B8_T4096_default,prefill_B1_T16384_default --out $j" ;;
        mgpudiag) echo "python -m benchmarks.gdn_kernels --mgpu-scan --only mgpu_scan_B1_T4096,mgpu_scan_B8_T4096 --out $j" ;;
        mgpukda) echo "python -m benchmarks.kda_kernels --only check_prefill_default,check_prefill_triton,fla,prefill_B1_T4096_default,prefill_B1_T4096_triton,prefill_B1_T16384_default,prefill_B1_T16384_triton,prefill_B8_T4096_default,prefill_B8_T4096_triton,prefill_B8_T4096_ckpt --out $j" ;;
        multidec) echo "python -m benchmarks.multi_decode --no-baselines --out $j" ;;
        gdnfold) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --only check_prefill_fold,check_prefill_mgpu,fla,prefill_B1_T4096_default,prefill_B1_T4096_fold,prefill_B8_T4096_default,prefill_B8_T4096_fold,prefill_B1_T16384_default,prefill_B1_T16384_fold --out $j" ;;
        gdnfoldbeta) echo "python -m benchmarks.gdn_kernels --intra-sweep --only intra_B8_T4096_foldcols_w4,intra_B8_T4096_foldbeta_w4 --out $j" ;;
        gdnfoldbetap) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --only check_prefill_foldcols,prefill_B8_T4096_default,prefill_B8_T4096_foldcols,prefill_B1_T4096_default,prefill_B1_T4096_foldcols --out $j" ;;
        gdnfoldaqk) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --only check_prefill_foldaqk,fla,prefill_B1_T4096_default,prefill_B1_T4096_foldaqk,prefill_B8_T4096_default,prefill_B8_T4096_foldaqk,prefill_B1_T16384_default,prefill_B1_T16384_foldaqk --out $j" ;;
        gdnpair) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --shapes 8x4096,4x4096,2x4096,1x4096,1x16384 --only check_prefill_pair,check_prefill_pair_aligned,fla,prefill_B8_T4096_nopair,prefill_B8_T4096_pair,prefill_B8_T4096_pairpers,prefill_B4_T4096_nopair,prefill_B4_T4096_pair,prefill_B2_T4096_nopair,prefill_B2_T4096_pair,prefill_B1_T4096_default,prefill_B1_T16384_default --out $j" ;;
        gdnfoldpers) echo "python -m benchmarks.gdn_kernels --skip-floors --no-fla-decode --only prefill_B8_T4096_default,prefill_B8_T4096_foldpers,prefill_B8_T4096_foldpers3,prefill_B8_T4096_foldpersaqk,prefill_B8_T4096_foldaqk,prefill_B1_T4096_default,prefill_B1_T4096_foldpers --out $j" ;;
        foldaqkregions) echo "python -m benchmarks.mgpu_regions --shapes 1x4096,8x4096 --variants fold_intra_mgpu,fold_aqk --time-shapes none --out $j" ;;
        gpucheckbf16) echo "python -m benchmarks.gpu_check --only qwen3_next_bf16_gdn_dims_64 --out $j" ;;
        foldregions) echo "python -m benchmarks.mgpu_regions --shapes 1x4096,8x4096 --variants default,fold,fold_intra_mgpu --time-shapes none --out $j" ;;
        gdnfoldintra) echo "python -m benchmarks.gdn_kernels --intra-sweep --only intra_B8_T4096_floor,intra_B8_T4096_fold_floor,intra_B8_T4096_blocked_bf16_w4,intra_B8_T4096_fold --out $j" ;;
        gdnfoldr128 | gdnfoldr168) echo "python -m benchmarks.gdn_kernels --intra-sweep --maxnreg ${1#gdnfoldr} --only intra_B8_T4096_fold --out $j" ;;
        multidecfirst) echo "python -m benchmarks.multi_decode --no-baselines --kernels triton,triton_first --ks 1,2,3 --chain 50 --out $j" ;;
        multidec4) echo "python -m benchmarks.multi_decode --no-baselines --ks 4 --chain 50 --out $j" ;;
        multidec3) echo "python -m benchmarks.multi_decode --no-baselines --families gdn --ks 3 --chain 50 --out $j" ;;
        multideck) echo "python -m benchmarks.multi_decode --no-baselines --families kda --ks 4 --chain 50 --out $j" ;;
        multidecbuf) echo "python -m benchmarks.multi_decode --no-baselines --families gdn --ks 4 --batches 64 --kernels mgpu --mgpu-buffers 3,4 --chain 50 --out $j" ;;
        verifyk3) echo "python -m benchmarks.verify_step --layers 8 --rows 64 --ks 3 --no-mixed --iters 10 --out $j" ;;
        verifyk3m) echo "env HYJAX_MULTI_DECODE_KERNEL=mgpu python -m benchmarks.verify_step --layers 8 --rows 64 --ks 3 --no-mixed --iters 10 --out $j" ;;
        kdackpt) echo "python -m benchmarks.kda_kernels --only prefill_B8_T4096_ckpt --out $j" ;;
        decmgpu) echo "python -m benchmarks.decode_mgpu --bf16 --out $j" ;;
        decmgpusw) echo "python -m benchmarks.decode_mgpu --sweep --out $j" ;;
        mgpuprobe) echo "python -m benchmarks.mgpu_probe --timeout 60 --out $j" ;;
        mgpuserve) echo "env HYJAX_PREFILL_SERIAL=mgpu python -m benchmarks.serving_throughput --model bench --layers 4 --concurrency 8 --input-len 700 --output-len 32 --max-seconds $((budget - 20)) --out $j" ;;
        mgpu) echo "python -m benchmarks.gdn_kernels --precisions tf32 --skip-floors --only check_prefill_tf32,check_prefill_mgpu_aligned,prefill_B1_T4096_default,prefill_B1_T4096_triton,prefill_B1_T16384_default,prefill_B1_T16384_triton,prefill_B8_T4096_default,prefill_B8_T4096_triton,prefill_B1_T32768_default,prefill_B1_T32768_triton,prefill_B8_T4096_ckpt,fla --out $j" ;;
        ncugdn | ncukda)  # ncu's counters of the default prefill's launches, in the log: the
            # warm-up call's skipped (SUITE_NCU_LAUNCHES, GDN 2, KDA 3 with its diagonal
            # launch), then SUITE_NCU_COUNT of the next (default all but the Mosaic GPU serial
            # launch, whose replay under ncu ran past 150 s on 2026-11-29)
            n=2; [ "$1" = ncukda ] && n=3
            n=${SUITE_NCU_LAUNCHES:-$n}
            echo "$ncu --kernel-name regex:prefill_ --launch-skip $n --launch-count ${SUITE_NCU_COUNT:-$((n - 1))} $sections ${SUITE_NCU_SECTIONS:-} python -m benchmarks.profile_delta_rule --family ${1#ncu} --op prefill --batch ${SUITE_NCU_BATCH:-8} --seq-len 4096" ;;
        ncugdn1src)  # the serial launch at one row, 4096 tokens: where its chain stalls
            echo "$ncu --kernel-name regex:serial_mgpu --launch-skip 1 --launch-count 1 $sections --section SourceCounters --section InstructionStats python -m benchmarks.profile_delta_rule --family gdn --op prefill --batch 1 --seq-len 4096" ;;
        ncugdndec | ncukdadec)  # the same of the decode kernel (rows in place, f32 state)
            n=${1#ncu}
            echo "$ncu --kernel-name regex:_decode_gpu --launch-skip 1 --launch-count 1 $sections python -m benchmarks.profile_delta_rule --family ${n%dec} --op decode --batch ${SUITE_NCU_ROWS:-256}" ;;
        ncugdnmdec | ncukdamdec)  # the same of the Mosaic GPU decode
            n=${1#ncu}
            echo "$ncu --kernel-name regex:_decode_mgpu --launch-skip 1 --launch-count 1 $sections python -m benchmarks.profile_delta_rule --family ${n%mdec} --op decode --mgpu-decode --batch ${SUITE_NCU_ROWS:-256}" ;;
        decode) echo "python -m benchmarks.decode_variants --out $j" ;;
        step) echo "python -m benchmarks.step_profile --layers 8 --decode-rows 64,256 --top 60 --host-profile --out $j" ;;
        stepdt) echo "python -m benchmarks.step_profile --layers 8 --decode-rows 64,256 --top 20 --dispatch-thread --out $j" ;;
        prefix) echo "python -m benchmarks.prefix_repetition --scheduling-policy fcfs lpm --out $j" ;;
        tp48) echo "python -m benchmarks.serving_throughput $tp 8 --concurrency 8 --profile-steps 8 --max-seconds $((budget - 20)) --out $j" ;;
        tp48c64) echo "python -m benchmarks.serving_throughput $tp 64 --concurrency 64 --max-seconds $((budget - 20)) --out $j" ;;
        kimi) echo "python -m benchmarks.serving_throughput --model kimi-linear-48b --concurrency 8 --min-seq-bucket 8 --max-seconds $((budget - 20)) --out $j" ;;
        kimidec) echo "env HYJAX_DECODE_KERNEL=mgpu python -m benchmarks.serving_throughput --model kimi-linear-48b --concurrency 8 --min-seq-bucket 8 --max-seconds $((budget - 20)) --out $j" ;;
        kimit) echo "env HYJAX_DECODE_KERNEL=triton python -m benchmarks.serving_throughput --model kimi-linear-48b --concurrency 8 --min-seq-bucket 8 --max-seconds $((budget - 20)) --out $j" ;;
        benchdec | benchdect)  # the 80B's layer shapes, 8 layers, 64 rows decoding
            n=; [ "$1" = benchdec ] || n="env HYJAX_DECODE_KERNEL=triton"
            echo "$n python -m benchmarks.serving_throughput --model bench --layers 8 --concurrency 64 --min-seq-bucket 64 --input-len 200 --output-len 256 --max-seconds $((budget - 20)) --out $j" ;;
        kimidt) echo "python -m benchmarks.serving_throughput --model kimi-linear-48b --concurrency 8 --min-seq-bucket 8 --dispatch-thread --max-seconds $((budget - 20)) --out $j" ;;
        hlo) echo "python -m benchmarks.serving_throughput --model bench --layers 4 --concurrency 8 --input-len 200 --output-len 64 --max-seconds $((budget - 20)) --out $j" ;;
        bufdump) echo "python -m benchmarks.serving_throughput $cb --output-len 48 --scheduling async --out $j" ;;
        launch) echo "python -m benchmarks.launch_overhead --out $j" ;;
        cbuf) echo "python -m benchmarks.cmdbuf_updates --max-seconds $((budget - 10)) --log $scratch/cbuf_child.log --out $j -- $cb --scheduling sync async" ;;
        cbuftp) echo "python -m benchmarks.cmdbuf_updates --max-seconds $((budget - 10)) --log $scratch/cbuftp_child.log --out $j -- $cb --tp 2 --scheduling async" ;;
        cbufskip) echo "python -m benchmarks.cmdbuf_updates --max-seconds $((budget - 10)) --log $scratch/cbufskip_child.log --out $j -- $cb --cache-gib 60 --scheduling async" ;;
        q24) echo "python -m benchmarks.serving_throughput --model qwen3-next-80b --layers 24 --concurrency 8 --min-seq-bucket 8 --profile-steps 8 --max-seconds $((budget - 20)) --out $j" ;;
        http | httpsplit)
            [ "$1" = http ] || pin=--split-cpus
            echo "python -m benchmarks.http_serving --model $scratch/bench8 --load-format dummy --dtype bfloat16 --block-size 64 --max-num-batched-tokens 2048 --input-len 1000 --output-len 2000 --concurrency 8 --num-prompts 16 --max-seconds $((budget - 20)) --artifact-dir $scratch/${1}_artifacts $pin --py-spy 15 --out $j" ;;
        *) return 1 ;;
    esac
}

pack() { tar czf "$out/suite.tgz" -C "$scratch" . ; }

run() {  # section[%set][@tree] visible-devices
    local spec=${1%%@*} tree=. devices=$2 cmd t0 tag=$1 fset=
    [ "$1" = "$spec" ] || tree=${1#*@}
    local name=${spec%%%*} fargs=
    [ "$spec" = "$name" ] || { fset=SUITE_FLAGS_${spec#*%}; fargs=SUITE_ARGS_${spec#*%}; }
    tag=${tag//[\/.%]/_}
    local k=2 base=$tag  # a section named twice: its second run's files get _2, then _3 ...
    while [ -e "$scratch/$tag.log" ]; do tag=${base}_$k; k=$((k + 1)); done
    t0=$(date +%s)
    local left=$(( deadline - (t0 - start) ))
    [ "$left" -lt "$limit" ] || left=$limit
    if [ "$left" -lt 30 ]; then echo "$name: skipped, the suite's deadline is near"; return; fi
    budget=$left
    cmd=$(command_of "$name") || { echo "$name: unknown section"; return; }
    cmd=${cmd//$scratch\/$name.json/$scratch\/$tag.json}
    cmd=${cmd//$scratch\/${name}_child.log/$scratch\/${tag}_child.log}
    cmd=${cmd//$scratch\/${name}_artifacts/$scratch\/${tag}_artifacts}
    [ -z "$fargs" ] || cmd="$cmd ${!fargs:-}"
    [ "${name#http}" = "$name" ] || python -m benchmarks.full_size --write-config "$scratch/bench8" --model bench > /dev/null
    # XLA flags (several, so not through $cmd's word splitting): SUITE_XLA_FLAGS for every
    # section, and hlo's and bufdump's dumps, cbufskip's update mode
    local xf=${SUITE_XLA_FLAGS:-}
    [ -z "$fset" ] || xf="${!fset:-} $xf"
    [ -n "${xf// /}" ] || xf=  # blank: none (XLA reads a blank XLA_FLAGS as a file name)
    [ "$name" != bufdump ] || xf="--xla_dump_to=$scratch/bufdump --xla_dump_hlo_module_re=.*jit__step.* $xf"
    [ "$name" != cbufskip ] || xf="--xla_gpu_command_buffer_update_mode=SKIP_TEMP $xf"
    [ "$name" != hlo ] || xf="--xla_dump_to=$scratch/hlo --xla_dump_hlo_module_re=.*jit__step.* --xla_dump_hlo_pass_re=^$ $xf"
    (cd "$tree" && if [ -n "$xf" ]; then export XLA_FLAGS="$xf"; fi
        PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=$devices timeout "$left" $cmd) \
        > "$scratch/$tag.log" 2>&1
    echo "$tag rc=$? $(( $(date +%s) - t0 )) s on $devices (at $(( $(date +%s) - start )) s)"
    # hlo: the step's optimized modules only (XLA also dumps every other module, PTX, LLVM IR)
    [ "$name" != hlo ] || find "$scratch/hlo" -type f ! -name '*jit__step*after_optimizations.txt' -delete
    [ "$name" != bufdump ] || find "$scratch/bufdump" -type f ! -name '*jit__step*buffer-assignment.txt' -delete
}

all=$(seq -s, 0 $((cards - 1)))
free=()
for ((c = 0; c < cards; c++)); do free+=("$c"); done
pids=()
for name in "$@"; do
    if [ "${SUITE_PARALLEL:-0}" != 1 ]; then  # one section at a time, alone on the machine
        case $name in tp48* | cbuftp*) run "$name" "$all" ;; *) run "$name" 0 ;; esac
        pack
        continue
    fi
    case $name in
        tp48* | cbuftp*)  # every card: wait for the one-card sections first
            wait
            pids=()
            free=()
            for ((c = 0; c < cards; c++)); do free+=("$c"); done
            run "$name" "$all"
            pack
            continue
            ;;
    esac
    if [ ${#free[@]} -eq 0 ]; then  # all cards busy: wait for one section to end
        wait -n
        # the cards whose section has ended come back (pids: the section running on each)
        free=()
        for ((c = 0; c < cards; c++)); do
            pid=${pids[$c]:-}
            if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then free+=("$c"); fi
        done
        pack
    fi
    card=${free[0]}
    free=("${free[@]:1}")
    run "$name" "$card" &
    pids[$card]=$!
done
wait
pack
echo "suite: $(( $(date +%s) - start )) s, $out/suite.tgz"
