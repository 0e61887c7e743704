"""The language-model loss: mean next-token cross-entropy of logits = x W^T over the vocabulary.

    loss = (1/N) sum_i [ logsumexp_v (x_i W^T)_v - (x_i W^T)_{y_i} ]

mecefo.model.GPT computes it whole (the (N x V) logits, then torch's cross-entropy in fp32: the reference, and the
default on a CPU) or, with `loss_rows` set, in chunks of rows (`ChunkedCrossEntropy` here), never holding more than one
chunk's logits: at llama-1b on a GPU (V = 32000, N = 8 x 2048 rows) the whole fp32 logits alone are 2 GiB, and their
gradient as much again.
"""

from __future__ import annotations

import contextlib

import torch


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    on = torch.is_autocast_enabled(kind) and x.dtype != torch.float64
    return torch.get_autocast_dtype(kind) if on else None


class ChunkedCrossEntropy(torch.autograd.Function):
    """The loss above with rows in chunks: each chunk's logits in the compute dtype (autocast's, as the LM head would
    run, else x's), its log-sum-exp and softmax in fp32, and the gradients computed in the forward pass, chunk by chunk:
        G_logits = (softmax(x W^T) - onehot(y)) / N,   G_x = G_logits W,   G_W = sum over chunks G_logits^T x
    (G_W accumulated in fp32 at least); backward scales them by the loss's upstream gradient. Nothing of size N x V
    outlives a chunk. The same FLOPs as the whole computation (the logits once, two GEMMs for the gradients)."""

    @staticmethod
    def forward(ctx, x, weight, targets, rows, grads):
        dtype = _autocast_dtype(x) or x.dtype
        acc = torch.promote_types(dtype, torch.float32)
        n = x.shape[0]
        with torch.autocast(x.device.type, enabled=False) if _autocast_dtype(x) else contextlib.nullcontext():
            w = weight.to(dtype)
            if grads:
                grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            total = torch.zeros((), dtype=acc, device=x.device)
            for start in range(0, n, rows):
                xc, yc = x[start:start + rows].to(dtype), targets[start:start + rows]
                logits = (xc @ w.T).to(acc)
                lse = torch.logsumexp(logits, dim=-1)
                total += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
                if not grads:  # (an evaluation: the loss only)
                    continue
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                grad[torch.arange(len(yc), device=yc.device), yc] -= 1
                grad = grad.div_(n).to(dtype)
                grad_x[start:start + rows] = grad @ w
                if grad.dtype == acc:  # fp32 (or fp64): one GEMM in place (addmm with out=, which FlopCounterMode counts)
                    torch.addmm(grad_w, grad.T, xc, out=grad_w)
                elif x.is_cuda:  # a low-precision GEMM with fp32 output
                    grad_w += torch.ops.aten.mm.dtype(grad.T, xc, acc)
                else:  # (a CPU has no low-precision GEMM with fp32 output)
                    torch.addmm(grad_w, grad.T.to(acc), xc.to(acc), out=grad_w)
        if grads:
            ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return (total / n).to(acc)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss.to(grad_x.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """Mean cross-entropy of x W^T (x: ... x D, W: V x D, targets: ...) against targets, in chunks of `rows` rows."""
    if rows < 1:
        raise ValueError(f"loss chunk of {rows} rows: at least 1")
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)  # (no gradient work in an evaluation)
    return ChunkedCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1), rows, grads)
