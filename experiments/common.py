"""Shared by the experiment modules: result paths and configs (mecefo.results), CLI error handling, and
independent runs two at a time (`in_parallel`)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Iterable, Iterator

from tqdm import tqdm

from mecefo.errors import guarded
from mecefo.results import CONFIGS, RESULTS, ROOT, load_config, run_dir

__all__ = ["CONFIGS", "RESULTS", "ROOT", "default_jobs", "guarded", "in_order", "in_parallel", "load_config", "run_dir"]


def default_jobs(best: int) -> int:
    """How many runs at once: MECEFO_JOBS if set, else `best` (what the caller measured fastest on 2 cores,
    `python -m experiments.bench_jobs`: small training runs gain nothing two at a time, best = 1; experiments.rate_gpt
    end to end and the pure-Python simulator do, best = 2) up to one per core."""
    env = os.environ.get("MECEFO_JOBS")
    return max(1, int(env)) if env else max(1, min(best, os.cpu_count() or 1))


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def in_parallel(fn: Callable, items: Iterable, jobs: int) -> Iterator[tuple[int, object]]:
    """(index, fn(item)) for every item, in the order they finish. jobs > 1: `jobs` spawned processes of one torch
    thread each, however few the items (so that every item of a run computes with the same threads; fn and the items
    must pickle; an exception in fn is raised here); jobs = 1: here, in order, with this process's threads."""
    items = list(items)
    if not items:
        return
    if jobs <= 1:
        for i, item in enumerate(items):
            yield i, fn(item)
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread) as pool:
        futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
        for f in as_completed(futures):
            yield futures[f], f.result()


def in_order(fn: Callable, items: Iterable, jobs: int, desc: str) -> list:
    """[fn(item) for item in items], computed by in_parallel `jobs` at a time, with a progress bar."""
    items = list(items)
    out: list = [None] * len(items)
    with tqdm(total=len(items), desc=desc, disable=not sys.stderr.isatty()) as bar:
        for i, result in in_parallel(fn, items, jobs):
            out[i] = result
            bar.update()
    return out
