"""Replacing a model's modules from outside (as gpt-fast's quantize.py and tp.py walk a plain
model): the quantizer and the backends install their modules this way, so model files never
name them."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# (qualified name, module, its parent) -> the module to put in its place, or None to keep it
# (and look inside it)
Replacement = Callable[[str, nn.Module, nn.Module], nn.Module | None]


def swap_modules(root: nn.Module, replace: Replacement) -> int:
    """Replaces modules under `root` by `replace`'s choice. Every choice is made on the model as
    it was (a replacement may read its parent's other children before they are replaced);
    a replaced module's own children are not visited. Returns how many were replaced."""
    plan: list[tuple[nn.Module, str, nn.Module]] = []
    _plan(root, "", replace, plan)
    for parent, name, new in plan:
        setattr(parent, name, new)
    return len(plan)


def _plan(module: nn.Module, prefix: str, replace: Replacement, plan: list) -> None:
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        new = replace(qualified, child, module)
        if new is None:
            _plan(child, f"{qualified}.", replace, plan)
        else:
            plan.append((module, name, new))
