"""Benchmark: what mecefo.adapter costs a Hugging Face model. A LlamaForCausalLM of the tiny preset's shape
(nano with --quick), built from a config (no download), one micro-batch forward and backward:
- normal mode through the adapter (`with adapter.neighbour(None)`) against the unwrapped model: target a
  ratio of at least 0.98 of the unwrapped model's speed (the adapter installs nothing in normal mode);
- MeCeFO's neighbour mode through the adapter against our GPT's own neighbour mode on the same weights
  (the cost of applying the techniques by module name).
Alternating the settings within each round; the median over rounds of each time ratio. Writes
results/bench/adapter-<profile>.json; skipped (with a note) where transformers is not installed.

    python -m experiments.bench_adapter [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mecefo.adapter import Adapter
from mecefo.model import GPT, preset
from mecefo.neighbour import MECEFO, LowRankWgrad, Neighbour
from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.results import quick_flag

from .common import RESULTS, guarded


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install -e .[hf]); nothing to measure")
        return 0
    name, rows, seq, rounds = ("nano", 8, 64, 5) if quick else ("tiny", 16, 128, 9)
    cfg = preset(name)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False, attn_implementation="sdpa"))
    adapter = Adapter(llama, "llama")
    lowrank_hf, lowrank_ours = LowRankWgrad().bind(llama), LowRankWgrad().bind(gpt)
    x = torch.randint(0, cfg.vocab_size, (rows, seq))
    y = torch.roll(x, -1, dims=1)

    def hf(neighbour, wrapped: bool) -> float:
        llama.zero_grad(set_to_none=True)
        t = time.perf_counter()
        if wrapped:
            with adapter.neighbour(neighbour):
                loss = F.cross_entropy(llama(x).logits.float().view(-1, cfg.vocab_size), y.reshape(-1))
        else:
            loss = F.cross_entropy(llama(x).logits.float().view(-1, cfg.vocab_size), y.reshape(-1))
        loss.backward()
        lowrank_hf.finish()
        return time.perf_counter() - t

    def ours(neighbour) -> float:
        gpt.zero_grad(set_to_none=True)
        t = time.perf_counter()
        gpt(x, y, neighbour=neighbour).backward()
        lowrank_ours.finish()
        return time.perf_counter() - t

    settings = {"hf unwrapped": lambda: hf(None, False), "hf adapter normal": lambda: hf(None, True),
                "hf adapter mecefo": lambda: hf(Neighbour(MECEFO, lowrank_hf), True),
                "ours mecefo": lambda: ours(Neighbour(MECEFO, lowrank_ours))}
    for run in settings.values():  # warm-up (and the V1 of every FFN matrix)
        run()
    times = {k: [] for k in settings}
    for _ in range(rounds):
        for k, run in settings.items():
            times[k].append(run())
    normal = statistics.median(u / a for u, a in zip(times["hf unwrapped"], times["hf adapter normal"]))
    neighbour = statistics.median(o / a for o, a in zip(times["ours mecefo"], times["hf adapter mecefo"]))
    result = {"model": name, "rows": rows, "seq_len": seq, "rounds": rounds, "times_s": times,
              "normal_speed_ratio": normal, "normal_target": 0.98, "normal_meets_target": normal >= 0.98,
              "neighbour_speed_vs_our_gpt": neighbour, "git_commit": git_commit(), "packages": package_versions()}
    path = RESULTS / "bench" / f"adapter-{'quick' if quick else 'default'}.json"
    atomic_write_json(path, result)
    print(f"adapter, normal mode: {normal:.3f}x the unwrapped model's speed (target >= 0.98); MeCeFO neighbour mode: "
          f"{neighbour:.3f}x our GPT's -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
