"""The paper's measurement protocol: datasets x prompts x repeats x systems, one warm-up, token checks."""
from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from experiments.records import RecordWriter, record, unavailable
from experiments.token_check import EQUAL, MISMATCH, TokenCheck, check_tokens
from specter.errors import SpecterError
from specter.metrics import gc_paused


def encode_prompts(model, prompts: dict[str, list[str] | str], prefix_tokens: int) -> dict[str, list | str]:
    """Dataset -> [1, T<=prefix_tokens] token tensors (an 'unavailable: ...' string passes through)."""
    encoded = {}
    for name, texts in prompts.items():
        if isinstance(texts, str):
            encoded[name] = texts
        elif not texts:
            raise SpecterError(f"dataset {name} gave no prompts")
        else:
            encoded[name] = [torch.tensor([model.tokenizer(t)["input_ids"][:prefix_tokens]]) for t in texts]
    return encoded


def warm_up(systems: list, ids: torch.Tensor, tokens, failed=None) -> list:
    """One generation per available system (excluded from the records); returns those that ran.

    `tokens` is an int or a function of the system's name: a warm-up as long as the measured cases
    pays every first-use cost (allocator growth, kernels for the longer KV lengths) before timing. A
    system whose engine fails there with a SpecterError (e.g. its worker process crashed) is left out and
    passed to `failed(system, reason)`, so the others still run; without `failed` the error propagates.
    """
    ready = []
    for system in systems:
        if system.available()[0]:
            count, start = tokens(system.name) if callable(tokens) else int(tokens), time.perf_counter()
            try:
                system.generate(ids, count)
                print(f"warm-up: {system.name}, {count} tokens in {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)
            except SpecterError as exc:
                if failed is None:
                    raise
                print(f"warning: {system.name} failed in its warm-up and is left out: {exc}", file=sys.stderr)
                failed(system, f"failed in its warm-up: {exc}")
                continue
            ready.append(system)
    return ready


def run_cases(systems: list, prompts: dict[str, list | str], repeats: int, max_new_tokens: int,
              writer: RecordWriter, strict: bool = False, tags: dict | None = None, repeat_offset: int = 0,
              token_caps: dict | None = None, warmup_tokens: int | None = None, references: dict | None = None,
              reference_target=None) -> None:
    """Every (dataset, prompt, repeat) on every system; rows go to `writer` as they finish.

    Repeat r visits the systems in an order rotated by r. Tokens of every system are compared with
    target-only's on the same case: equal, a numeric tie of the dtype, or a mismatch, which is reported, and
    fatal with `strict`. `token_caps`
    (system -> tokens) lets a very slow system decode fewer tokens per case (its rows say how many;
    its tokens are checked against the same prefix of target-only's). Each system warms up once on the
    first prompt, for `warmup_tokens` (None: as many as its measured cases) within its cap; a system
    whose cases a resumed `writer` holds already is skipped. `references` (case -> target-only's tokens) carries
    target-only's tokens from one call to the next (filled where target-only runs, read where it does not), and
    `reference_target` replays the target for those checks (`check_case`) where target-only is not among `systems`.
    """
    tags, token_caps = tags or {}, token_caps or {}

    def case_tokens(name: str, wanted: int = max_new_tokens) -> int:
        return min(wanted, int(token_caps.get(name) or wanted))

    def unavailable_system(system, reason: str) -> None:
        writer.add(unavailable({"system": system.name, "dataset": "*", "prompt_id": -1, **tags}, reason))

    for system in systems:
        ok, reason = system.available()
        if not ok:
            unavailable_system(system, reason)
    first = next((p[0] for p in prompts.values() if not isinstance(p, str)), None)
    keys = [{"dataset": dataset, "prompt_id": i, "repeat": repeat + repeat_offset, **tags}
            for dataset, cases in prompts.items() if not isinstance(cases, str)
            for repeat in range(repeats) for i in range(len(cases))]
    pending = [s for s in systems if any(not writer.done({**key, "system": s.name}) for key in keys)]
    def warm(name: str) -> int:
        return case_tokens(name, warmup_tokens or max_new_tokens)

    runnable = warm_up(pending, first, warm, unavailable_system) if first is not None else []
    writer.measure_link()  # after the warm-ups, the GPU otherwise idle (once per process)
    total = sum(len(p) for p in prompts.values() if not isinstance(p, str)) * repeats * len(runnable)
    with tqdm(total=total, desc="decoding", unit="run", file=sys.stderr) as bar:
        for dataset, cases in prompts.items():
            if isinstance(cases, str):
                for system in systems:
                    writer.add(unavailable({"system": system.name, "dataset": dataset, "prompt_id": -1, **tags},
                                           cases.removeprefix("unavailable: ")))
                continue
            for repeat in range(repeats):
                order = runnable[repeat % len(runnable):] + runnable[: repeat % len(runnable)] if runnable else []
                for i, ids in enumerate(cases):
                    key = {"dataset": dataset, "prompt_id": i, "repeat": repeat + repeat_offset, **tags}
                    _run_case(order, key, ids, case_tokens, writer, strict, references, reference_target)
                    bar.update(len(order))


def _run_case(systems: list, key: dict, ids: torch.Tensor, case_tokens, writer: RecordWriter,
              strict: bool, references: dict | None = None, reference_target=None) -> None:
    results = {}
    for system in systems:
        if not writer.done({**key, "system": system.name}):
            tokens = case_tokens(system.name)
            with gc_paused():
                results[system.name] = system.generate(ids, tokens)
    target = next((s for s in systems if s.name == "target_only"), reference_target)
    case = tuple(sorted(key.items()))
    reference = results["target_only"].token_ids if "target_only" in results else None
    if references is not None:
        if reference is None and case not in references and results and reference_target is not None:
            with gc_paused():  # a resumed later phase: target-only's tokens replayed once (its rows hold no tokens)
                reference = reference_target.generate(ids, case_tokens("target_only")).token_ids
        if reference is not None:
            references[case] = reference
        reference = references.get(case) if reference is None else reference
    for name, result in results.items():
        check = None if name == "target_only" or reference is None else reference[: len(result.token_ids)]
        verdict = None if check is None or target is None else check_case(target, key, ids, result, check)
        if verdict is not None and verdict.verdict != EQUAL:
            message = f"{name} tokens on {key['dataset']} prompt {key['prompt_id']}: {verdict.text()}"
            if strict and verdict.verdict == MISMATCH:
                raise SpecterError(message + " (strict mode)")
            if verdict.verdict == MISMATCH or (key["prompt_id"] == 0 and key["repeat"] == 0):
                print(f"{'warning' if verdict.verdict == MISMATCH else 'note'}: {message}", file=sys.stderr)
        writer.add(record({**key, "system": name}, result, check, writer.h2d_gbps, verdict))


def check_case(target, key: dict, ids: torch.Tensor, result, reference: list[int]) -> TokenCheck:
    """The case's tokens against target-only's: equal, a numeric tie or a mismatch (experiments.token_check)."""
    k = int(key.get("k") or 1)
    return check_tokens(target, ids, result.token_ids, reference, k, result.stats.get("windows"),
                        result.stats.get("kv_cache_length"))
