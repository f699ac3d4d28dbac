"""Shared pieces of the benchmark and analysis scripts (bench/, bench/analysis/): prompts, the HF
baseline built from the very same weights, timing, greedy replay, and where results go
(bench/results/<machine or device>/<name>-<date>.json)."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import statistics
import time

import torch

from eecore.cli import BENCH_PROMPTS

# EECORE_RESULTS_DIR redirects every script's results (the scripts' own tests write to a temporary folder)
RESULTS_DIR = os.environ.get("EECORE_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# the same prompts as `eecore bench`, so the scripts and the CLI measure the same work
PROMPTS = BENCH_PROMPTS


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def hf_model_from_loaded(loaded, dtype=torch.float32):
    """A transformers LlamaForCausalLM holding exactly the weights eecore loaded (no second
    dequantization of the GGUF, no download)."""
    import transformers

    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))
    model = transformers.LlamaForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return model.to(dtype).eval()


def hf_model_from_gguf(path, dtype=torch.float32):
    """transformers' own loading of a GGUF file (dequantized, eval mode): the HF baseline as an HF user
    would build it from the same file, independent of eecore's loader (hf_model_from_loaded shares
    eecore's weights instead)."""
    from unittest import mock

    import transformers
    import transformers.modeling_utils as modeling_utils

    dirname, basename = os.path.split(str(path))
    # transformers refuses GGUF files unless `accelerate` is installed, although its dequantizing
    # path does not use it; lift the gate so the comparison also runs where accelerate is absent.
    with mock.patch.object(modeling_utils, "is_accelerate_available", return_value=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(dirname, gguf_file=basename, dtype=dtype)
    return model.eval()


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int, **extra) -> list[list[int]]:
    """Greedy HF generation of exactly max_new_tokens per prompt (left-padded batch)."""
    import copy

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = model.config.vocab_size + 1000, 0  # never stop early
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.temperature = config.top_p = config.top_k = None
    for key, value in extra.items():  # e.g. assistant_early_exit=E: HF's own self-speculation
        setattr(config, key, value)
    with torch.no_grad():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
    return [row[width:].tolist() for row in out]


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def rotated(items: list, k: int) -> list:
    """`items` starting from its (k mod n)-th: the order of a run's configurations, turned from run to
    run so that none always follows the same one."""
    k %= len(items)
    return items[k:] + items[:k]


def call_seconds(fn, repeats: int) -> list[float]:
    """The seconds of each of `repeats` calls of fn(), after one call to warm it up (callers take the
    median, or the minimum where the best case is the figure)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def alternate_with_hf(llm, hf, prompts: list[list[int]], params, max_new_tokens: int, repeats: int):
    """Generate `prompts` with eecore and with HF `generate` in turn, `repeats` times each, so that a
    burst of load on a shared machine hits both alike. Returns the median seconds of each and
    their last outputs: (eecore_s, hf_s, eecore_outputs, hf_token_ids)."""
    t_ee, t_hf = [], []
    for _ in range(repeats):
        outs, t = timed(llm.generate, prompts, params)
        t_ee.append(t)
        hf_outs, t = timed(hf_generate_greedy, hf, prompts, max_new_tokens)
        t_hf.append(t)
    return statistics.median(t_ee), statistics.median(t_hf), outs, hf_outs


def _cpuinfo() -> dict:
    """The first processor's fields in /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which decides what a CPU figure means. A VM may report
    only "AMD EPYC": the family and model numbers and the vector extensions the kernels use then
    say which generation it is (family 25 model 1: Zen 3, AVX2; model 17: Zen 4, AVX-512)."""
    fields = _cpuinfo()
    if not fields:
        return platform.processor() or platform.machine()
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; {' '.join(isa) or 'no AVX2'})"


# AMD family 25 holds both Zen 3 and Zen 4; these model ranges are Zen 4 (Genoa, Raphael, Phoenix,
# Bergamo), the rest Zen 3. Family 26 is Zen 5.
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def machine_folder() -> str:
    """The folder under bench/results/ for this machine's CPU results: its generation where the
    figures depend on it (zen3, zen4, zen5, xeon), else vendor, family and model. A VM's model name
    is often just "AMD EPYC", so the family and model numbers decide."""
    fields = _cpuinfo()
    vendor, name = fields.get("vendor_id", ""), fields.get("model name", "")
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return platform.machine().lower() or "unknown-cpu"
    if vendor == "AuthenticAMD" and family == 25:
        return "zen4" if any(model in r for r in _ZEN4_MODELS) else "zen3"
    if vendor == "AuthenticAMD" and family == 26:
        return "zen5"
    if vendor == "GenuineIntel" and "Xeon" in name:
        return "xeon"
    return f"{vendor.removeprefix('Genuine').removeprefix('Authentic').lower() or 'cpu'}-family{family}-model{model}"


def device_slug(name: str) -> str:
    """A device name as a file-name part: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_folder(name: str) -> str:
    """The folder under bench/results/ for a GPU's results: its maker and model, without the memory
    variant ("NVIDIA H100 80GB HBM3" -> "nvidia-h100"), so one GPU model's runs sit together."""
    return "-".join(device_slug(name).split("-")[:2])


PROMPT_KINDS = ("chat", "everyday", "code", "mixed")


def bench_prompt_ids(tokenizer, kind: str, n: int) -> list[list[int]]:
    """`n` prompts as token ids: "chat" (the CLI's bench prompts in the chat template, cycled),
    "everyday" (everyday requests on held-out topics in the chat template,
    eecore.sources.general_chat_prompts.heldout_requests) or "code" (held-out function starts, raw
    text: code completion, the exit adapters' domain) or "mixed" (everyday and code in turn, as a
    server sees them: a draft planner must not judge the next request by the last)."""
    if kind == "mixed":
        halves = bench_prompt_ids(tokenizer, "everyday", (n + 1) // 2), bench_prompt_ids(tokenizer, "code", n // 2)
        return [p for pair in zip(*halves) for p in pair] + halves[0][len(halves[1]):]
    if kind == "chat":
        return [chat_prompt_ids(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    if kind == "everyday":
        from eecore.sources.general_chat_prompts import heldout_requests

        return [chat_prompt_ids(tokenizer, r.text) for r in heldout_requests(n)]
    if kind == "code":
        from eecore.evaluation.prompts import heldout_code_prompts

        return [tokenizer.encode(t) for t in heldout_code_prompts(n)]
    raise ValueError(f"prompts must be one of {PROMPT_KINDS}, got {kind!r}")


# The CALM exit classifier the early-exit benches use: trained on first use (a few minutes on the
# CPU) and cached per user, not committed with the results.
CLASSIFIER_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eecore",
                                "smollm2-exit-classifier.safetensors")


def ensure_classifier(path: str = CLASSIFIER_CACHE) -> str:
    """`path`, after training CALM's exit classifier for the embedded model there if it is missing."""
    if not os.path.exists(path):
        import eecore
        from eecore.train import calm_classifier

        print(f"training the exit classifier -> {path}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        calm_classifier.train(eecore.LLM(dtype="float32", device="cpu")).save(path)
    return path


def save_results(name: str, payload: dict, folder: str | None = None) -> str:
    """Write `payload` with the date, machine and torch settings to
    bench/results/<folder>/<name>-<date>.json; `folder` defaults to this machine's
    (machine_folder(); GPU scripts pass device_folder(...)). Returns the path."""
    directory = os.path.join(RESULTS_DIR, folder or machine_folder())
    os.makedirs(directory, exist_ok=True)
    date = datetime.date.today().isoformat()
    payload = dict(payload, date=date, machine=cpu_model(),
                   cpu_count=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads())
    path = os.path.join(directory, f"{name}-{date}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def file_sha256(path: str) -> str:
    """The SHA-256 of a file (the results name the exact adapter or draft file they ran)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def text_windows(tokenizer, num: int, seq_len: int) -> tuple[list[list[int]], dict]:
    """`num` windows of `seq_len` tokens, evenly spaced over the held-out corpus's token stream
    (the Python source of the held-out packages: text no training saw)."""
    from eecore.sources.corpus import DEFAULT_HELDOUT_PACKAGES, build_corpus

    corpus = build_corpus((), DEFAULT_HELDOUT_PACKAGES)
    if corpus.missing:
        raise SystemExit(f"held-out packages not installed: {corpus.missing}")
    stream = tokenizer.encode(corpus.text("heldout"), add_special_tokens=False)
    if len(stream) < seq_len:
        raise SystemExit(f"the held-out text has {len(stream)} tokens, fewer than --seq-len {seq_len}")
    last = len(stream) - seq_len
    starts = [round(i * last / max(1, num - 1)) for i in range(num)]
    info = dict(packages=corpus.versions, files=len(corpus.heldout), tokens=len(stream), starts=starts)
    return [stream[s:s + seq_len] for s in starts], info


class GreedyReplay:
    """One prompt's full-depth greedy continuation replayed verify round by verify round. Greedy
    output does not depend on the drafts, so a round that verifies `drafts` emits exactly their
    prefix that matches the continuation plus the model's own next token; `index` is prompt
    lookup's n-gram index over the context so far, as the decoder would hold it."""

    def __init__(self, prompt: list[int], continuation: list[int], min_n: int, max_n: int):
        from eecore.text.ngram_index import NgramIndex

        self.prompt, self.continuation, self.pos = prompt, continuation, 0  # pos: tokens emitted so far
        self.index = NgramIndex(min_n, max_n)
        self.index.extend(prompt)

    @property
    def done(self) -> bool:
        return self.pos >= len(self.continuation)

    def emitted(self, drafts: list[int]) -> int:
        """Tokens a round verifying `drafts` emits here: the accepted drafts and one more, never
        past the continuation's end."""
        accepted = 0
        while (accepted < len(drafts) and self.pos + accepted < len(self.continuation)
               and drafts[accepted] == self.continuation[self.pos + accepted]):
            accepted += 1
        return min(accepted + 1, len(self.continuation) - self.pos)

    def advance(self, drafts: list[int]) -> int:
        """Verify `drafts`: emit what the round emits, feed it to the index; how many tokens."""
        emitted = self.emitted(drafts)
        self.index.extend(self.continuation[self.pos: self.pos + emitted])
        self.pos += emitted
        return emitted
