"""A converted model's attention does what plain transformers' does: weights, arbitrary 4-D masks, switching.

Every check runs on all five converted families against the unconverted model (eager attention where
weights are asked for, SDPA otherwise) and against a float64 reference, with the 2x / 3x rule.
"""

import copy
import warnings

import pytest
import torch

from selective_ckpt import convert
from selective_ckpt.models import attention as hf_attention
from tests.models import test_gpt2, test_hf_llama
from tests.models.families import by_name
from tests.models.hf_checks import VOCAB, batch
from tests.reference import assert_within_rule

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "gpt2": test_gpt2.build,
    "llama": test_hf_llama.build,
    "mistral": by_name("mistral").build,  # sliding window 5, shorter than the sequences below
    "qwen2": lambda: by_name("qwen2").build(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                         layer_types=["full_attention", "sliding_attention"]),
    "qwen3": by_name("qwen3").build,
}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    hf_attention._WARNED.clear()
    yield
    hf_attention._WARNED.clear()


def models(family, impl, dtype=torch.float32):
    """(float64 reference, unconverted, converted) with the same weights; the first two run `impl` attention."""
    torch.manual_seed(0)
    ref = FAMILIES[family]()().double().train()
    ref.set_attn_implementation(impl)
    plain = copy.deepcopy(ref).to(dtype)
    ours = convert(copy.deepcopy(plain))
    assert ours.config._attn_implementation == "selective_ckpt"
    return ref, plain, ours


class KernelCalls:
    """Counts the calls of selective_ckpt's attention op made through the registry."""

    def __init__(self, monkeypatch):
        self.n = 0
        original = hf_attention.attention

        def counted(*args, **kwargs):
            self.n += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(hf_attention, "attention", counted)


def _weights_of_live_rows(attentions, mask):
    """[layers, ...] weights of the queries that attend something (padded queries: float64 eager gives NaN)."""
    live = mask.bool()
    return torch.stack([a.permute(0, 2, 1, 3)[live] for a in attentions])


def _probe(n):
    return torch.linspace(-1, 1, n, dtype=torch.float64)


def _step_with_weights(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    out.attentions[0].retain_grad()
    live = mask.bool()
    logits = out.logits[live]
    att = _weights_of_live_rows(out.attentions, mask)
    loss = (logits.double() * _probe(logits.shape[-1])).sum() + (att.double() * _probe(att.shape[-1])).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, logits.detach(), att.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_are_eager_weights_with_gradients(family, monkeypatch):
    """output_attentions=True returns one weight tensor per layer, as transformers' eager attention computes
    them; the weights carry gradients (retain_grad), and logits and parameter gradients meet the rule.

    Without padding against float64 (transformers' float64 eager mask overflows to -inf on padded rows,
    whose NaN then reaches every row); with left padding against the unconverted model in its dtype."""
    ref, plain, ours = models(family, "eager")
    ids, mask = batch(pad_rows=False)
    ro, rl, ra, rg = _step_with_weights(ref, ids, mask)
    po, pl, pa, pg = _step_with_weights(plain, ids, mask)
    calls = KernelCalls(monkeypatch)
    with pytest.warns(UserWarning, match="asks for the attention weights"):
        oo, ol, oa, og = _step_with_weights(ours, ids, mask)
    assert calls.n == 0, "a call asking for weights runs transformers' eager attention"
    assert len(oo.attentions) == len(po.attentions) == 2
    for a, b in zip(oo.attentions, po.attentions):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert oo.attentions[0].grad is not None
    assert_within_rule(oa, pa, ra, 2, name="attention weights")
    assert_within_rule(ol, pl, rl, 2, name="logits")
    assert_within_rule(oo.attentions[0].grad, po.attentions[0].grad, ro.attentions[0].grad, 3, name="weights grad")
    assert set(og) == set(pg) == set(rg)
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")

    ids, mask = batch()
    po, pl, pa, pg = _step_with_weights(plain, ids, mask)
    oo, ol, oa, og = _step_with_weights(ours, ids, mask)
    for a, b in zip(oo.attentions, po.attentions):  # padded queries included: uniform weights, as eager gives
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(oo.attentions[0].grad, po.attentions[0].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ol, pl, rtol=1e-4, atol=1e-5)
    for n in pg:
        torch.testing.assert_close(og[n], pg[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_only_for_the_call_that_asks(family, monkeypatch):
    """Warned once; a call without the flag (or with it False over a True config) runs our kernel and returns
    no weights; config.output_attentions (set while the model ran eager) alone asks for them, as in
    transformers, and output_attentions=False overrides it."""
    _, plain, ours = models(family, "eager")
    ours.eval()
    plain.eval()
    ids, mask = batch()
    calls = KernelCalls(monkeypatch)
    with pytest.warns(UserWarning, match="asks for the attention weights"):
        ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(input_ids=ids, attention_mask=mask, output_attentions=True)  # once only
    assert calls.n == 0
    assert ours(input_ids=ids, attention_mask=mask).attentions is None
    assert calls.n == 2, "every layer of a call without the flag runs selective_ckpt's kernel"
    plain.config.output_attentions = True  # transformers allows the config flag with eager attention only
    ours = convert(copy.deepcopy(plain))
    got, want = ours(input_ids=ids, attention_mask=mask), plain(input_ids=ids, attention_mask=mask)
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert calls.n == 2
    assert ours(input_ids=ids, attention_mask=mask, output_attentions=False).attentions is None
    assert calls.n == 4


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              pad_token_id=0, output_attentions=True, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_returns_weights_per_step_and_assisted_decoding_runs(family):
    _, plain, ours = models(family, "eager")
    ours.eval()
    plain.eval()
    ids = batch(b=1, s=7)[0]
    with pytest.warns(UserWarning, match="asks for the attention weights"):
        got = _generate(ours, ids)
    want = _generate(plain, ids)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.attentions) == len(want.attentions) == 4
    for step_got, step_want in zip(got.attentions, want.attentions):
        assert len(step_got) == len(step_want) == 2
        for a, b in zip(step_got, step_want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assistant = convert(copy.deepcopy(plain))
    got = _generate(ours, ids, assistant_model=assistant)
    want = _generate(plain, ids, assistant_model=copy.deepcopy(plain))
    assert torch.equal(got.sequences, want.sequences)
    assert [len(s) for s in got.attentions] == [len(s) for s in want.attentions]
    for step_got, step_want in zip(got.attentions, want.attentions):
        for a, b in zip(step_got, step_want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- 4-D masks that are neither causal + padding nor causal packed documents: transformers' SDPA for that call.

PREFIX, BRANCH = 2, 3  # one shared prefix, three continuations: a tree packed into one row (within windows)


def tree_mask(kind="tree", heads=4):
    """Bool [1, 1 or H, S, S] masks of several kinds, and the row's position_ids."""
    s = PREFIX + 3 * BRANCH
    pos = torch.arange(s)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    if kind == "tree":  # each continuation sees the prefix and itself, not the other continuations
        starts = [PREFIX + k * BRANCH for k in range(3)]
        for a in starts:
            for b in starts:
                if a != b:
                    mask[a:a + BRANCH, b:b + BRANCH] = False
            pos[a:a + BRANCH] = torch.arange(PREFIX, PREFIX + BRANCH)
    elif kind == "hole":  # one query cannot see one earlier key
        mask[6, 2] = False
    elif kind == "prefix_lm":  # the first positions see each other both ways
        mask[:4, :4] = True
    elif kind == "doc_sees_previous":  # documents [0, 5) and [5, S), but the last query sees the first one
        mask[5:, :5] = False
        mask[-1, :5] = True
    elif kind == "bidirectional":
        mask[:] = True
    mask = mask[None, None]
    if kind == "per_head":
        mask = mask.expand(1, heads, s, s).clone()
        mask[0, 1, 7, 0] = False
    return mask, pos[None]


def additive(mask, dtype):
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def _step_4d(model, ids, mask, pos):
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    m = additive(mask, dtype) if mask.dtype == torch.bool and pos is not None else mask
    logits = model(input_ids=ids, attention_mask=m, position_ids=pos, use_cache=False).logits
    (logits.double() * _probe(logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_tree_mask_runs_through_sdpa(family, monkeypatch):
    """A float 4-D tree mask (transformers' custom 4-D mask test): logits and gradients meet the rule against
    the unconverted model; each continuation's logits equal those of its own sequence run alone."""
    ref, plain, ours = models(family, "sdpa")
    mask, pos = tree_mask()
    ids = torch.randint(1, VOCAB, (1, mask.shape[-1]), generator=torch.Generator().manual_seed(4))
    r, rg = _step_4d(ref, ids, mask, pos)
    p, pg = _step_4d(plain, ids, mask, pos)
    calls = KernelCalls(monkeypatch)
    with pytest.warns(UserWarning, match="neither causal"):
        o, og = _step_4d(ours, ids, mask, pos)
    assert calls.n == 0
    assert_within_rule(o, p, r, 2, name="logits")
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")
    ours.eval()
    with torch.no_grad():
        for k in range(3):
            a = PREFIX + k * BRANCH
            alone = torch.cat([ids[:, :PREFIX], ids[:, a:a + BRANCH]], 1)
            torch.testing.assert_close(ours(input_ids=alone).logits[0, PREFIX:], o[0, a:a + BRANCH],
                                       rtol=1e-4, atol=1e-5)
    assert calls.n == 2 * 3, "a plain causal call runs selective_ckpt's kernel again"


@pytest.mark.parametrize("kind", ["hole", "prefix_lm", "doc_sees_previous", "per_head", "bidirectional", "bias"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_inexpressible_masks_match_sdpa(family, kind, monkeypatch):
    ref, plain, ours = models(family, "sdpa")
    if kind == "bias":  # an additive bias on one key column
        mask, _ = tree_mask("hole")
        masks = {dt: additive(mask, dt).index_fill(-1, torch.tensor([3]), -5.0) for dt in (torch.float64,
                                                                                          torch.float32)}
    else:
        mask, _ = tree_mask(kind)
        masks = {torch.float64: mask, torch.float32: mask}
    ids = torch.randint(1, VOCAB, (1, mask.shape[-1]), generator=torch.Generator().manual_seed(5))
    r, rg = _step_4d(ref, ids, masks[torch.float64], None)
    p, pg = _step_4d(plain, ids, masks[torch.float32], None)
    calls = KernelCalls(monkeypatch)
    with pytest.warns(UserWarning, match="neither causal|differs between heads|additive bias"):
        o, og = _step_4d(ours, ids, masks[torch.float32], None)
    assert calls.n == 0
    assert_within_rule(o, p, r, 2, name="logits")
    for n in rg:
        assert_within_rule(og[n], pg[n], rg[n], 3, floor=1e-5, name=f"grad {n}")


def test_padded_packed_rows_run_through_sdpa():
    """Documents in a batch of two rows (packing the kernel takes with B = 1 only): SDPA, same result."""
    ref, plain, ours = models("llama", "sdpa")
    s = 10
    doc = torch.ones(s, s, dtype=torch.bool).tril()
    doc[4:, :4] = False
    mask = torch.stack([doc, torch.ones(s, s, dtype=torch.bool).tril()])[:, None]
    ids = torch.randint(1, VOCAB, (2, s), generator=torch.Generator().manual_seed(6))
    r, _ = _step_4d(ref, ids, mask, None)
    p, _ = _step_4d(plain, ids, mask, None)
    with pytest.warns(UserWarning, match="packed documents need one row"):
        o, _ = _step_4d(ours, ids, mask, None)
    assert_within_rule(o, p, r, 2, name="logits")


# --- switching the attention implementation after convert


@pytest.mark.parametrize("family", FAMILIES)
def test_set_attn_implementation_switches_ours_off_and_on(family, monkeypatch, tmp_path):
    _, plain, ours = models(family, "sdpa")
    ids, mask = batch()
    calls = KernelCalls(monkeypatch)
    live = mask.bool()  # padded queries: eager and SDPA differ there
    want = plain(input_ids=ids, attention_mask=mask).logits[live]
    for impl in ("eager", "sdpa"):
        ours.set_attn_implementation(impl)
        plain.set_attn_implementation(impl)
        assert ours.config._attn_implementation == impl
        got = ours(input_ids=ids, attention_mask=mask, output_attentions=impl == "eager")
        assert calls.n == 0, f"{impl}: selective_ckpt's kernel must not run"
        torch.testing.assert_close(got.logits[live], want, rtol=1e-4, atol=1e-5)
        if impl == "eager":
            ref_att = plain(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
            assert len(got.attentions) == 2
            for a, b in zip(got.attentions, ref_att):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    ours.set_attn_implementation("selective_ckpt")
    assert ours.config._attn_implementation == "selective_ckpt"
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[live], want, rtol=1e-4, atol=1e-5)
    assert calls.n == 2

    ours.save_pretrained(tmp_path)
    cls = type(plain)
    for impl in ("eager", "sdpa", "selective_ckpt"):
        loaded = cls.from_pretrained(tmp_path, attn_implementation=impl)
        assert loaded.config._attn_implementation == impl
        before = calls.n
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits[live], want, rtol=1e-4, atol=1e-5)
        assert calls.n - before == (2 if impl == "selective_ckpt" else 0)
    back = convert(cls.from_pretrained(tmp_path, attn_implementation="eager"))
    assert back.config._attn_implementation == "selective_ckpt"
