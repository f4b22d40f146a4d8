"""Synchronised BatchNorm for PyTorch (--sync-batchnorm), on the CPU as on a GPU.

torch.nn.SyncBatchNorm refuses CPU tensors (torch 2.13) and needs a torch.distributed
process group; this one takes a `reduce` function instead, which sums a small flat
float32 tensor in place over the ranks that share a batch (the transport's polled
allreduce, through its staging on a GPU). Per layer and step:

- forward: ONE reduction of [sum(x - k), sum((x - k)^2), count] per channel, k the running
  mean (the same on every rank; shifting by it keeps E[x^2] - E[x]^2 from cancelling when
  the mean is large against the spread), so every rank normalises with the mean and
  variance of the whole batch and updates its running statistics with the same numbers
  (the unbiased variance over the global count, as torch does);
- backward: ONE reduction of [sum(dy), sum(dy * xhat)] per channel (the input gradient
  needs the whole batch's); the weight and bias gradients stay this rank's own sums, which
  the gradient allreduce adds up like every other gradient.

Until a `reduce` is given, and in eval mode, a layer is plain BatchNorm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["SyncBatchNorm", "convert_batchnorm"]

Reduce = Callable[[torch.Tensor], None]


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, shift, eps, reduce, sums):
        c = x.shape[1]
        dims, shape = _channel_dims(x)
        xf = x.float()
        centred = xf - shift.view(shape)
        sums[:c] = centred.sum(dims)
        sums[c : 2 * c] = (centred * centred).sum(dims)
        sums[2 * c] = x.numel() // c
        reduce(sums)
        count = float(sums[2 * c])
        if count <= 1:
            raise ValueError(
                f"synchronised BatchNorm: expected more than 1 value per channel over all ranks when "
                f"training, got input of size {list(x.shape)} and {count:.0f} in all"
            )
        offset = sums[:c] / count
        var = (sums[c : 2 * c] / count - offset * offset).clamp_min(0.0)
        mean = shift + offset
        invstd = torch.rsqrt(var + eps)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        out = xhat * weight.view(shape) + bias.view(shape) if weight is not None else xhat
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.reduce, ctx.sums, ctx.count, ctx.input_dtype = reduce, sums, count, x.dtype
        unbiased = var * (count / (count - 1))
        ctx.mark_non_differentiable(mean, unbiased)
        return out.to(x.dtype), mean, unbiased

    @staticmethod
    def backward(ctx, grad_out, _grad_mean, _grad_var):
        xhat, weight, invstd = ctx.saved_tensors
        c = xhat.shape[1]
        dims, shape = _channel_dims(xhat)
        dy = grad_out.float()
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:  # the same on every rank: the graph is the same
            sums = ctx.sums
            sums[:c] = sum_dy
            sums[c : 2 * c] = sum_dy_xhat
            sums[2 * c] = 0.0
            ctx.reduce(sums)
            mean_dy, mean_dy_xhat = sums[:c] / ctx.count, sums[c : 2 * c] / ctx.count
            scale = invstd * weight if weight is not None else invstd
            grad_x = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            grad_x = grad_x.to(ctx.input_dtype)
        affine = weight is not None
        return grad_x, sum_dy_xhat if affine else None, sum_dy if affine else None, None, None, None, None


def _channel_dims(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The dimensions a channel's statistics run over, and the shape of a per-channel vector
    broadcast against x (N, C, ...)."""
    return [0, *range(2, x.dim())], [1, x.shape[1], *([1] * (x.dim() - 2))]


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the batch of every rank `reduce` sums over; the parameters and running
    statistics are those of the layer it replaced (the same tensors)."""

    reduce: Reduce | None = None
    sums: torch.Tensor | None = None

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    @classmethod
    def replacing(cls, layer: nn.modules.batchnorm._BatchNorm) -> SyncBatchNorm:
        sync = cls(
            layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats, device="meta"
        )
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(sync, name, getattr(layer, name))  # the same Parameter or buffer (or None)
        sync.train(layer.training)
        return sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        synchronised = self.training and self.reduce is not None
        if not synchronised:
            return super().forward(x)
        factor = 0.0
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        shift = (
            self.running_mean.detach().float()
            if self.running_mean is not None
            else torch.zeros(x.shape[1], device=x.device)
        )
        out, mean, var = _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, shift, self.eps, self.reduce, self._sums(x)
        )
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.running_mean.mul_(1.0 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1.0 - factor).add_(var, alpha=factor)
        return out

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's reduction buffer, made once where the layer runs (not a registered
        buffer: it is no model state)."""
        if self.sums is None or self.sums.device != x.device:
            self.sums = torch.zeros(2 * self.num_features + 1, dtype=torch.float32, device=x.device)
        return self.sums


def convert_batchnorm(model: nn.Module) -> tuple[nn.Module, list[SyncBatchNorm]]:
    """`model` with every BatchNorm1d/2d/3d (and torch's own SyncBatchNorm) replaced by a
    SyncBatchNorm holding the same parameters and buffers, and the layers replaced."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm) and not isinstance(model, SyncBatchNorm):
        sync = SyncBatchNorm.replacing(model)
        return sync, [sync]
    layers: list[SyncBatchNorm] = []
    for name, child in model.named_children():
        converted, inside = convert_batchnorm(child)
        if converted is not child:
            setattr(model, name, converted)
        layers += inside
    if isinstance(model, SyncBatchNorm):
        layers.append(model)
    return model, layers
