"""eecore.train.generated_corpus: code prompts and chat instructions followed by the model's own
continuations, greedy or sampled."""
from __future__ import annotations

import json

import pytest

import eecore
from eecore.sources.corpus import FILE_SEPARATOR, CorpusFile
from eecore.train.generated_corpus import write_generated_corpus
from model_factory import make_tiny_hf_model

CODE = '''
import os

DEFAULT_NAME = "report"


def {name}(folder, suffix=".txt", limit=10):
    """Collect the names of the files in folder that end with suffix, at most limit of them,
    sorted by name so that the answer is the same on every machine."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(suffix))
    return names[:limit]
'''


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("gen"), num_layers=2, vocab_size=320, hidden_size=64)
    return eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=4)


def test_samples_are_prompts_with_the_models_greedy_continuations(llm, tmp_path):
    train = [CorpusFile("pkg_a", "a.py", CODE.format(name="list_reports"), "0"),
             CorpusFile("pkg_b", "b.py", CODE.format(name="find_logs"), "1")]
    held = [CorpusFile("pkg_h", "h.py", CODE.format(name="held_out_names"), "2")]
    manifest = write_generated_corpus(llm, str(tmp_path), train_files=train, heldout_files=held,
                                      train_prompts=2, heldout_prompts=1, max_tokens=6, versions={"pkg_a": "1.0"})
    assert manifest["train"]["prompts"] == 2 and manifest["heldout"]["packages"] == ["pkg_h"]
    assert json.load(open(tmp_path / "manifest.json")) == manifest and manifest["max_tokens"] == 6
    for split, names in (("train", ["list_reports", "find_logs"]), ("heldout", ["held_out_names"])):
        samples = (tmp_path / f"{split}.txt").read_text().split(FILE_SEPARATOR)
        assert len(samples) == len(names)
        for sample, name in zip(samples, names):
            prompt = sample[:sample.index('machine."""') + len('machine."""')]  # a prompt ends with its docstring
            assert f"def {name}(" in prompt
            out = llm.generate([prompt], eecore.SamplingParams(temperature=0.0, max_tokens=6))[0]
            assert len(out.token_ids) == 6 and sample == prompt + out.text


def test_temperatures_cycle_over_each_split_with_seeded_samples(llm, tmp_path):
    """temperatures=(0, 1): a split's even prompts continued greedily, its odd ones sampled at 1 with
    the prompt's index as seed, so the corpus is the same on every run."""
    train = [CorpusFile(f"pkg_{c}", f"{c}.py", CODE.format(name=f"list_{c}"), "0") for c in "abc"]
    held = [CorpusFile("pkg_h", "h.py", CODE.format(name="held_out_names"), "2")]
    manifest = write_generated_corpus(llm, str(tmp_path), train_files=train, heldout_files=held, train_prompts=3,
                                      heldout_prompts=1, max_tokens=8, temperatures=(0.0, 1.0))
    assert manifest["temperatures"] == [0.0, 1.0] and manifest["kind"].startswith("greedy and sampled")
    samples = (tmp_path / "train.txt").read_text().split(FILE_SEPARATOR)
    assert len(samples) == 3
    for i, sample in enumerate(samples):
        prompt = sample[:sample.index('machine."""') + len('machine."""')]
        params = eecore.SamplingParams(temperature=float(i % 2), seed=i, max_tokens=8)
        assert sample == prompt + llm.generate([prompt], params)[0].text
    greedy_sample = samples[1][:samples[1].index('machine."""') + len('machine."""')]
    greedy = llm.generate([greedy_sample], eecore.SamplingParams(temperature=0.0, max_tokens=8))[0].text
    assert samples[1] != greedy_sample + greedy  # the sampled one is not the greedy text (tiny random model)
    for bad in ((), (-0.5,), (0.0, float("nan"))):
        with pytest.raises(ValueError, match="temperatures must be one or more numbers >= 0"):
            write_generated_corpus(llm, str(tmp_path), train_files=train, heldout_files=held, train_prompts=1,
                                   heldout_prompts=1, temperatures=bad)


def test_chat_instructions_are_answered_in_the_chat_template(llm, tmp_path):
    """Chat samples are the instruction in the model's chat template, then its greedy answer, closed
    with the end-of-turn token when the answer ended there; interleaved with the code samples."""
    from eecore.sources.chat_prompts import chat_instruction_records

    train = [CorpusFile("pkg_a", "a.py", CODE.format(name="list_reports"), "0"),
             CorpusFile("pkg_b", "b.py", CODE.format(name="find_logs"), "1")]
    held = [CorpusFile("pkg_h", "h.py", CODE.format(name="held_out_names"), "2")]
    manifest = write_generated_corpus(llm, str(tmp_path), train_files=train, heldout_files=held, train_prompts=2,
                                      heldout_prompts=0, chat_train_prompts=2, chat_heldout_prompts=1, max_tokens=6)
    assert manifest["train"]["prompts"] == 4 and manifest["train"]["chat_prompts"] == 2
    assert manifest["heldout"]["prompts"] == manifest["heldout"]["chat_prompts"] == 1
    samples = (tmp_path / "train.txt").read_text().split(FILE_SEPARATOR)
    chat = [s for s in samples if s.startswith("<|im_start|>")]
    assert len(chat) == 2 and samples.index(chat[0]) < 2  # interleaved: not all code first
    for sample, instruction in zip(chat, chat_instruction_records(2, train)):
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": instruction.text}])
        out = llm.generate([prompt], eecore.SamplingParams(temperature=0.0, max_tokens=6))[0]
        closed = llm.tokenizer.eos_token if out.finish_reason == "stop" else ""
        assert sample == prompt + out.text + closed
    with pytest.raises(ValueError, match="the heldout split needs at least one prompt"):
        write_generated_corpus(llm, str(tmp_path), train_files=train, heldout_files=held, train_prompts=1,
                               heldout_prompts=0)


def test_an_empty_split_is_refused_before_the_model_writes_anything(llm, tmp_path, monkeypatch):
    """The split counts are checked first: asking the model for requests (asked_per_topic) took a
    quarter of an hour on 2 cores before an empty held-out split was refused."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model ran before the arguments were checked")
    monkeypatch.setattr(llm, "generate", no_model)
    with pytest.raises(ValueError, match="the heldout split needs at least one prompt"):
        write_generated_corpus(llm, str(tmp_path), train_files=[], heldout_files=[], train_prompts=0,
                               heldout_prompts=0, general_train_prompts=5, asked_per_topic=2)


def test_chat_instructions_need_a_chat_template(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    files = [CorpusFile("pkg_a", "a.py", CODE.format(name="list_reports"), "0")]
    with pytest.raises(ValueError, match="chat prompts need a model with a chat template"):
        write_generated_corpus(llm, str(tmp_path), train_files=files, heldout_files=files, train_prompts=0,
                               heldout_prompts=1, chat_train_prompts=1)


def test_the_clock_cuts_the_train_split_between_chunks(llm, tmp_path):
    """With stop_at, chunks of train prompts run until the clock reaches it; the held-out split is
    whole whatever the clock says, and the train split is the first chunks' samples, as an unstopped
    run writes them, with the stop in the manifest."""
    files = [CorpusFile(f"pkg_{i}", "a.py", CODE.format(name=f"fn_{i}"), str(i)) for i in range(5)]
    held = [CorpusFile("pkg_h", "h.py", CODE.format(name="held_out_names"), "h")]
    args = dict(train_files=files, heldout_files=held, train_prompts=5, heldout_prompts=1, max_tokens=4)
    full = write_generated_corpus(llm, str(tmp_path / "full"), **args)
    full_train = (tmp_path / "full" / "train.txt").read_text().split(FILE_SEPARATOR)
    assert full["train"]["prompts"] == 5 and "stopped_by_clock" not in full["train"]
    # the clock is read after each chunk: 0.5 after the first (go on), 2.0 after the second (stop)
    ticks = iter([0.5, 2.0])
    cut = write_generated_corpus(llm, str(tmp_path / "cut"), **args, stop_at=1.0, chunk_prompts=2,
                                 clock=lambda: next(ticks))
    assert cut["train"]["prompts"] == 4 and cut["train"]["stopped_by_clock"] == {"prompts_asked": 5}
    assert cut["train"]["packages"] == ["pkg_0", "pkg_1", "pkg_2", "pkg_3"]
    assert (tmp_path / "cut" / "train.txt").read_text().split(FILE_SEPARATOR) == full_train[:4]
    assert cut["heldout"] == full["heldout"]
    assert (tmp_path / "cut" / "heldout.txt").read_text() == (tmp_path / "full" / "heldout.txt").read_text()
    # a clock already past the stop still runs the held-out split and the first chunk
    late = write_generated_corpus(llm, str(tmp_path / "late"), **args, stop_at=0.0, chunk_prompts=2, clock=lambda: 5.0)
    assert late["train"]["prompts"] == 2 and late["heldout"] == full["heldout"]
    assert (tmp_path / "late" / "train.txt").read_text().split(FILE_SEPARATOR) == full_train[:2]


def test_the_folder_trains_draft_layers(tmp_path):
    """The folder is a corpus the trainer runs on to the end and exports from (its manifest has
    the keys the trainer records)."""
    from eecore.models.exit_adapter import ExitAdapters
    from eecore.train.exit_ready import main

    path, _ = make_tiny_hf_model(tmp_path / "model", num_layers=2, vocab_size=320, hidden_size=64)
    llm = eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=4)
    files = [CorpusFile(f"pkg_{i}", "a.py", CODE.format(name=f"fn_{i}"), str(i)) for i in range(3)]
    write_generated_corpus(llm, str(tmp_path / "gen"), train_files=files[:2], heldout_files=files[2:],
                           train_prompts=2, heldout_prompts=1, max_tokens=24, versions={"pkg_0": "1.0"})
    out = str(tmp_path / "draft.safetensors")
    assert main(["--corpus", str(tmp_path / "gen"), "--out", out, "--checkpoint-dir", str(tmp_path / "ck"),
                 "--model", path, "--exit-layers", "1", "--draft-only", "--adapter-hidden", "8", "--lora-rank", "2",
                 "--draft-vocab", "40", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--warmup", "0",
                 "--device", "cpu"]) == 0
    assert ExitAdapters.load(out).info["corpus"]["versions"] == {"pkg_0": "1.0"}


def test_files_without_a_code_prompt_are_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="the train files hold no usable code prompt"):
        write_generated_corpus(llm, str(tmp_path), train_files=[CorpusFile("p", "a.py", "x = 1\n", "0")],
                               heldout_files=[], train_prompts=1, heldout_prompts=1)
    with pytest.raises(ValueError, match="chunk_prompts must be >= 1"):
        write_generated_corpus(llm, str(tmp_path), train_files=[], heldout_files=[], train_prompts=1,
                               heldout_prompts=1, chunk_prompts=0)
    with pytest.raises(ValueError, match="chat_train_prompts must be >= 0"):
        write_generated_corpus(llm, str(tmp_path), train_files=[], heldout_files=[], train_prompts=1,
                               heldout_prompts=1, chat_train_prompts=-1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        write_generated_corpus(llm, str(tmp_path), train_files=[], heldout_files=[], train_prompts=1,
                               heldout_prompts=1, max_tokens=0)


def test_the_command_refuses_a_stop_that_is_not_positive(capsys):
    from eecore.train.generated_corpus import main

    with pytest.raises(SystemExit) as stop:
        main(["--out", "unused", "--stop-after-minutes", "0"])
    assert stop.value.code == 2 and "--stop-after-minutes must be > 0, got 0.0" in capsys.readouterr().err


def test_everyday_requests_are_answered_in_the_chat_template(llm, tmp_path, monkeypatch):
    """General requests (eecore.sources.general_chat_prompts) of each split are answered like the
    technical ones, counted apart in the manifest, and interleaved with the code samples."""
    from eecore.sources import general_chat_prompts as gcp

    monkeypatch.setattr(gcp, "TRAIN_TOPICS", ("bees", "tea"))
    monkeypatch.setattr(gcp, "HELDOUT_TOPICS", ("owls",))
    train = [CorpusFile("pkg_a", "a.py", CODE.format(name="list_reports"), "0")]
    held = [CorpusFile("pkg_h", "h.py", CODE.format(name="held_out_names"), "2")]
    manifest = write_generated_corpus(llm, str(tmp_path), train_files=train, heldout_files=held, train_prompts=1,
                                      heldout_prompts=0, general_train_prompts=3, general_heldout_prompts=2,
                                      max_tokens=5)
    assert manifest["train"]["general_prompts"] == manifest["train"]["chat_prompts"] == 3
    assert manifest["train"]["packages"] == ["pkg_a"] and manifest["heldout"]["packages"] == []
    assert manifest["heldout"]["general_prompts"] == 2
    for split, n in (("train", 3), ("heldout", 2)):
        samples = [s for s in (tmp_path / f"{split}.txt").read_text().split(FILE_SEPARATOR)
                   if s.startswith("<|im_start|>")]
        for sample, request in zip(samples, gcp.general_instruction_records(n, split), strict=True):
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": request.text}])
            out = llm.generate([prompt], eecore.SamplingParams(temperature=0.0, max_tokens=5))[0]
            assert sample == prompt + out.text + (llm.tokenizer.eos_token if out.finish_reason == "stop" else "")
    assert "owls" in (tmp_path / "heldout.txt").read_text() and "owls" not in (tmp_path / "train.txt").read_text()
