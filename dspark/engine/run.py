"""`dspark.engine.decode.generate` on the slot engine: static batches or continuous batching, one GenerationResult."""
from __future__ import annotations

import time

from dspark.engine.results import GenerationResult, RoundLog
from dspark.engine.serve import Sink, serve
from dspark.engine.slots import Request


def run_slots(host, prompts, *, drafter, verifier, K, limits, sampling, seeds, stops, batch_size, concurrency, bar,
              on_tokens, graphs, timing, overlap=None):
    """Static batches of `batch_size` (each admitted at once) or, with `concurrency`, one continuous run."""
    n = len(prompts)
    requests = [Request(index=i, prompt=list(prompts[i]), limit=limits[i], seed=seeds[i]) for i in range(n)]
    sink = Sink(outputs=[[] for _ in range(n)], reasons=["length"] * n, latency=[0.0] * n, ttft=[0.0] * n,
                log=RoundLog(), stops=stops, on_tokens=on_tokens, bar=bar)
    groups = [requests] if concurrency else [requests[lo: lo + batch_size] for lo in range(0, n, batch_size)]
    runs = [serve(host, group, drafter=drafter, verifier=verifier, K=K, sampling=sampling, sink=sink,
                  concurrency=concurrency or len(group), graphs=graphs, timing=timing, overlap=overlap)
            for group in groups]
    # why without warm-up: graph capture is a one-time cost per engine (reported as engine["warmup_s"])
    seconds = time.perf_counter() - sink.t0 - sum(r.warmup_s for r in runs)
    bar.close()
    sink.close()
    stage_s: dict[str, float] = {}
    for r in runs:
        for k, v in r.stage_s.items():
            stage_s[k] = stage_s.get(k, 0.0) + v
    engine = {"graphs": sum(r.graphs for r in runs), "prefill_graphs": sum(r.prefill_graphs for r in runs),
              "warmup_s": sum(r.warmup_s for r in runs), "stage_s": stage_s,
              "in_flight": [c for r in runs for c in r.in_flight], "widths": [w for r in runs for w in r.widths],
              "admissions": sum(r.admissions for r in runs), "admit_s": sum(r.admit_s for r in runs),
              "wait_s": sum(r.wait_s for r in runs), "gc_s": sum(r.gc_s for r in runs),
              "gc_collections": [sum(r.gc_collections[g] for r in runs) for g in range(3)],
              "drafted_rounds": sum(r.drafted for r in runs), "overlapped": all(r.overlapped for r in runs),
              "concurrency": concurrency or batch_size}
    return GenerationResult(token_ids=sink.outputs, finish_reasons=sink.reasons, log=sink.log, seconds=seconds,
                            rounds=sum(r.rounds for r in runs), latency=sink.latency,
                            batches=sum(r.admissions for r in runs), ttft=sink.ttft, engine=engine)
