"""`eecore generate "prompt"`: streams a completion of one or more prompts."""
from __future__ import annotations

import sys
import time

from eecore.cli.args import (add_model_flags, add_sampling_flags, build_llm, prompt_input, sampling_params,
                             speculative_config)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", usage="eecore generate [options] prompt [prompt ...]",
                       help="generate (streamed) completions of one or more prompts")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="wrap the prompt in the model's chat template (auto: when it has one)")
    add_sampling_flags(g, max_tokens=128)
    add_model_flags(g)
    g.set_defaults(func=cmd_generate)


def summary(n_tokens: int, layers: list[int], elapsed: float, num_layers: int) -> str:
    mean = sum(layers) / max(len(layers), 1)
    return (f"{n_tokens} tokens in {elapsed:.2f}s ({n_tokens / max(elapsed, 1e-9):.1f} tok/s), "
            f"mean layers/token {mean:.2f} of {num_layers}")


# A prompt's tokens are at most its UTF-8 bytes (byte-level BPE) plus the chat template's own.
_TEMPLATE_TOKENS = 64


def request_blocks(prompts: list[str], max_tokens: int, block_size: int, lookahead: int = 1) -> int:
    """KV blocks these requests can ever hold (`lookahead`: the slots a decoding round may write
    past the last token, self-speculation's verify width): a cache sized to the work, not to free
    memory (a short run then touches a few pages, not a huge page per layer). Doubled for an
    encoder-decoder's cross-attention K/V."""
    need = sum(-(-(len(p.encode()) + _TEMPLATE_TOKENS + max_tokens + lookahead) // block_size) + 1 for p in prompts)
    return 2 * need


def cmd_generate(args) -> int:
    lookahead = speculative_config(args).verify_width if args.speculate else 1
    llm = build_llm(args, num_blocks=request_blocks(args.prompt, args.max_tokens, args.block_size, lookahead))
    prompts = [prompt_input(llm, p, args.chat) for p in args.prompt]
    texts = [""] * len(prompts)
    layers: list[int] = []
    start = time.perf_counter()
    for delta in llm.generate_stream(prompts, sampling_params(args)):
        texts[delta.index] += delta.text
        layers += delta.exit_layers
        if len(prompts) == 1:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    if len(prompts) == 1:
        sys.stdout.write("\n")
    else:
        for i, text in enumerate(texts):
            print(f"[{i}] {text}")
    print(summary(len(layers), layers, elapsed, llm.model.num_layers), file=sys.stderr)
    return 0
