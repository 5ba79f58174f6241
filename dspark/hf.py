"""The transformers drop-in: speculative decoding behind `model.generate(custom_generate=...)`.

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import dspark.hf

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    inputs = tokenizer(["The capital of France is", "def fib(n):"], return_tensors="pt", padding=True)
    out = model.generate(**inputs, custom_generate=dspark.hf.speculative("ngram"), max_new_tokens=64,
                         do_sample=True, temperature=0.7, top_p=0.9, return_dict_in_generate=True)
    print(tokenizer.batch_decode(out.sequences[:, inputs["input_ids"].shape[1]:]), out.speculation.tau)

Shapes: B rows of input_ids, P padded prompt length, G generated length (the longest row's), V vocabulary.

transformers (>= 5.17) prepares the inputs, the GenerationConfig, its logits processors and stopping criteria,
then calls the callable in place of its own decoding loop. The callable strips each row's left padding, decodes
the prompts with dspark.engine.decode.generate (lossless: sampled output follows the same distribution; greedy output
is transformers' greedy output token for token in fp32 only: in bf16 / fp16 the multi-token verify forward rounds
differently from generate()'s one-token steps, so a near-tie can flip and the continuations part, see the README's
"Drop into transformers.generate") and returns what generate() returns: the padded input_ids followed
by the new tokens, rows that finished early padded with pad_token_id (the first eos id when unset, as in
transformers).

Honoured: max_new_tokens / max_length, min_new_tokens / min_length (eos suppressed before them, as transformers
does), eos_token_id (int or list), pad_token_id, do_sample / temperature / top_k / top_p (greedy when do_sample is
False), stopping_criteria, max_time, streamer (batch size 1, as in transformers),
num_return_sequences with sampling (each copy its own seed) and return_dict_in_generate. Stopping criteria are
called after every committed token on that row alone, (1, P + t) with scores=None. One difference: without an
eos_token_id, transformers keeps generating rows a criterion has stopped until every row has stopped; here they
are padded (pad_token_id is then required). stop_strings: transformers drops `tokenizer=` before it calls a
callable custom_generate, so generate() itself refuses them; pass
`stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, stop_strings)])` instead.
Refused with a ValueError naming the setting: beam search, assisted generation at the same time (assistant_model,
prompt_lookup_num_tokens, ...), every other logits processor (repetition_penalty, no_repeat_ngram_size, min_p,
bad_words_ids, logits_processor=...: each changes the target distribution), output_scores / output_logits /
output_attentions / output_hidden_states (the loop keeps no per-step scores) and inputs other than input_ids.

Randomness is dspark's counter-based noise keyed by (seed + row, position), not torch's global generator. By
default (seed=None) every call draws a fresh base seed from torch's generator, so repeated sampled calls differ
and torch.manual_seed governs them, as it governs transformers' sampling; `speculative(..., seed=5)` opts into a
fixed seed, with which every call repeats its samples.

With return_dict_in_generate=True the result is a GenerateDecoderOnlyOutput whose `sequences` are as above and
whose attribute `speculation` is a `Speculation` (tau, rounds, per-row accepted drafts, rounds and new tokens,
finish reasons, seconds and the RoundLog that dspark.metrics reads).
"""
from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers.generation import (EosTokenCriteria, GenerateDecoderOnlyOutput, LogitNormalization,
                                     MaxLengthCriteria, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                                     StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper,
                                     TopPLogitsWarper)
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from dspark.api import drafter_directory, resolve_drafter, resolve_verifier
from dspark.engine import decode
from dspark.engine.results import RoundLog
from dspark.engine.host import Host
from dspark.engine.sampling import STREAM_SAMPLE, SamplingConfig, process, sample

# Processors whose effect the loop reproduces exactly: the sampling warpers become the SamplingConfig, the two
# minimum-length processors are the eos suppression below, and log-softmax renormalisation changes no draw.
_REPRODUCED = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinLengthLogitsProcessor,
               MinNewTokensLengthLogitsProcessor, LogitNormalization)
_NATIVE_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)  # the loop's own length limit and stop tokens
# model kwargs generate() adds for its own loop; the host adapter keeps its own cache and positions
_OWN_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "cache_position", "logits_to_keep",
               "use_cache"}
_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


@dataclass
class Speculation:
    """Speculation statistics of one generate() call; per-row lists follow the rows of `sequences`."""

    tau: float  # mean tokens committed per request-round (accepted drafts + 1); nan without rounds
    rounds: int  # batched decode rounds, prefills excluded
    accepted: list[int]  # per row: drafts accepted
    request_rounds: list[int]  # per row: rounds it took part in
    new_tokens: list[int]  # per row: tokens generated (before padding)
    finish_reasons: list[str]  # per row: "stop" (eos or a stopping criterion) or "length"
    seconds: float
    log: RoundLog = field(repr=False)  # one row per (request, round), request = row of `sequences`


@dataclass
class _Row:
    """One request's growing output, shared by the decode callback and the eos fix-up."""

    prompt: list[int]  # the prompt without padding
    padded: torch.Tensor  # (P,) the input_ids row as given, padding included (what stopping criteria see)
    new: list[int] = field(default_factory=list)
    done: bool = False
    early_eos: bool = False  # the loop drew eos before min_new_tokens: that token is to be redrawn without eos
    reason: str = "length"

    def sequence(self) -> torch.Tensor:
        return torch.cat([self.padded, self.padded.new_tensor(self.new)]).unsqueeze(0)  # (1, P + len(new))


def speculative(drafter, verifier="full", *, draft_length: int = 7, seed: int | None = None, cost_table=None,
                threshold: float | None = None, calibration=None) -> "SpeculativeGenerate":
    """The callable for `model.generate(custom_generate=...)`.

    drafter: a Drafter, a registered name ("ngram", "dspark", ...) or a checkpoint directory; verifier: a name
    ("full", "threshold", "scheduler", "lagged") or a Verifier, with threshold / cost_table / calibration as in
    dspark.api.resolve_verifier. Both are built for the model at the first call and kept for later calls.
    seed: None (fresh randomness per call, from torch's generator) or a fixed base seed (calls repeat).
    """
    return SpeculativeGenerate(drafter, verifier, draft_length=draft_length, seed=seed, cost_table=cost_table,
                               threshold=threshold, calibration=calibration)


class SpeculativeGenerate:
    """A decoding method for transformers' generate(): see the module docstring for what it honours."""

    def __init__(self, drafter, verifier, *, draft_length: int, seed: int | None, cost_table, threshold,
                 calibration) -> None:
        self.drafter_spec, self.verifier_spec = drafter, verifier
        self.draft_length, self.seed = draft_length, seed
        self.verifier_options = dict(cost_table=cost_table, threshold=threshold, calibration=calibration)
        self._model = None
        self.host = self.drafter = self.verifier = None

    def bind(self, model) -> Host:
        """The Host of `model` with the drafter and verifier built for it; built once per model."""
        if model is not self._model:
            host = Host(model, name=model.config.name_or_path or "host")
            spec = self.drafter_spec
            drafter_path = drafter_directory(spec)  # a registered name is never read as a folder
            self.drafter = resolve_drafter(host, spec)
            self.verifier = resolve_verifier(host, self.verifier_spec, draft_length=self.draft_length,
                                             drafter_path=drafter_path, **self.verifier_options)
            self._model, self.host = model, host
        return self.host

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                 synced_gpus: bool = False, streamer=None, **model_kwargs):
        """Called by generate() with its prepared arguments; returns sequences (B, P + G) or a dict output."""
        passed = _generate_arguments()
        streamer = streamer if streamer is not None else passed.get("streamer")
        _refuse_unsupported(generation_config, passed.get("assistant_model"), logits_processor, model_kwargs)
        B, P = input_ids.shape
        if streamer is not None and B > 1:
            raise ValueError(f"a streamer only supports batch size 1 (as in transformers), got {B} rows")
        host = self.bind(model)
        rows = [_Row(prompt=p, padded=input_ids[b])
                for b, p in enumerate(_strip_padding(input_ids, model_kwargs.get("attention_mask")))]
        eos = set(_ids(generation_config.eos_token_id))
        max_new = generation_config.max_length - P  # generate() folded max_new_tokens into max_length
        min_new = max((generation_config.min_length or 0) - P, generation_config.min_new_tokens or 0) if eos else 0
        sampling = _sampling(generation_config, logits_processor)
        criteria = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, _NATIVE_CRITERIA)])
        base = int(torch.randint(0, 2**62, ())) if self.seed is None else self.seed

        def commit(row: _Row, ids: list[int]) -> bool:
            """Take committed ids into `row` up to where generate() would stop; True ends the row's decode."""
            kept: list[int] = []
            for t in ids:
                if t in eos and len(row.new) < min_new:
                    row.early_eos = True
                    break
                row.new.append(t)
                kept.append(t)
                stopped = t in eos or (len(criteria) > 0 and bool(criteria(row.sequence(), None)[0]))
                if stopped or len(row.new) >= max_new:
                    row.done, row.reason = True, "stop" if stopped else "length"
                    break
            if streamer is not None and kept:
                streamer.put(torch.tensor(kept))  # (n,) token ids, as generate() puts each step's tokens
            return row.done or row.early_eos

        log, rounds, start = RoundLog(), 0, time.perf_counter()
        seeds = [base + b for b in range(B)]
        pending = [b for b in range(B)] if max_new > 0 else []
        passes = 0
        # A pass decodes every pending row until it stops, or until it draws eos before min_new_tokens: that row's
        # token is then redrawn from p with eos masked (what MinNewTokensLengthLogitsProcessor samples from) and the
        # row continues in the next pass, with fresh noise so nothing depends on the rejected draw.
        while pending:
            result = decode.generate(host, [rows[b].prompt + rows[b].new for b in pending], drafter=self.drafter,
                                     verifier=self.verifier, draft_length=self.draft_length,
                                     max_new_tokens=[max_new - len(rows[b].new) for b in pending],
                                     sampling=sampling, seeds=[seeds[b] for b in pending], stop_token_ids=eos,
                                     on_tokens=lambda i, ids, pending=pending: commit(rows[pending[i]], ids))
            index = torch.tensor(pending)
            result.log.request = [index[r] for r in result.log.request]
            log.extend(result.log)
            rounds += result.rounds
            passes += 1
            for b in pending:
                if rows[b].early_eos:
                    rows[b].early_eos = False
                    seeds[b] = base + b + passes * B  # why: fresh noise, distinct from every row's other seeds
                    commit(rows[b], [_draw_without(host, rows[b].prompt + rows[b].new, eos, sampling, seeds[b])])
            pending = [b for b in pending if not rows[b].done]
        if streamer is not None:
            streamer.end()

        sequences = _pad_outputs(input_ids, [r.new for r in rows], generation_config)
        if not generation_config.return_dict_in_generate:
            return sequences
        out = GenerateDecoderOnlyOutput(sequences=sequences)
        out.speculation = _speculation(log, rows, rounds, time.perf_counter() - start)
        return out


def _generate_arguments() -> dict:
    """The locals of the generate() call that called us (empty when called otherwise).

    why: transformers (5.17 to at least 5.24) gives a callable custom_generate only its own extra parameters in
    place of the mode arguments, so `streamer` and `assistant_model` never reach it; they are still locals of the
    generate() frame that calls it (which has already put the prompt to the streamer).
    """
    frame = sys._getframe(2)  # 0 this function, 1 __call__, 2 its caller
    return frame.f_locals if frame.f_code is _GENERATE_CODE else {}


def _refuse_unsupported(config, assistant_model, logits_processor, model_kwargs) -> None:
    """A ValueError naming the setting, for everything the speculative loop cannot reproduce."""
    where = "dspark.hf.speculative"
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(f"{where} does not support beam search (num_beams={config.num_beams}); use num_beams=1")
    mode = config.get_generation_mode(assistant_model)
    if mode == GenerationMode.ASSISTED_GENERATION:
        raise ValueError(f"{where} is already assisted generation: drop assistant_model / prompt_lookup_num_tokens "
                         "/ assistant_early_exit / use_mtp (for prompt lookup use the 'ngram' drafter)")
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"{where} supports greedy search and sampling, not {mode.value} (check penalty_alpha, "
                         "dola_layers, constraints, force_words_ids)")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(config, name):
            raise ValueError(f"{where} cannot return {name.removeprefix('output_')}: the speculative loop keeps "
                             f"no per-step {name.removeprefix('output_')}; set {name}=False")
    foreign = [type(p).__name__ for p in logits_processor if not isinstance(p, _REPRODUCED)]
    if foreign:
        raise ValueError(f"{where} cannot apply the logits processors {foreign}: they change the distribution the "
                         "host samples from (unset repetition_penalty, no_repeat_ngram_size, bad_words_ids, "
                         "sequence_bias, suppress_tokens, min_p, typical_p, epsilon/eta_cutoff, logits_processor=, "
                         "... whichever added them)")
    unknown = sorted(set(model_kwargs) - _OWN_KWARGS)
    if unknown:
        raise ValueError(f"{where} decodes from input_ids only; it cannot use {unknown}")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(f"{where} cannot continue from a filled past_key_values cache; pass the full input_ids")


def _strip_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's prompt without its left padding; (B, P) -> B lists."""
    if attention_mask is None:
        return input_ids.tolist()
    prompts = []
    for b, (row, mask) in enumerate(zip(input_ids.tolist(), attention_mask.bool().tolist())):
        n = sum(mask)
        if mask != [False] * (len(row) - n) + [True] * n:
            raise ValueError(f"row {b} of attention_mask is not left padding (zeros then ones); decoder-only "
                             "generation needs padding_side='left'")
        prompts.append(row[len(row) - n:])
    return prompts


def _ids(value) -> list[int]:
    """eos_token_id as a list: None, an int, a list or a tensor."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return value.flatten().tolist()
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _sampling(config, logits_processor) -> SamplingConfig:
    """The SamplingConfig of generate()'s own warpers (greedy when do_sample is off), so that defaults such as
    top_k=50 apply exactly as transformers applies them."""
    if not config.do_sample:
        return SamplingConfig()
    temperature, top_k, top_p = 1.0, 0, 1.0
    for proc in logits_processor:
        if isinstance(proc, TemperatureLogitsWarper):
            temperature = float(proc.temperature)
        elif isinstance(proc, TopKLogitsWarper):
            top_k = int(proc.top_k)
        elif isinstance(proc, TopPLogitsWarper):
            top_p = float(proc.top_p)
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


@torch.no_grad()
def _draw_without(host: Host, ids: list[int], eos: set[int], sampling: SamplingConfig, seed: int) -> int:
    """The next token after `ids` drawn from p with the eos ids masked: one plain forward of the host model."""
    logits = host.model(torch.tensor([ids], device=host.device)).logits[0, -1].float()  # (V,)
    logits[[t for t in eos if t < logits.shape[-1]]] = float("-inf")
    if sampling.greedy:
        return int(logits.argmax())
    probs = process(logits.unsqueeze(0), sampling)  # (1, V)
    return int(sample(probs, torch.tensor([seed], device=host.device),
                      torch.tensor([len(ids)], device=host.device), STREAM_SAMPLE)[0])


def _pad_outputs(input_ids: torch.Tensor, new: list[list[int]], config) -> torch.Tensor:
    """input_ids (B, P) followed by each row's new tokens, padded to the longest: (B, P + G)."""
    G = max(len(t) for t in new)
    pad = config.pad_token_id if config.pad_token_id is not None else next(iter(_ids(config.eos_token_id)), None)
    if pad is None and any(len(t) < G for t in new):
        raise ValueError("rows finished at different lengths but there is no pad_token_id (nor eos_token_id) to "
                         "pad them with; pass pad_token_id=")
    out = torch.full((len(new), G), 0 if pad is None else int(pad), dtype=input_ids.dtype)  # (B, G)
    for b, tokens in enumerate(new):
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, out.to(input_ids.device)], dim=1)


def _speculation(log: RoundLog, rows: list[_Row], rounds: int, seconds: float) -> Speculation:
    B = len(rows)
    request, accepted = log.column("request"), log.column("accepted")
    return Speculation(
        tau=float((accepted.float() + 1).mean()) if len(accepted) else float("nan"),
        rounds=rounds,
        accepted=torch.zeros(B, dtype=torch.long).index_add_(0, request, accepted).tolist(),
        request_rounds=torch.bincount(request, minlength=B).tolist(),
        new_tokens=[len(r.new) for r in rows],
        finish_reasons=[r.reason for r in rows],
        seconds=seconds,
        log=log,
    )
