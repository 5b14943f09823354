"""What ``python -m shardkit.train`` prints before training: the run's header (data, backbone
size and cost, the head's shards and their memory from the planner, the recipe) and the
warnings about settings that do not do what they seem to on this machine."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, List, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from shardkit.distributed import sampled_class_counts
from shardkit.plan import format_size, plan_memory
from shardkit.train.checks import batch_norm_warning
from shardkit.train.world import World

if TYPE_CHECKING:
    from shardkit.train.setup import Parts


def backbone_flops(backbone: torch.nn.Module, image_size: int, device: torch.device) -> int:
    """Forward FLOPs (a multiply-add counts 2) of one image, counted by torch's FlopCounterMode."""
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            backbone(torch.zeros(1, 3, image_size, image_size, device=device))
        return counter.get_total_flops()
    finally:
        backbone.train(was_training)


def _margin(args: argparse.Namespace) -> str:
    if args.margin == "none":
        return f"plain softmax, s={args.scale:g}"
    return f"{'ArcFace' if args.margin == 'arcface' else 'CosFace'} s={args.scale:g} m={args.m:g}"


def lines(parts: Parts, args: argparse.Namespace, world: World, total: int, steps_per_epoch: int) -> List[str]:
    """The header, as lines."""
    head, dev0 = parts.head, parts.devices[0]
    out = [f"shardkit.train: {total} steps ({steps_per_epoch} per epoch), seed {args.seed}, writing to {args.out}"]
    if args.data:
        src = f"--data {args.data}: {parts.num_classes} classes, {len(parts.train_set)} images, cache {args.cache_ram}"
    else:
        src = f"synthetic identities: {args.classes} x {args.per_class} images"
    out.append(f"data: {src}, {args.image_size}x{args.image_size}; verification on {args.val_classes} held-out ids")
    # The write-up's arithmetic: each worker keeps prefetch_factor (2) uint8 batches in host RAM.
    batch_bytes = args.batch * args.image_size**2 * 3
    workers = (
        f"{args.workers} worker processes, ~{format_size(2 * args.workers * batch_bytes)} of prefetched batches"
        if args.workers
        else "in the main process (--workers N to decode in parallel)"
    )
    out.append(f"loader: {workers}")
    params = sum(p.numel() for p in parts.backbone.parameters())
    flops = backbone_flops(parts.backbone, args.image_size, dev0)
    out.append(
        f"backbone: {args.backbone}, {params / 1e6:.2f}M parameters, {flops / 1e6:.1f} MFLOPs/image forward, "
        f"init {args.init}{', checkpointing' if args.checkpointing else ''}"
    )
    n = world.size if world.size > 1 else len(head.shard_sizes)
    per_device_batch = args.batch if world.size > 1 else max(1, args.batch // n)
    sampling = "off" if args.sample_rate >= 1 else f"rate {args.sample_rate:g}"
    out.append(
        f"head: {parts.num_classes} classes x {args.dim}-d, {_margin(args)}, sampling {sampling}, init {args.init}"
    )
    if world.size > 1:
        plan = plan_memory(parts.num_classes, args.dim, n, per_device_batch, sample_rate=args.sample_rate)
        each = format_size(plan.shardkit_max.total)
        out.append(f"  {world.size} ranks, ~{math.ceil(parts.num_classes / n)} classes and {each} of head memory each")
    else:
        for d, off, size in zip(head.devices, head.class_offsets, head.shard_sizes):
            # the planner's figure for this shard's own size (--pipeline's shards are uneven)
            mem = plan_memory(size, args.dim, 1, per_device_batch * n, sample_rate=args.sample_rate) if size else None
            size_text = format_size(mem.devices[0].total) if mem else "none (no classes)"
            out.append(f"  {d}: classes [{off}, {off + size}), head memory {size_text} (weights, momentum, grad, loss)")
    amp = args.amp or "off"
    ema = f"decay {args.ema:g}, warm-up tau {args.ema_tau:g}" if args.ema > 0 else "off"
    out.append(
        f"step: batch {args.batch} x {args.accumulate} micro-batches x {world.size} rank(s) = "
        f"{args.batch * args.accumulate * world.size} images; lr {args.lr:g} (5% warm-up, cosine to 0); "
        f"AMP {amp}; EMA {ema}"
    )
    mode = "data-parallel (--dp)" if args.dp else ("DDP" if world.size > 1 else "backbone on the first")
    if args.pipeline:
        pipe = parts.backbone_train
        mode = (f"backbone pipelined (--pipeline): layers per stage {pipe.balance}, {args.chunks} micro-batches; "
                f"head classes per device {list(parts.head.shard_sizes)}")  # fmt: skip
    out.append(f"devices: {', '.join(str(d) for d in parts.devices)}; {mode}")
    return out


def _cpu_has_fast_bf16() -> Optional[bool]:
    """Whether this CPU has native bf16 arithmetic (None when it cannot tell)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return None
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", " bf16"))


def warnings(parts: Parts, args: argparse.Namespace, world: World) -> List[str]:
    """Settings that do not do here what they seem to: one line each."""
    out = []
    if args.sample_rate < 1:
        sizes = list(parts.head.shard_sizes) if world.size == 1 else [math.ceil(parts.num_classes / world.size)]
        global_batch = args.batch * world.size
        # PartialFC keeps at least as many classes per shard as the global batch has images.
        kept = sampled_class_counts(sizes, args.sample_rate, global_batch)
        if kept == sizes:
            out.append(
                f"--sample-rate {args.sample_rate:g} samples nothing here: a shard keeps at least as many "
                f"classes as the global batch has images ({global_batch}), which is all of its {max(sizes)} "
                "classes; this run equals --sample-rate 1 (sampling pays off when a shard's classes far "
                "outnumber the batch)"
            )
    small = batch_norm_warning(args, world.size)
    if small is not None:
        out.append(small)
    if args.amp == "bf16" and parts.devices[0].type == "cpu" and _cpu_has_fast_bf16() is False:
        out.append(
            "--amp bf16 on a CPU without native bf16 instructions (no avx512_bf16 / amx_bf16): bf16 is "
            "emulated and several times slower than fp32 here; drop --amp on this machine"
        )
    return out
