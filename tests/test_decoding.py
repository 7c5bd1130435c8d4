"""Streaming / block-wise decoding against a no-cache reference, KV-cache exactness, batching, sampling.

The reference below re-runs the *whole* sequence (prompt + committed tokens + reordered window)
from scratch at every step with an explicit causal mask and logical position ids: no KV cache,
no batching, no vectorisation. The cached decoder must reproduce it token for token and
forward for forward.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_wedlm.decoding import (
    DecodeSettings,
    generate,
    generate_batch,
)
from megatron_wedlm.decoding.model_runner import cache_keyword
from megatron_wedlm.decoding.parallel import decode
from megatron_wedlm.decoding.sampling import select_slots, stop_token_vocabulary
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def tiny_model(tokenizer, arch="qwen2", scale=1.0, seed=0):
    """Random tiny model; ``scale`` multiplies the output layer so predictions get confident (low entropy)."""
    if arch == "llama":  # same sizes as the shared qwen builders
        qwen = build_tiny_model(tokenizer, arch="qwen2", max_position_embeddings=256)
        fields = {k: getattr(qwen.config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "mask_token_id",
            "eos_token_id", "pad_token_id", "bos_token_id")}  # not LlamaConfig's default EOS 2, the tiny mask token
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    else:
        model = build_tiny_model(tokenizer, arch=arch, seed=seed, max_position_embeddings=256)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def full_forward_logits(model, ids, positions):
    """Logits of one cache-free forward: causal in the given (physical) order, RoPE at ``positions``."""
    n = len(ids)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask,
            use_cache=False,
        )
    return out.logits[0]


def reference_decode(
    model, prompt, *, mask_id, window, tau, lam, max_new, stops=(), schedule="streaming", fused_refill=True,
    contiguous_stop=False, stop_penalty=False, leftmost_fallback=False,
):
    """Algorithm 1 (or the block-wise baseline) written plainly, recomputing everything every step.

    ``stop_penalty``: a mask's score also carries ``-log(1 - p)`` of each mask before it that is not
    filled this step, ``p`` its probability of a stop token. ``leftmost_fallback``: when no mask
    passes tau, the leftmost mask is filled instead of the lowest score."""
    out, forwards, slots = [], 0, 0
    win = [mask_id] * min(window, max_new)
    block = len(win)

    def emit(tokens):
        for t in tokens:
            out.append(t)
            if t in stops or len(out) >= max_new:
                return True
        return False

    def leading_run(w):
        n = 0
        while n < len(w) and w[n] != mask_id:
            n += 1
        if schedule == "blockwise":
            return block if n >= block else 0
        return n

    while True:
        order = [i for i, t in enumerate(win) if t != mask_id] + [i for i, t in enumerate(win) if t == mask_id]
        base = len(prompt) + len(out)
        ids = prompt + out + [win[i] for i in order]
        positions = list(range(base)) + [base + i for i in order]
        physical = full_forward_logits(model, ids, positions)[base:]
        logits = {slot: physical[k] for k, slot in enumerate(order)}
        forwards += 1
        slots += len(win)

        n = leading_run(win)
        if emit(win[:n]):
            break
        masks = [i for i, t in enumerate(win) if t == mask_id]
        if masks:
            adjusted, chosen, not_ended = {}, [], 1.0  # not_ended: P(no stop in the masks left unfilled so far)
            for i in masks:
                scores = logits[i].clone()
                scores[mask_id] = -math.inf
                p = torch.softmax(scores, -1)
                h = -(p[p > 0] * p[p > 0].log()).sum().item()
                adjusted[i] = h + lam * (i - masks[0]) - (math.log(not_ended) if stop_penalty else 0.0)
                if tau is not None and adjusted[i] < tau:
                    chosen.append(i)
                else:
                    not_ended *= 1.0 - sum(p[t].item() for t in stops)
            chosen = chosen or [masks[0] if leftmost_fallback else min(masks, key=adjusted.get)]

            def argmax(i):
                scores = logits[i].clone()
                scores[mask_id] = -math.inf
                return int(scores.argmax())

            fill = {i: argmax(i) for i in chosen}
            while contiguous_stop:  # drop a stop token with an unfilled mask before it, until none is left
                early = [i for i in fill if fill[i] in stops and any(j < i and j not in fill for j in masks)]
                if not early:
                    break
                del fill[early[0]]
            for i, token in (fill or {masks[0]: argmax(masks[0])}).items():
                win[i] = token
        win = win[n:]
        if n and schedule == "blockwise":
            block = len(win)
        n_end = leading_run(win)
        if any(t in stops for t in win[:n_end]) or len(out) + n_end >= max_new:
            emit(win[:n_end])
            break
        if fused_refill:  # the run the next forward commits is replaced by masks in that same forward
            if n_end:
                win += [mask_id] * (min(window + n_end, max_new - len(out)) - len(win))
        else:  # Algorithm 1: append as many masks as were committed, the window stays W long
            win += [mask_id] * (min(window, max_new - len(out)) - len(win))
            if n and schedule == "blockwise":
                block = len(win)
    return out, forwards, slots


CASES = [
    # arch, output scale, window, tau, lambda, max_new
    ("qwen2", 1.0, 6, 0.4, 0.02, 20),  # high entropy: one slot per step
    ("qwen2", 200.0, 8, 0.4, 0.02, 37),  # low entropy, budget ends inside a window
    ("qwen3", 200.0, 5, 0.6, 0.1, 23),
    ("qwen3", 60.0, 4, None, 0.1, 11),  # entropy_threshold=None: one slot per step
    ("llama", 200.0, 7, 0.3, 0.05, 30),
    ("qwen3_moe", 200.0, 6, 0.5, 0.05, 25),  # routed per token: packed rows must not change a row's experts
]


@pytest.mark.parametrize("fused_refill", [False, True], ids=["spec-refill", "fused-refill"])
@pytest.mark.parametrize("schedule", ["streaming", "blockwise"])
@pytest.mark.parametrize("arch,scale,window,tau,lam,max_new", CASES)
def test_cached_decoder_equals_no_cache_reference(
    tokenizer, schedule, fused_refill, arch, scale, window, tau, lam, max_new
):
    model = tiny_model(tokenizer, arch, scale)
    mask_id = model.config.mask_token_id
    prompt = tokenizer.encode("Count from 3 to 12: 3 4 5")
    kw = dict(window_size=window, entropy_threshold=tau, distance_penalty=lam, max_new_tokens=max_new)
    result = generate(model, prompt, method=schedule, fused_refill=fused_refill, **kw)
    expected, forwards, slots = reference_decode(
        model, prompt, mask_id=mask_id, window=window, tau=tau, lam=lam, max_new=max_new, schedule=schedule,
        fused_refill=fused_refill,
    )
    if not fused_refill:  # Algorithm 1 keeps the parallel workload fixed at W slots per forward
        assert slots <= forwards * window
    assert result.token_ids == expected
    assert (result.num_forwards, result.num_slots) == (forwards, slots)
    assert result.stop_reason == "max_new_tokens" and len(expected) == max_new
    if scale >= 200:
        assert result.tokens_per_forward > 1.5  # several slots really were filled per forward
    if tau is None:
        assert result.tokens_per_forward <= 1.0


def test_engine_schedule_is_the_default_and_halves_forwards_on_confident_output(tokenizer):
    """docs/method.md §3.3: tau = infinity, W = 4, 40 tokens: the engine's schedule needs 10 forwards,
    the paper's step order 19 (every other forward only commits)."""
    model = tiny_model(tokenizer, "qwen2", 200.0)
    prompt = tokenizer.encode("1 2 3")
    kw = dict(window_size=4, entropy_threshold=float("inf"), distance_penalty=0.0, max_new_tokens=40)
    default = generate(model, prompt, **kw)
    fused = generate(model, prompt, fused_refill=True, **kw)
    paper = generate(model, prompt, fused_refill=False, **kw)
    assert (default.num_forwards, fused.num_forwards, paper.num_forwards) == (10, 10, 19)
    assert default.token_ids == fused.token_ids == paper.token_ids  # tau = inf: same tokens either way
    assert paper.num_slots == 19 * 4 - 4 + 4 and fused.num_slots == 4 + 9 * 8


@pytest.mark.parametrize("fused_refill", [False, True], ids=["spec-refill", "fused-refill"])
@pytest.mark.parametrize("schedule", ["streaming", "blockwise"])
def test_stop_token_inside_the_window_matches_reference(tokenizer, schedule, fused_refill):
    model = tiny_model(tokenizer, "qwen2", 200.0, seed=1)
    mask_id = model.config.mask_token_id
    prompt = tokenizer.encode("Repeat: a b c")
    kw = dict(window_size=8, entropy_threshold=0.4, distance_penalty=0.02, max_new_tokens=40)
    free = generate(model, prompt, method=schedule, fused_refill=fused_refill, **kw).token_ids
    stop = free[len(free) // 3]  # a token the model does produce, first seen early on
    cut = free.index(stop) + 1
    result = generate(model, prompt, method=schedule, stop_token_ids=[stop], fused_refill=fused_refill, **kw)
    expected, forwards, slots = reference_decode(
        model, prompt, mask_id=mask_id, window=8, tau=0.4, lam=0.02, max_new=40, stops=(stop,), schedule=schedule,
        fused_refill=fused_refill,
    )
    assert result.token_ids == expected == free[:cut]
    assert (result.num_forwards, result.num_slots) == (forwards, slots)
    assert result.stop_reason == "stop_token"


@pytest.mark.parametrize("option", ["contiguous_stop", "stop_penalty"])
@pytest.mark.parametrize("schedule", ["streaming", "blockwise"])
def test_stop_rules_match_the_reference_for_every_stop_token(tokenizer, schedule, option):
    """With ``contiguous_stop`` (drop a stop token that has an unfilled mask before it, else fill the
    leftmost mask) or ``stop_penalty`` (a slot after masks left unfilled also scores ``-log P(no
    stop in them)``) the decoder equals the reference's rule for every stop token the model
    produces; for some of them the output or the forwards change, so the rule was exercised."""
    model = tiny_model(tokenizer, "qwen2", 60.0)  # unsure enough that some fills leave masks before them
    mask_id = model.config.mask_token_id
    prompt = tokenizer.encode("Repeat: a b c")
    kw = dict(window_size=8, entropy_threshold=1.0, distance_penalty=0.02, max_new_tokens=40)
    free = generate(model, prompt, method=schedule, **kw).token_ids
    changed = 0
    for stop in sorted(set(free)):
        engine = generate(model, prompt, method=schedule, stop_token_ids=[stop], **kw)
        ruled = generate(model, prompt, method=schedule, stop_token_ids=[stop], **{option: True}, **kw)
        expected, forwards, slots = reference_decode(
            model, prompt, mask_id=mask_id, window=8, tau=1.0, lam=0.02, max_new=40, stops=(stop,),
            schedule=schedule, **{option: True},
        )
        assert ruled.token_ids == expected and (ruled.num_forwards, ruled.num_slots) == (forwards, slots)
        changed += ruled.token_ids != engine.token_ids or ruled.num_forwards != engine.num_forwards
    assert changed


@pytest.mark.parametrize("schedule", ["streaming", "blockwise"])
def test_leftmost_fallback_matches_the_reference_and_commits_every_forward(tokenizer, schedule):
    """With ``leftmost_fallback`` a forward where no slot passes tau fills the leftmost mask: the
    decoder equals the reference's rule for every stop token, and (streaming) every forward but the
    last commits a token, so forwards <= tokens + 1. The engine's rule, on the same model, fills
    slots past the reply's end that the stop token then throws away (more forwards than tokens)."""
    model = tiny_model(tokenizer, "qwen2", 10.0)
    prompt = tokenizer.encode("Repeat: a b c")
    kw = dict(window_size=6, entropy_threshold=0.5, distance_penalty=0.0, max_new_tokens=30)
    engine_wasted = 0
    for stop in sorted(set(generate(model, prompt, method=schedule, **kw).token_ids)):
        engine = generate(model, prompt, method=schedule, stop_token_ids=[stop], **kw)
        leftmost = generate(model, prompt, method=schedule, stop_token_ids=[stop], leftmost_fallback=True, **kw)
        expected, forwards, slots = reference_decode(
            model, prompt, mask_id=model.config.mask_token_id, window=6, tau=0.5, lam=0.0, max_new=30,
            stops=(stop,), schedule=schedule, leftmost_fallback=True,
        )
        assert leftmost.token_ids == expected and (leftmost.num_forwards, leftmost.num_slots) == (forwards, slots)
        if schedule == "streaming":
            assert leftmost.num_forwards <= len(leftmost.token_ids) + 1
            engine_wasted += engine.num_forwards > len(engine.token_ids) + 1
    assert engine_wasted or schedule == "blockwise"


def test_stop_penalty_without_stop_tokens_is_the_engine_rule(tokenizer):
    model = tiny_model(tokenizer, "qwen2", 60.0)
    prompt = tokenizer.encode("Repeat: a b c")
    kw = dict(window_size=8, entropy_threshold=1.0, distance_penalty=0.02, max_new_tokens=30)
    plain, weighed = (generate(model, prompt, stop_penalty=on, **kw) for on in (False, True))
    assert (weighed.token_ids, weighed.num_forwards) == (plain.token_ids, plain.num_forwards)


def test_fill_rule_weighs_only_the_masks_left_unfilled():
    slots = [0, 1, 2]
    # the engine's rule fills every slot under tau, whatever lies before it
    assert select_slots([0.0, 0.9, 0.0], slots, 0.4, 0.0) == [0, 2]
    # slot 1 stays a mask and likely holds a stop, so the confident slot after it waits
    assert select_slots([0.0, 0.9, 0.0], slots, 0.4, 0.0, [0.0, 0.9, 0.0]) == [0]
    # filled this step, slot 1's token is decided and holds nothing back
    assert select_slots([0.0, 0.1, 0.0], slots, 0.4, 0.0, [0.0, 0.9, 0.0]) == [0, 1, 2]
    # nothing qualifies: the argmin counts the penalty too (slot 2 alone would have the lowest entropy)
    assert select_slots([0.5, 0.6, 0.45], slots, 0.4, 0.0, [0.9, 0.0, 0.0]) == [0]
    assert select_slots([0.5, 0.6, 0.45], slots, 0.4, 0.0) == [2]
    assert select_slots([0.5, 0.6, 0.45], slots, 0.4, 0.0, leftmost_fallback=True) == [0]
    assert select_slots([0.5, 0.0, 0.45], slots, 0.4, 0.0, leftmost_fallback=True) == [1]  # a slot passes: as before
    # a certain stop keeps the penalty finite, and no threshold is cleared behind it
    assert select_slots([0.5, 0.0], [3, 4], None, 0.0, [1.0, 0.0]) == [0]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):  # stop probabilities of 0 leave the engine's rule unchanged
        n = int(torch.randint(1, 12, (1,), generator=gen))
        entropy = torch.rand(n, generator=gen).mul(0.8).tolist()
        window = sorted(torch.randperm(16, generator=gen)[:n].tolist())
        for tau in (None, 0.3):
            assert select_slots(entropy, window, tau, 0.05, [0.0] * n) == select_slots(entropy, window, tau, 0.05)


def test_stop_vocabulary_is_the_stop_ids_and_every_token_holding_a_stop_string(tokenizer):
    stops = stop_token_vocabulary(tokenizer, [0], ["a", "Z"])
    assert stops == sorted({0} | {i for i in range(len(tokenizer)) if {"a", "Z"} & set(tokenizer.decode([i]))})
    assert tokenizer.convert_tokens_to_ids("a") in stops and tokenizer.convert_tokens_to_ids("b") not in stops
    assert stop_token_vocabulary(tokenizer, [5, 3], []) == [3, 5]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe"])
def test_committed_kv_equals_one_causal_forward(tokenizer, arch):
    # The cache goes to the model under the keyword its forward declares: under one it no longer
    # declares, the model would take it into **kwargs and attend to a fresh cache of its own (these
    # keys would stay unwritten); under a deprecated one, transformers warns until it drops it.
    model = tiny_model(tokenizer, arch, 200.0)
    prompt = tokenizer.encode("12 + 35 = 47. 7 x 8 =")
    settings = DecodeSettings(window_size=6, entropy_threshold=0.4, distance_penalty=0.02, max_new_tokens=30)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        [result], runner = decode(model, [prompt], settings)
    committed = runner.cache.committed_kv(0)
    length = committed[0][0].shape[1]
    assert len(prompt) + 10 <= length <= len(prompt) + len(result.token_ids)
    sequence = (prompt + result.token_ids)[:length]
    with torch.no_grad():
        reference = getattr(model(input_ids=torch.tensor([sequence]), use_cache=True), cache_keyword(model.model))
    for layer, (keys, values) in enumerate(committed):
        torch.testing.assert_close(keys, reference.layers[layer].keys[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, reference.layers[layer].values[0], atol=1e-5, rtol=1e-5)


def test_cache_keyword_of_a_forward_before_the_rename():
    class OldStyleBody(torch.nn.Module):  # the signature transformers models had before `cache`
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return input_ids

    class NoCache(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs):
            return input_ids

    assert cache_keyword(OldStyleBody()) == "past_key_values"
    with pytest.raises(TypeError, match="takes no KV cache"):
        cache_keyword(NoCache())


@pytest.mark.parametrize("schedule", ["streaming", "blockwise"])
def test_batched_equals_one_at_a_time(tokenizer, schedule):
    model = tiny_model(tokenizer, "qwen2", 80.0, seed=2)
    texts = ["1 2 3", "def add(a, b):\n    return", "The quick brown fox jumps over the lazy dog.", "7"]
    prompts = [tokenizer.encode(t) for t in texts]
    stop = tokenizer.encode(" 9")[-1]
    kw = dict(window_size=6, entropy_threshold=0.5, distance_penalty=0.02, max_new_tokens=25, stop_token_ids=[stop])
    batched = generate_batch(model, prompts, method=schedule, **kw)
    single = [generate(model, p, method=schedule, **kw) for p in prompts]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.num_forwards for r in batched] == [r.num_forwards for r in single]
    assert [r.num_slots for r in batched] == [r.num_slots for r in single]
    assert len({r.num_forwards for r in single}) > 1  # rows really advanced at different rates


@pytest.mark.parametrize("method, attention, arch", [
    ("streaming", "sdpa", "qwen2"), ("blockwise", "sdpa", "qwen2"), ("ar", "sdpa", "qwen2"),
    ("streaming", "eager", "qwen2"), ("streaming", "sdpa", "qwen3_moe"), ("ar", "sdpa", "qwen3_moe"),
    ("streaming", "eager", "qwen3_moe"),
])
def test_greedy_output_is_the_same_for_any_batch_size_and_row_order(tokenizer, method, attention, arch):
    """Continuous batching (a finished row's place goes to the next prompt) and AR's batches: each
    prompt's output and counts equal one-at-a-time decoding, whatever rows it shares forwards with.
    SDPA models decode packed rows, eager ones padded rows with a per-row mask. Qwen3-MoE routes
    each token alone (no expert capacity), so its rows too are independent of their neighbours."""
    model = tiny_model(tokenizer, arch, 80.0, seed=2)
    model.config._attn_implementation = attention
    texts = ["1 2 3", "def add(a, b):\n    return", "The quick brown fox jumps over the lazy dog.", "7",
             "Count from 3 to 9:", "x = [1, 2", "hello world, hello", "aaa bbb ccc ddd"]
    prompts = [tokenizer.encode(t) for t in texts]
    stop = tokenizer.encode({"qwen2": " 9", "qwen3_moe": "+"}[arch])[-1]  # one that some of its replies hold
    kw = dict(method=method, window_size=5, entropy_threshold=0.5, distance_penalty=0.02, max_new_tokens=21,
              stop_token_ids=[stop])
    single = [generate(model, p, **kw) for p in prompts]
    expected = [(r.token_ids, r.num_forwards, r.num_slots) for r in single]
    assert len({len(r.token_ids) for r in single}) > 1  # rows finish at different times, so rows join mid-decode
    for batch_size, order in [(2, range(8)), (3, [7, 2, 5, 0, 3, 6, 1, 4]), (5, [4, 0, 6, 2, 7, 1, 3, 5])]:
        order = list(order)
        batched = generate_batch(model, [prompts[i] for i in order], batch_size=batch_size, **kw)
        assert [(r.token_ids, r.num_forwards, r.num_slots) for r in batched] == [expected[i] for i in order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe"])
def test_lean_body_gives_the_hf_bodys_logits_bit_for_bit(tokenizer, monkeypatch, arch, dtype):
    """The decoding step's lean body (lean_body.py) against the HF body it replaces: every step's
    logits are equal, bit for bit, on packed rows of different widths and caches, with rows
    joining, and on one-token steps (one AR row: the ``mv`` path). In bf16 on CPU the steps'
    matmuls run on oneDNN-packed weights (cpu_gemm.py), fused q/k/v and gate/up included."""
    import megatron_wedlm.decoding.model_runner as model_runner
    from megatron_wedlm.decoding.cpu_gemm import Packed, can_pack

    model = tiny_model(tokenizer, arch, 20.0, seed=4).to(dtype)
    if arch == "qwen2":  # q/k/v biases, which Qwen2 has, at values that matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    prompts = [tokenizer.encode(t) for t in ["1 2 3", "The quick brown fox", "7", "x = [1, 2", "hello world"]]
    logits, bodies = [], []
    project = model_runner.project

    def recorded(head, hidden):
        out = project(head, hidden)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(model_runner, "project", recorded)
    packed_rows = []
    packed_call = Packed.__call__
    monkeypatch.setattr(Packed, "__call__", lambda self, x: packed_rows.append(x.shape[0]) or packed_call(self, x))
    runs = {}
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(model_runner, "lean_body", lambda model: (None, "switched off"))
        logits.clear()
        results = generate_batch(model, prompts, method="streaming", window_size=4, entropy_threshold=0.3,
                                 max_new_tokens=12, stop_token_ids=(), batch_size=3)
        results += [generate(model, prompts[1], method="ar", max_new_tokens=6, stop_token_ids=())]
        runs[lean] = ([r.token_ids for r in results], list(logits))
    (tokens, lean_logits), (hf_tokens, hf_logits) = runs[True], runs[False]
    assert tokens == hf_tokens and len(lean_logits) == len(hf_logits)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(lean_logits, hf_logits))
    assert any(t.shape[0] == 1 for t in lean_logits) and any(t.shape[0] > 3 for t in lean_logits)
    if can_pack(model.lm_head.weight):  # the packed matmuls ran, at one row and at several
        assert 1 in packed_rows and max(packed_rows) > 3
    else:
        assert dtype == torch.float32 and not packed_rows


def test_a_packed_matmul_serves_only_where_it_equals_the_plain_one(monkeypatch):
    """cpu_gemm: bf16 matrices on a oneDNN-bf16 CPU pack (parts as one matrix, split back); the
    packed weight serves 1..PACKED_ROWS rows where its shape's check at this thread count passed,
    the plain matmul elsewhere."""
    from megatron_wedlm.decoding import cpu_gemm

    weight, bias = torch.randn(48, 40).bfloat16(), torch.randn(48).bfloat16()
    assert cpu_gemm.pack((weight.float(), None)) is None
    with pytest.raises(ValueError, match="biases for all parts or none"):
        cpu_gemm.Packed([(weight[:16], bias[:16]), (weight[16:], None)])
    packed = cpu_gemm.pack((weight[:16], bias[:16]), (weight[16:], bias[16:]))
    if packed is None:
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    x = torch.randn(5, 40).bfloat16()
    assert [part.shape[1] for part in packed.split(x)] == [16, 32]
    assert torch.equal(torch.cat(packed.split(x), dim=-1), torch.nn.functional.linear(x, weight, bias))
    assert packed.serves(1) and packed.serves(cpu_gemm.PACKED_ROWS) and not packed.serves(cpu_gemm.PACKED_ROWS + 1)
    monkeypatch.setattr(cpu_gemm, "_EQUAL", {})
    monkeypatch.setattr(cpu_gemm.Packed, "_equal_to_plain", lambda self: False)
    assert not packed.serves(5)


def test_lean_body_refuses_what_it_does_not_write_out(tokenizer):
    """Only Llama-family SDPA models take the lean body; the runner says why another does not."""
    from megatron_wedlm.decoding.lean_body import LeanBody, lean_body
    from megatron_wedlm.decoding.model_runner import ModelRunner

    model = tiny_model(tokenizer, "qwen3", 1.0)
    assert isinstance(ModelRunner(model, 5, 1, 32).body, LeanBody)
    model.config._attn_implementation = "eager"
    runner = ModelRunner(model, 5, 1, 32)
    assert runner.body is model.model and "sdpa" in runner.lean_refusal
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention"] + model.config.layer_types[1:]
    assert lean_body(model) == (None, "sliding-window layers")
    moe = tiny_model(tokenizer, "qwen3_moe", 1.0)  # its attention written out, its expert blocks HF's modules
    assert isinstance(ModelRunner(moe, 5, 1, 32).body, LeanBody)
    moe.config.sliding_window = 8  # Qwen3-MoE has no layer_types: a window, if set, is every layer's
    assert lean_body(moe) == (None, "sliding-window layers")
    with pytest.raises(ValueError, match="full causal attention only"):
        generate(moe, [5, 6, 7], max_new_tokens=2)


def test_ar_batches_do_not_share_a_budget_cut_by_a_long_prompt(tokenizer):
    """A prompt near the position limit may emit fewer tokens; batched with it, the short prompts
    still get their whole budget (AR batches group prompts of one budget)."""
    model = tiny_model(tokenizer, "qwen2", 1.0, seed=1)  # max_position_embeddings=256
    prompts = [tokenizer.encode("1 2 3"), [5] * 250, tokenizer.encode("hello")]
    kw = dict(method="ar", max_new_tokens=12)
    single = [generate(model, p, **kw).token_ids for p in prompts]
    assert [len(t) for t in single] == [12, 6, 12]
    assert [r.token_ids for r in generate_batch(model, prompts, batch_size=3, **kw)] == single


def test_rows_join_a_running_batch_when_others_finish(tokenizer):
    """With more prompts than rows, the batch stays full: the forwards of the whole decode carry
    ``batch_size`` rows until the prompts run out."""
    model = tiny_model(tokenizer, "qwen2", 80.0, seed=2)
    prompts = [tokenizer.encode(t) for t in ["1 2 3", "7", "hello world", "x = 1", "aa bb", "The end"]]
    settings = DecodeSettings(window_size=4, entropy_threshold=0.5, max_new_tokens=9,
                              mask_token_id=tokenizer.mask_token_id)
    _, runner = decode(model, prompts, settings, batch_rows=2)
    widths = [len(step.lengths) for step in runner.steps]
    assert max(widths) == 2 and widths.count(2) > len(widths) // 2
    joins = [k for k, step in enumerate(runner.steps) if k and 0 in step.cached]  # a row's first forward
    assert len(joins) >= 2  # prompts 3..6 were prefilled beside a running row
    with pytest.raises(ValueError, match="at least 1"):
        generate_batch(model, prompts, batch_size=0, max_new_tokens=2)


@pytest.mark.parametrize("method", ["streaming", "blockwise", "ar"])
def test_sampling_is_reproducible_with_a_seed(tokenizer, method):
    model = tiny_model(tokenizer, "qwen2", 3.0)
    prompt = tokenizer.encode("Count from 3 to 12:")
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95)

    def run(seed):
        return generate(model, prompt, method=method, generator=torch.Generator().manual_seed(seed), **kw).token_ids

    first = run(1)
    assert run(1) == first
    assert run(2) != first or run(3) != first
    assert model.config.mask_token_id not in first


def _mask_loving_model(tokenizer):
    """A model whose most likely token is always the mask token (its logit is pushed up by 100)."""
    model = tiny_model(tokenizer, "qwen2", 1.0)

    def favour_mask(module, inputs, logits):
        logits[..., model.config.mask_token_id] += 100.0
        return logits

    model.lm_head.register_forward_hook(favour_mask)
    return model


@pytest.mark.parametrize("method", ["streaming", "blockwise", "ar"])
def test_mask_token_is_never_emitted(tokenizer, method):
    model = _mask_loving_model(tokenizer)
    prompt = tokenizer.encode("1 2 3")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
    assert (logits.argmax(-1) == model.config.mask_token_id).all()  # the premise holds
    for temperature in (0.0, 1.0):
        result = generate(model, prompt, method=method, max_new_tokens=12, temperature=temperature,
                          generator=torch.Generator().manual_seed(0))
        assert len(result.token_ids) == 12
        assert model.config.mask_token_id not in result.token_ids


def test_ar_greedy_equals_a_plain_argmax_loop(tokenizer):
    """Without a stop token (``stop_token_ids=()``) AR runs to the budget; by default it stops at the
    model's EOS as HF ``generate`` does (this random model reaches it inside 15 tokens)."""
    model = tiny_model(tokenizer, "qwen3", 1.0)
    prompt = tokenizer.encode("for i in range(10):")
    mask_id = model.config.mask_token_id
    result = generate(model, prompt, method="ar", max_new_tokens=15, stop_token_ids=())
    ids = list(prompt)
    for _ in range(15):
        with torch.no_grad():
            scores = model(input_ids=torch.tensor([ids])).logits[0, -1]
        scores[mask_id] = -math.inf
        ids.append(int(scores.argmax()))
    assert result.token_ids == ids[len(prompt):]
    assert result.num_forwards == result.num_slots == 15
    assert result.p_cache == result.tokens_per_forward == 1.0

    eos = model.config.eos_token_id
    assert eos in result.token_ids
    stopped = generate(model, prompt, method="ar", max_new_tokens=15)
    assert stopped.token_ids == result.token_ids[: result.token_ids.index(eos) + 1]
    assert stopped.stop_reason == "stop_token"


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])
def test_ar_rows_of_the_batch_equal_hf_generate(tokenizer, arch):
    """``decode(method="ar")``, the next-token rows the server's batch decodes too, against HF
    ``generate`` one prompt at a time: the same tokens, forwards, slots and stop reasons, with rows
    joining as others finish, with a stop string, and for a model without a mask token (AR alone
    needs none)."""
    from megatron_wedlm.decoding.autoregressive import ar_decode

    model = tiny_model(tokenizer, arch, 1.0, seed=3)
    prompts = [tokenizer.encode(t) for t in ["1 2 3", "7", "hello world", "x = 1", "aa bb", "The end of it"]]

    def both(settings, tok=None):
        expected = [ar_decode(model, [p], settings, tokenizer=tok)[0] for p in prompts]
        got, _ = decode(model, prompts, settings, tokenizer=tok, batch_rows=2)
        return ([(r.token_ids, r.num_forwards, r.num_slots, r.stop_reason, r.stop_string) for r in got],
                [(r.token_ids, r.num_forwards, r.num_slots, r.stop_reason, r.stop_string) for r in expected])

    got, expected = both(DecodeSettings(method="ar", max_new_tokens=14, stop_token_ids=()))
    assert got == expected and all(len(e[0]) == 14 for e in expected)
    stop_id, stop = expected[1][0][6], tokenizer.decode(expected[2][0][3:5])  # from the middle of replies
    got, expected = both(DecodeSettings(method="ar", max_new_tokens=14, stop_token_ids=(stop_id,),
                                        stop_strings=(stop,)), tokenizer)
    assert got == expected and {"stop_token", "stop_string"} <= {e[3] for e in expected}
    model.config.mask_token_id = None
    got, expected = both(DecodeSettings(method="ar", max_new_tokens=14, stop_token_ids=()))
    assert got == expected and all(len(e[0]) == 14 for e in expected)


def test_metrics_are_consistent_across_methods(tokenizer):
    model = tiny_model(tokenizer, "qwen2", 200.0)
    prompts = [tokenizer.encode("1 2 3 4"), tokenizer.encode("a b c d e f")]
    for method in ("streaming", "blockwise", "ar"):
        for r in generate_batch(model, prompts, method=method, window_size=8, max_new_tokens=24):
            n = len(r.token_ids)
            assert n == 24 and r.method == method and r.seconds > 0
            assert r.p_cache == pytest.approx(n / r.num_slots) and 0 < r.p_cache <= 1
            assert r.tokens_per_forward == pytest.approx(n / r.num_forwards)
            assert r.num_slots >= n and r.num_forwards <= n
            if method == "ar":
                assert r.num_forwards == n


@pytest.mark.parametrize("method", ["streaming", "blockwise", "ar"])
def test_stop_string_cuts_text_and_tokens(tokenizer, method):
    model = tiny_model(tokenizer, "qwen2", 200.0, seed=3)
    prompt = tokenizer.encode("Count from 3 to 12:")
    free = generate(model, prompt, method=method, max_new_tokens=30, tokenizer=tokenizer)
    text = free.text
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    result = generate(model, prompt, method=method, max_new_tokens=30, tokenizer=tokenizer, stop_strings=[stop])
    assert result.stop_reason == "stop_string" and result.stop_string == stop
    assert result.text == text[: text.index(stop)]
    assert result.token_ids == free.token_ids[: len(result.token_ids)]
    assert stop in tokenizer.decode(result.token_ids)
    assert stop not in tokenizer.decode(result.token_ids[:-1])


def test_the_incremental_stop_string_search_equals_the_whole_one(tokenizer):
    """Decoders pass how many tokens held no stop string (``checked``) and the search decodes only
    a tail; over every split of real replies, multi-byte text included, it finds what decoding the
    whole reply finds."""
    from megatron_wedlm.decoding.result import find_stop_string

    texts = ["Count from 3 to 12: 3 4 5 6 7 8 9 10 11 12", "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600 end",
             "def add(a, b):\n    return a + b\n\nprint(add(1, 2))"]
    for text in texts:
        ids = tokenizer.encode(text)
        for stops in ([text[-3:]], [text[len(text) // 2 : len(text) // 2 + 4], "zz"], ["\u65e5\u672c"], ["nowhere"]):
            for end in range(1, len(ids) + 1):
                whole = find_stop_string(tokenizer, ids[:end], stops)
                for checked in range(end):
                    if find_stop_string(tokenizer, ids[:checked], stops) is None:  # what a decoder knows
                        assert find_stop_string(tokenizer, ids[:end], stops, checked) == whole, (text, stops, end)


def test_clear_errors(tokenizer):
    model = tiny_model(tokenizer)
    prompt = tokenizer.encode("1 2 3")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, list(range(5)) * 60, method="streaming", window_size=16)
    no_mask = tiny_model(tokenizer)
    no_mask.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask_token_id"):
        generate(no_mask, prompt, method="streaming")
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        generate(model, prompt, method="blockwise", stop_strings=["x"])
    with pytest.raises(ValueError, match="unknown decoding method"):
        generate(model, prompt, method="beam")
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(model, [], method="streaming")


def test_sampler_filters_restrict_the_support():
    from megatron_wedlm.decoding.sampling import sample_tokens

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_tokens(logits, 1.0, 1, 1.0, g), greedy)
    assert torch.equal(sample_tokens(logits, 1.0, 0, 1e-6, g), greedy)
    top3 = logits.topk(3, dim=-1).indices
    for _ in range(20):
        drawn = sample_tokens(logits, 2.0, 3, 1.0, g)
        assert (top3 == drawn[:, None]).any(-1).all()
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = ((sorted_p.cumsum(-1) - sorted_p) < 0.5).sum(-1)  # nucleus size for top_p = 0.5
    for _ in range(20):
        drawn = sample_tokens(logits, 1.0, 0, 0.5, g)
        rank = (order == drawn[:, None]).float().argmax(-1)
        assert (rank < keep).all()


def test_flash_attention_is_refused_for_a_batch(tokenizer):
    model = tiny_model(tokenizer)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager"):
        generate_batch(model, [[1, 2], [3]], max_new_tokens=2)


def test_one_settings_object_drives_every_method_and_keywords_override_it(tokenizer):
    model = tiny_model(tokenizer, "qwen2", 200.0)
    prompt = tokenizer.encode("1 2 3")
    settings = DecodeSettings(window_size=5, entropy_threshold=0.6, max_new_tokens=14)
    for method in ("streaming", "blockwise", "ar"):
        by_object = generate(model, prompt, DecodeSettings.build(settings, method=method))
        by_keywords = generate(model, prompt, method=method, window_size=5, entropy_threshold=0.6, max_new_tokens=14)
        assert (by_object.token_ids, by_object.num_forwards) == (by_keywords.token_ids, by_keywords.num_forwards)
        assert by_object.method == method
    assert len(generate(model, prompt, settings, max_new_tokens=3).token_ids) == 3  # a keyword overrides the object
    with pytest.raises(TypeError, match="unknown decoding setting"):
        generate(model, prompt, windowsize=4)
    with pytest.raises(ValueError, match="window_size must be >= 1"):
        DecodeSettings(window_size=0)


def test_packed_batch_attention_is_scoped_to_the_decode(tokenizer):
    """A batched decode runs the rows as one packed sequence through a registered attention
    function; the model's own attention implementation is back in place afterwards, also after an
    error, and a non-SDPA model is refused by the packed path rather than silently mis-attended."""
    from megatron_wedlm.decoding.packed_attention import packed_attention

    model = tiny_model(tokenizer, "qwen2", 80.0)
    prompts = [tokenizer.encode("1 2 3"), tokenizer.encode("a b c d e f g")]
    generate_batch(model, prompts, max_new_tokens=6)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with packed_attention(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="needs an sdpa model"):
        with packed_attention(model):
            pass
    eager = generate_batch(model, prompts, max_new_tokens=6)  # eager batches take the padded path
    model.config._attn_implementation = "sdpa"
    assert [r.token_ids for r in eager] == [r.token_ids for r in generate_batch(model, prompts, max_new_tokens=6)]


def test_packed_attention_reads_only_each_rows_own_keys():
    """Rows at different cache lengths do not pay for (or read) each other's padding: every cache
    slot past a row's own keys is NaN, which any score over it (masked or not) would carry into
    the output. Rows alike in width and cache length share one attention call."""
    from megatron_wedlm.decoding.packed_attention import Packing, packed_sdpa
    from megatron_wedlm.decoding.row_cache import RowKVCache

    lengths, cached, heads, kv_heads, dim, capacity = [4, 4, 2, 3], [10, 10, 3, 0], 4, 2, 8, 20
    g = torch.Generator().manual_seed(0)
    keys = torch.full((len(lengths), kv_heads, capacity, dim), math.nan)
    values = keys.clone()
    for r, (n, c) in enumerate(zip(lengths, cached)):
        keys[r, :, : c + n] = torch.randn(kv_heads, c + n, dim, generator=g)
        values[r, :, : c + n] = torch.randn(kv_heads, c + n, dim, generator=g)
    query = torch.randn(1, heads, sum(lengths), dim, generator=g)
    cache = RowKVCache(1, len(lengths), capacity, "cpu")
    packing = Packing.build(lengths, cached, cache, torch.float32)
    assert [(grp.first, grp.last) for grp in packing.groups] == [(0, 2), (2, 3), (3, 4)]

    out, _ = packed_sdpa(None, query, keys, values, None, wedlm_packing=packing, scaling=dim**-0.5)
    assert out.shape == (1, sum(lengths), heads, dim) and out.isfinite().all()
    start = 0
    for r, (n, c) in enumerate(zip(lengths, cached)):  # plain softmax attention, query i sees keys j <= c + i
        q = query[0, :, start : start + n]
        k = keys[r, :, : c + n].repeat_interleave(heads // kv_heads, 0)
        v = values[r, :, : c + n].repeat_interleave(heads // kv_heads, 0)
        scores = q @ k.transpose(-1, -2) * dim**-0.5
        scores = scores.masked_fill(torch.arange(c + n)[None, :] > c + torch.arange(n)[:, None], -math.inf)
        expected = (scores.softmax(-1) @ v).transpose(0, 1)
        torch.testing.assert_close(out[0, start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n


def test_row_masks_follow_the_cached_prefix_rule():
    """Query ``i`` of a row with ``c`` cached keys sees key ``j`` iff ``j <= c + i``: in one row's
    mask (a view of a band the cache keeps) and in the padded batch's mask, where the keys past a
    row's own (another row's longer prefix) are hidden as well."""
    from megatron_wedlm.decoding.row_cache import RowKVCache

    cache = RowKVCache(1, 3, capacity=40, device="cpu")
    cache.commit([0, 7, 25])
    dense = cache.attention_mask(9, torch.float32)[:, 0]  # [rows, 9, 25 + 9]
    assert dense.shape == (3, 9, 34)
    for r, c in enumerate([0, 7, 25]):
        rule = torch.tensor([[0.0 if j <= c + i else torch.finfo(torch.float32).min for j in range(34)]
                             for i in range(9)])
        torch.testing.assert_close(dense[r], rule)
        for n in (1, 9):
            torch.testing.assert_close(cache.causal_mask(c, n, torch.float32), rule[:n, : c + n])
