"""A Hugging Face causal LM as the trainer's model: `--hf_config path/config.json` (a transformers config of
the Llama, Mistral or Qwen2 family; built from it, randomly initialised and seeded, never downloaded).

HFCausalLM wraps the transformers model with our GPT's interface (forward(idx, targets, neighbour) -> mean
next-token cross-entropy; layers; the aggregation groups by module name; the FFN matrices), and applies the
neighbour techniques through mecefo.adapter. The cost accounting (mecefo.costs: FLOPs, activation bytes, the
memory check) counts our GPT's shapes: for a config that has them (as many key/value heads as heads, no
biases) it is exact; otherwise `cost_accounting` says what it leaves out.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .adapter import Adapter
from .errors import UsageError
from .model import ModelConfig

FAMILIES = ("llama", "mistral", "qwen2")


def read_config(path: str) -> dict:
    """The config.json's values (a folder holding one, or the file), checked: a supported family."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        values = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"model.hf_config={path!r} cannot be read as a Hugging Face config.json ({type(e).__name__})") from None
    if values.get("model_type") not in FAMILIES:
        raise UsageError(f"model.hf_config={path!r}: model_type {values.get('model_type')!r}; supported: {', '.join(FAMILIES)}")
    shape = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    for key in shape:
        if not isinstance(values.get(key), int) or isinstance(values[key], bool) or values[key] < 1:
            raise UsageError(f"model.hf_config={path!r}: {key} must be a positive integer, not {values.get(key)!r}")
    heads, kv_heads = values["num_attention_heads"], values.get("num_key_value_heads", values["num_attention_heads"])
    if values["hidden_size"] % heads:
        raise UsageError(f"model.hf_config={path!r}: num_attention_heads {heads} does not divide hidden_size "
                         f"{values['hidden_size']}")
    if (values["hidden_size"] // heads) % 2:
        raise UsageError(f"model.hf_config={path!r}: the head width hidden_size/num_attention_heads = "
                         f"{values['hidden_size'] // heads} must be even (rotary position embeddings)")
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise UsageError(f"model.hf_config={path!r}: num_key_value_heads {kv_heads!r} does not divide num_attention_heads {heads}")
    return values


def model_config(values: dict, vocab_size: int) -> tuple[ModelConfig, str]:
    """Our GPT's shape of the config (for the cost accounting) and whether that accounting is exact."""
    if values["vocab_size"] < vocab_size:
        raise UsageError(f"model.hf_config has vocab_size {values['vocab_size']} < the tokenizer's {vocab_size}")
    heads = values["num_attention_heads"]
    cfg = ModelConfig(vocab_size=values["vocab_size"], dim=values["hidden_size"], n_layers=values["num_hidden_layers"],
                      n_heads=heads, ffn_dim=values["intermediate_size"],
                      max_seq_len=values.get("max_position_embeddings", 2048), norm_eps=values.get("rms_norm_eps", 1e-6))
    left_out = []
    if values.get("num_key_value_heads", heads) != heads:
        left_out.append(f"grouped key/value heads ({values['num_key_value_heads']} of {heads}): k, v projections counted whole")
    if values.get("attention_bias") or values["model_type"] == "qwen2":
        left_out.append("attention biases")
    if values.get("mlp_bias"):
        left_out.append("FFN biases")
    if values.get("tie_word_embeddings"):
        left_out.append("the head tied to the embedding: counted as two matrices")
    return cfg, "exact" if not left_out else "our GPT's shapes; not counted: " + "; ".join(left_out)


class HFCausalLM(nn.Module):
    """The transformers model built from `values` (seeded by the caller), or a transformers model built elsewhere
    (a torchft loop's: the local replay of mecefo.for_torchft), with our GPT's interface."""

    def __init__(self, values: dict | nn.Module):
        super().__init__()
        if isinstance(values, nn.Module):
            self.hf = values
        else:
            try:
                import transformers
            except ImportError:
                raise UsageError("model.hf_config needs transformers: pip install -e .[hf]") from None
            values = dict(values)
            config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
            config._attn_implementation = "sdpa"
            self.hf = transformers.AutoModelForCausalLM.from_config(config)
        self.adapter = Adapter(self.hf, "llama")  # the three families share transformers' Llama module names
        self.layers = self.adapter.blocks  # (a plain list: the modules stay registered under hf)

    @property
    def lm_head(self) -> nn.Linear:
        return self.adapter.head

    def ffn_linears(self) -> list[nn.Linear]:
        return self.adapter.ffn_linears()

    def group_of(self, param_name: str) -> str:
        return self.adapter.group_of(param_name.removeprefix("hf."))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, neighbour=None):
        with self.adapter.neighbour(neighbour):
            logits = self.hf(idx).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
