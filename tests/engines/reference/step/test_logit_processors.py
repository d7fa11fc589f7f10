"""The logit processors and log-probabilities of `choose` (vLLM's semantics): each changes
the drawn token as specified, and log-probabilities are the model's own."""

from __future__ import annotations

import math

import torch

from prfaas.engines.reference.step.sampling import choose, processed, token_logprob
from prfaas.protocol.generate import SamplingParams

EOS = 9


def _logits() -> torch.Tensor:
    return torch.tensor([4.0, 3.0, 2.0, -1.0, 0.5, 0.0, 1.0, 1.5, -2.0, 3.5])


def test_logit_bias_moves_the_greedy_choice() -> None:
    params = SamplingParams(temperature=0, logit_bias=((3, 10.0),))
    assert choose(_logits(), params, 0, ([], []), EOS).token == 3
    assert choose(_logits(), SamplingParams(temperature=0), 0, ([], []), EOS).token == 0


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    logits = _logits()
    logits[EOS] = 50.0
    params = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(0,))
    first = choose(logits, params, 0, ([5], []), EOS).token
    assert first not in (EOS, 0)
    assert choose(logits, params, 0, ([5], [1, 2]), EOS).token == EOS


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = _logits()
    processed(logits, SamplingParams(repetition_penalty=2.0), [0], [3], EOS)
    assert logits[0].item() == 2.0 and logits[3].item() == -2.0
    assert logits[1].item() == 3.0  # unseen: unchanged


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    logits = _logits()
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    processed(logits, params, [1, 1, 1], [0, 0, 2], EOS)
    assert math.isclose(logits[0].item(), 4.0 - 2 * 0.5 - 1.0)
    assert math.isclose(logits[2].item(), 2.0 - 0.5 - 1.0)
    assert logits[1].item() == 3.0  # in the prompt only


def test_logprobs_are_the_models_own_before_processors() -> None:
    params = SamplingParams(temperature=0, logit_bias=((3, 10.0),), top_logprobs=2)
    choice = choose(_logits(), params, 0, ([], []), EOS)
    assert choice.logprob is not None
    expected = torch.log_softmax(_logits(), dim=-1)
    assert choice.token == 3
    assert math.isclose(choice.logprob.logprob, expected[3].item(), rel_tol=1e-6)
    assert [t for t, _ in choice.logprob.top] == [0, 9]
    assert token_logprob(_logits(), 0, 0).top == ()


def test_the_input_logits_are_not_changed() -> None:
    logits = _logits()
    choose(logits, SamplingParams(temperature=0, logit_bias=((3, 10.0),)), 0, ([], []), EOS)
    assert torch.equal(logits, _logits())
