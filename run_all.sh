#!/usr/bin/env bash
# The main job: run every experiment (cached by config hash under results/), then every figure and table
# (paper_figures/out/) and the README's generated blocks. Profiles:
#   bash run_all.sh            the CPU reproduction (the time of each step: docs/profiles.md)
#   bash run_all.sh --quick    the CI-sized profile (minutes on 2 CPU cores)
#   bash run_all.sh --full     the default plus what does not fit its hour: the chaos harness's default profile,
#                              slow heals, seeds 3-7 of the deciding Table 3 rows, the variance decomposition,
#                              the neighbour at llama-7b's layer shape
#                              (--long is the same profile under its old name)
# Each command's wall time is appended to results/run_all/times-<profile>.jsonl (paper_figures.profile reads it).
set -euo pipefail
cd "$(dirname "$0")"
quick=""
full=""
profile="default"
case "${1:-}" in
  "") ;;
  --quick) quick="--quick"; profile="quick" ;;
  --full|--long) full="--full"; profile="full" ;;
  *) echo "usage: bash run_all.sh [--quick | --full]" >&2; exit 2 ;;
esac
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fresh=true   # whether this run starts from an empty results/ (else it reuses what is cached there)
if [ -n "$(ls -A results 2>/dev/null | grep -v '^run_all$')" ]; then fresh=false; fi
mkdir -p results/run_all
times="results/run_all/times-$profile.jsonl"
invocation="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
commit="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
cores="$(nproc 2>/dev/null || echo unknown)"
step() { echo; echo "== $* =="; }
t() {  # run one command and append its wall time (seconds) to $times
  local start=$EPOCHREALTIME
  "$@"
  local seconds
  seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  printf '{"invocation": "%s", "commit": "%s", "fresh": %s, "cores": "%s", "command": "%s", "seconds": %s}\n' \
    "$invocation" "$commit" "$fresh" "$cores" "$*" "$seconds" >> "$times"
}
chaos="--quick"   # the chaos harness's quick profile (3 schedules) in the quick and default profiles, its own in --full
if [ -n "$full" ]; then chaos=""; fi

step "failure-free reference run"
t python -m experiments.failure_free $quick

step "sweep over n, failure level and policy (the paper's Table 3 and Figure 3)"
t python -m experiments.sweep $quick
[ -z "$quick" ] && t python -m experiments.sweep --full   # the paper-scale commands, each dry-run checked (seconds)
[ -n "$full" ] && t python -m experiments.sweep --long
t python -m experiments.table3 $quick    # verdicts from every sweep index results/ holds (default + long)
# where the variance comes from (18 more runs at n = 32): in the quick and full profiles
if [ -n "$quick$full" ]; then t python -m experiments.variance $quick; fi

step "cluster-scale throughput simulation (the paper's Table 2, its hypotheses, and 32 to 100k GPUs)"
# first the neighbour's time against its FLOPs at the layer shapes of llama-350m, 1b (--full: and 7b), Table 2's c by time
t python -m experiments.bench_neighbour $quick $full
t python -m experiments.throughput $quick
t python -m experiments.hypotheses $quick
t python -m experiments.table2 $quick   # the words and derived tables of Table 2, decided from the two above

step "analysis: bias and variance, Assumption 3 along training, the O(1/sqrt(nT)) rate"
t python -m analysis.bias_variance $quick
t python -m analysis.grad_error $quick
t python -m experiments.rate_gpt $quick
t python -m analysis.rate $quick

step "goodput: quality-equivalent steps x simulated throughput under every reading, every policy (failure-free runs of other lengths, drop at 7B's lost fractions, the null control)"
t python -m experiments.goodput_sim $quick   # spares for every policy, each scaling job's own overhead, the leader map
t python -m experiments.goodput_runs $quick   # the runs it is measured from (failure-free lengths, drop at 7B's lost fractions, the null control)
t python -m experiments.goodput $quick        # the decision, from those runs, the sweep and the simulations

step "neighbour cost ablation (the paper's Table 6) and the randomized SVD of V1 against the exact SVD"
t python -m experiments.ablation $quick
t python -m experiments.svd_accuracy $quick

step "benchmarks: the training step, ranks, torchft, the Hugging Face adapter, the V1 refresh"
t python -m experiments.bench_train $quick
t python -m experiments.bench_ranks $quick
t python -m experiments.bench_ft $quick
t python -m experiments.bench_adapter $quick   # the techniques on a Hugging Face Llama (mecefo.adapter)
t python -m experiments.bench_refresh $quick   # the V1 refresh shared among torch ranks against computed by each
[ -n "$full" ] && t python -m experiments.bench_heal   # slow heals on torchft (4 runs)
[ -n "$full" ] && t python -m experiments.bench_jobs   # two runs at once (one thread each) against one after the other

step "chaos harness: random real failures on the torchft backend, every run checked (3 schedules; --full: 73)"
t python -m experiments.chaos $chaos
t python -m experiments.chaos_example $chaos   # the torchft example (mecefo.for_torchft) killed at random (1 schedule; --full: 6)

step "figures and tables"
t python -m paper_figures.failure_free $quick
t python -m paper_figures.ablation $quick
t python -m paper_figures.svd_accuracy $quick
t python -m paper_figures.sweep $quick
if [ -n "$quick$full" ]; then t python -m paper_figures.variance $quick; fi
t python -m paper_figures.throughput $quick
t python -m paper_figures.goodput $quick
t python -m paper_figures.bias_variance $quick
t python -m paper_figures.grad_error $quick
t python -m paper_figures.rate $quick
[ -n "$full" ] && t python -m paper_figures.heal
t python -m paper_figures.chaos $chaos
t python -m paper_figures.torchft $quick
t python -m paper_figures.neighbour $quick
t python -m experiments.float_check --which $quick   # which float settings change the bits here (the full check: docs/reproducibility.md)
t python -m paper_figures.headline $quick   # the README's table of paper claims against ours, from the results above
t python -m analysis.run_notebooks
t python -m paper_figures.profile   # each profile's step times (docs/profiles.md; this run's last two steps are not in it)
t python -m paper_figures.readme $quick   # the one writer of the README's and docs/' generated blocks

echo
echo "results: $PWD/results    figures and tables: $PWD/paper_figures/out"
