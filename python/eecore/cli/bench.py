"""`eecore bench`: decode throughput over a few chat prompts."""
from __future__ import annotations

import time

from eecore.cli.args import add_model_flags, add_sampling_flags, build_llm, prompt_input
from eecore.cli.generate import summary


def add_parser(sub) -> None:
    b = sub.add_parser("bench", usage="eecore bench [options]", help="measure decode throughput")
    b.add_argument("--num-prompts", type=int, default=8)
    b.add_argument("--chat", choices=["auto", "on", "off"], default="auto")
    add_sampling_flags(b, max_tokens=128)
    add_model_flags(b)
    b.set_defaults(func=cmd_bench)


BENCH_PROMPTS = [
    "Explain how a paged KV cache works in an LLM inference engine.",
    "Write a short poem about the sea.",
    "What are the main differences between Python and C++?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Give three tips for writing readable code.",
    "Why is the sky blue?",
    "Describe the water cycle.",
    "How do vaccines work?",
]


def cmd_bench(args) -> int:
    from tqdm.auto import tqdm

    import eecore

    llm = build_llm(args)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                   top_k=args.top_k, seed=args.seed, ignore_eos=True)
    prompts = [prompt_input(llm, BENCH_PROMPTS[i % len(BENCH_PROMPTS)], args.chat) for i in range(args.num_prompts)]
    llm.generate(prompts[:1], eecore.SamplingParams(max_tokens=4))  # warm-up
    layers: list[int] = []
    start = time.perf_counter()
    with tqdm(total=args.num_prompts * args.max_tokens, desc="tokens", unit="tok") as bar:
        for delta in llm.generate_stream(prompts, params):
            bar.update(len(delta.token_ids))
            layers += delta.exit_layers
    elapsed = time.perf_counter() - start
    print(f"{args.num_prompts} requests, batch <= {args.max_num_seqs}: "
          + summary(len(layers), layers, elapsed, llm.model.num_layers))
    return 0
