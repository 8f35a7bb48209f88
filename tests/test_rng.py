"""The Philox dropout contract: known answers, C++ == Triton bit for bit, statistics, validation."""

import math

import pytest
import torch

from selective_ckpt import rng

# Random123's known-answer vectors for Philox4x32-10 (kat_vectors): counter, key, result.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _seed(key):
    return key[0] | (key[1] << 32)


def _triton_philox():
    from selective_ckpt.triton_kernels import philox

    return philox


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers_cpp(counter, key, expected):
    out = rng.philox4x32(_seed(key), torch.tensor([counter]))
    assert out[0].tolist() == list(expected)


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers_triton(counter, key, expected):
    c = torch.tensor([counter])
    out = _triton_philox().philox_words(_seed(key), c, torch.empty_like(c))
    assert out[0].tolist() == list(expected)


def test_cpp_and_triton_words_identical_near_edges():
    g = torch.Generator().manual_seed(1)
    counters = torch.randint(0, 1 << 32, (77, 4), generator=g)
    counters[:13] = (1 << 32) - 1 - torch.arange(13)[:, None]  # counters near 2^32
    for seed in (0xFEDCBA9876543210, (1 << 64) - 1, 1 << 63, 12345):
        ours = _triton_philox().philox_words(seed, counters, torch.empty_like(counters))
        assert torch.equal(rng.philox4x32(seed, counters), ours)


@pytest.mark.parametrize("shape,blocks", [((2, 3, 37, 53), (16, 16)), ((1, 2, 5, 9), (4, 8)), ((1, 1, 1, 1), (16, 16))])
def test_attention_mask_triton_matches_reference(shape, blocks):
    seed, p = 0xA5A5_0000_FFFF_1234, 0.17
    out = torch.empty(shape, dtype=torch.int8)
    _triton_philox().attention_mask(seed, rng.threshold(p), out, *blocks)
    assert torch.equal(out.bool(), rng.attention_keep_mask(seed, *shape, p))


@pytest.mark.parametrize("rows,cols,blocks", [(29, 45, (16, 16)), (3, 8, (2, 4)), (1, 1, (16, 16))])
def test_elementwise_mask_triton_matches_reference(rows, cols, blocks):
    seed, p = (1 << 64) - 7, 0.5
    out = torch.empty(rows, cols, dtype=torch.int8)
    _triton_philox().elementwise_mask(seed, rng.threshold(p), out, *blocks)
    assert torch.equal(out.bool(), rng.elementwise_keep_mask(seed, rows, cols, p))


def test_reference_mask_follows_the_counter_layout():
    # Recompute one attention element and one elementwise element by hand from raw words.
    seed, p = 987654321, 0.3
    t16 = rng.threshold(p)
    B, H, Sq, Sk = 2, 3, 4, 21
    b, h, i, j = 1, 2, 3, 19
    w = rng.philox4x32(seed, torch.tensor([[j >> 3, i, b * H + h, 0]]))[0].tolist()
    u = (w[(j & 7) & 3] >> (16 * ((j & 7) >> 2))) & 0xFFFF
    assert rng.attention_keep_mask(seed, B, H, Sq, Sk, p)[b, h, i, j].item() == (u >= t16)
    row, col = 5, 10
    w = rng.philox4x32(seed, torch.tensor([[col >> 3, row, 0, 1]]))[0].tolist()
    u = (w[(col & 7) & 3] >> (16 * ((col & 7) >> 2))) & 0xFFFF
    assert rng.elementwise_keep_mask(seed, 7, 13, p)[row, col].item() == (u >= t16)


@pytest.mark.parametrize("p", [0.1, 0.17, 0.5, 0.9])
def test_keep_rate_within_4_sigma(p):
    mask = rng.attention_keep_mask(42, 2, 4, 64, 96, p)
    n = mask.numel()
    keep = 1 - rng.threshold(p) / 65536
    sigma = math.sqrt(keep * (1 - keep) / n)
    assert abs(mask.double().mean().item() - keep) < 4 * sigma
    emask = rng.elementwise_keep_mask(43, 200, 250, p)
    sigma = math.sqrt(keep * (1 - keep) / emask.numel())
    assert abs(emask.double().mean().item() - keep) < 4 * sigma


def test_masks_differ_across_every_index_and_seed():
    m = rng.attention_keep_mask(7, 2, 2, 8, 32, 0.5)
    assert not torch.equal(m[0], m[1])  # batch
    assert not torch.equal(m[:, 0], m[:, 1])  # head
    assert not torch.equal(m[:, :, 0], m[:, :, 1])  # row
    assert not torch.equal(m[..., 0:8], m[..., 8:16])  # column group
    assert not torch.equal(m, rng.attention_keep_mask(8, 2, 2, 8, 32, 0.5))  # seed
    e = rng.elementwise_keep_mask(7, 4, 32, 0.5)
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[:, :8], e[:, 8:16])
    # The two streams never coincide for the same seed (counter word 3 differs).
    assert not torch.equal(m[0, 0, :4], e)


def test_p_zero_keeps_everything():
    assert rng.attention_keep_mask(3, 1, 2, 5, 17, 0.0).all()
    assert rng.elementwise_keep_mask(3, 5, 17, 0.0).all()
    assert rng.keep_scale(0.0) == 1.0


def test_keep_scale_makes_expectation_exact():
    for p in (0.1, 0.17, 0.5):
        t16 = round(p * 65536)
        assert rng.keep_scale(p) == 65536 / (65536 - t16)
        assert (1 - t16 / 65536) * rng.keep_scale(p) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), 1 - 2**-18])
def test_bad_p_is_value_error(bad):
    with pytest.raises(ValueError, match="p"):
        rng.threshold(bad)


@pytest.mark.parametrize("bad", [torch.tensor(0.1), "0.1", None, True])
def test_non_float_p_is_type_error(bad):
    with pytest.raises(TypeError, match="p"):
        rng.threshold(bad)


@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_bad_seed_is_value_error(bad):
    with pytest.raises(ValueError, match="seed"):
        rng.philox4x32(bad, torch.zeros(1, 4, dtype=torch.int64))


def test_bad_counters():
    with pytest.raises(ValueError, match="counters"):
        rng.philox4x32(0, torch.full((1, 4), 1 << 32))
    with pytest.raises(ValueError, match="counters"):
        rng.philox4x32(0, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="counters"):
        rng.philox4x32(0, torch.zeros(2, 4, dtype=torch.int32))


def test_draw_seed_reproducible_under_manual_seed():
    torch.manual_seed(0)
    a = [rng.draw_seed("cpu") for _ in range(3)]
    torch.manual_seed(0)
    b = [rng.draw_seed("cpu") for _ in range(3)]
    assert a == b and len(set(a)) == 3
    assert all(0 <= s < 1 << 64 for s in a)
    g = torch.Generator().manual_seed(5)
    assert rng.draw_seed(generator=g) == rng.draw_seed(generator=torch.Generator().manual_seed(5))


def test_seed_tensor_round_trip_and_same_draw_as_draw_seed():
    for seed in (0, 1, (1 << 31), (1 << 32) - 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        t = rng.seed_arg(seed)
        assert t.dtype == torch.int32 and t.shape == (2,) and t.nbytes == 8
        assert rng.seed_from_tensor(t) == seed and rng.check_seed(t) == seed
    torch.manual_seed(4)
    ints = [rng.draw_seed("cpu") for _ in range(3)]
    torch.manual_seed(4)
    assert [rng.seed_from_tensor(rng.draw_seed_tensor("cpu")) for _ in range(3)] == ints
    with pytest.raises(TypeError, match="seed"):
        rng.seed_arg(torch.zeros(2, dtype=torch.int64))
