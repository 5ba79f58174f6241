"""verifiers.draft_length: the fixed γ that a drafter's measured acceptance and step costs predict to pay best."""
from __future__ import annotations

import math

import pytest
import torch

from verifiers.cost_model import CostModel, draft_key, profile, profile_draft
from verifiers.draft_length import choose_draft_length, draft_keys, expected_tau

MS = 1e-3


def table(verify_ms: dict[int, float], draft_ms: dict[int, float], *, name: str = "small-lm",
          parameters: int = 1000) -> CostModel:
    """One request; a verify of T tokens takes verify_ms[T]; proposing K drafts draft_ms[K] (no observe)."""
    points = [{"batch_size": 1, "tokens_per_request": t, "tokens": t, "step_seconds": ms * MS}
              for t, ms in sorted(verify_ms.items())]
    return CostModel(tokens=sorted(verify_ms), sps=[1 / (verify_ms[t] * MS) for t in sorted(verify_ms)],
                     batch_sizes=[1], tokens_per_request=sorted(verify_ms), points=points,
                     draft={f"{name}/K{k}/{parameters}": {"batch_sizes": [1], "seconds": [ms * MS]}
                            for k, ms in draft_ms.items()})


def test_expected_tau_is_one_plus_the_prefix_survivals():
    a = [0.8, 0.5, 0.5]
    assert expected_tau(a, 1) == pytest.approx(1.8)
    assert expected_tau(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tau([0.9, float("nan"), 1.0], 3) == pytest.approx(1.9)  # an unreached position adds nothing
    with pytest.raises(ValueError, match="measured at 3 draft positions, not 4"):
        expected_tau(a, 4)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        expected_tau([1.5], 1)


def test_the_choice_maximises_predicted_tokens_per_second():
    # verify: 2 ms at 1 token, 2.2 at 2, 2.6 at 4, 3.4 at 8 (linear between); drafting costs 1 ms a draft
    cost = table({1: 2.0, 2: 2.2, 4: 2.6, 8: 3.4}, {1: 1.0, 3: 3.0, 7: 7.0})
    a = [0.9] * 7
    choice = choose_draft_length(cost, a, key_for=draft_keys(cost, "small-lm"))
    by_k = {r["draft_length"]: r for r in choice.rows}
    assert set(by_k) == {1, 3, 7} and choice.plain_ms == pytest.approx(2.0)
    for K, verify in ((1, 2.2), (3, 2.6), (7, 3.4)):
        tau = 1 + sum(0.9 ** k for k in range(1, K + 1))
        assert by_k[K]["verify_ms"] == pytest.approx(verify)
        assert by_k[K]["speedup"] == pytest.approx((tau / (K + verify)) * 2.0)
    assert choice.draft_length == max(by_k, key=lambda k: by_k[k]["speedup"]) == 3
    assert choice.reason().startswith("γ = 3:")


def test_plain_decoding_is_chosen_when_no_length_pays():
    cost = table({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}, {1: 5.0, 3: 15.0})
    choice = choose_draft_length(cost, [0.5, 0.5, 0.5], key_for=draft_keys(cost, "small-lm"))
    assert choice.draft_length == 0 and all(r["speedup"] < 1 for r in choice.rows)
    assert choice.reason().startswith("γ = 0 (plain decoding)")
    assert choice.to_dict()["reason"] == choice.reason()


def test_two_drafters_of_one_name_in_a_table_are_refused():
    cost = table({1: 1.0}, {3: 1.0})
    cost.draft["small-lm/K3/999"] = {"batch_sizes": [1], "seconds": [1e-3]}
    with pytest.raises(ValueError, match="2 'small-lm' drafters"):
        draft_keys(cost, "small-lm")


def test_profiled_costs_of_a_real_drafter_feed_the_choice(tiny_host):
    from drafters.small_lm import SmallLMDrafter
    from tests.conftest import tiny_model

    drafter = SmallLMDrafter(tiny_model("llama", layers=1, seed=3), tiny_host)
    cost = profile(tiny_host, batch_sizes=[1], tokens_per_request=[1, 2, 4], context=16, repeats=2, warmup=1)
    for K in (1, 3):
        cost.draft[draft_key(drafter, K)] = profile_draft(tiny_host, drafter, batch_sizes=[1], draft_length=K,
                                                          context=16, repeats=2, warmup=1)
    choice = choose_draft_length(cost, [0.7, 0.7, 0.7], key_for=lambda K: draft_key(drafter, K), lengths=[1, 2, 3])
    assert [r["draft_length"] for r in choice.rows] == [1, 3]  # K = 2 was not profiled
    assert all(r["draft_ms"] > 0 and r["verify_ms"] > 0 and math.isfinite(r["speedup"]) for r in choice.rows)
