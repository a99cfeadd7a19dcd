"""The OpenAI-compatible server: a real uvicorn server on the tiny default, driven by the official openai client."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest

import specter.__main__ as cli
from specter.errors import SpecterError
from specter.models.tokenizer import ByteTokenizer
from specter.serve.app import create_app
from specter.serve.engines import load_served
from specter.serve.server import BackgroundServer
from specter.serve.stops import StopText
from specter.text import printable

MODEL, MEM, NEW = "tiny", "low", 16


def tiny_loader(chat_template: bool = False):
    def load():
        served = load_served(MODEL, lambda model: cli.resident_slots(model, MEM), progress=False)
        if chat_template:
            served.model.tokenizer = TemplatedBytes()
        return served
    return load


class TemplatedBytes(ByteTokenizer):
    """The tiny model's byte tokenizer with a plain chat template (the registered tiny models have none)."""

    chat_template = "{role}: {content}\n ... assistant:"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" * add_generation_prompt)

    def encode(self, text, add_bos=True, add_special_tokens=None):
        return super().encode(text, add_bos if add_special_tokens is None else add_special_tokens)


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(create_app(tiny_loader())) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def scheduler(server):
    return server.app.state.specter.loaded[1]


def streamed(client, **kwargs) -> tuple[list[str], list]:
    """The text pieces of a streaming completion and all its chunks."""
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    return [c.choices[0].text for c in chunks if c.choices and c.choices[0].text], chunks


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve("tiny-dsv2").id == MODEL  # the registered spec's name is an alias
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == MODEL


def test_streamed_text_equals_the_generate_command(server, client, capsys, monkeypatch):
    pieces = []
    monkeypatch.setattr(cli, "printable", lambda piece: pieces.append(piece) or printable(piece))
    assert cli.main(["generate", "--model", MODEL, "--mem", MEM, "--max-new-tokens", str(NEW), "Hello"]) == 0
    stdout = capsys.readouterr().out
    assert pieces and printable("".join(pieces)) + "\n" == stdout

    got, chunks = streamed(client, prompt="Hello", max_tokens=NEW, stream_options={"include_usage": True})
    assert got == pieces  # the same pieces, as they commit
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW

    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=NEW)
    assert whole.choices[0].text == "".join(pieces) and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (6, NEW, 6 + NEW)


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=NEW).choices[0].text
    stop = full[4:6]
    expected = full[:full.find(stop)]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=NEW, stop=[stop, "never"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < NEW
    pieces, chunks = streamed(client, prompt="Once upon a time", max_tokens=NEW, stop=stop)
    assert "".join(pieces) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_is_seeded_and_streams_the_same(client):
    kwargs = {"model": MODEL, "prompt": "Hello", "max_tokens": NEW, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    greedy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=NEW).choices[0].text
    assert first == second != greedy
    pieces, _ = streamed(client, **{k: v for k, v in kwargs.items() if k != "model"})
    assert "".join(pieces) == first
    other = client.completions.create(**{**kwargs, "seed": 8}).choices[0].text
    assert other != first


def test_chat_without_a_template_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert info.value.status_code == 400 and info.value.body["code"] == "no_chat_template"


def test_chat_with_a_template_answers_and_streams():
    with BackgroundServer(create_app(tiny_loader(chat_template=True))) as chat_server:
        chat = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        whole = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW)
        assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
        assert whole.usage.prompt_tokens == len("system: Be brief.\nuser: Hi\nassistant:")  # no BOS: the template's
        chunks = list(chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, stream=True))
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == whole.choices[0].message.content and chunks[-1].choices[0].finish_reason == "length"
        parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
        assert chat.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=3).usage \
            .prompt_tokens == len("user: Hi\nassistant:")


class Blocker:
    """A long streaming request that holds the worker (one chunk read) until the block ends: a disconnect."""

    def __init__(self, server, max_tokens: int = 900) -> None:
        self.server, self.max_tokens = server, max_tokens

    def __enter__(self):
        self.http = httpx.Client(timeout=60)
        self.stream = self.http.stream("POST", self.server.url + "/v1/completions",
                                       json={"model": MODEL, "prompt": "x", "max_tokens": self.max_tokens,
                                             "stream": True})
        self.lines = self.stream.__enter__().iter_lines()  # kept: a dropped iterator closes the stream
        line = next(line for line in self.lines if line.startswith("data: "))
        self.id = json.loads(line[len("data: "):])["id"]
        return self

    def __exit__(self, *exc) -> None:
        self.stream.__exit__(None, None, None)
        self.http.close()


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_disconnect_cancels_its_request(server, client):
    with Blocker(server) as blocker:
        pass  # one chunk read, then the client goes away
    history = scheduler(server).history
    wait_for(lambda: any(h["id"] == blocker.id for h in history))
    entry = next(h for h in history if h["id"] == blocker.id)
    assert entry["status"] == "cancelled" and entry["completion_tokens"] < blocker.max_tokens
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].finish_reason == "length"


def test_concurrent_greedy_requests_decode_as_one_batch(server, client):
    prompts = ["Hello", "Once upon a time", "def f(x):", "Q: 2+2=?"]
    alone = {p: "".join(streamed(client, prompt=p, max_tokens=12)[0]) for p in prompts}
    before = scheduler(server).stats()["batches"].get("4", 0)
    answers, errors = {}, []

    def ask(prompt):
        answers[prompt] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12).choices[0].text

    def ask_badly():
        try:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)
        except openai.BadRequestError as err:
            errors.append(err.status_code)

    with Blocker(server):  # the worker is busy, so the four queue up together
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts] + [threading.Thread(target=ask_badly)]
        for thread in threads:
            thread.start()
        wait_for(lambda: scheduler(server).stats()["queued"] == len(prompts))
    for thread in threads:
        thread.join(60)
    assert answers == alone and errors == [400]
    assert scheduler(server).stats()["batches"].get("4", 0) == before + 1


def test_concurrent_streams_decode_as_one_batch_and_a_disconnect_ends_only_its_own(server, client):
    prompts = ["Hello", "Once upon a time", "def f(x):"]
    alone = {p: streamed(client, prompt=p, max_tokens=12)[0] for p in prompts}
    before = scheduler(server).stats()["batches"].get("4", 0)
    pieces, quitter = {}, {}

    def ask(prompt):
        pieces[prompt] = streamed(client, prompt=prompt, max_tokens=12)[0]

    def quit_after_one_chunk():
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", server.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 900, "stream": True}) as response:
            line = next(line for line in response.iter_lines() if line.startswith("data: "))
            quitter["id"] = json.loads(line[len("data: "):])["id"]

    with Blocker(server):  # the worker is busy, so the four queue up together
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        threads.append(threading.Thread(target=quit_after_one_chunk))
        for thread in threads:
            thread.start()
        wait_for(lambda: scheduler(server).stats()["queued"] == len(threads))
    for thread in threads:
        thread.join(60)
    assert pieces == alone  # each stream's pieces, as it decodes alone
    assert scheduler(server).stats()["batches"].get("4", 0) == before + 1
    history = scheduler(server).history
    wait_for(lambda: any(h["id"] == quitter["id"] for h in history))
    entry = next(h for h in history if h["id"] == quitter["id"])
    assert entry["status"] == "cancelled" and entry["batch"] == 4 and entry["completion_tokens"] < 900


def test_streaming_and_sampling_requests_queue_beside_each_other(client):
    results = {}

    def run(name, **kwargs):
        pieces, _ = streamed(client, prompt="Hello", max_tokens=8, **kwargs)
        results[name] = "".join(pieces)

    threads = [threading.Thread(target=run, args=(f"s{i}",), kwargs={"temperature": 0.7, "seed": 1}) for i in range(3)]
    threads += [threading.Thread(target=run, args=("greedy",))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results["s0"] == results["s1"] == results["s2"] and len(results) == 4


BAD = [  # (path, body, status, param, code)
    ("completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model", "model_not_found"),
    ("completions", {"prompt": "Hi"}, 400, "model", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "8"}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "temperature": -0.1}, 400, "temperature", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "top_p": 0}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "top_p": 1.5}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "seed": "x"}, 400, "seed", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "stop": 3}, 400, "stop", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "stream": "yes"}, 400, "stream", None),
    ("completions", {"model": MODEL, "prompt": "Hi", "n": 2}, 400, "n", None),
    ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "a" * 1020, "max_tokens": 16}, 400, "prompt",
     "context_length_exceeded"),
    ("chat/completions", {"model": MODEL}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "Hi"}]}, 400, "messages[0].role", None),
    ("completions", [1, 2], 400, None, None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD)
def test_bad_input_is_an_openai_error_and_one_log_line(server, caplog, path, body, status, param, code):
    with caplog.at_level(logging.INFO, logger="specter.serve"):
        response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    lines = [r for r in caplog.records if r.name == "specter.serve" and f"/v1/{path} {status}" in r.getMessage()]
    assert len(lines) == 1
    assert httpx.get(server.url + "/health").status_code == 200  # the server keeps running


def test_malformed_json_and_unknown_routes(server, client):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a" * 1030, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"


def test_503_while_loading_then_the_load_error():
    release, failures = threading.Event(), []

    def loader():
        release.wait(30)
        raise SpecterError("the checkpoint is gone")

    app = create_app(loader, on_load_error=failures.append)
    with BackgroundServer(app).start(wait_ready=False) as running:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            response = httpx.request(method, running.url + path, json={"model": MODEL, "prompt": "Hi"})
            assert response.status_code == 503 and response.json()["error"]["code"] == "model_loading"
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0).completions.create(
                model=MODEL, prompt="Hi", max_tokens=2)
        release.set()
        wait_for(lambda: failures)
        response = httpx.get(running.url + "/health")
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_load_failed"


def test_serve_start_up_errors_are_one_line_and_exit_2(capsys):
    assert cli.main(["serve", "--model", "no-such-model", "--mem", "low"]) == 2
    assert cli.main(["serve", "--model", "/no/such/checkpoint", "--mem", "low"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--model", MODEL, "--mem", "low", "--port", str(port)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)
    assert "in use" in lines[2]


def test_stop_text_holds_back_what_may_begin_a_stop_string():
    sent = []
    text = StopText(("END", "\n\n"), sent.append)
    for piece in ["ab", "cE", "N", "x\n", "yE", "ND", "zz"]:
        text.feed(piece)
    assert sent == ["ab", "c", "ENx", "\ny"] and text.result == "abcENx\ny" and text.stopped
    passthrough = []
    plain = StopText((), passthrough.append)
    for piece in ["a ", "b", "\n"]:
        plain.feed(piece)
    assert passthrough == ["a ", "b", "\n"]
