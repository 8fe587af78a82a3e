"""Choosing and wrapping a LightningModule's submodules with :class:`~lightning_ort.ORTModule`.

Shared by :class:`~lightning_ort.ORTDDPStrategy`, :class:`~lightning_ort.ORTSingleDeviceStrategy` and
:class:`~lightning_ort.ORTCallback`. Wrapping is idempotent: a submodule that already is an ORTModule stays.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

from torch import nn
from torchmetrics import Metric

from lightning_ort.engine.capture.blocks import resolve_blocks
from lightning_ort.engine.torch_internals import LossBase
from lightning_ort.lightning.config import ORTConfig
from lightning_ort.module import ORTModule
from lightning_ort.options import BlockSpec


def default_module_names(root: nn.Module) -> list[str]:
    """Direct children of ``root`` holding trainable parameters, excluding metrics and losses."""
    return [
        name
        for name, child in root.named_children()
        if not isinstance(child, (Metric, LossBase)) and any(p.requires_grad for p in child.parameters())
    ]


def wrap_submodules(root: nn.Module, config: ORTConfig, missing_ok: bool = False) -> dict[str, ORTModule]:
    """Replace the configured submodules of ``root`` by ORTModules; return every ORTModule under ``root``.

    All names are resolved before anything is replaced, so a bad name leaves ``root`` unchanged.

    Args:
        root: the LightningModule (or any module).
        config: which submodules and with which options.
        missing_ok: skip configured names that do not exist yet (``configure_model`` has not run) instead of
            failing.
    """
    names = list(config.modules) if config.modules is not None else default_module_names(root)
    targets: list[tuple[nn.Module, str, nn.Module]] = []
    target_paths: list[str] = []
    for path in names:
        found = _resolve(root, path, missing_ok)
        if found is None:
            continue
        parent, attribute, module = found
        if not isinstance(module, ORTModule):
            targets.append((parent, attribute, module))
            target_paths.append(path)
    options = config.module_options
    blocks = _blocks_per_target([module for _, _, module in targets], options.blocks)
    axes = _dynamic_axes_per_target([module for _, _, module in targets], target_paths, options.dynamic_axes)
    for (parent, attribute, module), path, block_classes, dynamic_axes in zip(targets, target_paths, blocks, axes):
        wrapped = ORTModule.with_options(module, options=config.options_for(path, block_classes, dynamic_axes))
        setattr(parent, attribute, wrapped)
    return wrapped_submodules(root)


def _blocks_per_target(
    modules: Sequence[nn.Module], blocks: Sequence[BlockSpec] | str | None
) -> list[list[type[nn.Module]]]:
    """The block classes of each module; a named class no module holds is an error listing the repeated ones."""
    if blocks is None or blocks == "auto":
        return [resolve_blocks(module, blocks) for module in modules]
    for name in blocks:
        if modules and not any(resolve_blocks(module, [name], missing_ok=True) for module in modules):
            resolve_blocks(modules[0], [name])
    return [resolve_blocks(module, blocks, missing_ok=True) for module in modules]


def _dynamic_axes_per_target(
    modules: Sequence[nn.Module], paths: Sequence[str], dynamic_axes: Mapping[str, tuple[int, ...]] | None
) -> list[dict[str, tuple[int, ...]] | None]:
    """Each module's share of ``dynamic_axes``: the names its ``forward`` takes.

    Raises:
        ValueError: a name that no module's ``forward`` takes.
    """
    if not dynamic_axes or not modules:
        return [None] * len(modules)
    parameters = [inspect.signature(module.forward).parameters for module in modules]
    taken = [{name: axes for name, axes in dynamic_axes.items() if name in names} for names in parameters]
    unused = sorted(set(dynamic_axes) - {name for share in taken for name in share})
    if unused:
        forwards = "; ".join(f"`{path}`: {list(names)}" for path, names in zip(paths, parameters))
        raise ValueError(
            f"dynamic_axes names {unused}, which no wrapped network's forward takes ({forwards}). Use the names "
            "of the forward parameters that receive the batch's tensors."
        )
    return [share or None for share in taken]


def wrapped_submodules(root: nn.Module) -> dict[str, ORTModule]:
    """Every ORTModule inside ``root``, by attribute path."""
    return {name: module for name, module in root.named_modules() if isinstance(module, ORTModule)}


def _resolve(root: nn.Module, path: str, missing_ok: bool) -> tuple[nn.Module, str, nn.Module] | None:
    parent = root
    *parents, attribute = path.split(".")
    for index, part in enumerate([*parents, attribute]):
        child = getattr(parent, part, None)
        if not isinstance(child, nn.Module):
            if missing_ok and child is None:
                return None
            done = ".".join([*parents, attribute][:index])
            where = f"`{done}`" if done else type(root).__name__
            available = ", ".join(name for name, _ in parent.named_children()) or "none"
            raise ValueError(
                f"modules={path!r}: {where} has no submodule {part!r}. Its children are: {available}. "
                "Pass attribute names of the LightningModule, dotted for nested ones (e.g. 'model.encoder')."
            )
        if index < len(parents):
            if isinstance(child, ORTModule):
                raise ValueError(
                    f"modules={path!r} lies inside `{part}`, which is already an ORTModule; wrap either the outer "
                    "module or the inner one, not both."
                )
            parent = child
        else:
            return parent, attribute, child
    return None
