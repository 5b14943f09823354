"""Small ResNet-style embedding backbones for face-recognition-style training.

``Backbone`` maps normalized images ``[N, C, H, W]`` (float/bf16/fp16, any H, W) to
embeddings ``[N, embedding_dim]`` (not L2-normalized: margin losses normalize them).

Layout: a 3x3 stem at full resolution, ``len(depths)`` stages of BasicBlocks (each stage
halves the resolution in its first block), then an embedding head like face models use:
BN -> (global average pool | flatten) -> dropout -> Linear -> BatchNorm1d.

Presets (``build_backbone(name)``): ``tiny`` (~0.3M parameters, ~500+ img/s fwd+bwd at 32x32
on 2 CPU cores), ``small``, ``r18`` (ResNet-18 widths and depths), and ``iresnet50``
(:class:`IResNet`: the ResNet-50-sized "improved ResNet" face models train at 112x112,
43.6M parameters with 512-d embeddings).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["BasicBlock", "Backbone", "IBlock", "IResNet", "PRESETS", "build_backbone"]

# "arch" picks the class (Backbone unless "iresnet"); the rest are its keyword arguments.
PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(widths=(16, 32, 64, 128), depths=(1, 1, 1, 1), stem_stride=2),
    "small": dict(widths=(32, 64, 128, 256), depths=(1, 2, 2, 1), stem_stride=2),
    "r18": dict(widths=(64, 128, 256, 512), depths=(2, 2, 2, 2)),
    "iresnet50": dict(arch="iresnet", depths=(3, 4, 14, 3)),
}


def _act(kind: str, channels: int) -> nn.Module:
    if kind == "prelu":
        return nn.PReLU(channels)
    if kind == "relu":
        return nn.ReLU(inplace=True)
    raise ValueError(f"argument `act` must be 'prelu' or 'relu', got {kind!r}")


@contextlib.contextmanager
def _frozen_bn_stats(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers of ``module`` normalize with the batch's statistics (as in training)
    and leave their running statistics and ``num_batches_tracked`` as they were. The op must
    be the same as in the forward (the checkpoint compares what both save), so the running
    statistics are still passed, with momentum 0: ``(1 - 0) * running + 0 * batch`` is exact."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = []
    for m in bns:
        counter = m.num_batches_tracked
        assert counter is not None  # registered with the running statistics
        saved.append((m.momentum, counter, counter.clone()))  # clone: no device sync
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, counter, tracked) in zip(bns, saved):
            m.momentum = momentum
            counter.copy_(tracked)


def _no_bn_update_on_recompute(stage: nn.Module) -> Callable[[], Tuple[ContextManager[None], ContextManager[None]]]:
    """A ``context_fn`` for torch.utils.checkpoint: the forward updates BatchNorm's running
    statistics once; the recomputation in the backward leaves them alone."""
    return lambda: (contextlib.nullcontext(), _frozen_bn_stats(stage))


class BasicBlock(nn.Module):
    """conv3x3(stride) - BN - act - conv3x3 - BN, plus an identity or 1x1-conv shortcut, then act.

    Shapes: ``[N, c_in, H, W] -> [N, c_out, ceil(H / stride), ceil(W / stride)]``.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1, act: Literal["prelu", "relu"] = "prelu") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.act1 = _act(act, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.act2 = _act(act, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act2(y + self.shortcut(x))


class Backbone(nn.Module):
    """ResNet-style image -> embedding network.

    Args:
        widths: output channels of each stage (one entry per stage).
        depths: BasicBlocks per stage (same length as ``widths``).
        embedding_dim: D, the embedding size.
        in_channels: image channels (3 for RGB).
        act: ``"prelu"`` (face-model default) or ``"relu"``.
        head: ``"pool"`` (global average pooling; any input size) or ``"flatten"``
            (flatten the last feature map, as face models do; needs ``image_size``).
        image_size: input side length, required by ``head="flatten"``.
        dropout: dropout before the embedding Linear.
        stem_stride: stride of the stem conv (2 quarters the cost of everything after it).
        checkpointing: recompute each stage in the backward (``torch.utils.checkpoint``),
            trading compute for activation memory. The recomputation normalizes with the
            batch's statistics as the forward did but does not update BatchNorm's running
            statistics again, so they match a run without checkpointing.

    Shapes: ``[N, in_channels, H, W]`` float -> ``[N, embedding_dim]`` of the same dtype.
    """

    def __init__(
        self,
        widths: Sequence[int] = PRESETS["tiny"]["widths"],
        depths: Sequence[int] = PRESETS["tiny"]["depths"],
        embedding_dim: int = 128,
        *,
        in_channels: int = 3,
        act: Literal["prelu", "relu"] = "prelu",
        head: Literal["pool", "flatten"] = "pool",
        image_size: Optional[int] = None,
        dropout: float = 0.0,
        stem_stride: int = 1,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if len(widths) != len(depths) or not widths:
            raise ValueError(f"`widths` and `depths` must be non-empty and of equal length, got {widths} and {depths}")
        if head not in ("pool", "flatten"):
            raise ValueError(f"argument `head` must be 'pool' or 'flatten', got {head!r}")
        self.checkpointing = checkpointing
        self.embedding_dim = embedding_dim
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, stem_stride, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            _act(act, widths[0]),
        )
        stages, c = [], widths[0]
        for w, d in zip(widths, depths):
            blocks = [BasicBlock(c, w, stride=2, act=act)] + [BasicBlock(w, w, 1, act) for _ in range(d - 1)]
            stages.append(nn.Sequential(*blocks))
            c = w
        self.stages = nn.ModuleList(stages)
        self.head_kind = head
        self.feature_side: Optional[int] = None  # the final map's side with head="flatten"
        self.bn_features = nn.BatchNorm2d(c)
        if head == "flatten":
            if image_size is None:
                raise ValueError("head='flatten' needs `image_size` (the input side length)")
            side = (image_size + stem_stride - 1) // stem_stride
            for _ in widths:
                side = (side + 1) // 2
            self.feature_side = side
            n_in = c * side * side
        else:
            n_in = c
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(n_in, embedding_dim)
        self.bn_embedding = nn.BatchNorm1d(embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        use_ckpt = self.checkpointing and self.training and torch.is_grad_enabled()
        for stage in self.stages:
            x = _run_stage(stage, x, use_ckpt)
        return _neck(self, _to_device_of(self.fc, x))

    def as_layers(self) -> List[nn.Module]:
        """The backbone as a list of layers in order (stem, each block, the embedding neck),
        sharing this module's submodules (and so its state_dict), for
        :class:`shardkit.parallel.PipelineModel`."""
        return [self.stem] + _blocks(self.stages) + [_Neck(self)]


def _blocks(stages: nn.ModuleList) -> List[nn.Module]:
    """Every block of the stages (each an nn.Sequential of blocks), in order."""
    return [block for stage in stages for block in cast(nn.Sequential, stage)]


def _run_blocks(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Block by block, each on its own parameters' device: PipelineModel splits a backbone at
    # block boundaries (as_layers), so one stage's blocks may sit on different devices.
    for block in stage.children():  # a stage is an nn.Sequential of blocks
        x = block(_to_device_of(block, x))
    return x


def _run_stage(stage: nn.Module, x: torch.Tensor, use_ckpt: bool) -> torch.Tensor:
    """One stage of blocks, recomputed in the backward when ``use_ckpt``."""
    if use_ckpt:
        return checkpoint(_run_blocks, stage, x, use_reentrant=False, context_fn=_no_bn_update_on_recompute(stage))
    return _run_blocks(stage, x)


def _to_device_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    p = next(module.parameters(), None)
    return x if p is None or p.device == x.device else x.to(p.device, non_blocking=True)


def _neck(m: Union[Backbone, IResNet, _Neck], x: torch.Tensor) -> torch.Tensor:
    """Feature map -> embedding: BN, global pooling or flatten, dropout, FC, BN."""
    x = m.bn_features(x)
    if m.head_kind == "flatten":
        if x.shape[-1] != m.feature_side or x.shape[-2] != m.feature_side:
            raise ValueError(
                f"head='flatten' was built for {m.feature_side}x{m.feature_side} final feature "
                f"maps (image_size), got {x.shape[-2]}x{x.shape[-1]}"
            )
        x = torch.flatten(x, 1)
    else:
        x = x.mean(dim=(2, 3))
    return m.bn_embedding(m.fc(m.dropout(x)))


class _Neck(nn.Module):
    """The backbone's embedding neck as one pipeline layer (the same module objects)."""

    def __init__(self, backbone: Union[Backbone, IResNet]) -> None:
        super().__init__()
        self.bn_features, self.dropout, self.fc = backbone.bn_features, backbone.dropout, backbone.fc
        self.bn_embedding = backbone.bn_embedding
        self.head_kind, self.feature_side = backbone.head_kind, backbone.feature_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _neck(self, x)


def build_backbone(
    name: Literal["tiny", "small", "r18", "iresnet50"] = "tiny", embedding_dim: int = 128, **overrides: Any
) -> Union[Backbone, IResNet]:
    """A backbone from a preset name: a :class:`Backbone` (``tiny``, ``small``, ``r18``) or an
    :class:`IResNet` (``iresnet50``); keyword arguments override the preset or any argument
    of that class."""
    if name not in PRESETS:
        raise ValueError(f"unknown backbone {name!r}; choose one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[name])
    kwargs.update(overrides)
    if kwargs.pop("arch", "resnet") == "iresnet":
        return IResNet(embedding_dim=embedding_dim, **kwargs)
    return Backbone(embedding_dim=embedding_dim, **kwargs)


class IBlock(nn.Module):
    """The residual block of the face-recognition "improved ResNet" (IResNet): BN - conv3x3 -
    BN - PReLU - conv3x3(stride) - BN on the residual branch (normalized input, the stride in
    the second conv), a 1x1-conv(stride) + BN shortcut where the shape changes, and no
    activation after the sum.

    Shapes: ``[N, c_in, H, W] -> [N, c_out, ceil(H / stride), ceil(W / stride)]``.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.bn_in = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, 1, 1, bias=False)
        self.bn_mid = nn.BatchNorm2d(c_out)
        self.act = nn.PReLU(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride, 1, bias=False)
        self.bn_out = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn_out(self.conv2(self.act(self.bn_mid(self.conv1(self.bn_in(x))))))
        return y + self.shortcut(x)


class IResNet(nn.Module):
    """The IResNet face-recognition backbone (ArcFace's ResNet-50/100 family) for 112x112 faces.

    Layout: a 3x3 stem (stride 1, 64 channels) - BN - PReLU; four stages of :class:`IBlock`
    of widths 64, 128, 256, 512, each halving the resolution in its first block (112 -> 7);
    then BN2d - flatten of the 7x7 map - dropout - Linear(512 * 49, D) - BatchNorm1d(D) whose
    scale is fixed at 1 (a parameter with ``requires_grad=False``; its shift learns). With
    ``depths=(3, 4, 14, 3)`` and D = 512 that is 43.6M parameters (``iresnet50``).

    Args:
        depths: IBlocks per stage.
        embedding_dim: D.
        widths: channels per stage.
        dropout: before the embedding Linear.
        checkpointing: recompute each stage in the backward, as :class:`Backbone`.
        feature_side: the final feature map's side the Linear is built for (7, from 112).
            Inputs of another size work: their final map is average-pooled to it
            (``adaptive_avg_pool2d``); at 112x112 nothing is pooled.

    Shapes: ``[N, 3, H, W]`` float -> ``[N, embedding_dim]`` of the same dtype.
    """

    def __init__(
        self,
        depths: Sequence[int] = (3, 4, 14, 3),
        embedding_dim: int = 512,
        *,
        widths: Sequence[int] = (64, 128, 256, 512),
        dropout: float = 0.0,
        checkpointing: bool = False,
        feature_side: int = 7,
    ) -> None:
        super().__init__()
        if len(widths) != len(depths) or not widths or min(depths) < 1:
            raise ValueError(
                f"`widths` and `depths` must be non-empty, of equal length, depths >= 1, got {widths}, {depths}"
            )
        self.checkpointing = checkpointing
        self.embedding_dim = embedding_dim
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.PReLU(widths[0])
        )
        stages, c = [], widths[0]
        for w, d in zip(widths, depths):
            stages.append(nn.Sequential(IBlock(c, w, 2), *[IBlock(w, w, 1) for _ in range(d - 1)]))
            c = w
        self.stages = nn.ModuleList(stages)
        # the embedding neck, named as Backbone's so that _neck and _Neck serve both
        self.head_kind, self.feature_side = "flatten", feature_side
        self.bn_features = nn.BatchNorm2d(c)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(c * feature_side * feature_side, embedding_dim)
        self.bn_embedding = nn.BatchNorm1d(embedding_dim)
        self.bn_embedding.weight.requires_grad_(False)  # scale fixed at 1: BN centres and shifts only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        use_ckpt = self.checkpointing and self.training and torch.is_grad_enabled()
        for stage in self.stages:
            x = _run_stage(stage, x, use_ckpt)
        return _neck(self, _fit_side(_to_device_of(self.fc, x), self.feature_side))

    def as_layers(self) -> List[nn.Module]:
        """Stem, each block, the neck: for :class:`shardkit.parallel.PipelineModel` (as
        :meth:`Backbone.as_layers`)."""
        return [self.stem] + _blocks(self.stages) + [_FittedNeck(self)]


def _fit_side(x: torch.Tensor, side: int) -> torch.Tensor:
    """The final feature map at ``side`` x ``side``: unchanged when it is (112x112 inputs),
    average-pooled to it otherwise."""
    if x.shape[-2] == side and x.shape[-1] == side:
        return x
    return nn.functional.adaptive_avg_pool2d(x, side)


class _FittedNeck(_Neck):
    """IResNet's neck as one pipeline layer: the side fitted, then :func:`_neck`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.feature_side is not None  # IResNet's neck is built for a fixed side
        return _neck(self, _fit_side(x, self.feature_side))
