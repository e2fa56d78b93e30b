"""logit_bias: validated like OpenAI's (≤ 300 entries, finite biases in [-100, 100], ids in the vocabulary),
added to the logits before penalties, temperature and filters on every sampling path (speculative
verification too), while reported logprobs stay the model's raw log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine.request import InvalidRequestError, SamplingParams
from deepinfer.engine.sampler import Sampler, SamplingRow, make_generator
from deepinfer.engine.speculative.verify import VerifyGroup, verify
from deepinfer.protocol.messages import SamplingParamsWire
from deepinfer.services.wire import to_engine_params

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
sampler = Sampler()


def row(output: list[int] | None = None, **kwargs: object) -> SamplingRow:
    p = SamplingParams(**kwargs)  # type: ignore[arg-type]
    return SamplingRow(p, [0], list(output or []), make_generator(p.seed))


def test_bias_changes_the_greedy_choice_and_only_its_row() -> None:
    rows = [row(logit_bias={1: 5.0}), row(), row(logit_bias={3: -100.0})]
    tokens = [t for t, _ in sampler(torch.tensor([LOGITS] * 3), rows)]
    assert tokens == [1, 3, 0]  # -1 + 5 beats 3; unbiased row untouched; the best token banned


def test_bias_comes_before_penalties() -> None:
    # Repetition penalty 2 on token 3 (seen): (3 + 1) / 2 = 2 if biased first; 3 / 2 + 1 = 2.5 if after.
    r = row(output=[3], logit_bias={3: 1.0}, repetition_penalty=2.0)
    got = sampler.penalise(torch.tensor([LOGITS]), [r])[0].tolist()
    assert got[3] == pytest.approx(2.0) and got[0] == pytest.approx(1.0)  # 0 is in the prompt: 2 / 2


def test_reported_logprobs_are_raw() -> None:
    raw = torch.tensor([LOGITS]).log_softmax(dim=-1)[0]
    for kwargs in (dict(logit_bias={1: 100.0}), dict(logit_bias={1: 100.0}, temperature=0.5, seed=3),
                   dict(presence_penalty=2.0, logit_bias={4: -50.0})):
        [(token, lp)] = sampler(torch.tensor([LOGITS]), [row(output=[3], logprobs=6, **kwargs)])
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(raw[token].item(), abs=1e-6)
        assert dict(lp.top) == pytest.approx({i: raw[i].item() for i in range(6)}, abs=1e-6)
    [(token, _)] = sampler(torch.tensor([LOGITS]), [row(logprobs=0, logit_bias={1: 100.0}, temperature=1.0, seed=5)])
    assert token == 1  # +100 makes it certain even when sampling


def test_speculative_verification_applies_the_bias() -> None:
    """Point-mass drafts are checked against the biased target: the same tokens as plain decoding."""
    params = SamplingParams(logit_bias={1: 5.0, 3: -100.0})
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])  # rows after the last token, then after each draft
    [res] = verify(sampler, logits.clone(), [VerifyGroup(params, [0], [], None, [1, 1])])
    assert res.token_ids == [1, 1, 1] and res.num_accepted == 2
    [res] = verify(sampler, logits.clone(), [VerifyGroup(params, [0], [], None, [3, 1])])
    assert res.token_ids == [1] and res.num_accepted == 0  # the banned draft is rejected


@pytest.mark.parametrize(("bias", "says"), [
    ({5: 100.5}, "[-100, 100]"),
    ({5: math.nan}, "finite"),
    ({5: math.inf}, "finite"),
    ({-1: 1.0}, "token id -1"),
    ({320: 1.0}, "token id 320 is outside the vocabulary (size 320)"),
    ({i: 1.0 for i in range(301)}, "at most 300"),
    ({"5": 1.0}, "token id '5'"),
    ({5: "1"}, "finite number"),
])
def test_invalid_bias_is_refused_naming_the_problem(bias: dict, says: str) -> None:
    with pytest.raises(InvalidRequestError, match="logit_bias") as info:
        SamplingParams(logit_bias=bias).validate(vocab_size=320)
    assert says in str(info.value)


def test_valid_bias_bounds() -> None:
    SamplingParams(logit_bias={i: (-100.0 if i % 2 else 100) for i in range(300)}).validate(vocab_size=320)


def test_wire_pairs_become_the_engine_mapping_and_duplicates_are_refused() -> None:
    assert to_engine_params(SamplingParamsWire(logit_bias=[(4, 1.0), (9, -2.0)])).logit_bias == {4: 1.0, 9: -2.0}
    with pytest.raises(InvalidRequestError, match="token id 4 more than once"):
        to_engine_params(SamplingParamsWire(logit_bias=[(4, 1.0), (4, 2.0)]))


def test_prompt_logprobs_bounded_like_logprobs() -> None:
    SamplingParams(prompt_logprobs=0).validate()
    SamplingParams(prompt_logprobs=20).validate()
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()  # type: ignore[arg-type]
