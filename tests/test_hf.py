"""The transformers drop-in: model.generate(custom_generate=dspark.hf.speculative(...)) against plain generate()."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria, TextIteratorStreamer

import dspark.engine.decode
import dspark.hf
from conftest import random_prompts, tiny_model
from dspark.engine.sampling import SamplingConfig

pytestmark = pytest.mark.filterwarnings("ignore:drafter '.*' has no checkpoint")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def left_padded(lengths, vocab: int = 128, pad: int = 0):
    """A left-padded batch (input_ids, attention_mask) of prompts with the given lengths."""
    prompts = random_prompts(lengths, vocab, seed=3)
    P = max(lengths)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    return {"input_ids": ids, "attention_mask": mask}


class RecordingStreamer:
    """The streamer protocol transformers drives: put(ids) then end()."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


class StopAfter(StoppingCriteria):
    """Stops a row when its last token is `token` (works on any batch, like transformers' own criteria)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("drafter", ["ngram", "dspark"])
@pytest.mark.parametrize("lengths", [[9], [12, 5, 8]], ids=["batch1", "padded-batch3"])
def test_greedy_equals_plain_generate(model, drafter, lengths):
    inputs = left_padded(lengths)
    settings = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(**inputs, **settings)
    got = model.generate(**inputs, **settings, custom_generate=dspark.hf.speculative(drafter))
    assert torch.equal(got, expected)


def test_drafter_object_and_reused_callable_keep_one_host(model):
    from drafters import build_drafter

    fn = dspark.hf.speculative("ngram", draft_length=3)
    inputs = left_padded([10])
    first = model.generate(**inputs, max_new_tokens=8, custom_generate=fn)
    host = fn.host
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, custom_generate=fn), first)
    assert fn.host is host  # built once per model
    drafter = build_drafter("dspark", host)
    got = model.generate(**inputs, max_new_tokens=8, custom_generate=dspark.hf.speculative(drafter))
    assert torch.equal(got, first)


def test_eos_stops_rows_and_pads_them(model):
    inputs = left_padded([12, 5, 8])
    plain = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    P = inputs["input_ids"].shape[1]
    eos = int(plain[1, P + 3])  # row 1 stops after 4 tokens (or earlier), the others maybe later
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=[127, eos], pad_token_id=1)
    expected = model.generate(**inputs, **settings)
    got = model.generate(**inputs, **settings, custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(got, expected)
    assert (got[1, P + 4:] == 1).all()  # padded with pad_token_id after eos


def test_pad_falls_back_to_eos(model):
    inputs = left_padded([12, 5])
    plain = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=0)
    P = inputs["input_ids"].shape[1]
    eos = int(plain[1, P + 1])
    got = model.generate(**inputs, max_new_tokens=12, eos_token_id=eos,
                         custom_generate=dspark.hf.speculative("ngram"))
    expected = model.generate(**inputs, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("setting", [{"min_new_tokens": 6}, {"min_length": 18}])
def test_min_new_tokens_suppresses_early_eos_like_transformers(model, setting):
    inputs = left_padded([12, 5, 8])
    plain = model.generate(**inputs, max_new_tokens=14, do_sample=False, pad_token_id=0)
    P = inputs["input_ids"].shape[1]
    eos = int(plain[0, P + 1])  # row 0 would stop after 2 tokens
    settings = dict(max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=0)
    unconstrained = model.generate(**inputs, **settings, custom_generate=dspark.hf.speculative("ngram"))
    assert eos in unconstrained[0, P:P + 2].tolist()  # without the minimum, row 0 ends early
    expected = model.generate(**inputs, **settings, **setting)
    got = model.generate(**inputs, **settings, **setting, custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(got, expected)
    assert eos not in got[:, P:P + 6].tolist()[0]


def test_min_new_tokens_when_sampling_never_ends_early(model):
    inputs = left_padded([10])
    P = inputs["input_ids"].shape[1]
    plain = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    eos = int(plain[0, P])  # the host's most likely first token
    for seed in range(4):
        got = model.generate(**inputs, max_new_tokens=10, min_new_tokens=5, do_sample=True, eos_token_id=eos,
                             pad_token_id=0, custom_generate=dspark.hf.speculative("ngram", seed=seed))
        assert got.shape[1] >= P + 5 and eos not in got[0, P:P + 5].tolist()


def test_min_new_tokens_sample_follows_p_without_eos():
    """The first token with min_new_tokens=1 is distributed as softmax(logits) with eos masked (chi-square)."""
    model = tiny_model("llama", vocab=8, hidden=32, layers=2, seed=1)
    with torch.no_grad():
        model.lm_head.weight.div_(2.0)  # spread, but far enough from uniform for the test to tell them apart
    prompt = torch.tensor([[1, 2, 3, 4]])
    logits = model(prompt).logits[0, -1]
    eos = int(logits.argmax())  # the likeliest token, so most rows take the eos fix-up
    expected_p = logits.masked_fill(torch.arange(8) == eos, float("-inf")).softmax(-1)
    n = 400
    out = model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=True, eos_token_id=eos,
                         pad_token_id=0, num_return_sequences=n, custom_generate=dspark.hf.speculative("ngram"))
    observed = torch.bincount(out[:, -1], minlength=8).float()
    assert observed[eos] == 0
    keep = torch.arange(8) != eos
    assert chisquare(observed[keep].numpy(), (expected_p[keep] * n).detach().numpy()).pvalue > 1e-3


def test_stopping_criteria_cut_where_transformers_does(model):
    inputs = left_padded([12, 5, 8])
    plain = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    P = inputs["input_ids"].shape[1]
    token = int(plain[2, P + 5])
    # why an eos id (one never generated): without one transformers keeps generating the rows a criterion has
    # stopped until every row has stopped, where the drop-in pads them
    unused = min(set(range(128)) - set(plain.flatten().tolist()))
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=unused,
                    stopping_criteria=StoppingCriteriaList([StopAfter(token)]))
    expected = model.generate(**inputs, **settings)
    got = model.generate(**inputs, **settings, custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(got, expected)
    assert got.shape[1] < P + 16 or token in got[:, P:].tolist()[2]


def test_max_length_counts_the_padded_prompt(model):
    inputs = left_padded([12, 5])
    expected = model.generate(**inputs, max_length=20, do_sample=False, pad_token_id=0)
    got = model.generate(**inputs, max_length=20, do_sample=False, pad_token_id=0,
                         custom_generate=dspark.hf.speculative("ngram"))
    assert got.shape == (2, 20) and torch.equal(got, expected)


def test_streamer_gets_prompt_then_exactly_the_new_tokens(model):
    inputs = left_padded([9])
    streamer = RecordingStreamer()
    out = model.generate(**inputs, max_new_tokens=12, streamer=streamer,
                         custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(streamer.puts[0], inputs["input_ids"])  # generate() puts the prompt first
    streamed = torch.cat([p.flatten() for p in streamer.puts[1:]])
    assert torch.equal(streamed, out[0, inputs["input_ids"].shape[1]:])
    assert streamer.ended == 1


def test_streamer_stops_at_eos(model):
    inputs = left_padded([9])
    P = inputs["input_ids"].shape[1]
    eos = int(model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, P + 3])
    streamer = RecordingStreamer()
    out = model.generate(**inputs, max_new_tokens=12, eos_token_id=eos, streamer=streamer,
                         custom_generate=dspark.hf.speculative("ngram"))
    streamed = torch.cat([p.flatten() for p in streamer.puts[1:]]).tolist()
    assert streamed == out[0, P:].tolist() and streamed[-1] == eos


def test_sampling_settings_reach_the_sampler(model, monkeypatch):
    seen: list[SamplingConfig] = []
    real = dspark.engine.decode.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["sampling"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dspark.engine.decode, "generate", spy)
    inputs = left_padded([9])
    fn = dspark.hf.speculative("ngram")
    model.generate(**inputs, max_new_tokens=4, do_sample=True, temperature=0.7, top_p=0.9, top_k=20,
                   custom_generate=fn)
    assert seen[-1] == SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    model.generate(**inputs, max_new_tokens=4, do_sample=True, custom_generate=fn)
    assert seen[-1] == SamplingConfig(temperature=1.0, top_k=50, top_p=1.0)  # transformers' own default top_k
    model.generate(**inputs, max_new_tokens=4, do_sample=False, custom_generate=fn)
    assert seen[-1].greedy


def test_sampling_top_k_1_is_greedy_and_seeds_are_per_row(model):
    inputs = left_padded([12, 5, 8])
    greedy = model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0)
    got = model.generate(**inputs, max_new_tokens=10, do_sample=True, top_k=1, pad_token_id=0,
                         custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(got, greedy)
    one = left_padded([10])
    fn = dspark.hf.speculative("ngram", seed=5)
    copies = model.generate(**one, max_new_tokens=10, do_sample=True, temperature=1.0, num_return_sequences=4,
                            custom_generate=fn)
    assert copies.shape == (4, 20) and len({tuple(r) for r in copies.tolist()}) > 1
    again = model.generate(**one, max_new_tokens=10, do_sample=True, temperature=1.0, num_return_sequences=4,
                           custom_generate=fn)
    assert torch.equal(again, copies)  # the same seed repeats its samples


def test_return_dict_has_sequences_and_speculation(model):
    inputs = left_padded([12, 5, 8])
    plain = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(out.sequences, plain)
    spec = out.speculation
    assert isinstance(spec, dspark.hf.Speculation)
    assert spec.new_tokens == [16, 16, 16] and spec.finish_reasons == ["length"] * 3
    assert len(spec.accepted) == 3 and spec.rounds >= max(spec.request_rounds) > 0
    assert sum(spec.request_rounds) == len(spec.log.column("request"))
    assert spec.tau == pytest.approx(1 + sum(spec.accepted) / sum(spec.request_rounds))


@pytest.mark.parametrize("setting, message", [
    ({"num_beams": 2}, "num_beams=2"),
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
    ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
    ({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    ({"output_logits": True, "return_dict_in_generate": True}, "output_logits"),
])
def test_unsupported_settings_are_named(model, setting, message):
    with pytest.raises(ValueError, match=message):
        model.generate(**left_padded([9]), max_new_tokens=4, custom_generate=dspark.hf.speculative("ngram"),
                       **setting)


def test_assistant_model_and_batched_streamer_are_refused(model):
    with pytest.raises(ValueError, match="assistant_model"):
        model.generate(**left_padded([9]), max_new_tokens=4, assistant_model=model,
                       custom_generate=dspark.hf.speculative("ngram"))
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(**left_padded([9, 6]), max_new_tokens=4, pad_token_id=0, streamer=RecordingStreamer(),
                       custom_generate=dspark.hf.speculative("ngram"))


def test_right_padding_is_refused(model):
    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="padding_side='left'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0,
                       custom_generate=dspark.hf.speculative("ngram"))


@pytest.mark.slow
def test_smollm2_text_streamer_gets_exactly_the_generated_text(smollm2_host):
    model, tokenizer = smollm2_host.model, smollm2_host.tokenizer
    inputs = tokenizer(["The three primary colours are"], return_tensors="pt")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False, streamer=streamer,
                         custom_generate=dspark.hf.speculative("ngram"))
    P = inputs["input_ids"].shape[1]
    assert "".join(streamer) == tokenizer.decode(out[0, P:])
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=24, do_sample=False))


@pytest.mark.slow
def test_smollm2_padded_batch_equals_plain_generate(smollm2_host, monkeypatch):
    model, tokenizer = smollm2_host.model, smollm2_host.tokenizer
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    inputs = tokenizer(["def fibonacci(n):", "The capital of France is Paris. The capital of Italy is"],
                       return_tensors="pt", padding=True)
    expected = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    got = model.generate(**inputs, max_new_tokens=20, do_sample=False, custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_smollm2_stop_strings_and_sampling(smollm2_host):
    model, tokenizer = smollm2_host.model, smollm2_host.tokenizer
    inputs = tokenizer(["Name three fruits. Answer: apples,"], return_tensors="pt")
    # transformers drops tokenizer= for a callable custom_generate, so stop strings come as a criterion
    settings = dict(max_new_tokens=24, do_sample=False,
                    stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, [","])]))
    expected = model.generate(**inputs, **settings)
    got = model.generate(**inputs, **settings, custom_generate=dspark.hf.speculative("ngram"))
    assert torch.equal(got, expected) and got.shape[1] < inputs["input_ids"].shape[1] + 24  # stopped at ","
    sampled = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.95,
                             return_dict_in_generate=True, custom_generate=dspark.hf.speculative("ngram", seed=1))
    assert sampled.sequences.shape[1] <= inputs["input_ids"].shape[1] + 16 and sampled.speculation.tau >= 1
