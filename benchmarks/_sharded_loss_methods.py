"""What benchmarks/bench_sharded_loss.py times: the peers' loss closures, shardkit's
memory-budget variants and the three-GEMM baseline.

Methods are named by strings: "shardkit" (memory_budget 0, the default), "shardkit+checks",
"shardkit@<budget>" (a memory_budget: a size such as "256MiB", "full" for the whole shard's
logits, or a percentage of them such as "50%"), and the peers of :data:`PEERS`."""

import inspect

import torch
import torch.nn.functional as F

PEERS = (
    "linear+cross_entropy",
    "torch.linear_cross_entropy",
    "cce_filtered",
    "cce_exact",
    "cce_torch_compile",
    "liger_flce",
    "quack_lce",
)
CPU_PEERS = ("linear+cross_entropy", "torch.linear_cross_entropy", "cce_torch_compile")
CCE = ("cce_filtered", "cce_exact")  # its Triton kernels (GPU)
GPU_ONLY = (*CCE, "liger_flce", "quack_lce")
BUDGET_PREFIX = "shardkit@"
INSTALL_HINT = (
    "pip install -r benchmarks/requirements.txt (benchmarks/fetch_wheels.sh gets the wheels gpu_suite.sh installs)"
)
# QuACK's CuTe-DSL kernels come with nvidia-cutlass-dsl and its CUDA libraries, beyond the
# pure-Python wheels fetch_wheels.sh brings (see there): installed by hand where a GPU machine
# reaches PyPI.
QUACK_HINT = "pip install quack-kernels (needs an sm90+ GPU; brings nvidia-cutlass-dsl)"
QUACK_CHUNK = 4096  # its default: tokens per chunk of bf16 logits (1 GiB at V=128,256)


def cce_default_filter_eps():
    """The installed cut-cross-entropy's default ``filter_eps`` (what "cce_filtered" runs with)."""
    from cut_cross_entropy import linear_cross_entropy

    return inspect.signature(linear_cross_entropy).parameters["filter_eps"].default


def method_notes():
    """What each method is, for the JSON and the printed legend."""
    try:
        eps = f"filter_eps={cce_default_filter_eps()!r} (its default)"
    except Exception:  # not installed: the notes still say what the rows would be
        eps = "filter_eps left at its default"
    return {
        "cce_filtered": f"cut-cross-entropy, {eps}: skips backward tiles, approximate gradient",
        "cce_exact": "cut-cross-entropy, filter_eps=None: every tile, exact gradient (the fair comparison)",
        "cce_torch_compile": 'cut-cross-entropy, impl="torch_compile": its torch.compile\'d path (CPU and GPU)',
        "quack_lce": f"QuACK chunked_linear_cross_entropy, chunk_size={QUACK_CHUNK} tokens (its default)",
        "shardkit@<budget>": "ShardedSoftmaxLoss(memory_budget=<budget>): logits kept for the backward "
        "('full' = the whole shard's, 'N%' = that share of them); CUDA shards keep logits only with "
        "SHARDKIT_CUDA_KEEP=1 (experimental: 16-bit logits, unfused kernels), else recompute at every budget",
    }


def budget_of(method):
    """The budget spec of a "shardkit@<budget>" method (None for other methods)."""
    return method[len(BUDGET_PREFIX) :] if method.startswith(BUDGET_PREFIX) else None


def check_budget_spec(spec):
    """``spec`` if it is "full", "N%" (0 < N <= 100) or a size shardkit parses; else ValueError."""
    if spec == "full":
        return spec
    if spec.endswith("%"):
        share = float(spec[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"budget share must be in (0, 100]%, got {spec!r}")
        return spec
    from shardkit.softmax.budget import check_memory_budget

    check_memory_budget(spec)
    return spec


def budget_bytes(spec, batch, classes, dtype, shards=1, device="cpu"):
    """The memory_budget (bytes per device) a spec gives a head of ``classes`` classes in
    ``shards`` shards on one ``device``: "full" holds every shard's logits (and row of target
    values, in the kept dtype of that device: shardkit.ops.kept_bytes), "N%" that share of it."""
    from shardkit.ops import kept_bytes
    from shardkit.softmax.budget import check_memory_budget

    # The device's budget is shared by its shards in proportion to their classes: "full" is
    # the least that grants every shard (the head's even split) all its logits.
    sizes = [classes // shards + (k < classes % shards) for k in range(shards)]
    full = max(-(-kept_bytes(batch, c, 1, 1 << 62, dtype, device) * classes // c) for c in sizes if c > 0)
    if spec == "full":
        return full
    if spec.endswith("%"):
        return int(full * float(spec[:-1]) / 100)
    return check_memory_budget(spec)


def unavailable(method, device):
    """None if the method can run here, else the reason."""
    if method == "torch.linear_cross_entropy" and not hasattr(F, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy"
    if method in (*GPU_ONLY, "cce_torch_compile"):
        if device.type != "cuda" and method != "cce_torch_compile":
            return "GPU-only (Triton / CuTe-DSL kernels)"
        try:  # the exact symbols peer_forward uses
            if method == "liger_flce":
                from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: F401
            elif method == "quack_lce":
                from quack.linear_cross_entropy import chunked_linear_cross_entropy  # noqa: F401
            else:
                from cut_cross_entropy import linear_cross_entropy  # noqa: F401
        except ImportError as err:
            return f"not installed ({err}); " + (QUACK_HINT if method == "quack_lce" else INSTALL_HINT)
        if method == "quack_lce" and torch.cuda.get_device_capability(device)[0] < 9:
            return "QuACK's kernels need sm90 or newer"
    return None


def peer_forward(method, x, weight, y):
    """The loss closure of peer ``method`` on embeddings ``x`` [B, D], weight [C, D], labels y."""
    if method == "linear+cross_entropy":  # the cross-entropy in fp32, as torch.autocast runs it
        return lambda: F.cross_entropy(F.linear(x, weight).float(), y)
    if method == "torch.linear_cross_entropy":
        return lambda: F.linear_cross_entropy(x, weight, y)
    if method == "cce_torch_compile":
        from cut_cross_entropy import linear_cross_entropy

        return lambda: linear_cross_entropy(x, weight, y, impl="torch_compile")
    if method in CCE:
        # linear_cross_entropy(e [..., D], c [C, D] classifier, targets [...]), mean reduction.
        # cce_filtered: its default filter_eps, as a user gets it (backward tiles whose values all
        # fall below eps are skipped: approximate gradient); cce_exact: filter_eps=None, exact.
        from cut_cross_entropy import linear_cross_entropy

        if method == "cce_exact":
            return lambda: linear_cross_entropy(x, weight, y, filter_eps=None)
        return lambda: linear_cross_entropy(x, weight, y)
    if method == "liger_flce":
        # LigerFusedLinearCrossEntropyLoss.forward(lin_weight [C, D], _input [B, D], target [B])
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss()
        return lambda: loss_fn(weight, x, y)
    if method == "quack_lce":
        # chunked_linear_cross_entropy(x [B*L, d], weight [V, d], target [B*L]), mean reduction,
        # exact (every chunk's logits, held one chunk of tokens at a time)
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        return lambda: chunked_linear_cross_entropy(x, weight, y, chunk_size=QUACK_CHUNK)
    raise ValueError(method)


def build_gemms(batch, classes, dim, dtype, device):
    """The layer's three GEMMs of the same shapes (logits, dX, dW), with dX accumulated and
    written in fp32 as shardkit's dX is (on CUDA with 16-bit inputs; on the CPU in the inputs'
    dtype, fp32 for the CPU runs)."""
    x = torch.randn(batch, dim, device=device, dtype=dtype)
    w = torch.randn(classes, dim, device=device, dtype=dtype)
    g = torch.randn(batch, classes, device=device, dtype=dtype)
    fp32_dx = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    dx = torch.empty(batch, dim, device=device, dtype=torch.float32 if fp32_dx else dtype)
    dw = torch.empty(classes, dim, device=device, dtype=dtype)

    def step():
        torch.mm(x, w.t(), out=g)
        if fp32_dx:
            torch.mm(g, w, out_dtype=torch.float32, out=dx)
        else:
            torch.mm(g, w, out=dx)
        torch.mm(g.t(), x, out=dw)

    return step
