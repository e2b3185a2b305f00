"""4-bit group-wise quantization (FlexGen §5): error bound, range search, independent reference, constant
groups, packing, grouping dim."""

from __future__ import annotations

import pytest
import torch

from quant_reference import reference_roundtrip
from xprofiler.specs import ModelSpec, get_model_spec
from xrunner.compression import (DEFAULT_CLIP_STEPS, QuantizedTensor, dequantize, hadamard_rotation, quantize,
                                 quantized_nbytes)


def _half_ulp(y: torch.Tensor) -> torch.Tensor:
    """Half the spacing of y's dtype at |y| (0 for float32: the bound is then scale/2 up to rounding)."""
    if y.dtype == torch.float32:
        return torch.zeros_like(y, dtype=torch.float32)
    a = y.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))).float() - a.float()) / 2


def _per_value_scale(q: QuantizedTensor) -> torch.Tensor:
    """The scale of each value's group, laid out like the original tensor."""
    s = q.scales.float()[..., None].expand(*q.scales.shape, q.group_size)
    s = s.reshape(*s.shape[:-2], -1)[..., :q.shape[q.dim]]
    return s.movedim(-1, q.dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((256, 192), 0), ((256, 192), 1), ((2, 3, 50, 64), 3), ((2, 3, 50, 64), 2),
                                       ((1000,), 0)])
def test_round_trip_error_is_at_most_half_a_step(dtype, shape, dim):
    """Plain min/max ranges cover every value: the error is at most half a step."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + torch.rand(shape, generator=g) * 10).to(dtype)
    q = quantize(x, dim=dim, clip_steps=0)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == dtype
    err = (x.float() - y.float()).abs()
    bound = _per_value_scale(q) / 2 * (1 + 1e-6) + _half_ulp(y)
    assert bool((err <= bound).all()), float((err - bound).max())
    # The bound is not vacuous: the steps are the group ranges / 15.
    assert float(_per_value_scale(q).max()) < float(x.float().max() - x.float().min()) / 15 * 1.01


def test_groups_run_along_the_chosen_dimension():
    # Rows of wildly different magnitude: grouping along dim 1 keeps each row's own scale.
    x = torch.stack([torch.linspace(0, 1, 64), torch.linspace(0, 1000, 64)])
    q_rows = quantize(x, dim=1, clip_steps=0)
    assert q_rows.scales.shape == (2, 1)
    torch.testing.assert_close(q_rows.scales[:, 0], torch.tensor([1 / 15, 1000 / 15]))
    q_cols = quantize(x, dim=0, group_size=2, clip_steps=0)
    assert q_cols.scales.shape == (64, 1)
    assert (dequantize(q_rows)[0] - x[0]).abs().max() <= 1 / 30 + 1e-6


@pytest.mark.parametrize("clip_steps", [0, DEFAULT_CLIP_STEPS])
def test_constant_groups_do_not_divide_by_zero(clip_steps):
    x = torch.full((4, 128), 2.5)
    x[1] = 0.0
    x[2, 64:] = -7.25
    q = quantize(x, clip_steps=clip_steps)
    y = dequantize(q)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert (q.scales[0] == 0).all()


def test_padding_of_a_partial_group_round_trips():
    x = torch.randn(3, 70)  # 70 = one full group of 64 + a partial one
    q = quantize(x, dim=1, clip_steps=0)
    assert q.packed.shape == (3, 2, 32)
    assert dequantize(q).shape == (3, 70)
    assert (dequantize(q) - x).abs().max() <= q.scales.max() / 2 + 1e-6


def test_values_are_packed_two_per_byte():
    x = torch.randn(512, 256, dtype=torch.float16)
    q = quantize(x, dim=0)
    assert q.packed.dtype == torch.uint8
    assert q.packed.numel() == x.numel() // 2
    assert q.nbytes == quantized_nbytes((512, 256), dim=0, dtype_bytes=2)
    assert q.nbytes / (x.numel() * 2) == pytest.approx((32 + 4) / 128)  # 4.5 bits per value with fp16 min/scale
    assert quantized_nbytes((3, 70), dim=1, dtype_bytes=4) == quantize(torch.randn(3, 70), dim=1).nbytes


def test_codes_are_exact_for_values_on_the_grid():
    codes = torch.arange(64) % 16
    x = (codes.float() * 0.5 - 2.0)[None]  # min -2, scale 0.5: every value is on the grid
    q = quantize(x)
    torch.testing.assert_close(dequantize(q), x, rtol=0, atol=0)
    low, high = q.packed & 0x0F, q.packed >> 4
    assert torch.equal(torch.stack((low, high), -1).flatten(), codes.to(torch.uint8))


def test_quantized_tensor_moves_between_devices():
    x = torch.randn(8, 64)
    q = quantize(x).to("cpu")
    torch.testing.assert_close(dequantize(q), dequantize(quantize(x)))


def test_bad_input():
    with pytest.raises(TypeError):
        quantize(torch.arange(10))
    with pytest.raises(ValueError):
        quantize(torch.randn(10), group_size=3)
    with pytest.raises(ValueError):
        quantize(torch.randn(10), clip_steps=-1)


def _heavy_tailed(shape, seed=0):
    """Student-t-like weights (a few large values per group), where the range choice matters."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp(min=0.05).sqrt()


def _group_sse(x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    d = (x.float() - y.float()).movedim(dim, -1)
    return d.square().unflatten(-1, (-1, 64)).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_range_search_never_increases_a_groups_squared_error(dtype, dim):
    x = _heavy_tailed((384, 256)).to(dtype)
    plain = _group_sse(x, dequantize(quantize(x, dim=dim, clip_steps=0)), dim)
    searched = _group_sse(x, dequantize(quantize(x, dim=dim)), dim)
    assert bool((searched <= plain).all()), float((searched - plain).max())
    # Not vacuous: on heavy tails most groups gain, and the total error drops clearly.
    assert float((searched < plain).float().mean()) > 0.5
    assert float(searched.sum()) < 0.95 * float(plain.sum())


@pytest.mark.parametrize("clip_steps", [0, DEFAULT_CLIP_STEPS])
@pytest.mark.parametrize("shape,dim", [((1536, 576), 0), ((2, 3, 40, 64), 3), ((5, 150), 1)])
def test_quantizer_matches_an_independent_reference(clip_steps, shape, dim):
    """Same values as a plain-torch model of the format, up to a code flip at an exact rounding tie.
    (1536, 576) along dim 0 is dequantized in four slices of ``DEQUANT_CHUNK_BYTES``."""
    x = _heavy_tailed(shape, seed=1)
    got = dequantize(quantize(x, dim=dim, clip_steps=clip_steps))
    want = reference_roundtrip(x, dim, steps=clip_steps)
    off = (got - want).abs() > 1e-5 * x.abs().max()
    assert float(off.float().mean()) < 1e-4, int(off.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((64, 16, 3, 64), 3), ((256, 192), 0), ((7, 80), 1), ((16, 16, 64, 64), 3)])
def test_min_max_quantization_on_a_cpu_stores_what_the_tensor_formula_does(dtype, shape, dim, monkeypatch):
    """Every KV cache write on a CPU goes through a numba kernel (in parallel from 2^20 values, the
    last shape); it must store exactly the mins, scales and codes of the tensor path, ties to even,
    constant groups and a padded last group included."""
    from xrunner import kvattend
    from xrunner.compression import _fit

    calls = []
    real = kvattend.quantize_groups
    monkeypatch.setattr(kvattend, "quantize_groups", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(7)
    x = (torch.round(torch.randn(shape, generator=g) * 15) / 2).to(dtype)  # many values half-way between codes
    x.movedim(dim, -1)[0] = 1.25  # constant groups
    q = quantize(x, dim=dim, clip_steps=0)
    assert calls
    moved = x.movedim(dim, -1)
    moved = torch.cat((moved, moved[..., -1:].expand(*moved.shape[:-1], -moved.shape[-1] % 64)), dim=-1)
    groups = moved.reshape(*moved.shape[:-1], -1, 64).float()
    mins, scales, codes = _fit(groups, groups.amin(-1), groups.amax(-1), dtype)
    assert torch.equal(q.mins, mins) and torch.equal(q.scales, scales)
    assert torch.equal(q.packed, codes[..., 0::2] | (codes[..., 1::2] << 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_min_max_ranges_on_a_cpu_round_and_widen_as_the_tensor_formula(dtype):
    """The CPU kernel rounds each group's scale to the dtype and widens it by one ulp where 15 steps
    fall short of the max, as ``compression._range`` does with torch; both happen for values across
    34 orders of magnitude. Subnormals, signed zeros, infinities and NaN must give the same bits."""
    from xrunner.compression import _fit, _round_toward, LEVELS

    g = torch.Generator().manual_seed(11)
    mags = torch.exp(torch.randn(2048, 1, generator=g) * 20)
    wide = torch.randn(2048, 64, generator=g) * mags + torch.randn(2048, 1, generator=g) * mags * 3
    tiny = torch.randn(64, 64, generator=g) * 1e-39
    tiny[0], tiny[1], tiny[2, :5] = 0.0, -0.0, 0.0
    odd = torch.randn(4, 64, generator=g)
    odd[0, 3], odd[1, 7], odd[2, 9] = float("inf"), float("-inf"), float("nan")
    x = torch.cat((wide, tiny, odd)).to(dtype)
    q = quantize(x, dim=1, clip_steps=0)
    groups = x.float()
    mins, scales, codes = _fit(groups[:, None], groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True), dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(q.mins.view(bits), mins.view(bits)) and torch.equal(q.scales.view(bits), scales.view(bits))
    assert torch.equal(q.packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    # Not vacuous: the data reach the rounding branches being compared.
    lo, hi = groups[:2048].amin(-1), groups[:2048].amax(-1)
    raw = (hi - lo) / LEVELS
    rounded = _round_toward(raw, dtype, up=True)
    widened = lo + LEVELS * rounded.float() < hi
    assert int((rounded.float() > raw).sum()) > 100 if dtype == torch.bfloat16 else int(widened.sum()) > 100


def test_hadamard_rotation_is_orthonormal_and_only_for_powers_of_two():
    r = hadamard_rotation(64, torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert set(r.abs().unique().tolist()) == {1 / 8}  # every entry +-1/sqrt(64): spreads each channel evenly
    assert hadamard_rotation(80) is None and hadamard_rotation(0) is None


def test_rotated_kv_attention_equals_attention_over_the_unrotated_cache():
    """The engine attends in the rotated space (query rotated, output rotated back); that must equal
    plain attention over the dequantized cache rotated back, and beat the unrotated cache on outliers."""
    from xrunner.stored_forms import KVCodec
    from xrunner.model import attention

    spec = get_model_spec("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, spec.num_heads, 1, spec.head_dim, generator=g)
    k, v = (torch.randn(2, spec.num_kv_heads, 40, spec.head_dim, generator=g) for _ in range(2))
    k[..., 5] *= 30  # one outlier channel, as rotary dimensions of real keys have
    codec = KVCodec(spec.head_dim, torch.float32, compress=True)
    kk, vv = codec.decode(codec.encode(k, v))
    r = hadamard_rotation(spec.head_dim)
    got = codec.attend(spec, q, kk, vv, None)
    want = attention(spec, q, kk @ r.T, vv @ r.T, None, causal=False)
    assert torch.allclose(got, want, atol=1e-5)
    exact = attention(spec, q, k, v, None, causal=False)
    plain = KVCodec(spec.head_dim, torch.float32, compress=True, rotate=False)
    pk, pv = plain.decode(plain.encode(k, v))
    unrotated = attention(spec, q, pk, pv, None, causal=False)
    assert (got - exact).norm() < 0.5 * (unrotated - exact).norm()


def test_rotated_weight_record_gives_the_layers_output_with_bias():
    """A 4-bit weight stored with its row groups rotated: the linear layer (output rotated back, then the
    bias) equals x W^T + b for W = the reference quantization of the rotated rows, rotated back; and an
    outlier row costs its group less than without the rotation."""
    from xrunner.stored_forms import WeightLayout
    from xrunner.model import linear

    g = torch.Generator().manual_seed(1)
    w = {"fc1.weight": torch.randn(128, 96, generator=g), "fc1.bias": torch.randn(128, generator=g)}
    w["fc1.weight"][3] *= 25  # one outlier output channel
    x = torch.randn(5, 96, generator=g)
    exact = x @ w["fc1.weight"].T + w["fc1.bias"]

    def through_record(rotate):
        layout = WeightLayout({k: tuple(v.shape) for k, v in w.items()}, torch.float32, compress=True, rotate=rotate)
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(w, flat)
        unpacked = layout.unpack(flat, {n: torch.empty(s) for n, s in layout.dequant_shapes().items()})
        return unpacked, linear(x, unpacked, "fc1")

    r = hadamard_rotation(64)
    blocks = w["fc1.weight"].unflatten(0, (-1, 64))
    ref = (r.T @ reference_roundtrip((r @ blocks).flatten(0, 1), dim=0).unflatten(0, (-1, 64))).flatten(0, 1)
    unpacked, got = through_record(True)
    assert set(unpacked) == {"fc1.weight", "fc1.bias", "fc1.out_rotation"}
    assert torch.allclose(got, x @ ref.T + w["fc1.bias"], atol=1e-4)
    errs = {rotate: float((through_record(rotate)[1] - exact).norm()) for rotate in (True, False)}
    assert errs[True] < 0.5 * errs[False]


def test_an_experts_4bit_weights_are_dequantized_on_first_read_and_once():
    """``WeightLayout.unpack`` of a mixture of experts' layer: the router and attention are ready
    at once; an expert's three projections appear among the keys but are dequantized (all three,
    into their buffers, equal to the reference path) on the first read of any of its keys, once."""
    from xrunner.model import linear
    from xrunner.stored_forms import WeightLayout

    spec = ModelSpec(name="m", family="llama", num_layers=1, hidden=64, ffn=128, num_heads=2, num_kv_heads=2,
                     head_dim=32, vocab_size=32, max_positions=64, norm="rmsnorm", activation="silu",
                     position="rotary", tied_embeddings=False, dtype="float32", num_experts=3, experts_per_token=1)
    shapes = spec.layer_tensor_shapes()
    g = torch.Generator().manual_seed(2)
    w = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    layout = WeightLayout(shapes, torch.float32, compress=True)
    flat = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(w, flat)
    buffers = {n: torch.full(s, float("nan")) for n, s in layout.dequant_shapes().items()}
    unpacked = layout.unpack(flat, buffers)
    expert = ("experts.1.gate_proj.weight", "experts.1.up_proj.weight", "experts.1.down_proj.weight")
    assert set(unpacked) == set(shapes) | {n.rsplit(".", 1)[0] + ".out_rotation" for n in layout.rotated}
    assert all(n in unpacked for n in expert) and len(unpacked) == len(set(unpacked))
    assert not buffers["router.weight"].isnan().any() and not buffers["q_proj.weight"].isnan().any()
    assert all(buffers[f"experts.{e}.{p}_proj.weight"].isnan().all() for e in range(3) for p in ("gate", "up", "down"))
    assert unpacked.experts_dequantized == 0
    got = unpacked["experts.1.up_proj.weight"]
    assert unpacked.experts_dequantized == 1 and not any(buffers[n].isnan().any() for n in expert)
    assert buffers["experts.0.up_proj.weight"].isnan().all() and buffers["experts.2.down_proj.weight"].isnan().all()
    assert got.data_ptr() == buffers["experts.1.up_proj.weight"].data_ptr()
    for n in expert:
        ref = layout.dequantize_tensor(n, layout.quantize_tensor(n, w[n]))
        x = torch.randn(5, ref.shape[1], generator=g)  # the projection's inputs (hidden, or ffn for down)
        assert torch.allclose(linear(x, unpacked, n.rsplit(".", 1)[0]), x @ ref.T, atol=1e-4)
    assert unpacked.experts_dequantized == 1
    assert "experts.3.up_proj.weight" not in unpacked
    with pytest.raises(KeyError):
        unpacked["experts.3.up_proj.weight"]


def test_mlp_output_projection_rotates_its_inputs_in_the_record_and_in_gptq():
    """The MLP's output projection is stored with its input channels rotated too (a 512 x 512
    Hadamard per block): the layer's output equals x W^T + b for W = the reference GPTQ of the weight
    rotated on both sides, with the Hessian of the rotated inputs, rotated back; the layout
    reference path (``dequantize_tensor``) gives that same W; other projections keep their inputs."""
    from quant_reference import reference_gptq
    from xrunner.stored_forms import WeightLayout
    from xrunner.model import linear

    g = torch.Generator().manual_seed(5)
    w = {"fc1.weight": torch.randn(512, 64, generator=g), "fc2.weight": torch.randn(64, 512, generator=g),
         "fc2.bias": torch.randn(64, generator=g)}
    X = torch.randn(2048, 512, generator=g) * torch.rand(512, generator=g)
    X[:, 9] *= 30  # an outlier input channel, as the MLP's hidden activation has
    H = X.T @ X
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    layout = WeightLayout(shapes, torch.float32, compress=True, rotate_inputs=True)
    assert layout.in_rotated == {"fc2.weight"}
    assert WeightLayout(shapes, torch.float32, compress=True).in_rotated == set()  # nearest rounding: never
    assert WeightLayout(shapes, torch.float32, compress=True, rotate=False, rotate_inputs=True).in_rotated == set()
    q = layout.quantize_tensor("fc2.weight", w["fc2.weight"], H)
    r_in = hadamard_rotation(512).double()
    r_out = hadamard_rotation(64).double()
    rotated = (r_out @ w["fc2.weight"].double() @ r_in).float()
    want = r_out.T @ reference_gptq(rotated, r_in.T @ H.double() @ r_in, 0.1).double() @ r_in.T
    got = layout.dequantize_tensor("fc2.weight", q)
    same_code = (got.double() - want).abs() < 1e-3
    assert float(same_code.float().mean()) > 0.99
    flat = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(w, flat, {"fc2.weight": q})
    unpacked = layout.unpack(flat, {n: torch.empty(s) for n, s in layout.dequant_shapes().items()})
    assert "fc2.in_rotation" in unpacked and "fc1.in_rotation" not in unpacked
    x = X[:5]
    assert torch.allclose(linear(x, unpacked, "fc2"), x @ got.T + w["fc2.bias"], atol=1e-3)


def test_gptq_matches_an_independent_obq_reference_and_beats_nearest_rounding():
    """GPTQ (Cholesky form, blocks of 16 columns here) equals the optimal-brain-quantizer updates of an
    independent reference column for column, each column's ranges searched on its values as the
    earlier columns' errors left them; it moves the layer's output on the calibration inputs less
    than nearest rounding; a never-active input does not break it."""
    from quant_reference import reference_gptq
    from xrunner.compression import gptq_quantize

    g = torch.Generator().manual_seed(3)
    X = torch.randn(512, 96, generator=g) @ torch.randn(96, 96, generator=g) + torch.randn(512, 96, generator=g)
    X[:, 7] = 0.0  # dead input channel
    w = torch.randn(130, 96, generator=g)  # 130 rows: a partial last group
    H = X.T @ X
    for damp in (0.01, 0.1):
        q = gptq_quantize(w, H, block=16, damp=damp)
        got = dequantize(q)
        want = reference_gptq(w, H, damp)
        same_code = (got - want).abs() < 1e-4  # a different code differs by a whole step (>= 0.01 here)
        assert float(same_code.float().mean()) > 0.99
        out_err = lambda y: float((X @ (y - w).T).norm())  # noqa: E731
        assert out_err(got) == pytest.approx(out_err(want), rel=1e-3)
        assert out_err(got) < 0.8 * out_err(dequantize(quantize(w, dim=0)))
        assert bool(torch.isfinite(got).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, dim", [((256, 96), 0), ((130, 70), 0), ((4, 2, 37, 64), -1)])
def test_dequantize_into_a_buffer_gives_the_same_values_as_a_view_of_it(dtype, shape, dim):
    """The engine dequantizes 4-bit weights into a preallocated buffer in the stored layout and
    computes with a view of it: the values equal the allocating path's bit for bit (padded groups
    and half precision included), and the result shares the buffer's memory."""
    from xrunner.compression import stored_shape

    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    q = quantize(x, dim=dim)
    buf = torch.empty(stored_shape(q), dtype=dtype)
    got = dequantize(q, out=buf)
    assert got.shape == x.shape and got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, dequantize(q))
    with pytest.raises(ValueError, match="out must be"):
        dequantize(q, out=torch.empty(x.shape if dim == 0 else (1,), dtype=dtype))


@pytest.mark.parametrize("heads,kv_heads,d,group", [(4, 4, 64, 64), (6, 2, 64, 64), (4, 2, 80, 64), (2, 1, 32, 16)])
def test_attention_over_the_codes_matches_attention_over_the_dequantized_cache(heads, kv_heads, d, group):
    """The fused CPU kernel gives what SDPA gives over the dequantized cache plus the own position,
    with padding keys masked, grouped-query heads and a head dim that is no multiple of the group."""
    from xprofiler.specs import ModelSpec
    from xrunner.kvattend import attend_quantized
    from xrunner.model import attention

    g = torch.Generator().manual_seed(3)
    B, T = 5, 23
    spec = ModelSpec(name="t", family="llama", num_layers=1, hidden=heads * d, ffn=4, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=d, vocab_size=8, max_positions=64, norm="rmsnorm",
                     activation="silu", position="rotary", tied_embeddings=False, bias=False, dtype="float32")
    k, v = (torch.randn(B, kv_heads, T, d, generator=g) * 2 + 0.5 for _ in range(2))
    own_k, own_v = (torch.randn(B, kv_heads, d, generator=g) for _ in range(2))
    q = torch.randn(B, heads, d, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :7] = False  # left padding of a shorter prompt
    mask[3, :T] = False  # a row that sees only its own position
    qk, qv = (quantize(x, dim=-1, group_size=group, clip_steps=0) for x in (k, v))
    kk = torch.cat((dequantize(qk), own_k[:, :, None]), dim=2)
    vv = torch.cat((dequantize(qv), own_v[:, :, None]), dim=2)
    full = torch.cat((mask, torch.ones(B, 1, dtype=torch.bool)), dim=1)
    for m, fm in ((mask, full), (None, None)):
        want = attention(spec, q[:, :, None], kk, vv, fm, causal=False).view(B, heads, d)
        got = attend_quantized(q, qk, qv, own_k, own_v, m)
        assert got.shape == (B, heads, d)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_over_the_codes_of_a_half_precision_cache_computes_in_float32(dtype):
    """A half-precision model's cache keeps its mins and scales in its dtype: the kernel converts
    them, the query and the own K/V, and gives float32 attention over exactly those stored values
    (dequantized in float32), not over a half-precision copy of them."""
    from xrunner.kvattend import attend_quantized

    g = torch.Generator().manual_seed(5)
    B, H, Hkv, T, d = 3, 4, 2, 17, 64
    qk, qv = (quantize((torch.randn(B, Hkv, T, d, generator=g) * 2 + 0.5).to(dtype), dim=-1, clip_steps=0)
              for _ in range(2))
    assert qk.mins.dtype == dtype
    q, own_k, own_v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((B, H, d), (B, Hkv, d), (B, Hkv, d)))
    as32 = [QuantizedTensor(x.packed, x.mins.float(), x.scales.float(), x.shape, x.dim, x.group_size) for x in (qk, qv)]
    kk, vv = (torch.cat((dequantize(x), own[:, :, None].float()), dim=2) for x, own in zip(as32, (own_k, own_v)))
    kk, vv = (x.repeat_interleave(H // Hkv, dim=1) for x in (kk, vv))
    want = torch.softmax((q.float()[:, :, None] @ kk.transpose(-1, -2)) / d ** 0.5, dim=-1) @ vv
    got = attend_quantized(q, qk, qv, own_k, own_v, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want[:, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles the kernel in two fresh processes: 13-15 s of the default suite's budget
def test_attention_over_the_codes_is_the_same_compiled_fresh_or_loaded_from_numba_cache(tmp_path):
    """numba's freshly compiled parallel code and the code it caches differ; with the softmax's sum
    reassociated they rounded differently, and one token of the bfloat16 offload benchmark changed
    with the cache's state (stop 47); on stop 69's host the dot products still did (4.8e-6). Two
    processes on one empty cache directory give the same bits: the first has a child process
    compile the kernel into the cache and loads it from there, as the second does."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch\ntorch.set_num_threads(2)\nfrom xrunner.compression import quantize\n"
            "from xrunner.kvattend import attend_quantized, _attend_kernel\n"
            "g = torch.Generator().manual_seed(0)\n"
            "k, v = (quantize((torch.randn(64, 8, 80, 64, generator=g) * 3).bfloat16(), clip_steps=0) for _ in range(2))\n"
            "q, own = (torch.randn(64, 8, 64, generator=g).bfloat16() * 4 for _ in range(2))\n"
            "out = attend_quantized(q, k, v, own, own, None)\n"
            "torch.save(out, sys.argv[1])\nprint(_attend_kernel.stats.cache_hits and 'loaded' or 'compiled')\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NUMBA_NUM_THREADS": "2"}
    runs = []
    for name in ("fresh", "cached"):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{name}.pt")], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.split()[-1])
    assert runs == ["loaded", "loaded"]
    assert torch.equal(torch.load(tmp_path / "fresh.pt"), torch.load(tmp_path / "cached.pt"))


@pytest.mark.parametrize("first", ["quantize", "attend"])
def test_the_numba_kernels_leave_torch_thread_count_alone(first):
    """numba's thread pool starts on the first call and resets the OpenMP thread count it shares
    with torch; a profile or run asked for one thread must stay on one, whichever kernel (a KV
    write's codes or attention over them) runs first. A fresh process: the pool starts once."""
    import os
    import subprocess
    import sys

    steps = {"quantize": "quantize(torch.randn(16, 16, 64, 64), clip_steps=0)\nprint(torch.get_num_threads())\n",
             "attend": "q = torch.randn(2, 2, 64)\nattend_quantized(q, k, k, q, q, None)\nprint(torch.get_num_threads())\n"}
    code = ("import torch\ntorch.set_num_threads(1)\nfrom xrunner.compression import quantize\n"
            "from xrunner.kvattend import attend_quantized\nk = quantize(torch.randn(2, 2, 5, 64))\n"
            + steps[first] + steps["attend" if first == "quantize" else "quantize"])
    env = {**os.environ, "OMP_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]
