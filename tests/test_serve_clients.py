"""The server seen by real clients: its page in headless Chromium, and lm-evaluation-harness.

Both talk to ``inference/serve.py`` in a process of its own (:class:`ServerProcess`) over HTTP,
serving a tiny checkpoint written to disk whose output layer is scaled up: its predictions are
confident (low entropy), so streaming parallel decoding commits several tokens in some forwards,
which a random tiny model never does (it commits about one token per forward).

* The page at ``/`` streams a chat reply as one ``<span>`` per forward's commit: its spans must
  add up to the non-streamed reply, match an SSE client's chunks one for one, and its displayed
  tokens per forward must be the API's.
* lm-eval's ``local-completions`` model against ``/v1/completions`` must score a local
  ``generate_until`` task exactly as the in-process ``wedlm`` adapter does on the same checkpoint
  and settings: the same generation for every example, the same metric.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from megatron_wedlm.decoding.generation_defaults import write_decoding_defaults
from megatron_wedlm.testing.serving import ServerProcess, write_tiny_chat_model

#: lm_head scale that makes the tiny random model confident (see tests/test_decoding.py, scale=200)
CONFIDENT_SCALE = 200.0
#: the operating point stored with the checkpoint: the server and the adapter both read it from there
DECODING = {"window_size": 16, "entropy_threshold": 0.4, "distance_penalty": 0.02}
PAGE_PROMPT = "Write a short poem about the sea."
PAGE_MAX_TOKENS = 48
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def write_confident_chat_model(directory: Path) -> Path:
    """The tiny chat checkpoint with its output layer scaled by :data:`CONFIDENT_SCALE`, saved again."""
    from transformers import AutoModelForCausalLM

    write_tiny_chat_model(directory, seed=3)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(CONFIDENT_SCALE)
    model.save_pretrained(directory)
    write_decoding_defaults(directory, DECODING)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_confident_chat_model(tmp_path_factory.mktemp("served") / "confident-tiny")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with ServerProcess(model_dir, "--device", "cpu", "--max-rows", "4", log=log) as process:
        yield process


# ---------------------------------------------------------------------------- HTTP helpers


def chat_body(method: str, max_tokens: int, prompt: str = PAGE_PROMPT, **extra) -> dict:
    """The request the page sends (see page.html), less ``stream``."""
    return {"messages": [{"role": "user", "content": prompt}], "method": method, "max_tokens": max_tokens, **extra}


def post(server: ServerProcess, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def sse_chunks(server: ServerProcess, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed reply, in order; asserts it ended with ``[DONE]``."""
    chunks, buffer, done = [], "", False
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        for text in response.iter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                assert event.startswith("data: "), event
                data = event[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                assert not done, "a chunk after [DONE]"
                chunks.append(json.loads(data))
    assert done and not buffer.strip(), f"the stream did not end with [DONE] (left: {buffer!r})"
    return chunks


# ---------------------------------------------------------------------------- the page in Chromium


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).is_file()]
    if missing:  # fall back to PATH (another distribution's names), else skip
        found = {name: shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chromedriver")}
        binary = found["chromium"] or found["chromium-browser"] or found["google-chrome"]
        driver_path = found["chromedriver"]
        if not (binary and driver_path):
            pytest.skip(f"headless Chromium is not installed ({', '.join(missing)} not found, and no chromium / "
                        "chromedriver on PATH): apt-get install chromium chromium-driver")
    else:
        binary, driver_path = CHROMIUM, CHROMEDRIVER
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--disable-extensions", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def run_page(driver, server: ServerProcess, prompt: str, method: str, max_tokens: int) -> tuple[list[dict], str]:
    """Open the page, send ``prompt`` with ``method``, wait for ``[DONE]``: the reply's spans
    (text, data-forward, data-tokens) and the displayed tokens per forward (``#stats``)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver.get(server.url + "/")
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    Select(driver.find_element(By.ID, "method")).select_by_visible_text(method)
    limit = driver.find_element(By.ID, "max_tokens")
    limit.clear()
    limit.send_keys(str(max_tokens))
    driver.find_element(By.ID, "send").click()

    def finished(d):
        if d.find_element(By.ID, "reply").get_attribute("data-done") == "1":
            return True
        stats = d.find_element(By.ID, "stats").get_attribute("textContent")
        if stats.startswith("error"):
            raise AssertionError(f"the page shows an error: {stats}")
        return False

    WebDriverWait(driver, 60, poll_frequency=0.1).until(finished)
    spans = driver.execute_script(
        "return Array.from(document.querySelectorAll('#reply > span')).map(s => "
        "({text: s.textContent, forward: Number(s.dataset.forward), tokens: Number(s.dataset.tokens)}));")
    reply = driver.execute_script("return document.getElementById('reply').textContent;")
    assert reply == "".join(span["text"] for span in spans)  # nothing but the spans in #reply
    stats = driver.find_element(By.ID, "stats")
    shown = stats.get_attribute("data-tokens-per-forward")
    assert shown is not None, "the page did not show the usage chunk's tokens per forward"
    assert stats.get_attribute("textContent").endswith(f"{float(shown):.2f} tokens per forward")
    return spans, shown


@pytest.mark.timeout(240)
def test_page_streams_one_span_per_commit_in_headless_chromium(browser, server):
    """Streaming shows several tokens in some forward's span, AR exactly one in each."""
    for method in ("streaming", "ar"):
        check_page(browser, server, method)


def check_page(browser, server: ServerProcess, method: str) -> None:
    spans, shown = run_page(browser, server, PAGE_PROMPT, method, PAGE_MAX_TOKENS)

    whole = post(server, "/v1/chat/completions", chat_body(method, PAGE_MAX_TOKENS))
    usage = whole["usage"]
    chunks = sse_chunks(server, "/v1/chat/completions", chat_body(method, PAGE_MAX_TOKENS,
                                                                  stream_options={"include_usage": True}))
    commits = [c for c in chunks if "wedlm" in c]
    assert usage["completion_tokens"] > 0 and usage["forwards"] > 0

    # the spans are the streamed reply: together the non-streamed reply (greedy), one per SSE commit
    assert "".join(span["text"] for span in spans) == whole["choices"][0]["message"]["content"]
    assert len(spans) == len(commits)
    assert [(s["text"], s["forward"], s["tokens"]) for s in spans] == [
        (c["choices"][0]["delta"]["content"], c["wedlm"]["forward"], c["wedlm"]["tokens"]) for c in commits]
    # each span is one forward's commit: forwards increase, tokens add up to the API's counts
    forwards = [span["forward"] for span in spans]
    assert forwards == sorted(set(forwards)) and forwards[-1] == usage["forwards"]
    assert sum(span["tokens"] for span in spans) == usage["completion_tokens"]
    assert float(shown) == usage["tokens_per_forward"] == usage["completion_tokens"] / usage["forwards"]
    stream_usage = [c["usage"] for c in chunks if c.get("usage")]
    assert stream_usage == [usage]

    if method == "ar":  # one token per forward, every forward, sent by the forward that sampled it
        assert float(shown) == 1.0
        tokens = [span["tokens"] for span in spans]
        assert tokens == [1] * len(spans)
        assert forwards == list(range(1, len(spans) + 1))
    else:  # the confident model: streaming parallel decoding commits several tokens in some forwards
        assert max(span["tokens"] for span in spans) > 1, spans
        assert usage["tokens_per_forward"] > 1.0


# ---------------------------------------------------------------------------- lm-evaluation-harness


QUESTIONS = ["What comes after 5?", "Repeat: q w e", "def add(a, b):", "The quick brown", "12 + 35 =",
             "Count from 3 to 12:", "7 x 8 =", "What is 2 + 2?"]
TASK = "wedlm_serve_gen"
MAX_GEN_TOKS = 16


def write_task(directory: Path, answers: list[str]) -> None:
    """A local ``generate_until`` task over :data:`QUESTIONS` (offline: the dataset is a local jsonl)."""
    data = directory / "serve_gen.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(QUESTIONS, answers)))
    (directory / "serve_gen.yaml").write_text(
        f"task: {TASK}\noutput_type: generate_until\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {directory / 'hf'}\n"
        "test_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN_TOKS}\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


def _generations(out: dict) -> dict[int, tuple]:
    return {s["doc_id"]: (s["arguments"], s["resps"], s["filtered_resps"]) for s in out["samples"][TASK]}


@pytest.mark.timeout(240)
def test_lm_eval_local_completions_scores_like_the_in_process_adapter(server, model_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    for module in ("aiohttp", "tenacity", "requests"):  # what lm-eval's API models need: pip install 'lm-eval[api]'
        pytest.importorskip(module, reason=f"lm-eval's local-completions model needs {module}: "
                                           "pip install 'lm-eval[api]'")
    import lm_eval.models  # noqa: F401 - the harness's own models: its registry loads them only while it is empty,
    # and importing the wedlm adapter has already registered one
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from megatron_wedlm.eval.lm_eval_adapter import WeDLMLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the project's evaluation: the wedlm adapter on the same checkpoint, greedy streaming, its stored settings
    local = WeDLMLM(pretrained=str(model_dir), device="cpu", method="streaming", batch_size=4)
    assert {k: local.setting_sources[k] for k in DECODING} == dict.fromkeys(DECODING, "model")
    # Make the metric informative: half the answers are the adapter's own generations, half cannot match.
    gen_kwargs = {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS}
    pilot = local.generate_until([Instance("generate_until", {}, (f"Question: {q}\nAnswer:", dict(gen_kwargs)), i)
                                  for i, q in enumerate(QUESTIONS)])
    assert len(set(pilot)) > 2, pilot  # the prompts lead to different generations: a mix-up would show
    answers = [text if i % 2 == 0 else f"no such answer {i}" for i, text in enumerate(pilot)]
    write_task(tmp_path, answers)

    common = dict(tasks=[TASK], bootstrap_iters=0, log_samples=True,
                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    in_process = lm_eval.simple_evaluate(model=local, **common)
    expected = _generations(in_process)
    assert sorted(expected) == list(range(len(QUESTIONS)))
    assert [expected[i][1][0][0] for i in range(len(QUESTIONS))] == pilot
    metric = "exact_match,none"
    assert in_process["results"][TASK][metric] == 0.5

    model_name = server.get("/v1/models")["data"][0]["id"]
    # text prompts from concurrent clients (one prompt a request), then the harness's default:
    # token-id prompts, four to a request (a list of prompts)
    for client in ({"tokenized_requests": False, "num_concurrent": 4}, {"tokenized_requests": True, "batch_size": 4}):
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": model_name, "base_url": server.url + "/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(model_dir), "max_retries": 2,
                        "timeout": 60, **client},
            **common,
        )
        # same prompts and settings: the same generation for every example, the same score
        assert _generations(served) == expected, client
        assert served["results"][TASK][metric] == in_process["results"][TASK][metric], client
