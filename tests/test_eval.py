"""`eecore eval` on tiny random models: the numbers it reports against by-hand computations,
ROUGE-L against hand-computed values, prompt-file errors, and the JSON / plot it writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import eecore
from eecore import cli
from eecore.evaluation.metrics import compare_outputs, token_matches
from eecore.outputs import RequestOutput
from eecore.evaluation.prompt_sets import EvalPrompt, PromptFileError, load_prompt_set, read_prompt_file
from eecore.text.rouge import rouge_l
from engine_utils import greedy
from model_factory import make_tiny_hf_model

PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):", "Early exit lets easy tokens"]
ROW_FIELDS = {"label", "strategy", "tokens_per_s", "full_tokens_per_s", "speedup", "num_tokens", "full_num_tokens",
              "seconds", "full_seconds", "early_exit_rate", "mean_layers_per_token", "num_layers",
              "token_agreement", "exact_match", "rouge_l_to_full", "rouge_l_to_reference",
              "full_rouge_l_to_reference", "strategy_metrics", "outputs"}
TOP_FIELDS = {"eecore", "model", "num_layers", "device", "dtype", "exit_adapter", "prompts", "sampling", "repeats",
              "max_num_seqs", "rows"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("eval"), num_layers=2)
    return str(path)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")  # a trailing blank line is skipped
    return str(path)


def run_eval(tiny, tmp_path, *flags):
    out = tmp_path / "eval.json"
    rc = cli.main(["eval", "--model", tiny, "--device", "cpu", "--max-tokens", "8", "--repeats", "2",
                   "--out", str(out), *flags])
    assert rc == 0
    return json.loads(out.read_text())


def by_hand_agreement(outs, full_outs):
    same = total = 0
    for o, f in zip(outs, full_outs):
        a, b = o.token_ids, f.token_ids
        total += max(len(a), len(b))
        same += sum(1 for j in range(min(len(a), len(b))) if a[j] == b[j])
    return same / total


# ---- ROUGE-L ---------------------------------------------------------------------------------
@pytest.mark.parametrize("candidate, reference, expected", [
    ("a b c d", "a b c d", 1.0),
    ("a b c d", "a c d e", 0.75),                 # LCS a c d: P = R = 3/4
    ("the cat sat", "the cat sat on the mat", 2 / 3),  # LCS 3: P = 1, R = 1/2, F1 = 2/3
    ("x y", "p q r", 0.0),
    ("b a", "a b", 0.5),                          # LCS 1 of 2 and 2
    ("x = f(a)", "x == f[a]", 1 / 3),             # code: punctuation and case are kept
    ("Return x", "return x", 0.5),
    ("", "", 1.0),                                # two empty outputs are the same output
    ("", "a b", 0.0),
    ("a\n  b\tc", "a b c", 1.0),                  # whitespace only separates tokens
])
def test_rouge_l_known_values(candidate, reference, expected):
    assert rouge_l(candidate, reference) == pytest.approx(expected)


def test_rouge_l_names_bad_arguments():
    with pytest.raises(TypeError, match="rouge_l"):
        rouge_l(["a"], "a")


# ---- agreement by definition ------------------------------------------------------------------
def _out(ids, text="", layers=None):
    return RequestOutput(prompt=None, prompt_token_ids=[1], text=text, token_ids=ids,
                         exit_layers=layers or [2] * len(ids), logprobs=None, finish_reason="length")


def test_compare_outputs_by_hand():
    outs = [_out([5, 6, 7], "a b c", [2, 1, 1]), _out([1, 2], "x y", [2, 2]), _out([], "")]
    full = [_out([5, 9, 7], "a q c"), _out([1, 2, 3, 4], "x y z w"), _out([], "")]
    assert token_matches([5, 6, 7], [5, 9, 7]) == (2, 3)
    r = compare_outputs(outs, full, num_layers=2, references=["a b c", None, None])
    assert r["token_agreement"] == pytest.approx((2 + 2 + 0) / (3 + 4 + 0))
    assert r["exact_match"] == pytest.approx(1 / 3)  # only the two empty outputs match exactly
    assert r["early_exit_rate"] == pytest.approx(2 / 3)  # decoded tokens 1, 1, 2: the prefill's left out
    assert r["mean_layers_per_token"] == pytest.approx(4 / 3)
    assert r["rouge_l_to_full"] == pytest.approx((2 / 3 + 2 * 1 * 0.5 / 1.5 + 1.0) / 3)
    assert r["rouge_l_to_reference"] == 1.0 and r["full_rouge_l_to_reference"] == pytest.approx(2 / 3)
    assert [o["exact_match"] for o in r["outputs"]] == [False, False, True]


# ---- the CLI on a tiny model -------------------------------------------------------------------
def test_full_depth_against_itself(tiny, prompt_file, tmp_path):
    plot = tmp_path / "plots" / "eval.png"
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--plot", str(plot))
    assert TOP_FIELDS <= set(data) and data["num_layers"] == 2 and data["prompts"]["count"] == len(PROMPTS)
    assert data["sampling"]["temperature"] == 0.0  # greedy by default
    (row,) = data["rows"]
    assert ROW_FIELDS <= set(row)
    assert row["label"] == "full depth" and row["strategy"]["kind"] == "full_depth"
    assert row["token_agreement"] == 1.0 and row["exact_match"] == 1.0 and row["rouge_l_to_full"] == 1.0
    assert row["early_exit_rate"] == 0.0 and row["mean_layers_per_token"] == 2.0
    assert row["rouge_l_to_reference"] is None  # a text file has no references
    assert len(row["seconds"]) == len(row["full_seconds"]) == 2 and row["speedup"] > 0
    assert len(row["outputs"]) == len(PROMPTS)
    assert plot.is_file() and plot.stat().st_size > 0


def test_static_exit_against_generate_by_hand(tiny, prompt_file, tmp_path):
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--ignore-eos",
                    "--early-exit", "static", "--exit-layer", "1")
    (row,) = data["rows"]
    assert row["label"] == "static E=1"
    assert row["early_exit_rate"] == 1.0 and row["mean_layers_per_token"] == 1.0

    params = greedy(8)
    full = eecore.LLM(tiny, device="cpu").generate(PROMPTS, params)
    static = eecore.LLM(tiny, device="cpu", early_exit=eecore.EarlyExitConfig(measure="static", exit_layer=1)
                        ).generate(PROMPTS, params)
    expected = by_hand_agreement(static, full)
    assert expected < 1.0  # one layer of a random model does not write what two write
    assert row["token_agreement"] == pytest.approx(expected)
    assert row["exact_match"] == pytest.approx(sum(s.token_ids == f.token_ids for s, f in zip(static, full)) / 4)
    assert [o["text"] for o in row["outputs"]] == [s.text for s in static]
    assert [o["full_text"] for o in row["outputs"]] == [f.text for f in full]
    assert row["rouge_l_to_full"] == pytest.approx(sum(rouge_l(s.text, f.text) for s, f in zip(static, full)) / 4)


def test_self_speculation_row_matches_full_depth(tiny, prompt_file, tmp_path):
    # greedy self-speculation writes exactly the full model's tokens (docs/architecture.md)
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--speculate", "--exit-layer", "1",
                    "--num-speculations", "2")
    (row,) = data["rows"]
    assert row["label"] == "speculate layer E=1 d=2" and row["strategy"]["kind"] == "speculative"
    assert row["token_agreement"] == 1.0 and row["exact_match"] == 1.0
    assert "acceptance_rate" in row["strategy_metrics"]


def test_speculation_settings_name_the_row(tiny, prompt_file, tmp_path):
    """The label carries the settings that tell sweep rows apart. With exit_threshold 1 nothing exits,
    so the verified drafts give full depth's output."""
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--speculate", "--exit-layer", "1",
                    "--num-speculations", "2", "--draft-threshold", "0", "--exit-threshold", "1")
    (row,) = data["rows"]
    assert row["label"] == "speculate layer E=1 d=2 t=0 exit=1"
    assert row["exact_match"] == 1.0 and row["early_exit_rate"] == 0.0


def test_threshold_sweep_gives_one_row_each(tiny, prompt_file, tmp_path):
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--early-exit", "softmax",
                    "--sweep-threshold", "0.0", "1.0", "--batch-rule", "compact")
    assert [r["label"] for r in data["rows"]] == ["softmax t=0 compact", "softmax t=1 compact"]
    assert [r["strategy"]["threshold"] for r in data["rows"]] == [0.0, 1.0]
    # a top-2 gap is never > 1: threshold 1 never exits, so it is full depth
    assert data["rows"][1]["early_exit_rate"] == 0.0 and data["rows"][1]["token_agreement"] == 1.0


def test_references_from_jsonl(tiny, tmp_path):
    full = eecore.LLM(tiny, device="cpu").generate(PROMPTS[:2], eecore.SamplingParams(max_tokens=8))
    path = tmp_path / "set.jsonl"
    lines = [{"prompt": PROMPTS[0], "reference": full[0].text},   # full depth's own output: 1.0
             {"prompt": PROMPTS[1], "reference": "completely different words here"},
             {"prompt": PROMPTS[2]}]                                # no reference: not in the means
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    data = run_eval(tiny, tmp_path, "--prompts", str(path), "--chat", "off", "--early-exit", "static",
                    "--exit-layer", "1")
    assert data["prompts"]["with_references"] == 2
    (row,) = data["rows"]
    outs = row["outputs"]
    assert outs[0]["full_rouge_l_to_reference"] == 1.0
    assert "reference" not in outs[2]
    expected = [rouge_l(o["text"], x["reference"]) for o, x in zip(outs, lines[:2])]
    assert [o["rouge_l_to_reference"] for o in outs[:2]] == pytest.approx(expected)
    assert row["rouge_l_to_reference"] == pytest.approx(sum(expected) / 2)
    assert row["full_rouge_l_to_reference"] == pytest.approx(
        (1.0 + rouge_l(full[1].text, lines[1]["reference"])) / 2)


def test_num_prompts_takes_the_first(tiny, prompt_file, tmp_path):
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--num-prompts", "2", "--repeats", "1")
    assert data["prompts"]["count"] == 2 and len(data["rows"][0]["outputs"]) == 2
    assert data["prompts"]["chat"] == "auto"  # a file's prompts go through the tiny model's template


# ---- prompt files and their errors -------------------------------------------------------------
def test_read_prompt_file_formats(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("  indented prompt\n\nsecond\n", encoding="utf-8")
    assert read_prompt_file(str(text)) == [EvalPrompt("  indented prompt"), EvalPrompt("second")]
    jsonl = tmp_path / "p.data"  # not .jsonl: told apart by its first line
    jsonl.write_text('{"prompt": "a", "reference": "b"}\n\n{"prompt": "c"}\n', encoding="utf-8")
    assert read_prompt_file(str(jsonl)) == [EvalPrompt("a", "b"), EvalPrompt("c")]


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": oops}\n', r"'.*bad\.jsonl' line 2 is not valid JSON"),
    ("noprompt.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n', r"noprompt\.jsonl' line 3 must have a non-empty string"),
    ("list.jsonl", '["a"]\n', r"list\.jsonl' line 1 must be a JSON object"),
    ("ref.jsonl", '{"prompt": "a", "reference": 3}\n', r"ref\.jsonl' line 1: \"reference\" must be a string"),
    ("empty.txt", "\n  \n", r"empty\.txt' holds no prompts"),
])
def test_prompt_file_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(PromptFileError, match=message):
        read_prompt_file(str(path))


def test_missing_prompt_file(tmp_path):
    with pytest.raises(PromptFileError, match=r"'.*nowhere\.txt' does not exist"):
        read_prompt_file(str(tmp_path / "nowhere.txt"))


def test_cli_prompt_errors_are_messages(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n', encoding="utf-8")
    with pytest.raises(SystemExit, match=r"eecore eval: --prompts: prompt file '.*bad\.jsonl' line 2"):
        cli.main(["eval", "--model", tiny, "--device", "cpu", "--prompts", str(bad)])
    long = tmp_path / "long.txt"
    long.write_text("word " * 600 + "\n", encoding="utf-8")  # past the tiny model's 512 positions
    with pytest.raises(SystemExit, match=r"--prompts .*long\.txt: prompt 0: .* tokens do not fit"):
        cli.main(["eval", "--model", tiny, "--device", "cpu", "--prompts", str(long), "--chat", "off"])
    with pytest.raises(SystemExit, match="--num-prompts must be >= 1"):
        cli.main(["eval", "--model", tiny, "--prompts", str(bad), "--num-prompts", "0"])


@pytest.mark.parametrize("flags, message", [
    (["--sweep-threshold", "0.5"], "--sweep-threshold needs --early-exit softmax"),
    (["--early-exit", "softmax", "--sweep-exit-layer", "1"], "--sweep-exit-layer needs --early-exit static"),
    (["--early-exit", "static", "--exit-layer", "5"], "static E=5: .*exit_layer"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--early-exit", "static", "--sweep-exit-layer", "1", "--sweep-threshold", "0.5"], "do not combine"),
    (["--speculate", "--draft-layers", "separate", "--sweep-exit-layer", "1", "2"], "speculate layer E=2 .*exit_layer"),
    (["--early-exit", "softmax", "--speculate", "--exit-layer", "1"], "eecore eval: choose --early-exit or --speculate"),
    (["--early-exit", "softmax", "--threshold", "2.5"], "eecore eval: EarlyExitConfig: 'threshold' must be"),
])
def test_cli_bad_strategy_flags(tiny, prompt_file, flags, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["eval", "--model", tiny, "--device", "cpu", "--prompts", prompt_file, *flags])


def test_cli_exits_nonzero_with_a_message(tmp_path):
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run([sys.executable, "-m", "eecore.cli", "eval", "--prompts", str(missing)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, TQDM_DISABLE="1"))
    assert proc.returncode != 0
    assert "missing.jsonl' does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_builtin_code_set_has_no_references():
    items, builtin = load_prompt_set("code", 2)
    assert builtin and len(items) == 2 and all(i.reference is None for i in items)
    with pytest.raises(PromptFileError, match="positive int"):
        load_prompt_set("code", 0)


def test_builtin_instructions_are_chat_messages_from_the_heldout_packages():
    from eecore.evaluation.prompt_sets import chat_mode
    from eecore.sources.chat_prompts import chat_instruction_records
    from eecore.sources.corpus import DEFAULT_HELDOUT_PACKAGES, build_corpus

    items, builtin = load_prompt_set("instructions", 3)
    expected = chat_instruction_records(3, build_corpus((), DEFAULT_HELDOUT_PACKAGES).heldout)
    assert builtin and [i.prompt for i in items] == [r.text for r in expected] and len(items) == 3
    assert all(i.reference is None for i in items)
    # --chat auto wraps these in the chat template, never the completion sets; on / off are obeyed
    assert chat_mode("instructions", True, "auto") == "on" and chat_mode("code", True, "auto") == "off"
    assert chat_mode("prompts.txt", False, "auto") == "auto" and chat_mode("instructions", True, "off") == "off"


def test_builtin_everyday_set_covers_the_heldout_topics_and_every_form():
    from eecore.evaluation.prompt_sets import chat_mode
    from eecore.sources.general_chat_prompts import HELDOUT_TOPICS, TEMPLATES, heldout_requests

    items, builtin = load_prompt_set("everyday", 24)
    records = heldout_requests(24)
    assert builtin and [i.prompt for i in items] == [r.text for r in records]
    assert {r.topic for r in records} == set(HELDOUT_TOPICS) and {r.kind for r in records} == {k for k, _ in TEMPLATES}
    assert len({i.prompt for i in items}) == 24 and all(i.reference is None for i in items)
    assert len(heldout_requests(10 ** 6)) == len(HELDOUT_TOPICS) * len(TEMPLATES)
    assert chat_mode("everyday", True, "auto") == "on"
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        heldout_requests(-1)


# ---- exit adapters -----------------------------------------------------------------------------
def test_exit_adapter_rows(tiny, prompt_file, tmp_path):
    """`--exit-adapter FILE` reaches both kinds of strategy: a static exit at an adapter layer reads
    through it, and self-speculation drafting through it still writes full depth's tokens."""
    import numpy as np

    from eecore.train.exit_adapter import AdapterTrainConfig, frequent_tokens, train

    llm = eecore.LLM(tiny, dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=32,
                     max_model_len=17)
    tokens = (np.random.default_rng(0).zipf(1.3, 2000) % 320).astype(np.int32)
    config = AdapterTrainConfig(exit_layers=(1,), adapter_hidden=8, draft_vocab=32, seq_len=16, batch_size=2,
                                steps=2, lr=1e-2, warmup=1, seed=0)
    adapters = train(llm, tokens, config, vocab=frequent_tokens(tokens, 320, 32, (2,))).adapters({"test": True})
    path = str(tmp_path / "adapters.safetensors")
    adapters.save(path)
    del llm

    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--exit-adapter", path,
                    "--early-exit", "static", "--exit-layer", "1", "--repeats", "1")
    (row,) = data["rows"]
    assert row["label"] == "static E=1 +adapter" and data["exit_adapter"] == path
    assert row["early_exit_rate"] == 1.0 and row["mean_layers_per_token"] == 1.0
    data = run_eval(tiny, tmp_path, "--prompts", prompt_file, "--chat", "off", "--exit-adapter", path,
                    "--speculate", "--exit-layer", "1", "--repeats", "1")
    (row,) = data["rows"]
    assert row["label"] == "speculate layer E=1 d=4 +adapter"
    assert row["token_agreement"] == 1.0 and row["exact_match"] == 1.0


def test_separate_draft_layer_rows(tmp_path):
    """Separate draft layers: each row loads the model with its configuration, the exit-ready file's
    LoRA pairs go into the draft copy alone, and the row's full depth is the original model, which
    the drafts' verification reproduces exactly. The row's acceptance is what the same LLM gives by
    hand."""
    from eecore.models.exit_adapter import ExitAdapters, model_fingerprint
    from model_factory import make_peaked_tiny_model, random_lora

    path, hf = make_peaked_tiny_model(tmp_path / "model", num_layers=3)
    path = str(path)
    plain = eecore.LLM(path, dtype="float32", device="cpu")
    file = str(tmp_path / "draft.safetensors")
    ExitAdapters({}, None, model_fingerprint(plain.model), {}, random_lora(hf, seed=3)).save(file)
    prompts = PROMPTS[:3]
    full = [o.token_ids for o in plain.generate(prompts, greedy(8))]
    merged = eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file).generate(prompts, greedy(8))
    assert [o.token_ids for o in merged] != full  # the pairs change the model they are merged into
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    data = run_eval(path, tmp_path, "--prompts", str(prompt_file), "--chat", "off", "--exit-adapter", file,
                    "--speculate", "--draft-layers", "separate", "--draft-dtype", "int8", "--num-speculations", "2",
                    "--sweep-exit-layer", "1", "2", "--repeats", "1")
    assert [r["label"] for r in data["rows"]] == [f"speculate layer E={e} d=2 separate int8 +adapter" for e in (1, 2)]
    for e, row in zip((1, 2), data["rows"]):
        layer = row["strategy"]["layer"]  # the config's parts as JSON objects
        assert layer["copy"] == {"dtype": "int8", "top_k": 1} and layer["exit_layer"] == e
        assert row["exact_match"] == 1.0 and row["token_agreement"] == 1.0
        assert [r["full_text"] for r in row["outputs"]] == [plain.tokenizer.decode(t) for t in full]
        by_hand = eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file,
                             speculative=eecore.SelfSpeculativeConfig(
                                 num_speculations=2,
                                 layer=eecore.LayerDrafts(exit_layer=e, copy=eecore.DraftCopy(dtype="int8"))))
        outs = by_hand.generate(prompts, greedy(8))
        expected = sum(o.metrics["acceptance_rate"] for o in outs) / len(outs)
        assert row["strategy_metrics"]["acceptance_rate"] == pytest.approx(expected)
        assert row["strategy_metrics"]["num_drafted_tokens"] > 0


def test_builtin_prose_set_end_to_end(tiny, tmp_path):
    data = run_eval(tiny, tmp_path, "--prompts", "prose", "--num-prompts", "2", "--repeats", "1")
    assert data["prompts"] == dict(source="prose", count=2, chat="off", with_references=2)  # completions: no template
    assert data["rows"][0]["rouge_l_to_reference"] is not None


def test_plot_without_matplotlib_names_the_extra_before_running(tiny, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib: pip install 'eecore\[plot\]'"):
        cli.main(["eval", "--model", tiny, "--device", "cpu", "--plot", str(tmp_path / "r.png")])


def test_training_entry_points_name_their_extra(monkeypatch):
    import importlib.util

    from eecore.train import exit_ready, layerskip

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("peft", "transformers") else
                        find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"needs transformers: pip install 'eecore\[train\]'"):
        layerskip.main(["--model", "x", "--data", "y", "--out", "z"])
    with pytest.raises(SystemExit, match=r"needs transformers: pip install 'eecore\[train\]'"):
        exit_ready.main(["--corpus", "x"])
