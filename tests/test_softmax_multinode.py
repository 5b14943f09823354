"""A multi-machine launch simulated on one machine: two torchrun agents (--nnodes=2, one
process each, rendezvous on the loopback address, gloo) train the distributed head, save it
with save_sharded, and a launch with another world size (one agent, 3 processes) resumes
from those files bit-exactly and trains on with the same losses as a single process would."""

import itertools
import os
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "softmax_multinode_job.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nnodes, nproc, node_rank, port, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=shardkit-multinode-test", "--max-restarts=0", "--local-addr=127.0.0.1",
           f"--log-dir={os.path.join(args[1], 'torchrun-logs')}", JOB] + args  # args[1]: the test's folder  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, what):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{what}: torchrun did not finish within 240 s") from None
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"{what}: torchrun exited {p.returncode}:\n{out[-4000:]}"


def _class_ordered(results):
    """(rows [C, D], momentum [C, D], seen [C]) from the ranks' shards, checked to tile [0, C)."""
    shards = sorted((off, *parts) for r in results for off, parts in r["shards"].items())
    assert [off for off, *_ in shards] == list(itertools.accumulate([0] + [w.shape[0] for _, w, _, _ in shards[:-1]]))
    assert all(buf is not None and seen is not None for _, _, buf, seen in shards), "a shard has no momentum"
    return tuple(torch.cat([s[k] for s in shards]) for k in (1, 2, 3))


def test_two_agents_train_save_and_resume_into_another_world_size(tmp_path):
    d = str(tmp_path)
    port = _free_port()
    _wait([_torchrun(2, 1, r, port, ["train", d, "3"]) for r in range(2)], "2 agents x 1 process")
    a, b = (torch.load(os.path.join(d, f"train-rank{r}.pt"), weights_only=True) for r in range(2))
    assert a["world"] == b["world"] == 2
    assert a["losses"] == b["losses"]  # every rank returns the loss of the global batch
    assert torch.equal(a["full"], b["full"])
    assert a["losses"][-1] < a["losses"][0]

    # resume into world size 3 (one agent with 3 processes): rows and momentum bit for bit
    _wait([_torchrun(1, 3, 0, _free_port(), ["resume", d, "0"])], "1 agent x 3 processes, 0 steps")
    resumed = [torch.load(os.path.join(d, f"resume-rank{r}.pt"), weights_only=True) for r in range(3)]
    for got in resumed:
        assert got["world"] == 3
        assert torch.equal(got["full"], a["full"]), "the weight loaded into 3 ranks differs from the saved one"
    saved_rows, saved_buf, saved_seen = _class_ordered([a, b])
    assert saved_buf.abs().sum() > 0 and saved_seen.all()  # every class is in every (unsampled) step
    rows, buf, seen = _class_ordered(resumed)
    assert torch.equal(rows, saved_rows) and torch.equal(rows, a["full"])
    assert torch.equal(buf, saved_buf), "the momentum loaded into 3 ranks differs from the saved one"
    assert torch.equal(seen, saved_seen) and seen.dtype == torch.bool

    # and train on: the same steps in world size 3 and in world size 1 give the same losses
    _wait([_torchrun(1, 3, 0, _free_port(), ["resume", d, "2"])], "1 agent x 3 processes")
    three = torch.load(os.path.join(d, "resume-rank0.pt"), weights_only=True)
    _wait([_torchrun(1, 1, 0, _free_port(), ["resume", d, "2"])], "1 agent x 1 process")
    one = torch.load(os.path.join(d, "resume-rank0.pt"), weights_only=True)
    torch.testing.assert_close(torch.tensor(three["losses"]), torch.tensor(one["losses"]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(three["full"], one["full"], rtol=1e-12, atol=1e-12)
