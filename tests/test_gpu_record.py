"""The README's line on what has run on a GPU (paper_figures.headline.gpu), from experiments.gpu_check's records
kept in experiments/gpu_runs/."""

from paper_figures.headline import gpu, gpu_records


def record(**changes):
    ok = {"exit": 0, "finite": True, "steps_with_failures": 3}
    r = {"date": "2026-12-04", "device": "NVIDIA H200", "packages": {"torch": "2.11.0"}, "tree_commit": "a" * 40,
         "file": "experiments/gpu_runs/x.json", "policies": {"mecefo": ok, "drop": ok},
         "low_rank": {"energy_gap": 0.0043},
         "torchrun": {"none": {"exit": 0, "error": ""}, "fsdp": {"exit": 2, "error": "Traceback\nerror: needs torch 2.13"}},
         "torchft": {"run": {"exit": 0, "ranks": 1, "kills": 0}, "refused": {"exit": 2}},
         "throughput": [{"preset": "llama-60m", "tokens_per_s": 243909.4, "mfu": 0.065, "measured_over_predicted": 1.09}]}
    return r | changes


def test_without_a_record_the_line_says_nothing_has_run_on_a_gpu():
    assert gpu([]).startswith("- **Never run on a GPU:**")


def test_a_record_says_what_ran_and_what_failed_on_it():
    line = gpu([record()])
    assert line.startswith("- **On a GPU** (`experiments.gpu_check` on one NVIDIA H200, torch 2.11.0, 2026-12-04")
    ran, failed = line.split("ran: ")[1].split(". Failed: ")
    assert "2 of 2 policies" in ran and "0.43%" in ran and "torchrun over NCCL" in ran and "torchft on CUDA (1 replica)" in ran
    assert "one replica more than GPUs refused" in ran
    assert failed.startswith("FSDP2 under torchrun (error: needs torch 2.13)")
    assert "llama-60m 243,909 tokens/s (MFU 6.5%" in line
    bad = record(policies={"mecefo": {"exit": 1, "finite": False, "steps_with_failures": 0}})
    assert "Failed: bf16 training under failures with 0 of 1 policies" in gpu([bad])
    newest = gpu([record(date="2026-01-01", device="old"), record()])
    assert "NVIDIA H200" in newest and "old" not in newest


def test_the_kept_records_render():
    for r in gpu_records():
        assert gpu([r]).startswith("- **On a GPU**")
