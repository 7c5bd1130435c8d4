#!/usr/bin/env python
"""Which mask slots a WeDLM model predicts wrongly *and confidently*, by distance from the prefix.

For every reference answer and every cut of it, the model sees the prompt and the answer up to
the cut, then W masks, and predicts them all at once (``megatron_wedlm.eval.slot_probe``). The
table gives per distance d: the argmax accuracy, and per tau how many slots the fill rule
``H + lambda * d < tau`` would commit on confidence alone and how many of them are wrong. Each
wrong commit ends an answer wrong, so the columns show how far ahead a model can be trusted at a
given tau: a seconds-long check of a training change, next to ``inference/evaluate.py``'s whole
decodes (minutes). Rows "early end" and "late end" count the wrong commits that end an answer
too early (EOS or the answer's final token, the newline that stops a built-in task's answer,
where it goes on) or too late (anything else where it ends).

    python tools/probe_masked_slots.py --model outputs/quickstart/hf/wedlm --tasks counting:calibration
    python tools/probe_masked_slots.py --model HF_DIR --pairs sft.jsonl --taus 0.2,0.4 --json probe.json
    python tools/probe_masked_slots.py --model outputs/smollm/hf/wedlm --chat

Answers come from the built-in tasks (what a correct model generates, ending at the newline that
stops it) or from ``--pairs`` (jsonl lines ``{"prompt": ..., "response": ...}``, the SFT format
of ``tools/prepare_data.py``). With ``--chat`` each prompt is one user turn in the tokenizer's
chat template and each answer is the reply, stripped as the chat SFT data has it, followed by the
tokenizer's EOS (the end of turn), which is how ``inference/evaluate.py --chat`` sees a chat
model answer. Window and lambda default to the model's stored decoding settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_wedlm.decoding.inputs import DTYPES, chat_prompt_text, encode_prompt, find_mask_token_id
from megatron_wedlm.training.hf_export import load_checkpoint
from megatron_wedlm.decoding.cli import float_list
from megatron_wedlm.decoding.options import describe, resolve_decoding_settings
from megatron_wedlm.eval.builtin_tasks import FAMILIES, completion_of
from megatron_wedlm.eval.registry import load_task, parse_task_spec
from megatron_wedlm.eval.slot_probe import format_probe, probe_masked_slots


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="WeDLM checkpoint directory (HF format), or a training checkpoint (iter_N) or run directory")
    p.add_argument("--tasks", default="counting,copying",
                   help=f"built-in tasks ({', '.join(FAMILIES)}), each optionally :calibration (default split: test)")
    p.add_argument("--pairs", help="jsonl of {prompt, response} pairs, probed instead of --tasks")
    p.add_argument("--chat", action="store_true",
                   help="prompts as one user turn of the tokenizer's chat template, answers ending at its EOS")
    p.add_argument("--num-examples", type=int, default=50, help="examples per built-in task, or pairs read")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in tasks")
    p.add_argument("--taus", type=float_list, default=[0.2, 0.3, 0.4], help="entropy thresholds to count commits at")
    p.add_argument("--window-size", type=int, default=None, help="default: the model's, else 16")
    p.add_argument("--distance-penalty", type=float, default=None, help="default: the model's, else 0.02")
    p.add_argument("--max-distance", type=int, default=7, help="last distance shown in the table (all in --json)")
    p.add_argument("--json", help="also write every distance's counts here")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    return p


def _answer_ids(tokenizer, prompt: str, completion: str, where: str, chat: bool) -> tuple[list[int], list[int]]:
    """Prompt ids, and the answer ids as the model sees them after the prompt (tokenized together)."""
    if chat:
        if tokenizer.eos_token is None:
            raise SystemExit("--chat: this tokenizer has no EOS token to end a reply with")
        text = chat_prompt_text(tokenizer, prompt)
        prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = list(tokenizer(text + completion.strip() + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
    else:
        prompt_ids = encode_prompt(tokenizer, prompt)
        ids = encode_prompt(tokenizer, prompt + completion)
    if ids[: len(prompt_ids)] != prompt_ids:
        raise SystemExit(f"{where}: the prompt's last token merges with the response's first one under this "
                         "tokenizer, so the answer has no tokenization of its own; end the prompt with a "
                         "separator (space, newline, colon)")
    return prompt_ids, ids[len(prompt_ids):]


def _examples(args, tokenizer) -> dict[str, list[tuple[list[int], list[int]]]]:
    if args.pairs:
        pairs = []
        with open(args.pairs, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if len(pairs) == args.num_examples:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    prompt, response = row["prompt"], row["response"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise SystemExit(f"{args.pairs}:{number}: expected a JSON object with \"prompt\" and "
                                     "\"response\" strings") from None
                pairs.append(_answer_ids(tokenizer, prompt, response, f"{args.pairs}:{number}", args.chat))
        return {os.path.basename(args.pairs): pairs}
    out = {}
    for spec in filter(None, (s.strip() for s in args.tasks.split(","))):
        if parse_task_spec(spec)[0] not in FAMILIES:
            raise SystemExit(f"--tasks {spec}: only built-in tasks have reference generations; use --pairs for others")
        task = load_task(spec, num_examples=args.num_examples, seed=args.seed)
        out[spec] = [_answer_ids(tokenizer, e.prompt, completion_of(e.reference), f"{spec} {e.uid}", args.chat)
                     for e in task.examples]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    taus = args.taus
    model, tokenizer = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
    given = {"window_size": args.window_size, "distance_penalty": args.distance_penalty}
    values, sources = resolve_decoding_settings(given, args.model)
    print(f"{args.model}: {describe({k: values[k] for k in given}, sources)}", file=sys.stderr)
    results = {}
    for name, examples in _examples(args, tokenizer).items():
        # what stops an answer: EOS, and the token each reference answer ends with (the built-in
        # tasks' stop newline)
        ends = {a[-1] for _, a in examples if a}
        if tokenizer.eos_token_id is not None:
            ends.add(tokenizer.eos_token_id)
        stats = probe_masked_slots(model, examples, mask_token_id=find_mask_token_id(model, tokenizer),
                                   window_size=values["window_size"],
                                   distance_penalty=values["distance_penalty"], taus=taus, end_token_ids=ends)
        print(f"\n{name}: {len(examples)} answers, first predictions of the masks after each cut")
        print(format_probe(stats, taus, args.max_distance, ends=True))
        results[name] = [{"distance": s.distance, "states": s.states, "correct": s.correct, "slipped": s.slipped,
                          "commits": {f"{t:g}": s.commits[t] for t in taus},
                          "wrong": {f"{t:g}": s.wrong[t] for t in taus},
                          "early_end": {f"{t:g}": s.early_end[t] for t in taus},
                          "late_end": {f"{t:g}": s.late_end[t] for t in taus}} for s in stats]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "window_size": values["window_size"],
                       "distance_penalty": values["distance_penalty"], "tasks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
