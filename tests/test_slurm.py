"""The Slurm recipe (scripts/slurm/mecefo.sbatch, python -m mecefo.slurm, its submitit launcher) on a fake
allocation: the script's srun and scontrol replaced by local processes with the variables Slurm sets
(tests/fake_slurm), each "node" one replica; a node's replica killed by the injector rejoins, and the run equals
its simulated twin."""

import json
import os
import socket
import subprocess
import sys

import pytest

from mecefo.errors import UsageError
from mecefo.launch import main as launch_main
from mecefo.slurm import main as slurm_main
from mecefo.slurm import slurm_kill
from mecefo.supervise import read_events as slurm_events
from mecefo.timing import PHASES
from mecefo.train import main as train_main
from tests.conftest import NANO, ROOT, metrics, python_module, subprocess_env

pytestmark = pytest.mark.filterwarnings("ignore")
FAKE = ROOT / "tests" / "fake_slurm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_allocation(nodes: int, **extra) -> dict:
    """The environment of an sbatch script on a fake allocation of `nodes` nodes (this machine, each node once)."""
    return subprocess_env(PATH=f"{FAKE}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", SLURM_JOB_ID="7",
                          SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=f"fake[0-{nodes - 1}]", **extra)


@pytest.mark.parametrize("spec, message", [
    ("1", "expected RANK:STEP"), ("1:x", "expected RANK:STEP"), ("1:0", "STEP must be at least 1"),
    ("1:3:-1s", "expected RANK:STEP"), ("1:3:2:5", "expected RANK:STEP"), ("a:3", "expected RANK:STEP"),
    ("1:3:2", "RESTART_STEP after it"), ("1/1:3", "a whole replica group"), ("lighthouse:3", "does not run the lighthouse"),
    ("2:3", "rank must be in 0..1")])
def test_an_injector_kill_outside_the_grammar_or_the_nodes_reach_is_refused(spec, message):
    with pytest.raises(UsageError, match=message):
        slurm_kill(spec, 2)


def test_the_injector_reads_the_launchers_grammar():
    """One grammar (mecefo.supervise): killed for good, restarted at a step, after seconds, while healing."""
    assert [(k.at_step, k.restart_step, k.restart_after_s) for k in map(lambda s: slurm_kill(s, 2),
            ["1:5", "1:5:9", "1:5:2.5s", "0:heal"])] == [(5, None, None), (5, 9, None), (5, None, 2.5), (None, 0, None)]


def test_a_node_outside_the_run_or_outside_srun_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert launch_main([*NANO, "--ranks", "2", "--out", str(out), "--prepare"]) == 0
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    assert slurm_main(["node", "--out", str(out), "--lighthouse", "http://127.0.0.1:1"]) == 2
    assert "run it under srun" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert slurm_main(["node", "--out", str(out), "--lighthouse", "http://127.0.0.1:1"]) == 2
    assert "node 2: the run in" in capsys.readouterr().err
    assert slurm_main(["watch", "--out", str(out), "--kill", "5:3"]) == 2
    assert "must be in 0..1" in capsys.readouterr().err
    assert slurm_main(["submit", "--out", str(out), "--nodes", "2", "--cluster", "local", "--", *NANO, "--ranks", "2"]) == 2
    assert "set by --nodes" in capsys.readouterr().err


def test_a_node_whose_lighthouse_never_answers_stops_with_one_line(tmp_path, capsys, monkeypatch):
    import mecefo.slurm as slurm

    out = tmp_path / "run"
    assert launch_main([*NANO, "--ranks", "2", "--out", str(out), "--prepare"]) == 0
    monkeypatch.setattr(slurm, "LIGHTHOUSE_WAIT_S", 0.5)
    monkeypatch.setattr(slurm.wait_for_lighthouse, "__defaults__", (0.5,))
    assert slurm_main(["node", "--out", str(out), "--lighthouse", f"http://127.0.0.1:{free_port()}", "--node", "0"]) == 3
    assert "did not answer for 0.5 s" in capsys.readouterr().err


@pytest.mark.slow
def test_the_submitit_job_survives_a_node_killed_and_equals_its_simulated_twin(tmp_path):
    """Two nodes (submitit's local executor); the injector kills node 1's replica at step 8 (SIGKILL to its process
    group, as a node lost) and its supervisor restarts it 2 s later with --rejoin: it heals from node 0 and trains
    again. The merged run has every step once, identical replicas, the kill and its recovery timings, per-step timing
    (the quorum and the exchange on every row, the heal in the restarted replica's totals), and node 0's lone steps
    and the rest equal the local backend on the same failed steps. (The sbatch script's run: the README's rehearsal,
    tests/test_readme_cluster.py.)"""
    out, port = tmp_path / "run", free_port()
    args = [*NANO, "--steps", "60", "--eval_every", "30"]
    r = python_module("mecefo.slurm", "submit", "--out", str(out), "--nodes", "2", "--cluster", "local", "--wait",
                      "--port", str(port), "--kill", "1:8:2s", "--min_step_s", "0.25", "--", *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = slurm_events(out)
    node1 = [e["kind"] for e in events if e.get("node") == 1]
    assert "inject" in node1 and [k for k in node1 if k != "inject"] == ["start", "kill", "start", "finished"]
    assert [e["kind"] for e in events if e.get("node") == 0] == ["start", "finished"]
    summary = json.loads((out / "summary.json").read_text())
    timings = summary["backend"]["timings"]  # the node supervisors' events, merged as the launcher's are
    assert summary["backend"]["kills"] == 1 and len(timings["kill_to_step_s"]) == 1
    assert len(timings["restart_to_rejoin_s"]) == 1 and summary["backend"]["not_rejoined"] == []
    assert summary["rank_agreement"] == {"ranks_checked": [0, 1], "identical": True}
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(61))
    alone = [row["step"] for row in rows[1:] if row["down"] == [1]]
    assert alone and alone[0] >= 9 and rows[-1]["down"] == []  # it died after step 8 and came back
    for row in rows[1:]:
        t = row["timing"]
        assert t["quorum_s"] > 0 and t["compute_s"] > 0 and (t["exchange_s"] > 0 or row["down"])
        assert t["total_s"] == pytest.approx(sum(t[f"{k}_s"] for k in PHASES) + t["other_s"], abs=1e-5)
    assert summary["backend"]["replica_timing"]["1"]["heal_s"] > 0 and summary["timing"]["pace_s"] > 0
    twin = tmp_path / "twin"
    assert train_main([*args, "--ranks", "2", "--quiet", "--out", str(twin), "--failures",
                       f"steps:{out / 'failed_steps.json'}"]) == 0
    for a, b in zip(rows[1:], metrics(twin)[1:], strict=True):
        assert a["down"] == b["down"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.slow
def test_every_node_dead_ends_the_job_and_the_same_job_submitted_again_continues_from_the_checkpoint(tmp_path):
    """Both nodes killed at step 12: their supervisors restart them, they find no live peer to heal from within
    MECEFO_FT_JOIN_TIMEOUT_S and stop (exit 3), and the job ends with exit 3 and says what to do. The same sbatch
    command again, the injection included, resumes from the checkpoint of step 10 (the rows after it cut; each
    --kill fires once per run: not again) and completes: every step once, equal to the local backend."""
    out, port = tmp_path / "run", free_port()
    args = [*NANO, "--steps", "30", "--eval_every", "15", "--checkpoint_every", "5"]
    job = ["bash", str(FAKE / "sbatch"), "--nodes=2", str(ROOT / "scripts" / "slurm" / "mecefo.sbatch"), str(out), *args]
    env = fake_allocation(2, MECEFO_LIGHTHOUSE_PORT=str(port), MECEFO_NODE_FLAGS="--min_step_s 0.25",
                          MECEFO_FT_JOIN_TIMEOUT_S="6")
    env["MECEFO_INJECT"] = "--kill 0:12:0s --kill 1:12:0s"
    r = subprocess.run(job, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submit the same command again to continue" in r.stderr
    assert not (out / "summary.json").exists()
    r = subprocess.run(job, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "[watch] node" not in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    events = slurm_events(out)
    assert [e["step"] for e in events if e["kind"] == "resume"] == [10]
    assert [(e["rank"], e["step"] >= 12) for e in events if e["kind"] == "kill"] in ([(0, True), (1, True)], [(1, True), (0, True)])
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(31)) and all(row["down"] == [] for row in rows[1:])
    assert json.loads((out / "summary.json").read_text())["rank_agreement"]["identical"]
    assert train_main([*args, "--ranks", "2", "--quiet", "--out", str(tmp_path / "twin")]) == 0
    for a, b in zip(rows[1:], metrics(tmp_path / "twin")[1:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def processes_of(out) -> list[int]:
    """The pids whose command line names OUT (the run's supervisors, replicas, lighthouse's watcher)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmd:
                found.append(int(d))
    return found


@pytest.mark.slow
def test_a_job_cancelled_leaves_no_process_behind(tmp_path):
    """scancel (SIGTERM to the job's processes) while both nodes train: every node supervisor takes its replica
    group down with it (the replicas run in sessions of their own, so a signal to the job does not reach them), and
    the watcher and the lighthouse (its port free again) go with the batch script."""
    import signal
    import time

    out, port = tmp_path / "run", free_port()
    job = subprocess.Popen(["bash", str(FAKE / "sbatch"), "--nodes=2", str(ROOT / "scripts" / "slurm" / "mecefo.sbatch"),
                            str(out), *NANO, "--steps", "200"], cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True,
                           env=fake_allocation(2, MECEFO_LIGHTHOUSE_PORT=str(port), MECEFO_NODE_FLAGS="--min_step_s 0.1"))
    deadline = time.time() + 120
    while not all((out / "replicas" / f"rank{r}.status").exists() and (out / "replicas" / f"rank{r}.status").read_text()
                  .startswith("step") for r in (0, 1)):
        assert time.time() < deadline and job.poll() is None, "the job did not start training"
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGTERM)
    job.wait(timeout=60)
    deadline = time.time() + 10
    while processes_of(out) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_of(out) == []
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens on the lighthouse's port


def test_the_node_gpus_come_from_slurm_or_the_visible_devices():
    from mecefo.slurm import node_gpus

    assert node_gpus({"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1"}) == 8
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "2,3,5"}) == 3 and node_gpus({}) == 1


@pytest.mark.parametrize("status, written, expected", [(1, 3, 3), (1, 2, 2), (3, None, 3), (0, None, 0)])
def test_a_replica_groups_own_exit_status_reaches_the_node_through_torchrun(tmp_path, monkeypatch, status, written,
                                                                             expected):
    """torchrun exits 1 for any worker's failure: a replica's 2 (bad input) or 3 (cannot go on) is read from
    OUT/replicas/rank<R>.exit, so that the node stops instead of restarting it as a crash."""
    import mecefo.slurm as slurm
    from mecefo.ft import exit_path

    out = tmp_path / "run"
    assert launch_main([*NANO, "--ranks", "2", "--out", str(out), "--prepare"]) == 0
    path = exit_path(out, 1)
    script = (f"echo {written} > {path}; " if written else "") + f"exit {status}"
    monkeypatch.setattr(slurm, "wait_for_lighthouse", lambda *a: None)
    monkeypatch.setattr(slurm, "replica_command", lambda *a: ["bash", "-c", script])
    (out / "replicas" / "rank0.status").write_text("step 3 0\n")  # a live peer: a finished run is not assumed
    assert slurm.node(out, 1, "http://127.0.0.1:1", None, max_restarts=0) == expected


def test_a_node_killed_for_good_ends_with_the_run_or_when_nobody_is_left(tmp_path, monkeypatch):
    """A node whose replica the injector killed for good (NODE:STEP) waits: it ends 0 once a replica has finished the
    run (others may be down), and 3 once every other replica has been down for RUN_OVER_S (nobody left to heal it)."""
    import mecefo.slurm as slurm
    from mecefo.runfiles import write_replica_status

    out = tmp_path / "run"
    assert launch_main([*NANO, "--ranks", "3", "--out", str(out), "--prepare"]) == 0
    cfg = slurm.run_config(out)
    write_replica_status(out, 0, "finished")
    write_replica_status(out, 2, "down")
    assert slurm.Node(out, 1, cfg, "node 1").wait_for_restart(None) == 0
    monkeypatch.setattr(slurm, "RUN_OVER_S", 0.2)
    write_replica_status(out, 0, "down")
    assert slurm.Node(out, 1, cfg, "node 1").wait_for_restart(None) == 3
    write_replica_status(out, 0, "step 12")
    assert slurm.Node(out, 1, cfg, "node 1").wait_for_restart({"at_step": 12}) is None  # restarted at its step


def test_the_injector_never_counts_a_stopped_node_as_training(tmp_path):
    """A node the injector stopped (SIGSTOP) keeps its 'step' status: it is neither a target nor counted among the
    nodes holding the run's state until its stall is over; a node that is down gets no order."""
    from mecefo.runfiles import write_replica_status
    from mecefo.slurm import Injector
    from mecefo.supervise import EventLog

    for r, words in enumerate(["step 5", "step 5", "down"]):
        write_replica_status(tmp_path, r, words)
    hands = Injector(tmp_path, 3, 100, EventLog(tmp_path, "watch"))
    hands.look()
    hands.stall(0, 30.0)
    hands.flush(5)
    (tmp_path / "slurm" / "order-node0").unlink()  # its supervisor took the order; the replica sleeps on
    assert hands.training() == [1] and not hands.running(2)
