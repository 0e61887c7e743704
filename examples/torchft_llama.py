"""A torchft training loop (in the style of torchft's train_ddp.py) on a Hugging Face Llama that keeps its global
batch when a replica group dies: mecefo.for_torchft's five lines, marked `# mecefo` below.

Each replica group is one process (REPLICA_GROUP_ID of NUM_REPLICA_GROUPS), torchft's lighthouse forms the quorums
(TORCHFT_LIGHTHOUSE), gloo on a CPU, NCCL with --device cuda. On one machine:

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 NUM_REPLICA_GROUPS=3
    for r in 0 1 2; do REPLICA_GROUP_ID=$r python examples/torchft_llama.py --policy mecefo --out run & done

Kill one (kill -9) and start it again with the same command: it heals from a live group and trains on. Each group
writes the steps it committed to OUT/rows-<R>.jsonl (step, the failed groups, samples in the global batch, loss);
`python examples/torchft_llama.py --replay run` checks them (every step committed once, the groups agreeing) and
recomputes them in one process with this repository's own engine (mecefo.engine.Batched) on the same failed sets:
it prints, as JSON, those facts and the largest relative difference of the losses.

The model: a small Llama built here (random init, seeded alike in every group), or --config CONFIG.json (a
transformers Llama/Mistral/Qwen2 config, random init) or --weights DIR (a local from_pretrained folder and its
tokenizer; nothing is downloaded). The data: the Shakespeare/Milton corpus this repository ships, as windows of
--seq tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mecefo.for_torchft import KeepBatch, StepBatches  # mecefo

POLICIES = ("drop", "mecefo", "ndb-exact", "spread", "spread-mecefo")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=POLICIES, default="drop", help="what the live groups do with a dead group's batch")
    p.add_argument("--out", type=Path, default=Path("torchft_llama"), help="folder of the groups' rows-<R>.jsonl")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="sequences per group and step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help="a Hugging Face config.json (random init)")
    p.add_argument("--weights", help="a local from_pretrained folder (weights and tokenizer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32", help="the model's dtype")
    p.add_argument("--min-step-s", type=float, default=0.0, help="pace the steps to at least this long (demos, tests)")
    p.add_argument("--replay", type=Path, metavar="OUT", help="replay OUT's rows locally with our engine; no torchft")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or args.lr <= 0:
        p.error("--steps, --batch must be >= 1, --seq >= 2, --lr > 0")
    return args


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of seq + 1 tokens: (inputs, next-token targets)."""

    def __init__(self, tokens: np.ndarray, seq: int):
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // (self.seq + 1)

    def __getitem__(self, i: int):
        w = torch.as_tensor(np.asarray(self.tokens[i * (self.seq + 1): (i + 1) * (self.seq + 1)], dtype=np.int64))
        return w[:-1], w[1:]


def build(args) -> tuple[torch.nn.Module, Windows]:
    """The model (the same initial weights in every group: seeded) and the training windows."""
    import transformers

    if args.weights:
        tok = transformers.AutoTokenizer.from_pretrained(args.weights, local_files_only=True)
        from mecefo.data import shakespeare_documents

        tokens = np.concatenate([np.asarray(tok(d)["input_ids"], dtype=np.int64) for d in shakespeare_documents("train")])
        model = transformers.AutoModelForCausalLM.from_pretrained(args.weights, local_files_only=True)
    else:
        from mecefo.config import DataConfig
        from mecefo.data import TokenData

        data = TokenData(DataConfig(vocab_size=512, seq_len=args.seq))
        tokens = data.tokens["train"]
        if args.config:
            from mecefo.hf import read_config

            values = read_config(args.config)
            config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        else:
            config = transformers.LlamaConfig(vocab_size=data.vocab_size, hidden_size=128, intermediate_size=344,
                                              num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
        if config.vocab_size < data.vocab_size:
            sys.exit(f"--config: vocab_size {config.vocab_size} < the corpus tokenizer's {data.vocab_size}")
        torch.manual_seed(args.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(args.device, getattr(torch, args.dtype)), Windows(tokens, args.seq)


def loss_of(model, batch) -> torch.Tensor:
    """Mean next-token cross-entropy of the batch's rows (in float32 at least)."""
    x, y = (t.to(model.device) for t in batch)
    logits = model(x).logits
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1), y.flatten())


def digest(model) -> float:
    """A checksum of the parameters (each weighted by position): equal in every group that holds the same weights."""
    with torch.no_grad():
        return sum(float((p.double().flatten() * torch.arange(1, p.numel() + 1, dtype=torch.float64)).sum())
                   for p in model.parameters())


def train(args) -> None:
    from torchft import Manager, Optimizer, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    replica, n = int(os.environ.get("REPLICA_GROUP_ID", 0)), int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # one GPU per group on this host (NCCL needs distinct devices)
        device = torch.device("cuda", replica % torch.cuda.device_count())
        torch.cuda.set_device(device)
        args.device = str(device)
    model, dataset = build(args)
    batches = StepBatches(dataset, n, args.batch, seed=args.seed)  # mecefo: any group's batch at any step
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict(), "keep": keep.state_dict()}  # mecefo: + keep

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        keep.load_state_dict(state["keep"])  # mecefo: the subspaces its peers hold

    timeout = timedelta(seconds=30)
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    store = {}
    if "MASTER_ADDR" not in os.environ:  # a bare process (not under torchrun) hosts its group's store, on this host only
        from torch.distributed import TCPStore

        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store = {"store_addr": "127.0.0.1", "store_port": server.port, "rank": 0, "world_size": 1}
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"torchft_llama_{replica}", timeout=timeout, use_async_quorum=False,
                      checkpoint_transport=PGTransport(pg, timeout=timeout, device=device), **store)
    keep = KeepBatch(manager, model, replica, n, args.batch, policy=args.policy, layout="llama")  # mecefo
    optimizer = Optimizer(manager, inner)

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"rows-{replica}.jsonl", "a") as rows:
        t0 = time.perf_counter()
        while manager.current_step() < args.steps:
            time.sleep(max(0.0, args.min_step_s - (time.perf_counter() - t0)))
            t0 = time.perf_counter()
            optimizer.zero_grad()  # torchft: the quorum (a group behind its peers heals in it)
            plan = keep.plan()  # mecefo: who is down, which batches this group computes
            keep.backward(plan, lambda piece: batches.rows(plan.step, piece), loss_of)  # mecefo
            loss = keep.all_reduce(plan)  # mecefo: SUM, each parameter group divided by its weight
            optimizer.step()  # torchft: applied unless this group saw an error in the step
            if manager.current_step() > plan.step:  # committed
                row = {"step": plan.step, "failed": sorted(plan.failed), "samples": keep.samples, "loss": loss,
                       "replica": replica, "pid": os.getpid(), "seconds": round(time.perf_counter() - t0, 4),
                       "digest": digest(model)}
                rows.write(json.dumps(row) + "\n")
                rows.flush()
                print(f"[{replica}] step {plan.step + 1}: loss {loss:.4f}, failed {sorted(plan.failed)}, "
                      f"{keep.samples} samples", flush=True)
    manager.shutdown(wait=False)


def check(out: Path, n: int, steps: int) -> tuple[dict, dict[int, dict]]:
    """What the groups' rows say of the run: every step committed once by the groups alive at it, agreeing on its failed
    set, loss, samples and the parameters it left (their checksum); the samples the exchange summed at every step; how many processes each group ran. A live
    group may miss a step's row only where its process ended there (killed after the step's exchange: torchft decides
    a commit per group, so the others committed it) and a later process of the group, if any, wrote the next rows."""
    rows: dict[int, list[dict]] = {}
    for path in sorted(out.glob("rows-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["step"], []).append(row)
    by_group: dict[int, list[dict]] = {}
    for s in sorted(rows):
        for r in rows[s]:
            by_group.setdefault(r["replica"], []).append(r)

    def ended_there(group: int, step: int) -> bool:
        before = [r["pid"] for r in by_group.get(group, []) if r["step"] < step][-1:]
        after = [r["pid"] for r in by_group.get(group, []) if r["step"] > step][:1]
        return before != after or not before

    def agree(step: int, rs: list[dict]) -> bool:
        wrote, live = [r["replica"] for r in rs], set(range(n)) - set(rs[0]["failed"])
        return (len({(tuple(r["failed"]), r["loss"], r["samples"], r["digest"]) for r in rs}) == 1
                and len(set(wrote)) == len(wrote)
                and set(wrote) <= live and all(ended_there(g, step) for g in live - set(wrote)))

    facts = {"steps": sorted(rows) == list(range(steps)), "groups_agree": all(agree(s, rs) for s, rs in rows.items()),
             "samples": sorted({rs[0]["samples"] for rs in rows.values()}),
             "steps_with_failures": sum(1 for rs in rows.values() if rs[0]["failed"]),
             "processes_per_group": {str(g): len({r["pid"] for r in rs}) for g, rs in sorted(by_group.items())}}
    return facts, {s: rs[0] for s, rs in rows.items()}


def replay(args) -> dict:
    """The committed steps of args.replay recomputed with our engine (every group in one process) on the same failed
    sets, after check(): the largest relative difference of the losses through the first window with a dead group
    ("replay_rel_diff_first_window") and over the whole run ("replay_rel_diff"), printed as JSON."""
    from contextlib import nullcontext

    from mecefo.engine import Batched
    from mecefo.hf import HFCausalLM
    from mecefo.neighbour import LowRankWgrad
    from mecefo.plan import Piece
    from mecefo.policies import plan_step

    n = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    facts, steps = check(args.replay, n, args.steps)
    if not (facts["steps"] and facts["groups_agree"]):
        print(json.dumps(facts))
        sys.exit(f"{args.replay}: steps missing or committed twice, or groups disagree: no replay")
    model, dataset = build(args)
    batches = StepBatches(dataset, n, args.batch, seed=args.seed)

    class Source:  # our engine's data interface on the same batches
        def micro_batch(self, seed, step, rank=0, micro=0, n_ranks=1):
            x, y = batches.rows(step, Piece(rank, micro, 0, args.batch, args.batch))
            return x.numpy(), y.numpy()

    class Wrapped(HFCausalLM):  # our engine's model interface around the Llama, with this example's loss
        def forward(self, idx, targets=None, neighbour=None):
            with self.adapter.neighbour(neighbour):
                return loss_of(self.hf, (torch.as_tensor(idx), torch.as_tensor(targets)))

    wrapped = Wrapped(model)
    engine = Batched(wrapped, Source(), args.seed, torch.device(args.device), LowRankWgrad().bind(model), nullcontext,
                     n_ranks=n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    diffs = []
    for step in range(args.steps):
        plan = plan_step(args.policy, step, frozenset(steps[step]["failed"]), n, 1, args.batch)
        engine.lowrank.steps = step
        engine.prepare(plan)
        loss = engine.step(plan).loss
        optimizer.step()
        diffs.append(abs(loss / steps[step]["loss"] - 1))
    # Through the end of the first window with a dead group (the first half of the run without one): before training has
    # amplified the float32 rounding of sums made in other orders (AdamW grows it ~2-3x per 10 steps)
    failed = [s for s in range(args.steps) if steps[s]["failed"]]
    end = next((s for s in range(failed[0], args.steps) if not steps[s]["failed"]), args.steps) if failed else args.steps // 2
    facts["replay_rel_diff_first_window"] = max(diffs[:end + 1])
    facts["replay_rel_diff"] = max(diffs)
    facts["replay_rel_diff_every_10"] = [float(f"{max(diffs[i:i + 10]):.2e}") for i in range(0, len(diffs), 10)]
    print(json.dumps(facts))
    return facts


if __name__ == "__main__":
    a = parse()
    replay(a) if a.replay else train(a)
