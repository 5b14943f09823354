"""The CPU sharded cross-entropy has two versions of its float row loops: AVX2 + FMA
intrinsics (used where the CPU has both) and generic vector-extension code (every other CPU,
or SHARDKIT_CPU_ISA=generic). The rest of the suite runs whichever this CPU picks; this test
runs the op tests again in a fresh process with the generic loops forced, so both versions
are checked against the float64 reference on every machine that has AVX2."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_generic_row_loops_pass_the_op_tests():
    env = dict(os.environ, SHARDKIT_CPU_ISA="generic")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "test_softmax_ops.py"]
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    assert proc.returncode == 0, f"the op tests fail with the generic row loops:\n{tail}\n{proc.stderr[-2000:]}"
    assert " passed" in tail, tail  # something actually ran


def test_unknown_isa_value_warns_and_runs():
    code = (
        "import torch, shardkit; from shardkit.ops import ce_shard_stats; "
        "lse = ce_shard_stats(torch.randn(4, 8), torch.randn(40, 8), torch.randint(0, 40, (4,)))[0]; "
        "assert torch.isfinite(lse).all(); print('ok')"
    )
    env = dict(os.environ, SHARDKIT_CPU_ISA="avx3")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
    assert 'SHARDKIT_CPU_ISA=avx3 is not one of "auto" or "generic"' in proc.stdout + proc.stderr
