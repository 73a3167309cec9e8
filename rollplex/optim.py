"""AdamW with FP32 master weights for low-precision parameters, and the learning-rate schedule.

When the model runs in bfloat16 (GPU), updates of size lr·g ≈ 1e-6 vanish in bf16 arithmetic, so the
optimizer keeps an FP32 master copy of every trainable parameter (paper §3.2: "permanent state"),
applies ``torch.optim.AdamW`` to the masters with the gradients upcast to FP32, and writes the result
back into the bf16 parameters (the new snapshot θ_{k+1}). In float32/float64 the parameters are their
own masters and this is plain ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch


class MasterWeightAdamW:
    """AdamW over FP32 masters of ``params``.

    Args:
        params: trainable parameters (any floating dtype).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
    """

    @classmethod
    def for_model(cls, model: torch.nn.Module, optim) -> MasterWeightAdamW:
        """Over ``model``'s trainable parameters, with the settings of an ``OptimConfig`` (config.optim)."""
        params = [p for p in model.parameters() if p.requires_grad]
        return cls(
            params,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )

    def __init__(
        self, params: list[torch.nn.Parameter], *, lr: float, betas, eps: float, weight_decay: float
    ):
        self.params = list(params)
        self.shadow = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.params)
        if self.shadow:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        else:
            self.masters = self.params
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clip the global gradient norm to ``max_grad_norm`` (0 = no clipping), step, zero gradients.
        A gradient whose global norm is not finite (a NaN or inf in it, or a norm past float32's range)
        is dropped without a step: the weights and the AdamW state stay as they were, where stepping
        would write NaN into every weight (and every later checkpoint).

        Returns:
            The global L2 gradient norm before clipping (float, finite or inf/nan as computed; not
            finite means the step was skipped).
        """
        if self.shadow:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None  # one parameter at a time: never both full gradient copies at once
        norm = torch.nn.utils.clip_grad_norm_(
            self.masters, max_grad_norm if max_grad_norm > 0 else float("inf")
        )
        if not torch.isfinite(norm):
            self.zero_grad()
            return float(norm)
        self.inner.step()
        if self.shadow:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.zero_grad()
        return float(norm)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.shadow:
            for m in self.masters:
                m.grad = None

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        state = {"inner": self.inner.state_dict()}
        if self.shadow:
            state["masters"] = [m.detach().cpu() for m in self.masters]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        if self.shadow:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)


def learning_rate(step: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant ``base_lr``."""
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, (step + 1) / warmup_steps)
