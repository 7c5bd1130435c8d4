"""Automatic prefix caching (megatron_wedlm/decoding/prefix_cache.py): the block store, then the
decode and the real server with it, whose greedy replies must not change by a token."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch

from megatron_wedlm.decoding import DecodeSettings, load_tokenizer, load_wedlm_model
from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids
from megatron_wedlm.decoding.prefix_cache import PrefixCache
from megatron_wedlm.decoding.row_cache import RowKVCache
from megatron_wedlm.testing.serving import CHAT_TEMPLATE, ServerProcess
from megatron_wedlm.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.timeout(240)

B = 4  # block size of the store's unit tests
LAYERS, HEADS, DIM = 2, 2, 3
BLOCK_BYTES = 2 * LAYERS * HEADS * B * DIM * 4  # keys and values, fp32


def row_cache(rows: int = 3, capacity: int = 64) -> RowKVCache:
    """A decoding cache whose row ``r`` holds, at slot ``s``, keys ``1000 r + s`` and values minus that."""
    cache = RowKVCache(LAYERS, rows, capacity, "cpu")
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(1, HEADS, 1, DIM), torch.zeros(1, HEADS, 1, DIM))
        marks = 1000.0 * torch.arange(rows)[:, None] + torch.arange(capacity)[None, :]
        layer.keys.copy_(marks[:, None, :, None].expand_as(layer.keys))
        layer.values.copy_(-layer.keys)
    return cache


def slot_marks(cache: RowKVCache, row: int, n: int) -> list[int]:
    return cache.layers[-1].keys[row, 0, :n, 0].int().tolist()


def test_a_block_is_shared_only_by_prompts_that_agree_on_everything_before_it():
    store, cache = PrefixCache(10**6, block_size=B), row_cache()
    prompt = list(range(1, 14))  # 3 full blocks and a token
    assert store.store(prompt, cache, row=0) == 3
    assert len(store.match(prompt)) == 3
    assert len(store.match(prompt[:8] + [99] * 5)) == 2  # differs in the third block
    assert len(store.match(prompt[:4] + [99] + prompt[5:])) == 1  # differs in the second block only
    assert store.match([99] + prompt[1:]) == []  # same second and third blocks, after another first one
    assert store.store(prompt[:8] + [7, 7, 7, 7], cache, row=1) == 1  # the shared blocks are not stored twice
    assert len(store) == 4
    store.check()


def test_load_copies_the_longest_cached_run_and_leaves_a_token_to_compute():
    store, cache = PrefixCache(10**6, block_size=B), row_cache()
    prompt = list(range(1, 13))  # exactly 3 blocks
    store.store(prompt, cache, row=0)
    assert store.load(prompt, cache, row=2) == 8  # not all 12: the first forward needs a query
    assert slot_marks(cache, 2, 9) == [0, 1, 2, 3, 4, 5, 6, 7, 2008]  # row 0's slots, then row 2's own
    assert torch.equal(cache.layers[0].values[2, :, :8], -cache.layers[0].keys[2, :, :8])
    assert store.load(prompt + [50], cache, row=1) == 12
    assert store.load(prompt[:6] + [50] * 6, cache, row=1) == 4  # a partial block is not a hit
    assert store.load([50] + prompt, cache, row=1) == 0
    assert (store.stats.prompt_tokens, store.stats.hit_tokens) == (12 + 13 + 12 + 13, 8 + 12 + 4)


def test_the_least_recently_used_block_is_evicted_within_the_byte_bound():
    store, cache = PrefixCache(2 * BLOCK_BYTES, block_size=B), row_cache()
    a, b, c = [1] * B + [0], [2] * B + [0], [3] * B + [0]
    store.store(a, cache, 0)
    store.store(b, cache, 0)
    assert store.load(a, cache, 1) == B  # a is used again: b is now the least recently used
    store.store(c, cache, 0)
    assert store.match(b) == [] and len(store.match(a)) == len(store.match(c)) == 1
    assert (store.bytes, store.stats.evictions) == (2 * BLOCK_BYTES, 1)
    assert PrefixCache(BLOCK_BYTES - 1, block_size=B).store(a, cache, 0) == 0  # a block beyond the bound


def test_a_prefix_is_evicted_only_after_the_blocks_that_extend_it():
    store, cache = PrefixCache(2 * BLOCK_BYTES, block_size=B), row_cache()
    base, extension = [5] * B, [6] * B
    store.store(base + extension + [0], cache, 0)  # base was stored first, and is used by every hit on both
    store.store([1] * B + [0], cache, 0)  # one block must go: the extension, not the prefix under it
    assert len(store.match(base + extension)) == 1 and len(store.match([1] * B)) == 1
    # a chain longer than the bound keeps its first blocks (it never evicts its own parents)
    store = PrefixCache(3 * BLOCK_BYTES, block_size=B)
    assert store.store(list(range(6 * B)), cache, 0) == 3
    assert len(store.match(list(range(6 * B)))) == 3
    store.check()


def test_random_traffic_keeps_the_bound_and_never_orphans_a_block():
    rng = random.Random(0)
    store, cache = PrefixCache(7 * BLOCK_BYTES, block_size=B), row_cache(capacity=40)
    for _ in range(300):  # prompts over a 2-letter alphabet share prefixes often
        prompt = [rng.randint(0, 1) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.5:
            store.load(prompt, cache, 1)
        else:
            store.store(prompt, cache, 0)
        store.check()
    assert store.stats.evictions > 0 and store.stats.hit_tokens > 0


# ---- the decode: replies with the prefix cached equal those without it ------------------------------
SYSTEM = "You are a careful assistant. Count from 3 to 12: 3 4 5 6 7 8 9 10 11 12. " * 4
QUESTIONS = ["1 2 3", "def add(a, b):\n    return", "The quick brown fox", "7", "for i in range(10):"]
METHODS = ("streaming", "blockwise", "ar")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny chat checkpoint whose weights are large enough that every input, positions included,
    shows in its greedy replies (a wrong position or key changes them)."""
    directory = tmp_path_factory.mktemp("prefix") / "tiny"
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_tiny_causal_lm(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, mask_token_id=tokenizer.mask_token_id, seed=1)
    with torch.no_grad():  # the mask's embedding as conversion sets it (the mean row): masks read their context
        embeddings = model.get_input_embeddings().weight
        embeddings[tokenizer.mask_token_id] = embeddings.mean(0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def local(model_dir):
    return load_wedlm_model(model_dir, device="cpu"), load_tokenizer(model_dir)


def decode_waves(local, waves: list[list[tuple[list[int], DecodeSettings]]], prefix_cache_bytes: int):
    """Each wave's requests submitted together to a fresh engine, the next wave once they ended;
    returns the replies' token ids in order, and the engine."""
    from megatron_wedlm.serving.engine import Request, ServingEngine

    model, tokenizer = local
    engine = ServingEngine(model, tokenizer, max_rows=4, max_queue=16, max_model_len=1024, max_window=8,
                           prefix_cache_bytes=prefix_cache_bytes)
    engine.start()
    replies = []
    try:
        for wave in waves:
            results, done = {}, threading.Semaphore(0)

            def sink(key):
                def on_event(event):
                    if isinstance(event, BaseException) or event.result is not None:
                        results[key] = event
                        done.release()
                return on_event

            for key, (prompt, settings) in enumerate(wave):
                engine.submit(Request(prompt, settings, sink(key)))
            for _ in wave:
                assert done.acquire(timeout=120)
            assert not any(isinstance(results[k], BaseException) for k in results), results
            replies += [results[k].result.token_ids for k in range(len(wave))]
    finally:
        engine.shutdown()
    return replies, engine


def shared_prefix_waves(local):
    """A first request that caches the system prompt, then every method on prompts that start with it:
    a block boundary inside the question, the whole prefix, a prompt that is a whole number of blocks."""
    model, tokenizer = local
    system = encode_prompt(tokenizer, SYSTEM)
    prompts = [system + encode_prompt(tokenizer, q) for q in QUESTIONS]
    whole = system[: len(system) // 16 * 16]
    prompts += [whole, whole + system[len(whole):]]  # a whole number of blocks; the system prompt alone
    stops = eos_token_ids(model, tokenizer)
    settings = {m: DecodeSettings(method=m, max_new_tokens=16, window_size=4, stop_token_ids=stops) for m in METHODS}
    first = [(system + encode_prompt(tokenizer, "Problem: Solution:"), settings["streaming"])]
    rest = [(p, settings[m]) for m in METHODS for p in prompts]
    return [first, rest[: len(rest) // 2], rest[len(rest) // 2 :]]


@pytest.fixture(scope="module")
def decoded(local):
    """The waves decoded without and with the prefix cache: (waves, replies, replies, engine with the cache)."""
    waves = shared_prefix_waves(local)
    plain, _ = decode_waves(local, waves, prefix_cache_bytes=0)
    cached, engine = decode_waves(local, waves, prefix_cache_bytes=1 << 30)
    return waves, plain, cached, engine


def test_greedy_replies_are_the_same_with_the_prefix_cached_for_every_method(decoded):
    waves, plain, cached, engine = decoded
    assert cached == plain
    later = sum(len(p) for wave in waves[1:] for p, _ in wave)
    assert engine.prefix_cache.stats.hit_tokens > 0.8 * later  # every later prompt found the system prompt


def test_cached_keys_and_values_are_the_prompts_own(local, decoded):
    """What a row stores is its prompt's keys/values as a plain causal forward computes them
    (prompt tokens at their positions; no mask or window slot)."""
    model = local[0]
    waves, _, _, engine = decoded
    prompt = waves[1][0][0]
    blocks = engine.prefix_cache.match(prompt)
    assert len(blocks) == len(prompt) // 16
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
    for index, layer in enumerate(reference.layers):
        n = len(blocks) * 16
        torch.testing.assert_close(torch.cat([b.keys[index] for b in blocks], dim=1), layer.keys[0, :, :n])
        torch.testing.assert_close(torch.cat([b.values[index] for b in blocks], dim=1), layer.values[0, :, :n])


# ---- the real server --------------------------------------------------------------------------------
def test_served_replies_are_the_same_with_and_without_the_cache_and_metrics_show_the_hits(model_dir, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from prometheus_client.parser import text_string_to_metric_families

    bodies = [{"prompt": SYSTEM + "Problem: Solution:", "max_tokens": 12, "temperature": 0}]
    bodies += [{"prompt": SYSTEM + q, "max_tokens": 16, "temperature": 0, "method": m, "window_size": 4,
                "stream": stream}
               for m in METHODS for q, stream in zip(QUESTIONS[:3], (False, True, False))]
    bodies.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "7"}],
                   "max_tokens": 16, "temperature": 0})

    def replies(server) -> list[str]:
        texts = []
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = httpx.post(server.url + path, json=body, timeout=120)
            assert response.status_code == 200, response.text
            if body.get("stream"):
                chunks = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
                texts.append("".join(json.loads(c)["choices"][0]["text"] for c in chunks))
            else:
                choice = response.json()["choices"][0]
                texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
        return texts

    def metrics(server) -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if s.name.startswith("wedlm_prefix_cache")}

    args = ["--max-rows", "4", "--max-model-len", "1024"]
    with ServerProcess(model_dir, *args, log=tmp_path / "cached.log") as cached, \
            ServerProcess(model_dir, *args, "--no-prefix-cache", log=tmp_path / "plain.log") as plain:
        texts = replies(cached)
        assert texts == replies(plain) and any(texts)
        seen, none = metrics(cached), metrics(plain)
    assert none == {}
    # each completion after the first found the system prompt, up to the block holding its last token
    system = len(encode_prompt(load_tokenizer(model_dir), SYSTEM))
    assert seen["wedlm_prefix_cache_hit_tokens_total"] >= (len(bodies) - 2) * (system - 16)
    assert seen["wedlm_prefix_cache_hit_rate"] == pytest.approx(
        seen["wedlm_prefix_cache_hit_tokens_total"] / seen["wedlm_prefix_cache_prompt_tokens_total"])
    assert seen["wedlm_prefix_cache_blocks"] > 0 and seen["wedlm_prefix_cache_bytes"] > 0
    assert seen["wedlm_prefix_cache_evictions_total"] == 0
    assert seen["wedlm_prefix_cache_capacity_bytes"] == 2**30
