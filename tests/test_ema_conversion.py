"""ModelEMA follows a conversion of any part of its own module (``ema.module[i].bfloat16()``,
``.double()``, a swap-tensors conversion), the first, last or any middle submodule alike; and a
part of an fp32 EMA converted to bf16 rounds stochastically, as a bf16 EMA does (per tensor, by
its dtype, as timm's ModelEmaV3 decides), the fp32 rest to nearest."""

import pytest
import torch
from torch import nn

import shardkit

PARTS = 5


def _net(width=64):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(PARTS)])


@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("stochastic", [True, False])
def test_a_part_converted_to_bf16_rounds_as_a_bf16_ema_wherever_it_is(part, stochastic):
    model = _net()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 0.5 + 2**-9)  # within one bf16 ulp above 0.5 (ulp 2**-8)
    ema = shardkit.ModelEMA(model, decay=0.999, tau=None, stochastic_rounding=stochastic)
    ema.module[part].bfloat16()
    start = {k: v.double() for k, v in ema.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # each update moves the EMA by ~1e-4: far below a bf16 ulp
    ref = dict(start)
    steps = 300
    for n in range(steps):
        ema.update(model, step=n + 2)
        d = ema.get_decay(n + 2)
        ref = {k: d * v + (1 - d) * model.state_dict()[k].double() for k, v in ref.items()}
    for k, v in ema.module.state_dict().items():
        if k.startswith(f"{part}."):
            assert v.dtype == torch.bfloat16
            if stochastic:  # the expected value tracks the float64 EMA (about 0.026 above the start)
                drift = (ref[k] - start[k]).mean().item()
                assert abs((v.double() - ref[k]).mean().item()) < 0.1 * drift, k
            else:  # to nearest: steps below half an ulp round away, the EMA never moves
                assert torch.equal(v.double(), start[k]), k
        else:
            assert v.dtype == torch.float32
            assert ((v.double() - ref[k]).norm() / ref[k].norm()).item() <= 1e-6, k


@pytest.mark.parametrize("swap_tensors", [False, True])
def test_a_middle_part_converted_to_float64_is_followed(swap_tensors):
    model = _net(8)
    ema = shardkit.ModelEMA(model, decay=0.6, tau=None)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap_tensors)
    try:
        ema.module[2].double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    ref = {k: v.double() for k, v in ema.module.state_dict().items()}
    for n in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        d = ema.get_decay(n)
        ref = {k: d * v + (1 - d) * model.state_dict()[k].double() for k, v in ref.items()}
    for k, v in ema.module.state_dict().items():
        assert v.dtype == (torch.float64 if k.startswith("2.") else torch.float32), k
        tol = 1e-13 if k.startswith("2.") else 1e-6
        assert ((v.double() - ref[k]).norm() / ref[k].norm()).item() <= tol, k
