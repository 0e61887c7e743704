"""Run configuration: one frozen dataclass per concern, loaded from TOML, every field overridable from the CLI.

TOML sections are the dataclasses' names ([model], [data], [optim], [train], [cluster]). On the command line a field
is named by itself (`--lr 3e-4`, `--steps 30`) or with its section (`--optim.lr 3e-4`); field names are
unique across sections so the short form is never ambiguous.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .cluster import ClusterConfig
from .data import DataConfig
from .errors import UsageError
from .model import PRESETS
from .records import stable_hash


@dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"  # see mecefo.model.PRESETS; the vocabulary size comes from the tokenizer
    hf_config: str = ""  # a Hugging Face config.json (Llama/Mistral/Qwen2) to train instead of our GPT (mecefo.hf)

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise UsageError(f"model.preset={self.preset!r}; allowed: {', '.join(PRESETS)}")
        if self.hf_config:
            from .hf import read_config

            read_config(self.hf_config)


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # adamw (the paper's experiments) | sgd (momentum SGD, the paper's theory)
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at min_lr_ratio * lr
    warmup_steps: int = 50  # linear warmup, then cosine decay
    weight_decay: float = 0.1  # AdamW only; applied to matrices, not to norm weights
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    momentum: float = 0.9  # SGD only
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def validate(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise UsageError(f"optim.optimizer={self.optimizer!r}; allowed: 'adamw', 'sgd'")
        if not self.lr > 0:
            raise UsageError(f"optim.lr={self.lr} must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UsageError(f"optim.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "momentum"):
            if getattr(self, name) < 0:
                raise UsageError(f"optim.{name}={getattr(self, name)} must be non-negative")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UsageError(f"optim.{name}={getattr(self, name)} must lie in [0, 1)")


MAX_STEPS = 10_000_000  # the paper's longest run is 60k steps; a schedule of 1e9 steps would not fit in memory


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600  # optimizer steps
    eval_every: int = 100  # validation every k steps (and always at the end)
    checkpoint_every: int = 200  # 0: only the final checkpoint
    keep_checkpoints: int = 1  # the latest (OUT/checkpoint) and the K - 1 before it (OUT/checkpoint.step-S-*)
    log_every: int = 20  # plain progress lines when not on a terminal
    seed: int = 0  # model initialisation and data order
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    loss_rows: int = -1  # the loss in chunks of this many rows (mecefo.loss); 0: the whole logits; -1: auto (below)
    compile: bool = False  # torch.compile every block (mecefo.model.compile_blocks), neighbour passes included

    def resolved_loss_rows(self) -> int:
        """-1 (auto): 4096-row chunks on CUDA (no fp32 logits of the whole vocabulary), the whole logits on a CPU (whose
        numerics stay those of the results and goldens computed before chunks existed)."""
        if self.loss_rows != -1:
            return self.loss_rows
        return 4096 if self.resolved_device() == "cuda" else 0

    def resolved_device(self) -> str:
        """The device type the run will use: cuda for auto when a CUDA device is present."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def validate(self) -> None:
        if not 1 <= self.steps <= MAX_STEPS:
            raise UsageError(f"train.steps={self.steps} must lie in 1..{MAX_STEPS:,} (the failure schedule keeps a failed "
                             "set per step)")
        if self.seed < 0:
            raise UsageError(f"train.seed={self.seed} must be non-negative")
        for name in ("eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"train.{name}={getattr(self, name)} must be at least 1")
        if self.checkpoint_every < 0:
            raise UsageError(f"train.checkpoint_every={self.checkpoint_every} must be non-negative")
        if self.keep_checkpoints < 1:
            raise UsageError(f"train.keep_checkpoints={self.keep_checkpoints} must be at least 1 (the latest)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"train.device={self.device!r}; allowed: 'auto', 'cpu', 'cuda'")
        if self.loss_rows < -1:
            raise UsageError(f"train.loss_rows={self.loss_rows}; allowed: a number of rows, 0 (whole) or -1 (auto)")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise UsageError(f"train.precision={self.precision!r}; allowed: 'auto', 'fp32', 'bf16'")


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> "Config":
        if self.data.c4_train_tokens == 0:  # sized to the run (mecefo.data.run_tokens)
            from .data import run_tokens

            sized = run_tokens(self.train.steps, self.cluster.ranks, self.data)
            return replace(self, data=replace(self.data, c4_train_tokens=sized)).validate()
        for section in fields(self):
            getattr(self, section.name).validate()
        if self.model.hf_config and self.train.loss_rows > 0:
            raise UsageError("train.loss_rows applies to our GPT; a model.hf_config model takes its whole logits")
        if self.model.hf_config and self.train.compile:
            raise UsageError("train.compile applies to our GPT's blocks; a model.hf_config model runs eager")
        if self.model.hf_config and self.cluster.shard != "none":
            raise UsageError("model.hf_config trains with cluster.shard='none' (FSDP2 sharding is built for our GPT)")
        if self.model.hf_config:
            from .hf import read_config

            limit = read_config(self.model.hf_config).get("max_position_embeddings", 2048)
            if self.data.seq_len > limit:
                raise UsageError(f"data.seq_len={self.data.seq_len} exceeds model.hf_config's max_position_embeddings={limit}")
        elif self.data.seq_len > PRESETS[self.model.preset].max_seq_len:
            raise UsageError(f"data.seq_len={self.data.seq_len} exceeds the {self.model.preset} preset's "
                             f"max_seq_len={PRESETS[self.model.preset].max_seq_len}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Identity of the results this config produces (logging cadence, device, checkpoints kept and who computes V1
        excluded; fields added after results existed are left out at their default, so those results keep their
        identity)."""
        d = self.to_dict()
        for k in ("log_every", "device", "keep_checkpoints", "compile"):  # (how a run is kept or run, not what it computes)
            d["train"].pop(k)
        d["cluster"].pop("low_rank_refresh")  # (which rank computes a V1, not what it is)
        if self.cluster.backend == "local":  # (it runs every rank's micro-batch m in one pass whatever neighbour_pass says)
            d["cluster"]["neighbour_pass"] = "sequential"
        d["train"]["loss_rows"] = self.train.resolved_loss_rows()  # (auto: what it does on this device)
        if self.train.precision == "auto" and self.train.resolved_device() == "cuda":
            d["train"]["precision"] = "bf16"  # what auto does there (on a CPU, auto is fp32 and hashed as "auto")
        if self.model.hf_config:  # the config's content, not where it lies
            from .hf import read_config

            d["model"]["hf_config"] = "sha:" + stable_hash(read_config(self.model.hf_config))
        for (section, key), default in HASH_NEUTRAL_DEFAULTS.items():
            if d[section][key] == default:
                d[section].pop(key)
        return stable_hash(d)


HASH_NEUTRAL_DEFAULTS = {("cluster", "failure_free_steps"): 0, ("model", "hf_config"): "", ("train", "loss_rows"): 0,
                         ("cluster", "neighbour_pass"): "sequential"}


RENAMED = {"low_rank": "r"}  # old key -> new key, refused with a message naming the new one


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}


def _convert(section: str, name: str, kind: type, value):
    where = f"{section}.{name}"
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise UsageError(f"{where}={value!r} must be true or false")
    if isinstance(value, bool):  # TOML's `steps = true` is not a number
        raise UsageError(f"{where}={value!r} must be of type {kind.__name__}")
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        converted = kind(value)
    except (TypeError, ValueError):
        raise UsageError(f"{where}={value!r} must be of type {kind.__name__}") from None
    if kind is float and not math.isfinite(converted):
        raise UsageError(f"{where}={value!r} must be a finite number")
    return converted


def _field_types(cls) -> dict[str, type]:
    return {f.name: type(f.default) for f in fields(cls)}


def build(values: dict[str, dict]) -> Config:
    """A validated Config from {section: {field: value}}; unknown sections or fields are errors."""
    sections = _sections()
    kwargs = {}
    for section, cls in sections.items():
        given = dict(values.get(section, {}))
        types = _field_types(cls)
        unknown = sorted(set(given) - set(types))
        for old in unknown:
            if old in RENAMED:
                raise UsageError(f"config key {section}.{old} was renamed: use {section}.{RENAMED[old]} (--{RENAMED[old]})")
        if unknown:
            raise UsageError(f"unknown config key {section}.{unknown[0]}; allowed in [{section}]: {', '.join(types)}")
        kwargs[section] = cls(**{k: _convert(section, k, types[k], v) for k, v in given.items()})
    extra = sorted(set(values) - set(sections))
    if extra:
        raise UsageError(f"unknown config section [{extra[0]}]; allowed: {', '.join(sections)}")
    return Config(**kwargs).validate()


def load(path: str | Path | None, overrides: dict[str, str] | None = None) -> Config:
    """Read a TOML file (or start from defaults when path is None) and apply `--name value` overrides."""
    values: dict[str, dict] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"config file {path} does not exist")
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"config file {path} is not valid TOML: {e}") from None
        except UnicodeDecodeError:
            raise UsageError(f"config file {path} is not a text TOML file") from None
        for section, body in values.items():
            if not isinstance(body, dict):
                raise UsageError(f"config key {section!r} in {path} must sit inside a [section]")
    owner = {name: section for section, cls in _sections().items() for name in _field_types(cls)}
    for key, value in (overrides or {}).items():
        section, _, name = key.rpartition(".")
        if not section:
            if name in RENAMED:
                raise UsageError(f"option --{name} was renamed: use --{RENAMED[name]}")
            if name not in owner:
                raise UsageError(f"unknown option --{key}; allowed: {', '.join('--' + n for n in owner)}")
            section = owner[name]
        values.setdefault(section, {})[name] = value
    return build(values)


def _comments(cls) -> dict[str, str]:
    """Each field's trailing comment in its dataclass's source: the one place a field's meaning is written."""
    import inspect
    import re

    names = {f.name for f in fields(cls)}
    found = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+= .*?(?:  # (.*))?$", line)
        if m and m.group(1) in names:
            found[m.group(1)] = (m.group(2) or "").strip()
    return found


def fields_help() -> str:
    """Every config field with its default and meaning (the --help of mecefo.train and mecefo.launch), read from
    the dataclasses themselves so that it cannot drift from them."""
    lines = ["config fields, each overridable as --name VALUE or --section.name VALUE (dashes and underscores alike):"]
    for section, cls in _sections().items():
        lines.append(f"  [{section}]")
        notes = _comments(cls)
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"    --{f.name} {default!r}".ljust(40) + (f"  {notes[f.name]}" if notes.get(f.name) else ""))
    return "\n".join(lines)


def add_flag(parser, name: str, **kwargs) -> None:
    """An entry point's own flag, accepted with dashes and with underscores alike (--stop-after, --stop_after)."""
    spellings = dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name.replace('-', '_')}"])
    parser.add_argument(*spellings, dest=name.replace("-", "_"), **kwargs)


def with_overrides(cfg: Config, **sections: dict) -> Config:
    """A copy of cfg with some fields replaced, e.g. with_overrides(cfg, train={"steps": 10})."""
    return replace(cfg, **{s: replace(getattr(cfg, s), **v) for s, v in sections.items()}).validate()
