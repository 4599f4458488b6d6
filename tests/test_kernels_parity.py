"""The host kernels against torch: AdamW elementwise, the cast bit for bit, sums, norms."""

from __future__ import annotations

import pytest
import torch

from slidedp.kernels import Kernels

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}
STEPS = 12


def _f32_specials() -> torch.Tensor:
    bits = [
        0x00000000,
        0x80000000,  # ±0
        0x7F800000,
        0xFF800000,  # ±inf
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0x7FBFFFFF,
        0xFF812345,  # quiet/signalling NaNs
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x00008000,
        0x00018000,
        0x0000FFFF,  # denormals
        0x00800000,
        0x7F7FFFFF,
        0xFF7FFFFF,  # smallest normal, ±max
        0x3F808000,
        0x3F818000,  # exact ties: round down to even / up to even
        0x3F808001,
        0x3F817FFF,  # just above / below a tie
        0x7F7F8000,  # rounds up to inf
    ]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _cast_inputs(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    x = random_bits.to(torch.int32).view(torch.float32)
    specials = _f32_specials()
    x[: min(n, specials.numel())] = specials[: min(n, specials.numel())]
    return x


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 33, 63, 1000, 65_537])
def test_cast_is_bit_exact_with_torch(isa: str, n: int) -> None:
    x = _cast_inputs(n)
    ours = Kernels(threads=2, isa=isa).cast_f32_to_bf16(x)
    ref = x.to(torch.bfloat16)
    nan = torch.isnan(ref)
    # NaN stays NaN (its payload is not specified: torch's own scalar and vector paths differ).
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def _reference_adamw(
    p0: torch.Tensor, grads: list[torch.Tensor], weight_decay: float, grad_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW on f32 params; grads are widened to f32 and scaled the way
    clip_grad_norm_ does it (``g.mul_(coef)``) before the step."""
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], weight_decay=weight_decay, foreach=False, **HP)  # type: ignore[arg-type]
    for g in grads:
        p.grad = g.float().mul(grad_scale)
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_adamw_matches_torch_elementwise(
    isa: str, grad_dtype: torch.dtype, weight_decay: float, grad_scale: float
) -> None:
    n = 10_007  # not a multiple of any vector width
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 10 ** (-s % 4)).to(grad_dtype) for s in range(STEPS)]
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    kernels = Kernels(threads=3, isa=isa)
    for step, g in enumerate(grads, start=1):
        kernels.adamw(
            p,
            m,
            v,
            g,
            step=step,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            **HP,  # type: ignore[arg-type]
        )
    p_ref, m_ref, v_ref = _reference_adamw(p0, grads, weight_decay, grad_scale)
    # Same formula, same f32 constants, same operation order as torch's single-tensor AdamW
    # (lerp, mul + addcmul, sqrt / bc2 + eps, p + (-step_size * m) / denom). m and v come out
    # bit-identical; p differs by at most 1 ulp (measured 1.2e-7 absolute, |p| ~ 1) because torch's
    # f32 sqrt on some CPU builds is not correctly rounded while ours is IEEE. rtol=1e-5 and
    # atol=1e-6 leave a decade of margin for that ulp to propagate over the 12 steps, and still
    # catch any wrong constant, bias correction, decay or scale (those move p by >= 1e-5).
    torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)


def test_adamw_bf16_emission_is_the_cast_of_the_update(isa: str) -> None:
    n = 4099
    gen = torch.Generator().manual_seed(2)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    kernels = Kernels(threads=2, isa=isa)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        kernels.adamw(p, m, v, g, step=step, weight_decay=0.1, bf16_out=out, **HP)  # type: ignore[arg-type]
        assert torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))


def test_every_isa_is_bit_exact_with_scalar(isa: str) -> None:
    n = 70_001
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen)
    states = {}
    for path in ("scalar", isa):
        k = Kernels(threads=2, isa=path)
        p, m, v = x.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 11):
            g = torch.randn(n, generator=torch.Generator().manual_seed(step))
            k.adamw(p, m, v, g, step=step, weight_decay=0.05, grad_scale=0.5, bf16_out=out, **HP)  # type: ignore[arg-type]
        cast = k.cast_f32_to_bf16(_cast_inputs(n))
        total = k.sum_into(torch.empty(n), [x, out, x.to(torch.bfloat16)])
        states[path] = [
            t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)
            for t in (p, m, v, out, total)
        ] + [cast.view(torch.int16)]
    for ours, ref in zip(states[isa], states["scalar"], strict=True):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    "dtypes",
    [
        [torch.float32],
        [torch.bfloat16, torch.float32],
        [torch.float32, torch.bfloat16, torch.bfloat16],
    ],
)
def test_sum_into_matches_torch_bit_for_bit(isa: str, dtypes: list[torch.dtype]) -> None:
    n = 5003
    gen = torch.Generator().manual_seed(4)
    srcs = [torch.randn(n, generator=gen).to(d) for d in dtypes]
    kernels = Kernels(threads=2, isa=isa)
    dst = torch.randn(n, generator=gen)
    expected = dst.clone()
    for s in srcs:  # left to right, in f32, like the kernel
        expected = expected + s.float()
    kernels.sum_into(dst, srcs, accumulate=True)
    assert torch.equal(dst, expected)
    fresh = kernels.sum_into(torch.full((n,), 7.0), srcs, accumulate=False)
    expected_fresh = srcs[0].float()
    for s in srcs[1:]:
        expected_fresh = expected_fresh + s.float()
    assert torch.equal(fresh, expected_fresh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares_matches_a_float64_reference(isa: str, dtype: torch.dtype) -> None:
    x = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    ours = Kernels(threads=3, isa=isa).sum_squares(x)
    ref = x.double().pow(2).sum().item()
    # Each square is exact in f64; only the ~1e6 additions round, in a different order from
    # torch's: relative error <= n * 2**-53 ~ 1e-10.
    assert ours == pytest.approx(ref, rel=1e-10)
    assert Kernels(threads=1, isa=isa).sum_squares(x) == ours, "must not depend on thread count"
