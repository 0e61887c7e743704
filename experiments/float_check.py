"""Do Table 3's words survive another float environment? Rerun every run Table 3 decides from (every row at the
main n) with one float setting changed, as another CPU would round, decide the whole table again from the reruns
(the pooled noise re-estimated from them), and compare every row's word with the original's.

    python -m experiments.float_check --which [--quick]             # which settings change the bits here
    python -m experiments.float_check [--setting NAME ...] [--rows printed] [--quick]  # rerun the table under them

SETTINGS are the float knobs this torch build honours: torch's own vectorised kernels (ATEN_CPU_CAPABILITY),
oneDNN's and MKL's instruction sets (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), MKL's reproducibility mode
(MKL_CBWR) and the intra-op thread count. `--which` trains a short run of the sweep's base config under each and
compares the final parameters bit for bit with this machine's own (results/float_check/which-<profile>.json);
without --setting, the rerun uses every setting that changed the bits. --rows printed reruns only the runs
behind the printed words (the other runs keep their values in the rerun table, and only rows that use a rerun are
compared). The reruns live in
results/float_check/<setting>/ (their own results root: same configs, other rounding) and are reused on rerun;
the comparison goes to results/float_check/float_check-<profile>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

from mecefo.errors import UsageError
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import RESULTS

from . import sweep, table3
from .common import guarded

SETTINGS = {"aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
            "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
            "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"}, "one-thread": {"OMP_NUM_THREADS": "1"}}
KNOBS = {k for s in SETTINGS.values() for k in s}
WHICH_STEPS = 30  # the short run --which compares: failures from step 0, so the neighbours' kernels run too


def table_cells(profile: str) -> list[sweep.Cell]:
    """Every cell Table 3 decides from: the profile's cells at its main n."""
    d = sweep.DESIGNS[profile]
    return [c for c in sweep.cells(profile) if c.n == d.n]


def cell_key(c) -> str:
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k)
    return ":".join(str(get(k)) for k in ("tag", "level", "policy", "techniques", "failable", "seed"))


def environment(setting: str | None) -> dict:
    """This process's environment with every float knob unset, then the setting's (None: this machine's own)."""
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    return {**env, **(SETTINGS[setting] if setting else {})}


def worker(profile: str, which: bool, only: list[str] | None = None) -> dict:
    """In this process's float environment: the short run's parameter digest (which) or every table cell's ppl."""
    import torch

    from mecefo import config as config_mod
    from mecefo.train import Run, run

    info = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    base = sweep.DESIGNS[profile].base
    if which:
        cell = sweep.Cell(sweep.DESIGNS[profile].n, "high", "mecefo", 0)
        cfg = config_mod.with_overrides(sweep.cell_config(base, cell), train={"steps": WHICH_STEPS, "eval_every": WHICH_STEPS},
                                        cluster={"failure_free_steps": 0})
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            training = Run(cfg, Path(tmp), torch.device("cpu"), quiet=True)
            training.start(resume=False)
            for step in range(WHICH_STEPS):
                row, _ = training.step(step, training.schedule.failed[step])
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in training.model.parameters()))
            training.metrics.close()
        return {**info, "digest": digest.hexdigest(), "loss": row["loss"]}
    out = {}
    cells = [c for c in table_cells(profile) if only is None or cell_key(c) in only]
    for i, c in enumerate(cells):
        cfg = sweep.cell_config(base, c)
        folder = RESULTS / "sweep" / f"{cfg.model.preset}-{cfg.hash()}"
        run(cfg, folder, quiet=True)
        out[cell_key(c)] = sweep.run_ppl(folder)
        print(f"[{i + 1}/{len(cells)}] {cell_key(c)}: ppl {out[cell_key(c)]:.4f}", file=sys.stderr, flush=True)
    return {**info, "ppl": out}


def in_setting(setting: str | None, profile: str, which: bool, only: list[str] | None = None) -> dict:
    """Run the worker in a subprocess under a setting (its reruns under results/float_check/<setting>/); only: the
    keys of the cells to rerun (None: every cell of the table)."""
    env = environment(setting)
    if not which:
        env["MECEFO_RESULTS"] = str(RESULTS / "float_check" / setting)
    if only is not None:
        env["MECEFO_FLOAT_CHECK_CELLS"] = json.dumps(sorted(only))
    args = [sys.executable, "-m", "experiments.float_check", "--worker"] + (["--which"] if which else []) + \
        (["--quick"] if profile == "quick" else [])
    proc = subprocess.run(args, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"the float-check worker under {setting or 'this machine'} exited {proc.returncode}")
    return json.loads(proc.stdout.splitlines()[-1])


def which(profile: str) -> dict:
    """Which settings change the bits of a short run here, against this machine's own (nothing set)."""
    own = in_setting(None, profile, True)
    out = {"profile": profile, "steps": WHICH_STEPS, "own": own, "settings": {}, "git_commit": git_commit()}
    for name in SETTINGS:
        got = in_setting(name, profile, True)
        out["settings"][name] = {**got, "env": SETTINGS[name], "changes_bits": got["digest"] != own["digest"]}
        print(f"{name:15s} ({' '.join(f'{k}={v}' for k, v in SETTINGS[name].items())}): "
              f"{'changes the bits' if got['digest'] != own['digest'] else 'the same bits'} "
              f"(final loss {got['loss']:.9g} against {own['loss']:.9g})", flush=True)
    atomic_write_json(RESULTS / "float_check" / f"which-{profile}.json", out)
    return out


def compare(original: dict, rerun: dict, rows_rerun: set[str] | None = None) -> dict:
    """Row by row: the original table's word and the rerun's. Beside the count of changed words: the printed
    directions the rerun lost, against the number a rerun with new seeds deciding by the same rule would be expected
    to lose (the sum of 1 - repeat over them: mecefo.stats.repeat_probability). A float rerun of the same seeds is
    closer to the original than new seeds are, so it should lose fewer."""
    before, after = ({r["id"]: r for r in t["rows"]} for t in (original, rerun))
    rows = {}
    for rid, a in before.items():
        b = after.get(rid)
        if b is None or (rows_rerun is not None and rid not in rows_rerun):
            continue
        rows[rid] = {"group": a["group"], "comparison": a["comparison"],
                     "original": {k: a[k] for k in ("change_pct", "word", "claim", "probability", "margin", "repeat")},
                     "rerun": {k: b[k] for k in ("change_pct", "word", "claim", "probability", "margin", "repeat")}}
    direction = lambda w: w.split()[0] if w.split()[0] in ("worse", "better") else None  # noqa: E731
    printed = [r for r in rows.values() if direction(r["original"]["word"])]
    return {"rows": rows, "words_changed": sum(r["original"]["word"] != r["rerun"]["word"] for r in rows.values()),
            "directions_printed": len(printed),
            "directions_lost": sum(direction(r["rerun"]["word"]) != direction(r["original"]["word"]) for r in printed),
            "directions_lost_new_seeds": float(sum(1 - r["original"]["repeat"] for r in printed)),
            "noise": {"original": original["noise"], "rerun": rerun["noise"]}}


def printed_cells(table: dict, cells: list[dict]) -> set[str]:
    """The keys of the runs behind every row whose word is printed (both sides, every seed of the row)."""
    sides = {}
    for r in table["rows"]:
        if not r["word"].startswith("not decided"):
            a, b = r["id"].split("/")
            for side in (a, b):
                sides.setdefault(side, set()).update(r["seeds"])
    return {cell_key(c) for c in cells if ":".join(table3.key(c)) in sides and c["seed"] in sides[":".join(table3.key(c))]}


def touched(table: dict, keys: set[str], cells: list[dict]) -> set[str]:
    """The ids of the rows that use at least one rerun run."""
    runs = {(":".join(table3.key(c)), c["seed"]) for c in cells if cell_key(c) in keys}
    return {r["id"] for r in table["rows"] if any((side, s) in runs for side in r["id"].split("/") for s in r["seeds"])}


def check(profile: str, settings: list[str], rows: str = "all") -> dict:
    cells, meta = table3.load_cells(profile)
    n = int(next(iter(meta.values()))["design"]["n"])
    at = [c for c in cells if c["n"] == n]
    original = table3.decide_table(at, meta)
    keys = ({cell_key(c) for c in table_cells(profile)} if rows == "all" else printed_cells(original, at))
    result = {"profile": profile, "n": n, "rows_rerun": rows, "settings": {}, "git_commit": git_commit()}
    for name in settings:
        got = in_setting(name, profile, False, None if rows == "all" else sorted(keys))
        rerun_ppl = got["ppl"]
        missing = set(rerun_ppl) - {cell_key(c) for c in at}
        if missing:
            raise UsageError(f"the sweep index lacks runs the rerun made ({sorted(missing)[:3]}); run python -m "
                             f"experiments.sweep{' --quick' if profile == 'quick' else ''} first")
        rel = [abs(100 * (rerun_ppl[cell_key(c)] / c["val_ppl"] - 1)) for c in at if cell_key(c) in rerun_ppl]
        # the rerun table: every run at n, the rerun ones in their rerun values; the pooled noise re-estimated from it
        rerun_table = table3.decide_table([{**c, "val_ppl": rerun_ppl.get(cell_key(c), c["val_ppl"])} for c in at], meta)
        result["settings"][name] = {"env": SETTINGS[name], "capability": got["capability"], "threads": got["threads"],
                                    "runs": len(rel), "of_runs": len(at), "mean_abs_change_of_ppl_pct": float(np.mean(rel)),
                                    "max_abs_change_of_ppl_pct": float(np.max(rel)),
                                    **compare(original, rerun_table, touched(original, set(rerun_ppl), at))}
        s = result["settings"][name]
        print(f"{name}: per-run ppl moved by {s['mean_abs_change_of_ppl_pct']:.2f}% on average (max "
              f"{s['max_abs_change_of_ppl_pct']:.2f}%); {s['words_changed']} of {len(s['rows'])} words changed; "
              f"{s['directions_lost']} of {s['directions_printed']} printed directions lost (new seeds would lose "
              f"{s['directions_lost_new_seeds']:.2f})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", action="store_true", help="measure which settings change the bits here")
    parser.add_argument("--setting", action="append", choices=sorted(SETTINGS),
                        help="rerun under this setting (repeatable; default: every one --which found to change bits)")
    parser.add_argument("--rows", choices=("all", "printed"), default="all",
                        help="rerun every run of the table, or only those behind the printed words (the rest keep "
                             "their original values in the rerun table)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    profile = "quick" if args.quick else "default"
    if args.worker:
        only = os.environ.get("MECEFO_FLOAT_CHECK_CELLS")
        print(json.dumps(worker(profile, args.which, json.loads(only) if only else None)))
        return 0
    if args.which:
        which(profile)
        return 0
    settings = args.setting
    if not settings:
        path = RESULTS / "float_check" / f"which-{profile}.json"
        if not path.exists():
            raise UsageError(f"no {path}: run python -m experiments.float_check --which"
                             f"{' --quick' if args.quick else ''} first, or name --setting")
        settings = [k for k, v in json.loads(path.read_text())["settings"].items() if v["changes_bits"]]
        if not settings:
            raise UsageError("no setting changed the bits here: the float check would test nothing")
    result = check(profile, settings, args.rows)
    path = RESULTS / "float_check" / f"float_check-{profile}.json"
    atomic_write_json(path, result)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
