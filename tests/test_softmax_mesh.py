"""The head composes with torch's current distributed stack: on a 2-D DeviceMesh
(data-parallel x class-shard, 4 gloo ranks on the CPU) the head's process group is the
mesh's "shard" dimension while the backbone is wrapped by FSDP2 (fully_shard, replicated
over "dp" and sharded over "shard"). Every rank's loss equals the one-process loss of its
class-shard group's batch, and after the step's reductions the backbone and head gradients
equal those of the one-process loss of the whole batch (float64)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import TORCH_VERSION

C, D, ROWS = 13, 6, 3


def _backbone():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, D)).double()


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, ROWS, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (4, ROWS), generator=g)
    w = torch.randn(C, D, generator=g, dtype=torch.float64) * 0.3
    return x, y, w


def _rank(rank, port, errors):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=4)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import shardkit

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
        backbone = _backbone()
        fully_shard(backbone, mesh=mesh)  # HSDP: replicated over "dp", sharded over "shard"
        head = shardkit.ShardedSoftmaxLoss(D, C, process_group=mesh.get_group("shard"), dtype=torch.float64)
        x, y, w = _data()
        shardkit.import_full_weight(head, w)
        loss = head(backbone(x[rank]), y[rank])
        loss.backward()
        for p in head.parameters():  # the class-shard replicas of the dp dimension average their grads
            dist.all_reduce(p.grad, group=mesh.get_group("dp"))
            p.grad /= 2

        # one process: the same backbone and weight, the two shard groups' batches
        ref_backbone = _backbone()
        wr = w.clone().requires_grad_()
        group = rank // 2
        per_group = [
            F.cross_entropy(
                ref_backbone(x[2 * g : 2 * g + 2].reshape(-1, 5)) @ wr.t(), y[2 * g : 2 * g + 2].reshape(-1)
            )
            for g in range(2)
        ]
        torch.testing.assert_close(loss.detach(), per_group[group].detach(), rtol=1e-12, atol=1e-12)
        (sum(per_group) / 2).backward()
        for p, q in zip(backbone.parameters(), ref_backbone.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-10, atol=1e-12)
        offset, size = head.class_offsets[0], head.shard_sizes[0]
        torch.testing.assert_close(head.weight_shards[0].grad, wr.grad[offset : offset + size], rtol=1e-10, atol=1e-12)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 (reported by the test)
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")
@pytest.mark.skipif(
    TORCH_VERSION < (2, 11),
    reason=f"FSDP2 on CPU/gloo fails inside torch 2.6 ('Stream' has no record_event); tested from 2.11, this is "
    f"{torch.__version__}",
)
def test_head_on_a_2d_mesh_with_fsdp2_backbone():
    pytest.importorskip("torch.distributed.fsdp", reason="needs torch.distributed.fsdp.fully_shard (FSDP2)")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, errors)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, "\n".join(messages)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
