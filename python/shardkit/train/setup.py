"""Building blocks of ``python -m shardkit.train``: data, model, head, optimizers, checkpoints,
evaluation, report and plot (see :mod:`shardkit.train`)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sized, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler, Subset

import shardkit
from shardkit.parallel import DataParallelCriterion, DataParallelModel, PipelineModel
from shardkit.plan import balance_shards
from shardkit.train import checkpoint
from shardkit.train.argtypes import _head_misfit, _ram_bytes, held_out_bytes
from shardkit.train.cpu_bf16 import use_float32_where_bf16_fails
from shardkit.train.data import (
    ImageFolderDataset,
    SyntheticIdentities,
    VerificationSet,
    collate_uint8,
    verification_split,
)
from shardkit.train.errors import UsageError
from shardkit.train.metrics import impostor_pairs
from shardkit.train.models import Backbone, IResNet, build_backbone
from shardkit.train.world import World

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
CKPT_FILE = checkpoint.CKPT_FILE


class _RankBatches(Sampler[List[int]]):
    """This rank's micro-batches of one epoch, from batch ``start`` on: the order of torch's
    DistributedSampler (shuffled by ``seed + epoch``, drop_last), the same indices in the same
    order, kept as one int64 tensor (8 bytes per image, not a Python list) and cut into
    batches. Global batch b is the same set of samples for every world size (positions
    [b B W, (b+1) B W) of the epoch's permutation); skipping to ``start`` only slices indices,
    so a resume mid-epoch reads no data it does not train on."""

    def __init__(self, dataset: Sized, batch: int, world: World, seed: int, epoch: int, start: int) -> None:
        self.n, self.world_size, self.rank = len(dataset), world.size, world.rank
        self.seed, self.epoch = seed, epoch
        self.per_rank = self.n // self.world_size  # DistributedSampler's num_samples with drop_last
        self.batch, self.start = batch, start

    def __len__(self) -> int:
        return max(0, self.per_rank // self.batch - self.start)

    def __iter__(self) -> Iterator[List[int]]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g)
        mine = order[self.rank : self.per_rank * self.world_size : self.world_size]
        for b in range(self.start, self.per_rank // self.batch):
            yield mine[b * self.batch : (b + 1) * self.batch].tolist()


class Batches:
    """Micro-batch ``i`` of the run (epoch ``i // per_epoch``), in an order fixed by the seed:
    asking for the micro-batch after the last one continues the current loader, any other
    one (a resume) starts a loader at that position."""

    def __init__(self, dataset: TrainSet, batch: int, world: World, seed: int, workers: int) -> None:
        self.dataset, self.batch, self.world, self.seed, self.workers = dataset, batch, world, seed, workers
        self._it: Optional[Iterator[Tuple[torch.Tensor, torch.Tensor]]] = None
        self._next: Optional[int] = None

    def get(self, i: int, per_epoch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if i != self._next or self._it is None:  # (no loader only before the first call, when _next is None)
            epoch, start = divmod(i, per_epoch)
            # The loader's own generator (seeded by the run's seed and the epoch) gives its
            # workers their seeds: without one, every iter() drew from the global generator,
            # which PartialFC sampling also draws from, so a resume's extra mid-epoch loader
            # changed the negatives sampled after it.
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            loader = DataLoader(
                self.dataset,
                batch_sampler=_RankBatches(self.dataset, self.batch, self.world, self.seed, epoch, start),
                collate_fn=collate_uint8,
                num_workers=self.workers,
                pin_memory=torch.cuda.is_available(),
                generator=generator,
            )
            self._it = iter(loader)
        self._next = i + 1 if (i + 1) % per_epoch else None
        try:
            return next(self._it)
        except ValueError as e:
            line = decode_error_line(e)
            if line is None:
                raise
            raise UsageError(f"{line}; remove or replace that file in --data") from None


def decode_error_line(e: BaseException) -> Optional[str]:
    """The "cannot decode image <path>: ..." line of ``e`` (also from inside a DataLoader
    worker's re-raised error, whose first line only names the worker), else None."""
    for line in reversed(str(e).splitlines()):  # last: a worker's message quotes the raising source line first
        at = line.find("cannot decode image ")
        if at >= 0:
            return line[at:]
    return None


# the training images: a synthetic set, or the training classes of an image folder
TrainSet = Union[SyntheticIdentities, Subset[Tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class Parts:
    args: argparse.Namespace
    world: World
    train_set: TrainSet
    num_classes: int
    val_set: VerificationSet
    devices: List[torch.device]
    normalize: nn.Module
    backbone: nn.Module  # the plain module (EMA source, checkpoint)
    backbone_train: nn.Module  # what the step calls: the backbone, DataParallelModel or DDP
    head: shardkit.ShardedSoftmaxLoss
    criterion: Optional[nn.Module]
    optimizers: List[torch.optim.Optimizer]
    scaler: Optional[Any]
    ema: Optional[shardkit.ModelEMA]
    batches: Batches
    data_fingerprint: Optional[Dict[str, Any]] = None  # --data: what a resume must find there again

    def autocast(self) -> ContextManager[object]:
        if self.args.amp is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.args.amp == "bf16" else torch.float16
        return torch.autocast(self.devices[0].type, dtype=dtype)


def _folder_data(args: argparse.Namespace, world_size: int) -> Tuple[TrainSet, int, VerificationSet]:
    try:
        full = ImageFolderDataset(args.data, args.image_size, cache_ram=args.cache_ram)
    except ValueError as e:  # an empty or broken folder, an image that does not decode
        line = decode_error_line(e)  # (--cache-ram decoded decodes every image here)
        if line is not None:
            raise UsageError(f"{line}; remove or replace that file in --data") from None
        raise UsageError(f"{e}; point --data at a folder of class subfolders of images") from None
    k = len(full.classes)
    if k < args.val_classes + 2:
        raise UsageError(
            f"--data has {k} classes; need more than --val-classes={args.val_classes}, by 2 or more "
            f"(the last --val-classes classes are held out for verification; a softmax over one class has "
            f"loss 0: nothing to learn)"
        )
    train_k = k - args.val_classes
    labels = [lb for _, lb in full.samples]
    train_idx = [i for i, lb in enumerate(labels) if lb < train_k]
    val_idx = [i for i, lb in enumerate(labels) if lb >= train_k]
    if not train_idx or not val_idx:
        which = "training" if not train_idx else "held-out (the last --val-classes)"
        raise UsageError(f"--data {args.data!r}: the {which} class folders hold no images")
    _check_folder_fits(args, world_size, train_k, [labels[i] for i in val_idx])
    try:
        images = torch.stack([full[i][0] for i in val_idx])
    except ValueError as e:  # a held-out image that cannot be read or decoded
        raise UsageError(f"{e}; remove or replace that file in --data") from None
    ids = torch.tensor([labels[i] for i in val_idx])
    try:
        pairs = _pairs_from(images, ids, args.seed)
    except UsageError:  # --data holds out every image of its last classes: --val-per-class plays no part
        raise UsageError(
            f"--data {args.data!r}: the held-out classes (the last --val-classes={args.val_classes}) give no "
            "genuine or no impostor pairs; they need two or more images each, and two or more classes"
        ) from None
    return Subset(full, train_idx), train_k, pairs


def _check_folder_fits(args: argparse.Namespace, world_size: int, train_classes: int, held_out: List[int]) -> None:
    """The checks the synthetic data gets before the run starts, on --data's own sizes once the
    folder is listed: the head of its training classes on --devices, its held-out images and
    their pairs in RAM (a UsageError before anything large is built)."""
    misfit = _head_misfit(args, world_size, classes=train_classes)
    if misfit is not None:
        raise UsageError(misfit)
    ram = _ram_bytes()
    sizes = torch.bincount(torch.tensor(held_out)).tolist()
    genuine = sum(min(n * (n - 1) // 2, MAX_GENUINE_PER_CLASS) for n in sizes)
    need = held_out_bytes(len(held_out), genuine + 10000, args)
    if ram is not None and need > ram:
        raise UsageError(
            f"--data's held-out classes (the last --val-classes={args.val_classes}): {len(held_out)} images and "
            f"{genuine} genuine pairs need over {need / 2**30:.3g} GiB of RAM, this machine has {ram / 2**30:.3g} "
            "GiB; hold out fewer classes (--val-classes)"
        )


def data_fingerprint(full: ImageFolderDataset) -> Dict[str, Any]:
    """What --data holds, as a resume must find it again (its labels and batches follow from it):
    the class folders' names and image counts (a digest of them), and the totals."""
    counts = torch.bincount(full.labels, minlength=len(full.classes)).tolist()
    text = "\n".join(f"{name}\t{n}" for name, n in zip(full.classes, counts))
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return {"classes": len(full.classes), "images": len(full.samples), "digest": digest}


def _pairs_from(images: torch.Tensor, ids: torch.Tensor, seed: int, num_impostor: int = 10000) -> VerificationSet:
    """The genuine pairs of held-out images (every pair of a class, at most ``MAX_GENUINE_PER_CLASS``
    of a larger class: :func:`_genuine_pairs`) and ``num_impostor`` distinct random impostor pairs
    (all of them if there are fewer: :func:`shardkit.train.metrics.impostor_pairs`)."""
    genuine = _genuine_pairs(ids, seed)
    impostor = impostor_pairs(ids, num_impostor, torch.Generator().manual_seed(seed))
    if len(genuine) == 0 or len(impostor) == 0:
        raise UsageError("the held-out classes give no genuine or no impostor pairs; use more --val-per-class images")
    pairs = torch.cat([genuine, impostor])
    is_same = torch.cat([torch.ones(len(genuine), dtype=torch.bool), torch.zeros(len(impostor), dtype=torch.bool)])
    return VerificationSet(images, ids, pairs, is_same, len(genuine))


# A held-out class of n images has n(n-1)/2 genuine pairs: beyond this many (a class of over
# 141 images) a class gives this many, drawn deterministically from --seed (the memory of the
# pairs and of their scoring stays bounded: ~16 + 8 * --dim bytes a pair).
MAX_GENUINE_PER_CLASS = 10000


def _genuine_pairs(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """[P, 2] index pairs of same-class images, class by class in order of first appearance:
    all of a class's pairs, or ``MAX_GENUINE_PER_CLASS`` distinct ones drawn from ``seed``."""
    cap = MAX_GENUINE_PER_CLASS
    out = []
    for c, label in enumerate(torch.unique(ids).tolist()):
        members = (ids == label).nonzero().flatten()
        n = len(members)
        total = n * (n - 1) // 2
        if total <= 4 * cap:  # small enough to list: all of them, or a random subset
            a, b = torch.triu_indices(n, n, offset=1)
            if total > cap:
                g = torch.Generator().manual_seed((seed * 1000003 + c) % 2**63)
                pick = torch.randperm(total, generator=g)[:cap].sort().values
                a, b = a[pick], b[pick]
        else:  # draw pairs (i < j) at random; among 2 * cap draws of > 4 * cap pairs, >= cap distinct ones
            g = torch.Generator().manual_seed((seed * 1000003 + c) % 2**63)
            i = torch.randint(0, n, (2 * cap,), generator=g)
            j = torch.randint(0, n - 1, (2 * cap,), generator=g)
            j = j + (j >= i).long()  # j != i
            lo, hi = torch.minimum(i, j), torch.maximum(i, j)
            first = _first_occurrences(lo * n + hi)[:cap]
            a, b = lo[first], hi[first]
        out.append(torch.stack([members[a], members[b]], 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def _first_occurrences(keys: torch.Tensor) -> torch.Tensor:
    """The positions of the first occurrence of each distinct value of ``keys``, in draw order."""
    _, inverse = torch.unique(keys, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(keys), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(len(keys)), reduce="amin")
    return first.sort().values


def init_weights(kind: str, backbone: nn.Module, head: nn.Module, num_classes: int) -> None:
    """``--init``: xavier or kaiming for the backbone's conv/linear weights and the head's
    rows (the head's bounds from its full [classes, dim] shape, not a shard's); default keeps torch's."""
    if kind == "default":
        return
    with torch.no_grad():
        for mod in backbone.modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                if kind == "xavier":
                    nn.init.xavier_uniform_(mod.weight)
                else:
                    nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
                if mod.bias is not None:
                    mod.bias.zero_()
        for w in head.parameters():
            dim = w.shape[1]
            if kind == "xavier":
                bound = (6.0 / (dim + num_classes)) ** 0.5
                w.uniform_(-bound, bound)
            else:
                w.normal_(0.0, (2.0 / dim) ** 0.5)


def build(args: argparse.Namespace, world: World) -> Parts:
    if args.data:
        train_set, num_classes, val_set = _folder_data(args, world.size)
        assert isinstance(train_set, Subset) and isinstance(train_set.dataset, ImageFolderDataset)
        fingerprint = data_fingerprint(train_set.dataset)
    else:
        fingerprint = None
        train_set = SyntheticIdentities(args.classes, args.per_class, args.image_size, args.seed)
        num_classes = args.classes
        val_set = verification_split(
            args.val_classes, args.val_per_class, args.image_size, args.seed, train_classes=args.classes
        )
    devices = list(args.devices)
    dev0 = devices[0]
    backbone = build_backbone(args.backbone, args.dim, checkpointing=args.checkpointing).to(dev0)
    if args.amp == "bf16" and dev0.type == "cpu":
        use_float32_where_bf16_fails(backbone)  # torch's bf16 CPU kernel: see shardkit.train.cpu_bf16
    margin = {
        "arcface": lambda: shardkit.ArcFace(s=args.scale, m=args.m),
        "cosface": lambda: shardkit.CosFace(s=args.scale, m=args.m),
        "none": lambda: None,
    }[args.margin]()
    group = None
    if world.size > 1:
        group = dist.group.WORLD
    pipeline = build_pipeline(args, backbone, devices) if args.pipeline else None
    head = shardkit.ShardedSoftmaxLoss(
        args.dim,
        num_classes,
        margin=margin,
        sample_rate=args.sample_rate,
        process_group=group,
        devices=None if group is not None else devices,
        shard_sizes=None if pipeline is None else pipeline_shard_sizes(pipeline, num_classes, args.dim),
        topk=(1,),
    )
    if group is not None:
        head.to(dev0)
    init_weights(args.init, backbone, head, num_classes)
    criterion = None
    backbone_train: nn.Module = backbone
    if pipeline is not None:
        backbone_train = pipeline
    elif args.dp:
        ids = [d.index if d.type == "cuda" else d for d in devices]
        backbone_train = DataParallelModel(backbone, device_ids=ids)
        criterion = DataParallelCriterion(head, device_ids=ids)
    elif world.size > 1:
        backbone_train = nn.parallel.DistributedDataParallel(
            backbone, device_ids=[dev0.index] if dev0.type == "cuda" else None
        )
    decay: List[nn.Parameter] = []
    no_decay: List[nn.Parameter] = []
    for p in backbone.parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    opt_backbone = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        momentum=0.9,
    )
    # The head's rows get a row-sparse gradient under sampling: SparseRowSGD leaves the others alone.
    opt_head = shardkit.SparseRowSGD(head.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(dev0.type) if args.amp == "fp16" else None
    ema = shardkit.ModelEMA(backbone, decay=args.ema, tau=args.ema_tau) if args.ema > 0 else None
    normalize = shardkit.Normalize(MEAN, STD, input_layout="NHWC").to(dev0)
    parts = Parts(
        args,
        world,
        train_set,
        num_classes,
        val_set,
        devices,
        normalize,
        backbone,
        backbone_train,
        head,
        criterion,
        [opt_backbone, opt_head],
        scaler,
        ema,
        Batches(train_set, args.batch, world, args.seed, args.workers),
        fingerprint,
    )
    return parts


def build_pipeline(
    args: argparse.Namespace, backbone: Union[Backbone, IResNet], devices: List[torch.device]
) -> PipelineModel:
    """--pipeline: the backbone's layers over the devices, one stage each, balanced by their
    measured time on a sample batch; output (the embeddings) back on the first device."""
    sample = torch.randn(max(2, args.batch // max(args.chunks, 1)), 3, args.image_size, args.image_size,
                         device=devices[0])  # fmt: skip
    layers = backbone.as_layers()
    if len(layers) < len(devices):
        raise UsageError(f"--pipeline: the {args.backbone} backbone has {len(layers)} layers, fewer than the "
                         f"{len(devices)} devices; pass fewer --devices")  # fmt: skip
    balance = PipelineModel.balance_by(layers, sample, len(devices), by="time")
    return PipelineModel(layers, devices, chunks=args.chunks, balance=balance, output_device=devices[0],
                         checkpoint="except_last" if args.checkpointing else "never")  # fmt: skip


def pipeline_shard_sizes(pipeline: PipelineModel, num_classes: int, dim: int) -> List[int]:
    """Head classes per device that even out each device's memory with its backbone stage."""
    used = [sum(t.numel() * t.element_size() for t in list(part.parameters()) + list(part.buffers()))
            for part in pipeline.partitions]  # fmt: skip
    return balance_shards(num_classes, dim, used)
