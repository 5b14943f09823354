"""The scripts under examples/ that the guides point to run as documented on the CPU: the
DataParallel head's --check against single-device training, and the DDP recipe under torchrun
(2 gloo processes)."""

import os
import re
import socket
import subprocess
import sys

import shardkit

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _env():
    here = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    return env


def test_dp_sharded_head_check_matches_single_device(tmp_path):
    script = os.path.join(EXAMPLES, "dp_sharded_head.py")
    r = subprocess.run(
        [sys.executable, script, "--check", "--steps", "3"], cwd=tmp_path, env=_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(
        r"check: loss ([\d.]+) vs single-device ([\d.]+); worst relative gradient difference ([\d.e+-]+)", r.stdout
    )
    assert m, r.stdout[-2000:]
    loss, ref, worst = map(float, m.groups())
    assert abs(loss - ref) <= 1e-5 * max(1.0, abs(ref)) and worst <= 1e-4, m.group(0)


def test_train_ddp_runs_under_torchrun(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0", "--local-addr=127.0.0.1",
           f"--log-dir={tmp_path / 'torchrun-logs'}",
           os.path.join(EXAMPLES, "train_ddp.py"), "--steps", "4", "--classes", "50", "--sample-rate", "0.5",
           "--uneven", "--checkpoint", str(tmp_path / "head")]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "EMA  backbone: loss" in r.stdout, r.stdout[-2000:]
    assert os.listdir(tmp_path / "head"), "the sharded head's checkpoint was not written"
