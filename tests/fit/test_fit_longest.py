"""fit's longest context fits by construction: for every variant row, on several bundled configs and training
forms and on budgets from tight to ample, the projection fits at the longest context and not one token further
(or the longest is the config's max_position_embeddings), and each row's "fits" at the report's context agrees
with its longest context. Only the two probe contexts are simulated per config and form (fit keeps the steps of
the last configs and forms it saw); every other figure here is arithmetic on them."""

import pytest
import torch

from selective_ckpt.fit import VARIANTS, TrainingForm, fit, load_config
from selective_ckpt.fit.fitting import plan_at

pytest.importorskip("transformers")
pytest.importorskip("peft")

CASES = {
    "Llama-3.1-8B qlora": ("Llama-3.1-8B", TrainingForm("qlora")),
    "Qwen3-8B lora bf16 autocast": ("Qwen3-8B", TrainingForm("lora", autocast=torch.bfloat16, lora_dropout=0.05)),
    "Gemma-2-9B full bf16": ("Gemma-2-9B", TrainingForm("full", weights=torch.bfloat16)),
}
# budgets as multiples of the weights and optimizer state: tight (only the lightest variants fit short
# contexts) to ample (the longest context is the config's limit for some rows)
MULTIPLES = (1.05, 2.0, 40.0)


def _checks(config, form):
    limit = load_config(config).max_position_embeddings
    fixed = None
    out = []
    for m in (None,) + MULTIPLES:
        if m is None:  # parts first, at a budget everything fits
            r = fit(config, 1e15, seq_len=4096, form=form)
            fixed = r.parts["weights"] + r.parts["optimizer state"]
            continue
        r = fit(config, fixed * m, seq_len=4096, form=form)
        for name in VARIANTS:
            longest = r.max_context[name]
            assert 0 <= longest <= limit, (name, longest)
            at = r.fits_at(name, longest) if longest else None
            past = r.fits_at(name, longest + 1) if longest < limit else None
            out.append((m, name, longest, at, past, r.fits(name), r.seq_len))
    return out


@pytest.mark.parametrize("case", CASES)
def test_longest_context_fits_and_the_next_token_does_not(case):
    rows = _checks(*CASES[case])
    assert any(longest == 0 for _, _, longest, *_ in rows), "a tight budget leaves some row no context"
    assert any(0 < longest for _, _, longest, *_ in rows)
    for m, name, longest, at, past, fits_row, seq_len in rows:
        if longest:
            assert at is True, (m, name, longest)
        assert past is not True, (m, name, longest)
        # the row at the report's context says what its longest context says
        assert fits_row == (longest >= seq_len), (m, name, longest, seq_len, fits_row)


def test_seq_len_max_reports_a_context_that_fits():
    """The issue's case: QLoRA Llama-3.1-8B on 24 GB. The report stands at the longest context the plan fits; its
    row says it fits there, and one more token does not."""
    r = fit("Llama-3.1-8B", 24e9, form=TrainingForm("qlora"), host_bytes=64e9)
    assert r.seq_len == r.max_context["ours plan"] > r.max_context["ours selective"] > 0
    assert r.fits("ours plan") and r.plan is not None and r.plan.host_bytes <= 64e9
    assert r.max_context["ours plan"] >= max(v for k, v in r.max_context.items() if k != "ours plan")
    assert plan_at(r._projection, r.seq_len + 1, r.gpu_bytes, r.host_bytes, r.rates)[0] is None
    for name in VARIANTS:
        assert r.fits(name) == (r.max_context[name] >= r.seq_len), name
    # "ours plan" is at least every layer "full", which is a plan
    assert r.max_context["ours plan"] >= r.max_context["ours full"]
