"""Adam as ``torch.optim.Adam`` computes it, without torch.optim's start-up cost.

What it saves a user, on every rank of every job (training, inference, the planner's runs):
every method of ``torch.optim.Optimizer`` (``__init__``, ``step``, ``zero_grad``,
``state_dict``) is wrapped in ``torch._disable_dynamo``, whose first call imports TorchDynamo,
although hpcgnn never compiles. Building ``torch.optim.Adam`` and taking its first step in a
fresh process costs 1.5-1.6 s of CPU (2.4-4.2 s wall) and 68 MiB more peak resident memory
(322 against 252 MiB) than this class on the project's 2-core machine; later steps take the same
time with either (about 1 ms for a 0.1 M-parameter MLP; ``python -m benchmarks.optim``). :class:`Adam`
runs the same tensor operations in the same order as torch 2.13's default implementations,
so its results are bitwise equal to ``torch.optim.Adam``'s (tests/nn/test_optim.py):

* parameters off CUDA: torch's per-parameter loop (``_single_tensor_adam``);
* all parameters on CUDA (or XPU): torch's ``foreach`` path (``_multi_tensor_adam``: one list
  of parameter-sized temporaries at a time, grouped by device and dtype).

The step count is a float32 CPU scalar per parameter (no device synchronisation to read it),
and :meth:`Adam.state_dict` / :meth:`Adam.load_state_dict` use ``torch.optim.Adam``'s format,
so checkpoints move between the two. Only what hpcgnn trains with is offered: L2 weight decay
added to the gradient, no AMSGrad, no maximize, no capturable or fused kernels, no closures.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

_FOREACH_DEVICES = ("cuda", "xpu")


class Adam:
    """``torch.optim.Adam(params, lr, betas, eps, weight_decay)`` with torch's defaults
    otherwise (module docstring). Attributes as torch's: ``param_groups`` (list of dicts with
    ``params`` and the hyperparameters), ``state`` (parameter -> ``{"step", "exp_avg",
    "exp_avg_sq"}``), ``defaults``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        # the keys of torch.optim.Adam's groups, so that state_dict() is its format
        self.defaults = {"lr": float(lr), "betas": (float(betas[0]), float(betas[1])), "eps": float(eps),
                         "weight_decay": float(weight_decay), "amsgrad": False, "maximize": False,
                         "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                         "decoupled_weight_decay": False}
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups: list[dict] = []
        self.state: dict[torch.Tensor, dict] = {}
        seen: set[int] = set()
        for g in groups:
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:
                if not isinstance(p, torch.Tensor) or not p.is_leaf:
                    raise TypeError("optimizer can only optimize leaf Tensors")
                if id(p) in seen:
                    raise ValueError("some parameters appear in more than one parameter group")
                seen.add(id(p))
            self.param_groups.append({**self.defaults, **{k: v for k, v in g.items() if k != "params"},
                                      "params": ps})

    def __repr__(self) -> str:
        g = self.param_groups[0]
        return (f"Adam(lr={g['lr']}, betas={g['betas']}, eps={g['eps']}, weight_decay={g['weight_decay']}, "
                f"params={sum(len(g['params']) for g in self.param_groups)})")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero every parameter's gradient."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step for every parameter with a gradient (the first creates its state)."""
        for g in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                st = self.state.get(p)
                if not st:
                    st = self.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                params.append(p)
                grads.append(p.grad)
                avgs.append(st["exp_avg"])
                sqs.append(st["exp_avg_sq"])
                steps.append(st["step"])
            if not params:
                continue
            if any(torch.is_complex(p) for p in params):
                raise RuntimeError("hpcgnn's Adam steps real parameters only")
            beta1, beta2 = g["betas"]
            foreach = all(p.device.type in _FOREACH_DEVICES for p in params)
            (_foreach_adam if foreach else _per_tensor_adam)(
                params, grads, avgs, sqs, steps, lr=g["lr"], beta1=beta1, beta2=beta2,
                weight_decay=g["weight_decay"], eps=g["eps"])

    # ---- state in torch.optim's format ---------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``, the
        parameters numbered in group order as ``torch.optim.Optimizer.state_dict`` does."""
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(st) for p, st in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of ``torch.optim.Adam``: ValueError when its groups
        or their sizes differ from this optimizer's, KeyError when a part is missing. Moments are
        cast to their parameter's device and dtype; step counts stay float32 CPU scalars."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(a["params"]) != len(b["params"]) for a, b in zip(self.param_groups, groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size "
                             "of optimizer's group")
        by_index = {i: p for saved, own in zip(groups, self.param_groups) for i, p in zip(saved["params"], own["params"])}
        state: dict[torch.Tensor, dict] = {}
        for i, st in state_dict["state"].items():
            p = by_index.get(i)
            if p is None:
                continue
            new = {}
            for k, v in st.items():
                if k == "step":
                    new[k] = torch.as_tensor(v, dtype=torch.float32).detach().clone().cpu()
                elif isinstance(v, torch.Tensor):
                    if v.shape != p.shape:
                        raise ValueError(f"state '{k}' of parameter {i} has shape {tuple(v.shape)}, "
                                         f"the parameter {tuple(p.shape)}")
                    new[k] = v.detach().to(device=p.device, dtype=p.dtype).clone()
                else:
                    new[k] = v
            missing = {"step", "exp_avg", "exp_avg_sq"} - set(new)
            if missing:
                raise KeyError(f"state of parameter {i} lacks {sorted(missing)}")
            state[p] = new
        self.state = state
        for own, saved in zip(self.param_groups, groups):
            own.update({k: v for k, v in saved.items() if k != "params"})
            own["betas"] = tuple(own["betas"])


def _per_tensor_adam(params, grads, avgs, sqs, steps, *, lr, beta1, beta2, weight_decay, eps) -> None:
    """torch 2.13's ``_single_tensor_adam`` (defaults: no AMSGrad, maximize, capturable): the
    same operations in the same order (and so the same temporaries: the decayed gradient,
    the square root, the denominator while the previous parameter's is still referenced)."""
    for i, param in enumerate(params):
        grad = grads[i]
        exp_avg = avgs[i]
        exp_avg_sq = sqs[i]
        step_t = steps[i]
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _foreach_adam(params, grads, avgs, sqs, steps, *, lr, beta1, beta2, weight_decay, eps) -> None:
    """torch 2.13's ``_multi_tensor_adam`` (the same defaults), per (device, dtype) group."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    one = torch.tensor(1.0)
    for idx in groups.values():
        device_params = [params[i] for i in idx]
        device_grads = [grads[i] for i in idx]
        device_exp_avgs = [avgs[i] for i in idx]
        device_exp_avg_sqs = [sqs[i] for i in idx]
        device_state_steps = [steps[i] for i in idx]
        torch._foreach_add_(device_state_steps, one, alpha=1.0)
        if weight_decay != 0:
            device_grads = torch._foreach_add(device_grads, device_params, alpha=weight_decay)
        torch._foreach_lerp_(device_exp_avgs, device_grads, 1 - beta1)
        torch._foreach_mul_(device_exp_avg_sqs, beta2)
        torch._foreach_addcmul_(device_exp_avg_sqs, device_grads, device_grads, 1 - beta2)
        del device_grads
        bias_correction1 = [1 - beta1 ** s.item() for s in device_state_steps]
        bias_correction2 = [1 - beta2 ** s.item() for s in device_state_steps]
        step_size = [(lr / bc) * -1 for bc in bias_correction1]
        bias_correction2_sqrt = [bc ** 0.5 for bc in bias_correction2]
        exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)
        torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
        torch._foreach_add_(exp_avg_sq_sqrt, eps)
        torch._foreach_addcdiv_(device_params, device_exp_avgs, exp_avg_sq_sqrt, step_size)

