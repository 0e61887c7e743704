"""MeCeFO's neighbour techniques on a model this repository does not own (a Hugging Face LLaMA-family causal
LM, or any pre-norm decoder whose blocks have an attention and an FFN submodule), without editing its code.

    adapter = Adapter(model, "llama")              # presets: LAYOUTS; or Layout(...) with your module names
    with adapter.neighbour(Neighbour(MECEFO, lowrank)):
        loss = loss_of(model(x))                   # this micro-batch as a neighbour's
    loss.backward()                                # inside or after the block: the techniques' backward
    lowrank.finish()                               # pieces need nothing of it; once per optimizer step

Inside `neighbour(...)` the adapter replaces, on the instances only, the forward of the modules the
techniques act on; on leaving it removes them, so outside (normal mode) the model's forward and gradients
are exactly its own (nothing is wrapped, nothing registered):
- skip_attention: each block's attention module runs under no_grad (its output feeds the residual; no
  gradient reaches its parameters nor, through it, the norm before it, which feeds nothing else);
- recompute_ffn, low_rank_wgrad: a gated FFN (gate, up, down linears and an activation, SwiGLU's SiLU by
  default or the module's act_fn) runs as mecefo.neighbour.NeighbourFFN, as our GPT's does: it keeps its
  input (and the three x V1 under low_rank_wgrad), recomputes gate and up in backward, and accumulates the
  low-rank factors in fp32 buffers. Where the FFN's RMSNorm sits outside the FFN module (Hugging Face's
  post_attention_layernorm), the Function keeps the norm's output and the norm keeps its own saved input:
  one more (B, T, D) tensor per layer than our GPT, whose Function spans norm and FFN. An FFN with another
  number of linears runs under torch's non-reentrant checkpoint, its linears as mecefo.neighbour's
  low-rank linear, during the forward and the checkpoint's recomputation alike;
- skip_ffn: the FFN module runs under no_grad; low_rank_head: the LM head as low_rank_wgrad's linears.
These are mecefo.neighbour's techniques (the same Neighbour object, the same LowRankWgrad), applied by module
name instead of by our model's code: on our GPT with the "mecefo" layout they give its own neighbour mode's
loss and gradients (tests), and on a LlamaForCausalLM with our GPT's weights mapped in, the same as our
GPT's (tests, tolerance stated there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

import torch.nn.functional as F

from .neighbour import Neighbour, low_rank_linear, neighbour_ffn


@dataclass(frozen=True)
class Layout:
    """Where the techniques act, by module name: the blocks (a dotted path to a ModuleList), and in each
    block its attention and FFN submodules with the norms before them, the FFN's linears, the LM head."""

    layers: str
    attention: str
    ffn: str
    ffn_linears: tuple[str, ...]
    head: str
    attention_norm: str
    ffn_norm: str


_HF_LLAMA = Layout("model.layers", "self_attn", "mlp", ("gate_proj", "up_proj", "down_proj"), "lm_head",
                   "input_layernorm", "post_attention_layernorm")
LAYOUTS = {
    "mecefo": Layout("layers", "attention", "ffn", ("gate_proj", "up_proj", "down_proj"), "lm_head",
                     "attention_norm", "ffn_norm"),  # this repository's GPT (mecefo.model)
    "llama": _HF_LLAMA, "mistral": _HF_LLAMA, "qwen2": _HF_LLAMA,  # transformers' LlamaForCausalLM & co.
}


class Adapter:
    """The techniques for `model`, whose modules `layout` (a Layout or a LAYOUTS name) names."""

    def __init__(self, model: torch.nn.Module, layout: Layout | str):
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise ValueError(f"layout {layout!r}; presets: {', '.join(LAYOUTS)} (or a mecefo.adapter.Layout)")
            layout = LAYOUTS[layout]
        self.model, self.layout = model, layout
        try:
            self.blocks = list(model.get_submodule(layout.layers))
            for block in self.blocks:
                for name in (layout.attention, layout.ffn, layout.attention_norm, layout.ffn_norm):
                    block.get_submodule(name)
                for name in layout.ffn_linears:
                    block.get_submodule(layout.ffn).get_submodule(name)
            self.head = model.get_submodule(layout.head)
        except AttributeError as e:
            raise ValueError(f"the model has no module the layout names ({e}); give your model's names with "
                             "mecefo.adapter.Layout") from None

    def ffn_linears(self) -> list[torch.nn.Linear]:
        """The FFN projections of every block, in order: the matrices low_rank_wgrad applies to."""
        return [b.get_submodule(self.layout.ffn).get_submodule(n) for b in self.blocks for n in self.layout.ffn_linears]

    def group_of(self, param_name: str) -> str:
        """The aggregation group of a parameter (mecefo.model.group_of's groups): 'attention.<l>' (the attention
        module and its norm), 'ffn.<l>' (the FFN and its norm), 'head', and for the rest 'embedding' or 'norm'."""
        prefix = self.layout.layers + "."
        if param_name.startswith(prefix):
            layer, rest = param_name[len(prefix):].split(".", 1)
            kind = "attention" if rest.startswith((self.layout.attention + ".", self.layout.attention_norm + ".")) else "ffn"
            return f"{kind}.{layer}"
        if param_name.startswith(self.layout.head + "."):
            return "head"
        return "norm" if "norm" in param_name else "embedding"

    @contextlib.contextmanager
    def neighbour(self, neighbour: Neighbour | None):
        """The model as `neighbour`'s techniques make it, inside the block (None: normal mode, untouched)."""
        patched: list[torch.nn.Module] = []

        def patch(module: torch.nn.Module, forward) -> None:
            module.forward = forward
            patched.append(module)

        t = neighbour.techniques if neighbour is not None else None
        try:
            if t is not None:
                for block in self.blocks:
                    if t.skip_attention:
                        attention = block.get_submodule(self.layout.attention)
                        patch(attention, _no_grad(_own(attention)))
                    ffn = block.get_submodule(self.layout.ffn)
                    if t.skip_ffn:
                        patch(ffn, _no_grad(_own(ffn)))
                    elif t.recompute_ffn or t.low_rank_wgrad:
                        patch(ffn, self._ffn(ffn, neighbour))
                if t.low_rank_head:
                    head = self.head
                    patch(head, lambda x: low_rank_linear(head, x, neighbour.lowrank))
            yield self.model
        finally:
            for module in patched:
                del module.forward  # the class's forward again

    def _ffn(self, ffn: torch.nn.Module, neighbour: Neighbour):
        t, original = neighbour.techniques, _own(ffn)
        linears = [ffn.get_submodule(n) for n in self.layout.ffn_linears]
        if len(linears) == 3:  # a gated FFN (gate, up, down): mecefo.neighbour's NeighbourFFN, as our own GPT's
            act = getattr(ffn, "act_fn", F.silu)  # (Hugging Face's MLPs name their activation act_fn)
            lowrank = neighbour.lowrank if t.low_rank_wgrad else None

            def fused(x, *args, **kwargs):
                if not torch.is_grad_enabled() or args or kwargs:
                    return original(x, *args, **kwargs)
                return neighbour_ffn(x, None, linears, act, lowrank, t.recompute_ffn)

            return fused

        def run(*args, **kwargs):
            if not t.low_rank_wgrad:
                return original(*args, **kwargs)
            with _low_rank(linears, neighbour):  # entered again by the checkpoint's recomputation
                return original(*args, **kwargs)

        def forward(*args, **kwargs):
            if t.recompute_ffn and torch.is_grad_enabled():
                if neighbour.held is not None:
                    neighbour.held.append(args[0])
                return checkpoint(run, *args, use_reentrant=False, **kwargs)
            return run(*args, **kwargs)

        return forward


def _own(module: torch.nn.Module):
    """The module's class forward, bound (whatever is patched on the instance)."""
    return type(module).forward.__get__(module)


def _no_grad(forward):
    def run(*args, **kwargs):
        with torch.no_grad():
            return forward(*args, **kwargs)
    return run


@contextlib.contextmanager
def _low_rank(linears: list[torch.nn.Linear], neighbour: Neighbour):
    for linear in linears:
        linear.forward = (lambda lin: lambda x: low_rank_linear(lin, x, neighbour.lowrank))(linear)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward
