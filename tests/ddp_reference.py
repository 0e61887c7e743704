"""Run under torchrun: one DDP step's averaged gradient on nano, each rank on its own micro-batch, saved by rank 0.
    torchrun --nproc_per_node N tests/ddp_reference.py OUT.pt"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mecefo.data import DataConfig, TokenData
from mecefo.model import GPT, preset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = TokenData(DataConfig(vocab_size=512, seq_len=64, micro_batch_size=4))
torch.manual_seed(0)
model = DDP(GPT(preset("nano", vocab_size=data.vocab_size)))
x, y = data.micro_batch(seed=0, step=0, rank=rank, n_ranks=world)
model(torch.as_tensor(x), torch.as_tensor(y)).backward()
if rank == 0:
    torch.save({n: p.grad for n, p in model.module.named_parameters()}, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # skip interpreter teardown, where gloo's worker threads can abort the process
