"""The ``wedlm`` model for lm-evaluation-harness.

* ``generate_until`` decodes with WeDLM streaming decoding; ``--model_args`` keys
  (:class:`DecodingArgs`) switch the method (``blockwise``, ``ar``) and the step rules
  (``refill``, ``stop_fill``, ``stop_penalty``, ``fallback``, ``stop_at_eos``); the window
  settings default to those stored with a ``pretrained`` model, else the built-in ones
  (``setting_sources`` and the log say which).
* ``loglikelihood`` / ``loglikelihood_rolling`` use the plain causal forward (a WeDLM keeps its
  next-token head), the mask token excluded from every distribution as in decoding.

lm_eval finds models only through its registry (no plugin entry points), so importing this
module registers ``wedlm``; run the harness through it::

    python -m megatron_wedlm.eval.lm_eval_adapter --model wedlm \\
        --model_args pretrained=/ckpt,entropy_threshold=0.4 --tasks arc_easy --device cpu
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - exercised only without lm_eval installed
    raise ImportError(
        "the lm_eval adapter needs lm-evaluation-harness: pip install 'lm-eval>=0.4.5' "
        "-c constraints.txt (or pip install -e '.[eval]')"
    ) from e

from megatron_wedlm.decoding.api import generate, generate_batch
from megatron_wedlm.decoding.inputs import find_mask_token_id
from megatron_wedlm.decoding.log_likelihood import causal_log_likelihoods
from megatron_wedlm.decoding.options import FALLBACKS, ONE_SLOT, REFILL_ORDERS, STOP_FILLS, describe, resolve_decoding_settings
from megatron_wedlm.decoding.settings import METHODS, DecodeSettings
from megatron_wedlm.eval.tasks import truncate_at_stop
from megatron_wedlm.training.hf_export import load_checkpoint

logger = logging.getLogger(__name__)


def _as_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class DecodingArgs:
    """The decoding keys of ``--model_args``, as strings or values; None: the value stored with a
    ``pretrained`` model, else the built-in one."""

    method: str = "streaming"
    mask_token_id: int | None = None
    window_size: int | None = None
    entropy_threshold: float | str | None = None  # "none": one slot per forward
    distance_penalty: float | None = None
    refill: str | None = None
    stop_fill: str | None = None
    stop_penalty: bool | str | None = None
    fallback: str | None = None
    stop_at_eos: bool | str = True
    max_gen_toks: int = 256
    chat: bool | str = False

    @classmethod
    def pick(cls, args: dict[str, Any]) -> "DecodingArgs":
        """The keys named here; lm-eval passes others too (e.g. ``max_batch_size``), which are ignored."""
        return cls(**{f.name: args[f.name] for f in fields(cls) if f.name in args})

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.refill is not None and self.refill not in REFILL_ORDERS:
            raise ValueError(f"refill must be fused (the reference engine's schedule) or paper, got {self.refill!r}")
        if self.stop_fill is not None and self.stop_fill not in STOP_FILLS:
            raise ValueError(f"stop_fill must be anywhere (the reference engine) or contiguous, got {self.stop_fill!r}")
        if self.fallback is not None and self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be argmin (the reference engine) or leftmost, got {self.fallback!r}")

    def given(self) -> dict[str, Any]:
        """The window settings given, typed, for :func:`resolve_decoding_settings` (None: not given)."""
        tau = self.entropy_threshold
        if tau is not None:
            tau = ONE_SLOT if str(tau).lower() == "none" else float(tau)
        return {
            "window_size": None if self.window_size is None else int(self.window_size),
            "entropy_threshold": tau,
            "distance_penalty": None if self.distance_penalty is None else float(self.distance_penalty),
            "fused_refill": None if self.refill is None else REFILL_ORDERS[self.refill],
            "contiguous_stop": None if self.stop_fill is None else STOP_FILLS[self.stop_fill],
            "stop_penalty": None if self.stop_penalty is None else _as_bool(self.stop_penalty),
            "leftmost_fallback": None if self.fallback is None else FALLBACKS[self.fallback],
        }


@register_model("wedlm")
class WeDLMLM(LM):
    """lm_eval LM over an HF causal model with a mask token, from ``pretrained`` (a checkpoint,
    training checkpoint or run directory) or ready ``model`` and ``tokenizer``. lm-eval builds it as
    ``WeDLMLM(**model_args)``, so the decoding keys arrive as keywords, named by :class:`DecodingArgs`."""

    def __init__(self, pretrained: str | None = None, model: Any = None, tokenizer: Any = None,
                 device: str | None = None, dtype: str = "auto", max_length: int | None = None,
                 batch_size: int | str = 1, **decoding: Any):
        super().__init__()
        args = DecodingArgs.pick(decoding)
        if (pretrained is None) == (model is None):
            raise ValueError("give exactly one of pretrained=DIR or model=<HF model object>")
        if pretrained is not None:
            model, tokenizer = load_checkpoint(
                pretrained, device=device, dtype=dtype,
                require_mask_token=args.mask_token_id is None and args.method != "ar",
            )
        elif tokenizer is None:
            raise ValueError("model= needs tokenizer= as well")
        mask_token_id = find_mask_token_id(model, tokenizer, args.mask_token_id)
        if mask_token_id is None and args.method != "ar":
            raise ValueError("model has no mask token: set config.mask_token_id or pass mask_token_id")
        args.check()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.mask_token_id = mask_token_id
        values, self.setting_sources = resolve_decoding_settings(args.given(), pretrained)
        logger.info(f"wedlm decoding settings: {describe(values, self.setting_sources)}")
        self.refill = "fused" if values["fused_refill"] else "paper"
        self.stop_at_eos = _as_bool(args.stop_at_eos)
        eos = tokenizer.eos_token_id if self.stop_at_eos else None
        self.settings = DecodeSettings(method=args.method, mask_token_id=mask_token_id,
                                       stop_token_ids=() if eos is None else (eos,), **values)
        self.max_gen_toks = int(args.max_gen_toks)
        self.chat = _as_bool(args.chat)
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self._max_length = int(max_length) if max_length else int(
            getattr(model.config, "max_position_embeddings", 2048)
        )
        self._device = next(model.parameters()).device

    # ------------------------------------------------------------------ token helpers

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def prefix_token_id(self) -> int:
        """Context for an empty prompt: BOS if the tokenizer has one, else EOS (as HF models do)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "wedlm").replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _context_continuation_ids(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids split where tokenizing the joined text puts the boundary (lm_eval's convention):
        the context's trailing spaces move to the continuation, so "Answer: " + "B" scores as " B"."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix_token_id], self._encode(continuation)
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return whole[: len(ctx)], whole[len(ctx):]

    # ------------------------------------------------------------------ likelihoods

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum log p(continuation | context) and the greedy-match flag of each pair, left-truncated to
        the model's length as lm-eval's ``hf`` model truncates."""
        sequences = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in pairs]
        scored = causal_log_likelihoods(self.model, sequences, [len(seq) - len(cont) for seq, (_, cont) in
                                                                  zip(sequences, pairs)],
                                        exclude_token_id=self.mask_token_id, batch_rows=self.batch_size)
        return [(s.total, s.greedy) for s in scored]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for context, continuation in (r.args for r in requests):
            ctx, cont = self._context_continuation_ids(context, continuation)
            if not cont:
                raise ValueError(f"empty continuation after tokenization for context {context[-40:]!r}")
            pairs.append((ctx, cont))
        results = self._score(pairs)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        results = []
        for req in requests:
            (text,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self._encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            total = sum(lp for lp, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy requests that share their generation arguments decode together in continuous
        batches of ``batch_size`` rows (greedy outputs do not depend on the batch); a sampled
        request decodes alone, so its draws do not depend on which requests came with it."""
        parsed = [self._generation_request(req) for req in requests]
        results: list[Any] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for index, (prompt, kwargs) in enumerate(parsed):
            if kwargs["temperature"] > 0:
                results[index] = generate(self.model, prompt, self.settings, tokenizer=self.tokenizer, **kwargs)
            else:
                groups.setdefault(tuple(sorted(kwargs.items())), []).append(index)
        for key, indices in groups.items():
            batch = generate_batch(self.model, [parsed[i][0] for i in indices], self.settings, tokenizer=self.tokenizer,
                                   batch_size=self.batch_size, **dict(key))
            for i, result in zip(indices, batch):
                results[i] = result
        stop_ids = self.settings.stop_token_ids
        outputs = []
        for req, (_, kwargs), result in zip(requests, parsed, results):
            ids = [int(t) for t in result.token_ids]
            if ids and ids[-1] in stop_ids:
                ids = ids[:-1]
            text = truncate_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), kwargs["stop_strings"])
            self.cache_hook.add_partial("generate_until", req.args, text)
            outputs.append(text)
        return outputs

    def _generation_request(self, req: Any) -> tuple[list[int], dict[str, Any]]:
        """A ``generate_until`` request as (prompt ids, decoding keywords)."""
        context, gen_kwargs = req.args
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = _as_bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 0.0)) if do_sample else 0.0
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a prompt in {self.max_length}")
        prompt = self._encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
        return prompt, {
            "max_new_tokens": max_new, "temperature": temperature, "top_k": int(gen_kwargs.pop("top_k", 0)),
            "top_p": float(gen_kwargs.pop("top_p", 1.0)), "stop_strings": tuple(u for u in until if u),
        }


def main() -> None:
    """lm_eval's command line with the ``wedlm`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
