"""eecore.sources.general_chat_prompts: everyday chat requests from a topic list, templated and
written by the model itself."""
from __future__ import annotations

import pytest

import eecore
from eecore.cli import BENCH_PROMPTS
from eecore.sources import general_chat_prompts as gcp
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("gcp"), num_layers=2, vocab_size=320, hidden_size=64)
    return eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=8)


def test_the_bench_prompts_topics_are_held_out():
    """No training request is a bench prompt or names a held-out topic, so the CLI's bench prompts
    measure drafts on topics they never saw."""
    train = [r.text.lower() for v in gcp.templated_instructions("train").values() for r in v]
    assert not set(gcp.TRAIN_TOPICS) & set(gcp.HELDOUT_TOPICS)
    assert not {p.lower() for p in BENCH_PROMPTS} & set(train)
    for topic in gcp.HELDOUT_TOPICS:
        assert not any(topic.lower() in text for text in train), topic
    for word in ("sea", "sky", "water cycle", "vaccine", "romeo", "programming languages", "readable code"):
        assert any(word in t.lower() for t in gcp.HELDOUT_TOPICS), word


def test_templated_requests_fill_every_form_with_every_topic():
    grouped = gcp.templated_instructions("heldout")
    assert list(grouped) == list(gcp.HELDOUT_TOPICS)
    for topic, requests in grouped.items():
        assert [r.kind for r in requests] == [k for k, _ in gcp.TEMPLATES]
        assert all(topic in r.text and r.topic == topic for r in requests)
    with pytest.raises(ValueError, match="split must be 'train' or 'heldout', got 'test'"):
        gcp.templated_instructions("test")


@pytest.mark.parametrize("raw, clean", [
    ('A curious person might ask, "What makes chocolate so delicious?"', "What makes chocolate so delicious?"),
    ('What a delightful topic! A curious person might ask: "Which breed is your favorite?"',
     "Which breed is your favorite?"),
    ("Which part of the bee do you find most interesting?\nMore text.",
     "Which part of the bee do you find most interesting?"),
    ("What an intriguing topic! why do owls hunt at night?", "Why do owls hunt at night?"),
    ("Question: how tall can a sunflower grow?", "How tall can a sunflower grow?"),
    ("What would be the best question for a curious person to ask?", None),   # about the question itself
    ("I'm a helpful AI named SmolLM, designed to help. What would you ask?", None),
    ("The answer is quite intriguing.", None),                                 # not a question
    ("Why?", None),                                                            # too short
    ("What is 🌋 made of?", None),                                             # not plain English punctuation
    ("", None),
])
def test_clean_request(raw, clean):
    assert gcp.clean_request(raw) == clean


def test_asked_requests_repeat_and_pass_the_filter(llm, monkeypatch):
    """Model-written requests are sampled with a seed each, so two runs give the same ones, and every
    kept one is what clean_request makes of the model's text for that seed."""
    monkeypatch.setattr(gcp, "TRAIN_TOPICS", ("bees", "tea"))
    seen = []
    monkeypatch.setattr(gcp, "clean_request", lambda text: seen.append(text) or f"Is {len(seen)} fine?")
    first = gcp.asked_instructions(llm, "train", 3, max_tokens=6)
    texts = list(seen)
    seen.clear()
    assert gcp.asked_instructions(llm, "train", 3, max_tokens=6) == first and seen == texts
    assert len(texts) == 6 and len(set(texts)) > 1                   # seeds differ within a topic
    assert {t: [r.text for r in v] for t, v in first.items()} == {
        "bees": ["Is 1 fine?", "Is 2 fine?", "Is 3 fine?"], "tea": ["Is 4 fine?", "Is 5 fine?", "Is 6 fine?"]}
    assert [s for _, s in gcp.ask_prompts("train", 3)] == [0, 1, 2, 1000, 1001, 1002]
    assert not set(s for _, s in gcp.ask_prompts("heldout", 3)) & set(range(10 ** 6))


def test_records_mix_asked_and_templated_requests_topic_by_topic(llm, monkeypatch):
    monkeypatch.setattr(gcp, "TRAIN_TOPICS", ("bees", "tea"))
    monkeypatch.setattr(gcp, "asked_instructions",
                        lambda llm, split, k: {"tea": [gcp.GeneralInstruction("tea", "asked", "Why is tea hot?")]})
    records = gcp.general_instruction_records(100, "train", llm, asked_per_topic=1)
    assert len(records) == 2 * len(gcp.TEMPLATES) + 1
    assert [r.topic for r in records[:4]] == ["bees", "tea", "bees", "tea"]
    assert records[1].text == "Why is tea hot?"
    assert len(gcp.general_instruction_records(5, "train")) == 5
    with pytest.raises(ValueError, match="asked_per_topic needs the llm"):
        gcp.general_instruction_records(5, "train", asked_per_topic=1)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        gcp.general_instruction_records(-1, "train")
    with pytest.raises(ValueError, match=r"per_topic must be an int in \[0, 1000\], got -2"):
        gcp.ask_prompts("train", -2)
    with pytest.raises(ValueError, match="per_topic must be an int in"):
        gcp.ask_prompts("train", 1001)  # its seeds would meet the next topic's


def test_asked_requests_need_a_chat_template(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="needs a chat template"):
        gcp.asked_instructions(llm, "train", 1)
