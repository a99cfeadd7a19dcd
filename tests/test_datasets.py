"""Dataset prompts: real local files, created GPQA/C4 files, malformed input, the Hub path (faked), configs, prep CLI."""
from __future__ import annotations

import csv
import gzip
import json
import shutil
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments import datasets as ds
from experiments.datasets import DATASETS, load_prompts, prompts_for
from initialization import prepare_datasets
from specter.errors import SpecterError

real_hub_problem = ds.hub_problem

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf" / "dataset"
GPQA_COLUMNS = [
    "Pre-Revision Question", "Pre-Revision Correct Answer", "Pre-Revision Incorrect Answer 1",
    "Pre-Revision Incorrect Answer 2", "Pre-Revision Incorrect Answer 3", "Pre-Revision Explanation",
    "Self-reported question-writing time (minutes)", "Question", "Correct Answer", "Incorrect Answer 1",
    "Incorrect Answer 2", "Incorrect Answer 3", "Explanation", "Revision Comments (from Question Writer)",
    "Subdomain", "Writer's Difficulty Estimate", "Record ID", "High-level domain",
]
GPQA_QUESTIONS = [
    ("Two quantum states with energies E1 and E2 have a lifetime of 10^-9 sec and 10^-8 sec, respectively.\n"
     "We want to clearly distinguish these two energy levels. Which one of the following options could be "
     "their energy difference so that they can be clearly resolved?"),
    'trans-cinnamaldehyde was treated with methylmagnesium bromide, forming product 1, "quoted", with commas.',
    "A spin-half particle is in a linear superposition 0.5|up>+sqrt(3)/2|down> of its spin-up and spin-down states.",
]
C4_TEXTS = ["Beginners BBQ Class Taking Place in Missoula!\nDo you want to get better at making delicious BBQ?",
            "Discussion in 'Mac OS X Lion (10.7)' started by axboi87, Jan 20, 2012.",
            "Foil plaid lycra and spandex shortall with metallic slinky insets."]
WIKI_TEXT = (" \n = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre actor . \n"
             " In 2006 , Boulter starred alongside Whishaw . \n \n = = Career = = \n \n Second paragraph line . \n")


class HubCalls:
    """A stand-in for the `datasets` module: records load_dataset calls, returns rows or raises."""

    def __init__(self, rows: dict | None = None):
        self.rows, self.calls = rows or {}, []

    def load_dataset(self, path, **kwargs):
        self.calls.append((path, kwargs))
        if path not in self.rows:
            raise ConnectionError(f"Couldn't reach '{path}' on the Hub (network disabled in tests)")
        return self.rows[path]


@pytest.fixture(autouse=True)
def no_network(monkeypatch) -> HubCalls:
    """No test touches the network: `import datasets` inside the loader gets this fake."""
    hub = HubCalls()
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=hub.load_dataset))
    monkeypatch.setattr(ds, "hub_problem", lambda: "")  # the fake Hub is always reachable
    return hub


def write_gpqa_csv(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=GPQA_COLUMNS)
        writer.writeheader()
        for i, question in enumerate(GPQA_QUESTIONS):
            row = {c: f"{c} value {i}" for c in GPQA_COLUMNS}
            row.update({"Question": question, "Correct Answer": "10^-4 eV", "Record ID": f"rec{i:04d}",
                        "Pre-Revision Question": f"old question {i}"})
            writer.writerow(row)
    return path


def write_c4(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for i, text in enumerate(C4_TEXTS):
            handle.write(json.dumps({"text": text, "timestamp": f"2019-04-2{i}T08:07:02Z",
                                     "url": f"https://example.org/{i}"}) + "\n")
    return path


def password_zip(csv_path: Path) -> Path:
    """gpqa_main.csv.zip encrypted with the GPQA password (zipfile cannot write encrypted zips)."""
    if shutil.which("zip") is None:
        pytest.skip("the `zip` command is not installed (needed to write a password-protected zip)")
    out = csv_path.with_name(csv_path.name + ".zip")
    subprocess.run(["zip", "-j", "-q", "-P", ds.GPQA_PASSWORD.decode(), str(out), str(csv_path)], check=True)
    return out


def make_data_dir(root: Path) -> Path:
    """Small files for all five datasets in the default layout."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"Question {i}?", "answer": "#### 1"}) + "\n" for i in range(4)))
    (root / "wikitext2").mkdir()
    (root / "wikitext2" / "wiki.test.tokens").write_text(WIKI_TEXT)
    (root / "humaneval").mkdir()
    with gzip.open(root / "humaneval" / "HumanEval.jsonl.gz", "wt") as handle:
        for i in range(3):
            handle.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"Doc.\"\"\"\n"}) + "\n")
    write_gpqa_csv(root / "gpqa" / "gpqa_main.csv")
    write_c4(root / "c4" / "c4-validation.00000-of-00008.json.gz")
    return root


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    root = make_data_dir(tmp_path / "data")
    monkeypatch.setenv("SPECTER_DATA", str(root))
    return root


@pytest.fixture
def empty_data(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "nodata"
    root.mkdir()
    monkeypatch.setenv("SPECTER_DATA", str(root))
    return root


# -- the real shared files -------------------------------------------------------------------------

REAL = {"gsm8k": "Janet", "humaneval": "from typing import List", "wikitext2": "Robert <unk> is an English film"}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_shared_files(name):
    file = ds.default_files(name)[0]
    if not file.is_file():
        pytest.skip(f"{file} not present (set SPECTER_DATA to the shared data directory)")
    prompts = load_prompts(name, 5, source="local")
    assert len(prompts) == 5 and prompts[0].startswith(REAL[name])
    assert all(p.strip() for p in prompts)
    if name == "wikitext2":
        assert not any(ds.HEADING.match(p) for p in prompts)
    assert load_prompts(name, 2, path=str(file)) == prompts[:2]


# -- local formats ---------------------------------------------------------------------------------

def test_gpqa_csv_reads_the_question_column(tmp_path):
    file = write_gpqa_csv(tmp_path / "gpqa_main.csv")
    assert load_prompts("gpqa", 10, path=str(file)) == GPQA_QUESTIONS
    assert load_prompts("gpqa", 2, path=str(file)) == GPQA_QUESTIONS[:2]


def test_gpqa_password_zip(tmp_path, monkeypatch):
    file = password_zip(write_gpqa_csv(tmp_path / "gpqa" / "gpqa_main.csv"))
    with zipfile.ZipFile(file) as archive:
        assert archive.infolist()[0].flag_bits & 0x1, "the test zip should be encrypted"
    assert load_prompts("gpqa", 3, path=str(file)) == GPQA_QUESTIONS
    (tmp_path / "gpqa" / "gpqa_main.csv").unlink()  # default lookup falls back to the zip
    monkeypatch.setenv("SPECTER_DATA", str(tmp_path))
    assert load_prompts("gpqa", 1, source="local") == GPQA_QUESTIONS[:1]


def test_zip_with_a_wrong_password_is_one_line(tmp_path):
    csv_path = write_gpqa_csv(tmp_path / "gpqa_main.csv")
    if shutil.which("zip") is None:
        pytest.skip("the `zip` command is not installed")
    out = tmp_path / "gpqa_main.csv.zip"
    subprocess.run(["zip", "-j", "-q", "-P", "not-the-password", str(out), str(csv_path)], check=True)
    with pytest.raises(SpecterError, match="gpqa_main.csv") as err:
        load_prompts("gpqa", 1, path=str(out))
    assert "\n" not in str(err.value)


def test_c4_gzip_jsonl(tmp_path):
    file = write_c4(tmp_path / "c4-validation.00000-of-00008.json.gz")
    assert load_prompts("c4", 2, path=str(file)) == C4_TEXTS[:2]


def test_wikitext_skips_blank_and_heading_lines(tmp_path):
    file = tmp_path / "wiki.test.tokens"
    file.write_text(WIKI_TEXT)
    assert load_prompts("wikitext2", 10, path=str(file)) == [
        "Robert Boulter is an English film , television and theatre actor .",
        "In 2006 , Boulter starred alongside Whishaw .", "Second paragraph line ."]


def test_blank_records_are_skipped_and_order_kept(tmp_path):
    file = tmp_path / "q.jsonl"
    file.write_text('{"question": "a"}\n\n{"question": "  "}\n{"question": "b"}\n{"question": "c"}\n')
    assert load_prompts("gsm8k", 2, path=str(file)) == ["a", "b"]


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, match", [
    ("", "is empty"),
    ('{"question": "a"}\n{"question": \n', r"q\.jsonl:2 is not valid JSON"),
    ('{"question": "a"}\n{"answer": "b"}\n', r"q\.jsonl:2 has no 'question'"),
    ('{"question": 3}\n', r"q\.jsonl:1 has no 'question'"),
    ('[1, 2]\n', r"q\.jsonl:1 is not a JSON object"),
    ('{"question": ""}\n\n', "no usable gsm8k prompt"),
])
def test_bad_jsonl_is_a_one_line_error_naming_the_file(tmp_path, content, match):
    file = tmp_path / "q.jsonl"
    file.write_text(content)
    with pytest.raises(SpecterError, match=match) as err:
        load_prompts("gsm8k", 3, path=str(file))
    assert str(file) in str(err.value) and "\n" not in str(err.value)


def test_bad_files_of_other_formats(tmp_path):
    (tmp_path / "empty.tokens").write_text("")
    with pytest.raises(SpecterError, match="empty.tokens is empty"):
        load_prompts("wikitext2", 1, path=str(tmp_path / "empty.tokens"))
    (tmp_path / "headings.tokens").write_text(" = A = \n \n = = B = = \n")
    with pytest.raises(SpecterError, match="headings.tokens has no usable"):
        load_prompts("wikitext2", 1, path=str(tmp_path / "headings.tokens"))
    (tmp_path / "q.csv").write_text("Record ID,Answer\nrec1,x\n")
    with pytest.raises(SpecterError, match=r"q\.csv has no 'Question' column"):
        load_prompts("gpqa", 1, path=str(tmp_path / "q.csv"))
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(SpecterError, match="empty.csv is empty"):
        load_prompts("gpqa", 1, path=str(tmp_path / "empty.csv"))
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(SpecterError, match="cannot read .*bad.json.gz"):
        load_prompts("c4", 1, path=str(tmp_path / "bad.json.gz"))
    (tmp_path / "bad.zip").write_bytes(b"not a zip")
    with pytest.raises(SpecterError, match="cannot read .*bad.zip"):
        load_prompts("gpqa", 1, path=str(tmp_path / "bad.zip"))


def test_unknown_name_source_and_count():
    with pytest.raises(SpecterError, match="unknown dataset 'mmlu'; known: gsm8k, wikitext2, humaneval, gpqa, c4"):
        load_prompts("mmlu", 1)
    with pytest.raises(SpecterError, match="unknown dataset source 'web'"):
        load_prompts("gsm8k", 1, source="web")
    with pytest.raises(SpecterError, match="at least 1"):
        load_prompts("gsm8k", 0)


def test_missing_local_file_says_where_and_how(empty_data, no_network):
    with pytest.raises(SpecterError) as err:
        load_prompts("gsm8k", 1, source="local")
    message = str(err.value)
    assert str(empty_data / "gsm8k" / "test.jsonl") in message and "prepare_datasets.py" in message
    assert "dataset.path=" in message and "\n" not in message and not no_network.calls
    with pytest.raises(SpecterError, match="gpqa_main.csv or .*gpqa_main.csv.zip"):
        load_prompts("gpqa", 1, source="local")
    with pytest.raises(SpecterError, match="nope.jsonl not found"):
        load_prompts("gsm8k", 1, path=str(empty_data / "nope.jsonl"))


# -- the Hub path (load_dataset faked) -------------------------------------------------------------

def test_hub_arguments_and_rows(empty_data, no_network):
    no_network.rows = {
        "openai/gsm8k": [{"question": "q0", "answer": "a"}, {"question": "q1", "answer": "a"}],
        "Salesforce/wikitext": [{"text": ""}, {"text": " = Robert Boulter = \n"}, {"text": ""},
                                {"text": " Robert Boulter is an English film . \n"}],
        "openai/openai_humaneval": [{"task_id": "HumanEval/0", "prompt": "def f():\n"}],
        "Idavidrein/gpqa": [{"Question": q, "Record ID": "r"} for q in GPQA_QUESTIONS],
        "allenai/c4": [{"text": t, "timestamp": "", "url": ""} for t in C4_TEXTS],
    }
    assert load_prompts("gsm8k", 5, source="hub") == ["q0", "q1"]
    assert load_prompts("wikitext2", 5, source="auto") == ["Robert Boulter is an English film ."]
    assert load_prompts("humaneval", 1, source="hub") == ["def f():\n"]
    assert load_prompts("gpqa", 1, source="hub") == GPQA_QUESTIONS[:1]
    assert load_prompts("c4", 2, source="hub") == C4_TEXTS[:2]
    assert no_network.calls == [
        ("openai/gsm8k", {"name": "main", "split": "test"}),
        ("Salesforce/wikitext", {"name": "wikitext-2-v1", "split": "test"}),
        ("openai/openai_humaneval", {"split": "test"}),
        ("Idavidrein/gpqa", {"name": "gpqa_main", "split": "train"}),
        ("allenai/c4", {"split": "validation",
                        "data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"}}),
    ]


def test_hub_failures_are_one_line(empty_data, no_network):
    with pytest.raises(SpecterError, match="cannot load gsm8k from the Hugging Face Hub openai/gsm8k") as err:
        load_prompts("gsm8k", 1, source="hub")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecterError, match=r"gsm8k: no local file \(gsm8k/test\.jsonl under .*\) and cannot load gsm8k"):
        load_prompts("gsm8k", 1, source="auto")
    no_network.rows = {"openai/gsm8k": [{"answer": "a"}]}
    with pytest.raises(SpecterError, match="openai/gsm8k .*row 0 has no 'question'"):
        load_prompts("gsm8k", 1, source="hub")


@pytest.mark.parametrize("env", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_mode_fails_at_once_in_one_short_line(empty_data, no_network, monkeypatch, env):
    monkeypatch.setattr(ds, "hub_problem", real_hub_problem)
    monkeypatch.setenv(env, "1")
    start = time.perf_counter()
    with pytest.raises(SpecterError, match=f"gpqa: no local file .* offline mode \\({env}=1\\)") as err:
        load_prompts("gpqa", 1)
    assert time.perf_counter() - start < 2 and not no_network.calls
    assert "\n" not in str(err.value) and len(str(err.value).replace(str(empty_data), "")) < 200


def test_an_unreachable_hub_fails_within_seconds(empty_data, no_network, monkeypatch):
    monkeypatch.setattr(ds, "hub_problem", real_hub_problem)
    for env in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # a reserved name: never resolves

    def refuse(address, timeout):
        assert timeout <= 5
        raise OSError("no route")

    monkeypatch.setattr(ds.socket, "create_connection", refuse)
    with pytest.raises(SpecterError, match="hub.invalid is unreachable") as err:
        load_prompts("gpqa", 1, source="hub")
    assert not no_network.calls and "\n" not in str(err.value)


def test_local_file_wins_over_the_hub_in_auto(data, no_network):
    assert load_prompts("gsm8k", 1) == ["Question 0?"] and not no_network.calls


def test_missing_datasets_package(empty_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(SpecterError, match="pip install datasets"):
        load_prompts("gsm8k", 1, source="hub")


# -- prompts_for and the config options ------------------------------------------------------------

def test_prompts_for_builtin():
    cfg = OmegaConf.load(CONF / "builtin.yaml")
    assert prompts_for(cfg, 2) == {"builtin": list(cfg.prompts)[:2]}
    assert prompts_for({"name": "builtin", "prompts": ["a", "b"]}, 5) == {"builtin": ["a", "b"]}


def test_prompts_for_single_dataset(empty_data, tmp_path):
    cfg = OmegaConf.create({"name": "gsm8k", "members": ["gsm8k"], "path": None, "source": "auto"})
    with pytest.raises(SpecterError, match="no local file"):  # single datasets propagate errors
        prompts_for(cfg, 2)
    cfg.path = str(make_data_dir(tmp_path / "elsewhere") / "gsm8k" / "test.jsonl")
    assert prompts_for(cfg, 2) == {"gsm8k": ["Question 0?", "Question 1?"]}
    plain = types.SimpleNamespace(name="gsm8k", members=["gsm8k"], path=cfg.path, source="local")
    assert prompts_for(plain, 1) == {"gsm8k": ["Question 0?"]}


def test_prompts_for_all_marks_unavailable_members(data, no_network):
    (data / "c4" / "c4-validation.00000-of-00008.json.gz").unlink()
    no_network.rows = {"openai/gsm8k": [{"question": "hub question"}]}  # never asked: the local file wins
    cfg = OmegaConf.load(CONF / "all.yaml")
    out = prompts_for(cfg, 2)
    assert list(out) == list(DATASETS)
    assert out["gsm8k"] == ["Question 0?", "Question 1?"] and out["gpqa"] == GPQA_QUESTIONS[:2]
    assert isinstance(out["c4"], str) and out["c4"].startswith("unavailable: ")
    assert "c4-validation.00000-of-00008.json.gz" in out["c4"] and "\n" not in out["c4"]
    assert [call[0] for call in no_network.calls] == ["allenai/c4"]


def test_prompts_for_config_errors_propagate_even_for_all(data):
    with pytest.raises(SpecterError, match="unknown dataset 'mmlu'"):
        prompts_for({"name": "all", "members": ["gsm8k", "mmlu"], "path": None, "source": "auto"}, 1)
    with pytest.raises(SpecterError, match="unknown dataset source"):
        prompts_for({"name": "all", "members": list(DATASETS), "path": None, "source": "web"}, 1)
    with pytest.raises(SpecterError, match="must be a directory"):
        prompts_for({"name": "all", "members": list(DATASETS), "path": str(data / "gsm8k" / "test.jsonl"),
                     "source": "auto"}, 1)


@pytest.mark.parametrize("option", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_dataset_option_gives_prompts(option, data, no_network):
    cfg = OmegaConf.load(CONF / f"{option}.yaml")
    assert cfg.name == option and cfg.get("path", None) is None
    out = prompts_for(cfg, 2)
    expected = list(DATASETS) if option == "all" else [option]
    assert list(out) == expected
    for name, prompts in out.items():
        assert isinstance(prompts, list) and len(prompts) == 2 and all(isinstance(p, str) and p.strip() for p in prompts), name
    assert not no_network.calls


# -- prepare_datasets.py ---------------------------------------------------------------------------

def read_prepared(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()]


def test_prepare_writes_files_and_refuses_to_overwrite(data, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert prepare_datasets.main(["--output", str(out), "--num-prompts", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.jsonl" for n in DATASETS)
    assert read_prepared(out / "gsm8k.jsonl") == [{"id": 0, "prompt": "Question 0?"}, {"id": 1, "prompt": "Question 1?"}]
    assert [r["prompt"] for r in read_prepared(out / "gpqa.jsonl")] == GPQA_QUESTIONS[:2]
    # the prepared files load back, one by one and as a directory for `all`
    assert load_prompts("c4", 5, path=str(out / "c4.jsonl")) == C4_TEXTS[:2]
    assert prompts_for({"name": "all", "members": list(DATASETS), "path": str(out), "source": "auto"}, 1) == \
        {n: [r["prompt"] for r in read_prepared(out / f"{n}.jsonl")][:1] for n in DATASETS}
    capsys.readouterr()
    before = (out / "gsm8k.jsonl").read_bytes()
    assert prepare_datasets.main(["--output", str(out), "--only", "gsm8k", "--num-prompts", "3"]) == 2
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and "gsm8k.jsonl" in err and err.count("\n") == 1
    assert (out / "gsm8k.jsonl").read_bytes() == before
    assert prepare_datasets.main(["--output", str(out), "--only", "gsm8k", "--num-prompts", "3", "--force"]) == 0
    assert len(read_prepared(out / "gsm8k.jsonl")) == 3


def test_prepare_reports_skipped_datasets(data, tmp_path, capsys):
    shutil.rmtree(data / "gpqa")
    out = tmp_path / "prepared"
    assert prepare_datasets.main(["--output", str(out), "--only", "gsm8k", "gpqa", "--source", "local"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"wrote {out / 'gsm8k.jsonl'}: 4 prompts from ")
    assert lines[1].startswith("skipped gpqa: ") and "gpqa_main.csv" in lines[1]
    assert not (out / "gpqa.jsonl").exists()


@pytest.mark.parametrize("argv, match", [
    (["--output", "x", "--only", "mmlu"], "unknown dataset 'mmlu'"),
    (["--output", "x", "--num-prompts", "0"], "at least 1"),
    (["--output", "x", "--source", "web"], "invalid choice"),
    (["--only", "gsm8k"], "--output"),
])
def test_prepare_usage_errors_are_one_line(argv, match, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert prepare_datasets.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "x").exists()


def test_prepare_runs_as_a_script(tmp_path):
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "gsm8k.jsonl").write_text("{}\n")
    done = subprocess.run([sys.executable, str(ROOT / "initialization" / "prepare_datasets.py"), "--output", str(out),
                           "--only", "gsm8k"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert "refusing to overwrite" in done.stderr


def test_local_datasets_lists_those_whose_file_is_under_the_data_dir(data, empty_data, monkeypatch):
    assert ds.local_datasets() == []  # empty_data's SPECTER_DATA is set last
    monkeypatch.setenv("SPECTER_DATA", str(data))
    assert ds.local_datasets() == list(ds.REGISTRY)
    (data / "c4" / "c4-validation.00000-of-00008.json.gz").unlink()
    assert "c4" not in ds.local_datasets() and "gsm8k" in ds.local_datasets()
