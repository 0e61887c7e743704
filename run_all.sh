#!/usr/bin/env bash
# The main job: run every experiment (cached by config hash under results/), then every figure and table
# (paper_figures/out/). `bash run_all.sh --quick` is the CI-sized profile (minutes on 2 CPU cores);
# `bash run_all.sh --long` is the default plus the long sweep (more seeds of the deciding Table 3 rows).
set -euo pipefail
cd "$(dirname "$0")"
quick=""
long=""
case "${1:-}" in
  "") ;;
  --quick) quick="--quick" ;;
  --long) long="--long" ;;
  *) echo "usage: bash run_all.sh [--quick | --long]" >&2; exit 2 ;;
esac
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { echo; echo "== $* =="; }

step "failure-free reference run"
python -m experiments.failure_free $quick
step "randomized SVD of V1 against the exact SVD (trained and 1B-shaped weights)"
python -m experiments.svd_accuracy $quick
step "training-step benchmark (ours vs a plain reference loop)"
python -m experiments.bench_train $quick
python -m experiments.bench_ranks $quick
python -m experiments.bench_ft $quick
python -m experiments.bench_adapter $quick   # the techniques on a Hugging Face Llama (mecefo.adapter)
python -m experiments.bench_neighbour $quick # the neighbour's time against its FLOPs at 350m/1b/7b layer shapes (~7 min)
python -m experiments.bench_refresh $quick   # the V1 refresh shared among torch ranks against computed by each (~2 min)
[ -z "$quick" ] && python -m experiments.bench_heal   # slow heals on torchft (4 runs, ~4 min; not in CI's profile)
step "chaos harness: random real failures on the torchft backend, every run checked (quick: 3 schedules)"
python -m experiments.chaos $quick

step "neighbour cost ablation (the paper's Table 6)"
python -m experiments.ablation $quick

step "sweep over n, failure level and policy (the paper's Table 3 and Figure 3)"
python -m experiments.sweep $quick
[ -z "$quick" ] && python -m experiments.sweep --full
[ -n "$long" ] && python -m experiments.sweep --long
python -m experiments.table3 $quick    # verdicts from every sweep index results/ holds (default + long)
# where the variance comes from (18 more runs at n = 32): in the quick and long profiles
if [ -n "$quick$long" ]; then python -m experiments.variance $quick; fi

step "cluster-scale throughput simulation (the paper's Table 2, its hypotheses, and 32 to 100k GPUs)"
python -m experiments.throughput $quick
python -m experiments.hypotheses $quick
python -m experiments.table2 $quick   # the words and derived tables of Table 2, decided from the two above
step "goodput: quality-equivalent steps x simulated throughput under every reading, every policy (failure-free runs of other lengths, drop at 7B's lost fractions, the null control)"
python -m experiments.goodput_sim $quick   # spares for every policy, each scaling job's own overhead, the leader map
python -m experiments.goodput $quick

step "analysis: bias and variance, Assumption 3 along training, the O(1/sqrt(nT)) rate"
python -m analysis.bias_variance $quick
python -m analysis.grad_error $quick
python -m experiments.rate_gpt $quick
python -m analysis.rate $quick

step "figures and tables"
python -m mecefo.policies --readme
python -m paper_figures.failure_free $quick
python -m paper_figures.ablation $quick
python -m paper_figures.svd_accuracy $quick
python -m paper_figures.sweep $quick
if [ -n "$quick$long" ]; then python -m paper_figures.variance $quick; fi
python -m paper_figures.throughput $quick
python -m paper_figures.goodput $quick
python -m paper_figures.bias_variance $quick
python -m paper_figures.grad_error $quick
python -m paper_figures.rate $quick
[ -z "$quick" ] && python -m paper_figures.heal
python -m paper_figures.chaos $quick
python -m paper_figures.neighbour $quick
python -m experiments.float_check --which $quick   # which float settings change the bits here (the full check: see README)
python -m paper_figures.headline $quick   # the README's first screen, from the results above
python -m analysis.run_notebooks

echo
echo "results: $PWD/results    figures and tables: $PWD/paper_figures/out"
