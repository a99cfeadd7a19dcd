"""The server's throughput and latency under N concurrent clients, against the same prompts decoded in-process.

The model loads once (`specter.serve.engines.load_served`, as `python -m specter serve` loads it) and is served
by uvicorn on a free port of 127.0.0.1 in this process. For each N, in turn: the engine decodes the prompts
directly on this thread (the server idle) as the server would decode N requests that arrive together: one at a
time through `generate_text` with a stream callback for N = 1, in batches of N through `engine.generate([...])`
with a per-request `on_commit` otherwise; then N client threads each send `--requests` streaming requests, and
again not streaming. Greedy, at most `--max-new-tokens` new tokens each, ending at the tokenizer's EOS as the
server does.
The server, its worker and the clients share this process (and its GIL) and the machine's cores, which counts in
the server's overhead.

TTFT: request sent (in-process: the decode's start) -> first text (not streaming: the whole answer). TPOT: (end -
first text) / (tokens - 1), not streaming the whole time over the tokens. The last column is the in-process
decode's requests/s over the server's: the server's overhead as a factor.

    python benchmarks/bench_serve.py --model tiny --mem low --clients 1 4 16 --max-new-tokens 32
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.row_log import commit as commit_id  # noqa: E402
from specter.__main__ import memory, resident_slots  # noqa: E402
from specter.serve.app import create_app  # noqa: E402
from specter.serve.engines import GREEDY, load_served  # noqa: E402
from specter.serve.server import BackgroundServer  # noqa: E402

PROMPTS = ["Natalia sold clips to 48 of her friends in April,", "def fibonacci(n):", "Q: What is 2+2?\nA:",
           "The tower is 324 metres tall, about the same height as", "Once upon a time",
           "import numpy as np\n", "Translate to French: good morning", "The capital of Australia is"]


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    tpot_s: float


def timed_stream(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, tokens = time.perf_counter(), None, 0
    with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"][0]["text"]:
                first = time.perf_counter()
    end = time.perf_counter()
    first = end if first is None else first
    return Sample(first - started, (end - first) / max(tokens - 1, 1))


def timed_answer(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    started = time.perf_counter()
    response = http.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens})
    response.raise_for_status()
    elapsed = time.perf_counter() - started
    return Sample(elapsed, elapsed / max(response.json()["usage"]["completion_tokens"], 1))


def drive(url: str, model: str, clients: int, requests: int, max_tokens: int, stream: bool) -> tuple[float, list]:
    """N client threads, each sending `requests` requests one after another: (requests/s, samples)."""
    samples, barrier = [], threading.Barrier(clients)
    ask = timed_stream if stream else timed_answer

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            barrier.wait()
            for r in range(requests):
                samples.append(ask(http, url, model, PROMPTS[(i * requests + r) % len(PROMPTS)], max_tokens))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return clients * requests / (time.perf_counter() - started), samples


def in_process(engine, clients: int, requests: int, max_tokens: int) -> tuple[float, list]:
    """The same prompts on the engine directly, as the server decodes `clients` requests that arrive together:
    one at a time (streamed) for one client, else in batches of `clients` (each request's commits timed)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients * requests)]
    tokenizer, samples = engine.model.tokenizer, []
    eos = getattr(tokenizer, "eos_token_id", None)
    started = time.perf_counter()
    for i in range(0, len(prompts), clients):
        batch = [tokenizer.encode(p) for p in prompts[i:i + clients]]
        firsts: dict[int, float] = {}
        t0 = time.perf_counter()
        if clients == 1:
            results = [engine.generate(torch.tensor(batch), max_tokens, eos_token_id=eos,
                                       on_commit=lambda tokens: firsts.setdefault(0, time.perf_counter()))]
        else:
            results = engine.generate(batch, max_tokens, eos_token_id=eos,
                                      on_commit=lambda r, tokens: firsts.setdefault(r, time.perf_counter()) and None)
        end = time.perf_counter()
        samples += [Sample(firsts.get(r, end) - t0, (end - firsts.get(r, end)) / max(len(res.token_ids) - 1, 1))
                    for r, res in enumerate(results)]
    return len(prompts) / (time.perf_counter() - started), samples


def row(clients: int, mode: str, rate: float, samples: list, baseline: float | None) -> str:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = statistics.mean(s.tpot_s * 1000 for s in samples)
    ratio = "" if baseline is None else f"{baseline / rate:.2f}"
    return (f"| {clients} | {mode} | {len(samples)} | {rate:.2f} | {statistics.mean(ttft):.1f} | "
            f"{statistics.median(ttft):.1f} | {tpot:.2f} | {ratio} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--mem", type=memory, default="low")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    served = load_served(args.model, lambda model: resident_slots(model, args.mem))
    engine = served.engine_for(*GREEDY)
    print(f"# bench_serve {datetime.datetime.now().isoformat(timespec='seconds')}, host {platform.node()} "
          f"({platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}), device "
          f"{served.model.device}, model {args.model}, mem {args.mem}, {args.max_new_tokens} new tokens, "
          f"{args.requests} requests per client, greedy, commit {commit_id()}")
    lines = [("| clients | decode | requests | req/s | TTFT mean ms | TTFT median ms | TPOT mean ms | "
              "in-process req/s over server's |"), "|---|---|---|---|---|---|---|---|"]
    with BackgroundServer(create_app(lambda: served)) as server:
        # each in-process decode runs while the server is idle (its worker touches the engine only for a request)
        in_process(engine, 2, 1, args.max_new_tokens)  # warm-ups
        drive(server.url, served.name, 1, 1, args.max_new_tokens, stream=True)
        for clients in args.clients:
            rate, samples = in_process(engine, clients, args.requests, args.max_new_tokens)
            mode = "in-process, one at a time" if clients == 1 else f"in-process, batches of {clients}"
            lines.append(row(clients, mode, rate, samples, None))
            for stream in (True, False):
                lines.append(row(clients, "server, " + ("streaming" if stream else "not streaming"),
                                 *drive(server.url, served.name, clients, args.requests, args.max_new_tokens,
                                        stream), rate))
        batches = server.app.state.specter.loaded[1].stats()["batches"]
    print("\n".join(lines))
    print(f"# the server's batches (size: count): {batches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
