"""A corpus of the model's own continuations: on-policy data for training drafts.

Draft layers are used on what the model itself writes, while `eecore.sources.corpus` holds source code
as people wrote it. This builds the other kind: code-completion prompts (`eecore.evaluation.prompts`) and, for
an instruction-tuned model, chat requests (technical ones, `eecore.sources.chat_prompts`, and
everyday ones, `eecore.sources.general_chat_prompts`, in its chat template)
from the training packages and from the held-out packages, each followed by the original model's
continuation, in the folder layout `python -m eecore.train.exit_ready --corpus` reads. Greedy by
default; with `--temperatures 0 1` every other prompt is continued by sampling at temperature 1
(seeded by its place in its split), so the drafts also learn the contexts a sampled request
produces (`bench/analysis/sampled_acceptance.py`: a copy trained on greedy text alone agreed with
full depth on 0.56 of the positions of code sampled at temperature 1, against 0.82 along greedy
continuations).

    python -m eecore.train.generated_corpus --out gen/ --train-prompts 2400 --heldout-prompts 64 \
        [--chat-train-prompts 1400 --chat-heldout-prompts 48] \
        [--general-train-prompts 1400 --general-heldout-prompts 48 --asked-per-topic 4] [--temperatures 0 1]

Greedy decoding on one machine is deterministic; another CPU's kernels may round differently and
so, rarely, continue differently, and a GPU in bf16 (`--device cuda --dtype bfloat16`, for a corpus
a hundred times larger) more often: the text is then nearly, not exactly, the fp32 model's own,
while the trainer's targets stay the original model's distributions on it. Measured on SmolLM2
(the draft layers' model card): 2,400 prompts x 128 tokens took 22 minutes on 2 CPU cores, and
200 steps on them moved the copy's agreement less than a point; 20,000 prompts took 110 s on an
H200 (bf16, 128 sequences), and 2,897 steps of 32 x 512 tokens on them moved it 3-4 points and
the drafts' acceptance 6 (the shipped draft file since 2026-11-26).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Callable, Optional, Sequence

from eecore.evaluation.prompts import heldout_code_prompt_records
from eecore.sources.chat_prompts import chat_instruction_records
from eecore.sources.general_chat_prompts import general_instruction_records
from eecore.sources.corpus import (DEFAULT_HELDOUT_PACKAGES, DEFAULT_TRAIN_PACKAGES, FILE_SEPARATOR, CorpusFile,
                                 build_corpus)


def continuations(llm, prompts: list[str], max_tokens: int, *, temperature: float = 0.0,
                  seeds: Optional[list[int]] = None, close_turns: bool = False) -> list[str]:
    """Each prompt followed by the model's continuation of at most `max_tokens` tokens: greedy, or
    sampled at `temperature` with each prompt's seed from `seeds`; with `close_turns`, a
    continuation that ended on an end-of-sequence token gets the tokenizer's end-of-sequence text
    appended (a chat model's end-of-turn marker, which drafts must learn to propose too)."""
    import eecore

    seeds = seeds if seeds is not None else [None] * len(prompts)
    outs = llm.generate(prompts, [eecore.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
                                  for seed in seeds])
    eos = llm.tokenizer.eos_token if close_turns else None
    return [p + o.text + (eos if eos and o.finish_reason == "stop" else "") for p, o in zip(prompts, outs)]


def _interleave(*lists: list) -> list:
    """The lists merged so that every prefix holds each in its overall proportion (each keeps its
    order): a corpus cut short by the clock still has every kind."""
    keyed = [((i + 0.5) / len(v), k, x) for k, v in enumerate(lists) for i, x in enumerate(v)]
    return [x for _, _, x in sorted(keyed, key=lambda key: (key[0], key[1]))]


def _in_chat_template(llm, message: str) -> str:
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("write_generated_corpus: chat prompts need a model with a chat template")
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)


def _split_prompts(llm, split: str, files: list[CorpusFile], code: int, chat: int, general: int,
                   asked_per_topic: int) -> list[tuple[str, str, bool]]:
    """(source, prompt text, is chat) for `code` code-completion prompts and `chat` technical
    instructions from `files` (source: the package), and `general` everyday requests of `split`
    (`eecore.sources.general_chat_prompts`; source: "topic:" and the topic), the requests in the
    model's chat template, the three kinds interleaved."""
    code_records = heldout_code_prompt_records(code, packages=sorted({f.package for f in files}), files=files) \
        if code else []
    chat_prompts = [(r.package, _in_chat_template(llm, r.text), True)
                    for r in (chat_instruction_records(chat, files) if chat else [])]
    general_records = general_instruction_records(general, split, llm, asked_per_topic) if general else []
    general_prompts = [(f"topic:{r.topic}", _in_chat_template(llm, r.text), True) for r in general_records]
    return _interleave([(r.package, r.text, False) for r in code_records], chat_prompts, general_prompts)


def write_generated_corpus(llm, out_dir: str, *, train_files: list[CorpusFile], heldout_files: list[CorpusFile],
                           train_prompts: int, heldout_prompts: int, chat_train_prompts: int = 0,
                           chat_heldout_prompts: int = 0, general_train_prompts: int = 0,
                           general_heldout_prompts: int = 0, asked_per_topic: int = 0, max_tokens: int = 128,
                           temperatures: Sequence[float] = (0.0,),
                           versions: Optional[dict[str, str]] = None, stop_at: Optional[float] = None,
                           chunk_prompts: int = 512, clock: Callable[[], float] = time.monotonic) -> dict:
    """Writes train.txt and heldout.txt (samples separated as in `eecore.sources.corpus`) and a manifest
    with the keys the trainer records in its file (`versions`: the source packages' versions).

    Each split holds `*_prompts` code-completion prompts, `chat_*_prompts` technical instructions
    (`eecore.sources.chat_prompts`) and `general_*_prompts` everyday requests (templated, and with
    `asked_per_topic` as many tries a topic at requests the model writes itself:
    `eecore.sources.general_chat_prompts`), the requests in the model's chat template and each answer
    closed with its end-of-turn token when it ended there, the kinds interleaved. The i-th prompt of a
    split is continued at `temperatures[i % len(temperatures)]` (0: greedy), seeded with i when
    sampled. The held-out split is generated first and
    always whole. The train prompts then go to the model `chunk_prompts` at a time, and once
    `clock()` has reached `stop_at` no further chunk starts (the first always does): the split
    keeps the prompts done (a prefix of the full list, which interleaves the packages and the two
    kinds), and the manifest says so ("stopped_by_clock"). That is how a run on a lent machine,
    whose calls have a time limit, still leaves a corpus the trainer can use."""
    for name, value in (("max_tokens", max_tokens), ("chunk_prompts", chunk_prompts)):
        if value < 1:
            raise ValueError(f"write_generated_corpus: {name} must be >= 1, got {value!r}")
    for name, value in (("train_prompts", train_prompts), ("heldout_prompts", heldout_prompts),
                        ("chat_train_prompts", chat_train_prompts), ("chat_heldout_prompts", chat_heldout_prompts),
                        ("general_train_prompts", general_train_prompts),
                        ("general_heldout_prompts", general_heldout_prompts), ("asked_per_topic", asked_per_topic)):
        if value < 0:
            raise ValueError(f"write_generated_corpus: {name} must be >= 0, got {value!r}")
    temperatures = tuple(temperatures)
    if not temperatures or any(not t >= 0 for t in temperatures):
        raise ValueError(f"write_generated_corpus: temperatures must be one or more numbers >= 0, got {temperatures!r}")
    counts = {"train": (train_files, train_prompts, chat_train_prompts, general_train_prompts),
              "heldout": (heldout_files, heldout_prompts, chat_heldout_prompts, general_heldout_prompts)}
    for split, (_, code, chat, general) in counts.items():  # (before the model writes any request)
        if code + chat + general < 1:
            raise ValueError(f"write_generated_corpus: the {split} split needs at least one prompt, code or chat")
    splits = {}
    for split, (files, code, chat, general) in counts.items():
        prompts = _split_prompts(llm, split, files, code, chat, general, asked_per_topic)
        if not prompts:
            raise ValueError(f"write_generated_corpus: the {split} files hold no usable code prompt or instruction")
        splits[split] = prompts
    os.makedirs(out_dir, exist_ok=True)
    with_chat = chat_train_prompts or chat_heldout_prompts or general_train_prompts or general_heldout_prompts
    how = "greedy" if temperatures == (0.0,) else "greedy and sampled"
    kind = f"{how} continuations of code prompts" + (" and chat instructions" if with_chat else "")
    manifest = {"kind": kind, "max_tokens": max_tokens, "temperatures": list(temperatures),
                "separator": FILE_SEPARATOR, "versions": dict(versions or {})}
    for split in ("heldout", "train"):
        prompts = splits[split]
        # the held-out split always whole; the train split in chunks, until the clock says stop
        samples = _generate(llm, prompts, max_tokens, temperatures, None if split == "heldout" else chunk_prompts,
                            stop_at, clock)
        done = len(samples)
        with open(os.path.join(out_dir, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write(FILE_SEPARATOR.join(samples))
        sources = {p for p, _, _ in prompts[:done]}
        manifest[split] = {"prompts": done, "chat_prompts": sum(c for _, _, c in prompts[:done]),
                           "general_prompts": sum(p.startswith("topic:") for p, _, _ in prompts[:done]),
                           "chars": sum(map(len, samples)),
                           "packages": sorted(p for p in sources if not p.startswith("topic:"))}
        if done < len(prompts):
            manifest[split]["stopped_by_clock"] = {"prompts_asked": len(prompts)}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def _generate(llm, prompts: list, max_tokens: int, temperatures: tuple[float, ...], chunk: Optional[int],
              stop_at: Optional[float], clock: Callable[[], float]) -> list[str]:
    """The answers to a prefix of `prompts` ((source, prompt, is chat) each), the i-th at
    temperatures[i % len(temperatures)] with seed i: all of them when `chunk` is None, else `chunk`
    at a time while `clock()` is before `stop_at` (the first chunk always runs)."""
    samples: list[str] = []
    step = chunk or len(prompts)
    while len(samples) < len(prompts) and (chunk is None or not samples or stop_at is None or clock() < stop_at):
        first = len(samples)
        batch = prompts[first: first + step]
        texts = [""] * len(batch)
        # one generate call per kind and temperature: only chat answers are closed
        for chat, temperature in itertools.product((False, True), sorted(set(temperatures))):
            where = [i for i, (_, _, is_chat) in enumerate(batch)
                     if is_chat == chat and temperatures[(first + i) % len(temperatures)] == temperature]
            if where:
                answers = continuations(llm, [batch[i][1] for i in where], max_tokens, temperature=temperature,
                                        seeds=[first + i for i in where], close_turns=chat)
                for i, text in zip(where, answers):
                    texts[i] = text
        samples += texts
    return samples


def main(argv: Optional[list[str]] = None) -> int:
    import eecore

    ap = argparse.ArgumentParser(prog="python -m eecore.train.generated_corpus", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--train-prompts", type=int, default=2400)
    ap.add_argument("--heldout-prompts", type=int, default=64)
    ap.add_argument("--chat-train-prompts", type=int, default=0,
                    help="chat instructions (eecore.sources.chat_prompts) in the train split, besides the code prompts")
    ap.add_argument("--chat-heldout-prompts", type=int, default=0)
    ap.add_argument("--general-train-prompts", type=int, default=0,
                    help="everyday chat requests (eecore.sources.general_chat_prompts) in the train split")
    ap.add_argument("--general-heldout-prompts", type=int, default=0)
    ap.add_argument("--asked-per-topic", type=int, default=0,
                    help="tries a topic at a request the model writes itself (sampled, seeded), besides the templated "
                         "ones; kept when eecore.sources.general_chat_prompts.clean_request accepts it")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                    help="the i-th prompt of a split is continued at the i-th of these, cycled (0: greedy; sampled "
                         "ones seeded with i)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--device", default="cpu",
                    help="where the model generates (cuda: tools/gpu_train_exit_ready.sh generate)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--stop-after-minutes", type=float, default=None,
                    help="start no further chunk of train prompts after this long (the held-out split is always "
                         "whole); the manifest records the stop")
    args = ap.parse_args(argv)
    if args.stop_after_minutes is not None and not args.stop_after_minutes > 0:
        ap.error(f"--stop-after-minutes must be > 0, got {args.stop_after_minutes!r}")
    stop_at = None if args.stop_after_minutes is None else time.monotonic() + 60 * args.stop_after_minutes
    corpus = build_corpus(DEFAULT_TRAIN_PACKAGES, DEFAULT_HELDOUT_PACKAGES)
    llm = eecore.LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs)
    manifest = write_generated_corpus(llm, args.out, train_files=corpus.train, heldout_files=corpus.heldout,
                                      train_prompts=args.train_prompts, heldout_prompts=args.heldout_prompts,
                                      chat_train_prompts=args.chat_train_prompts,
                                      chat_heldout_prompts=args.chat_heldout_prompts,
                                      general_train_prompts=args.general_train_prompts,
                                      general_heldout_prompts=args.general_heldout_prompts,
                                      asked_per_topic=args.asked_per_topic,
                                      max_tokens=args.max_tokens, temperatures=args.temperatures,
                                      versions=corpus.versions, stop_at=stop_at)
    print(json.dumps({k: manifest[k] for k in ("train", "heldout")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
