"""Type stub of the compiled extension (csrc/shardkit.cpp): its one Python function. The ops it
registers are called through ``torch.ops.shardkit`` (typed by the wrappers in shardkit.ops)."""

def cuda_built() -> bool: ...
