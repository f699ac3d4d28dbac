"""General chat requests (a poem, tips, why the sky is blue), for on-policy data of a chat model.

`eecore.sources.chat_prompts` makes technical requests from the installed packages; drafts trained on
their answers got better on technical chat (0.53 -> 0.68 acceptance) and not at all on everyday
requests (0.27 -> 0.28 on the CLI's bench prompts), because nothing installed reads like them. No
chat dataset is on this machine and the tests never download one, so this module makes everyday
requests from a hand-written list of topics, two ways:

- "templated": fixed request forms (a short poem, three tips, an explanation for a child, ...)
  filled in with a topic: deterministic, no model needed;
- "asked":     the model itself writes a question about a topic (sampled with a fixed seed per
  request, so a run repeats), kept only when it passes `clean_request`'s checks: a small model's
  self-written requests are otherwise noise about half the time.

What drafting learns from is the answers, which the original model writes (greedy); the requests
only have to lead it into its everyday register. The topics of the CLI's bench prompts (and a few
more) are held out, so that those prompts measure drafts on topics they never saw.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from eecore.sources.descriptions import balanced_picks

TRAIN_TOPICS = (
    "autumn leaves", "baking bread", "bees", "bicycles", "birthday parties", "black holes", "board games",
    "bridges", "butterflies", "camping", "cats", "chess", "chocolate", "city parks", "climate change",
    "clouds", "coffee", "coral reefs", "dinosaurs", "dogs", "dreams", "earthquakes", "electric cars",
    "elephants", "email etiquette", "exercise", "farming", "first aid", "fishing", "forests",
    "friendship", "gardening", "glaciers", "gravity", "hiking", "honey", "hot air balloons",
    "houseplants", "ice cream", "insomnia", "jazz", "job interviews", "kindness", "kites",
    "learning a new language", "libraries", "lighthouses", "magnets", "maps", "marathons",
    "meditation", "memory", "microscopes", "migrating birds", "money saving", "moon landings",
    "mountains", "museums", "mushrooms", "neighbors", "night sky", "octopuses", "olympic games",
    "owls", "painting", "pandas", "paper making", "penguins", "photography", "pizza", "planets",
    "plastic recycling", "pottery", "public speaking", "pyramids", "rain forests", "reading habits",
    "renewable energy", "robots", "roman history", "running shoes", "sailing", "sandwiches",
    "school lunches", "sharks", "sleep", "snow", "soccer", "solar panels", "spices", "spring cleaning",
    "stars", "street food", "sunflowers", "tea", "teamwork", "thunderstorms", "time management",
    "tomatoes", "trains", "traveling abroad", "trees", "tsunamis", "video games", "violins",
    "volcanoes", "volunteering", "walking", "whales", "wind", "winter holidays", "wolves",
    "writing letters", "yoga", "zoos", "the internet", "smartphones", "the human heart",
    "the printing press", "the ancient greeks", "rivers", "deserts", "islands", "rainbows",
    "healthy breakfast", "cooking pasta", "moving house", "learning to swim", "the solar system",
    "airplanes", "castles", "fairy tales", "music lessons", "the stock market", "vitamins",
)

# The CLI's bench prompts' topics (eecore.cli.BENCH_PROMPTS) and a few more, never trained on.
HELDOUT_TOPICS = (
    "the sea", "the color of the sky", "the water cycle", "vaccines", "Romeo and Juliet",
    "programming languages", "readable code", "paged memory", "rabbits", "the moon", "bread making at home",
    "recycling glass", "the french revolution", "hurricanes", "learning to cook", "deep sea fish",
)

TEMPLATES = (
    ("poem", "Write a short poem about {topic}."),
    ("explain", "Explain {topic} in simple terms."),
    ("tips", "Give three tips about {topic}."),
    ("story", "Write a short story about {topic}."),
    ("facts", "Tell me some interesting facts about {topic}."),
    ("child", "How would you explain {topic} to a child?"),
    ("why", "Why do people care about {topic}?"),
    ("describe", "Describe {topic}."),
    ("haiku", "Write a haiku about {topic}."),
    ("history", "What is the history of {topic}?"),
    ("beginner", "What should a beginner know about {topic}?"),
    ("letter", "Write a short letter to a friend about {topic}."),
    ("myths", "What are some common myths about {topic}?"),
    ("changes", "How has {topic} changed over time?"),
    ("summary", "Summarize what makes {topic} interesting in a few sentences."),
    ("expert", "What would you ask an expert on {topic}?"),
)

# The request the model answers to write a question of its own.
ASK = "Write one question that a curious person might ask about {topic}. Reply with the question only."

_SEEDS_PER_TOPIC = 1000
_PREFIX = re.compile(r"^(?:question|q|user|request)\s*[:.\-]\s*", re.I)
_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.'\"?!;:()\-]+$")


@dataclass(frozen=True)
class GeneralInstruction:
    topic: str
    kind: str       # one of TEMPLATES' kinds, or "asked"
    text: str       # the user's message (not yet in the chat template)


def topics(split: str) -> tuple[str, ...]:
    if split not in ("train", "heldout"):
        raise ValueError(f"topics: split must be 'train' or 'heldout', got {split!r}")
    return TRAIN_TOPICS if split == "train" else HELDOUT_TOPICS


def templated_instructions(split: str) -> dict[str, list[GeneralInstruction]]:
    """Every template filled in with every topic of `split`, grouped by topic."""
    return {t: [GeneralInstruction(t, kind, form.format(topic=t)) for kind, form in TEMPLATES] for t in topics(split)}


def heldout_requests(n: int) -> list[GeneralInstruction]:
    """`n` held-out requests for evaluation (`eecore eval --prompts everyday`): topic after topic,
    the form moving on by one each round, so that a few cover every topic and every form."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"heldout_requests: n must be an int >= 0, got {n!r}")
    n = min(n, len(HELDOUT_TOPICS) * len(TEMPLATES))
    out = []
    for k in range(n):
        rounds, i = divmod(k, len(HELDOUT_TOPICS))
        kind, form = TEMPLATES[(i + rounds) % len(TEMPLATES)]
        out.append(GeneralInstruction(HELDOUT_TOPICS[i], kind, form.format(topic=HELDOUT_TOPICS[i])))
    return out


def clean_request(text: str) -> Optional[str]:
    """A model-written question made usable, or None. The small model often wraps its question
    ('What a delightful topic! A curious person might ask: "Why ...?"'), so a quoted span that asks
    something is taken, else the first line's first question after any exclamations. Kept: 3-30
    words of plain English punctuation ending in "?", not about the question itself, the asker or
    being an AI."""
    quoted = re.findall(r'"([^"]*\?)"|(?:^|[\s:,])\'([^\']*\?)\'(?!\w)', text)
    if quoted:
        line = next(a or b for a, b in reversed(quoted)).strip()
    else:
        lines = [line.strip() for line in text.strip().split("\n") if line.strip()]
        if not lines:
            return None
        line = _PREFIX.sub("", lines[0]).strip()
        match = re.match(r"^(?:[^?!]*!\s*)*([^?!]*\?)", line)  # skip leading exclamations
        if match is None:
            return None
        line = match.group(1).strip()
    words = line.split()
    if not 3 <= len(words) <= 30 or not _ALLOWED.match(line) or not line.endswith("?"):
        return None
    lowered = f" {line.lower()} "
    if any(w in lowered for w in ("question", "curious person", " ask", " ai ", "assistant", "language model")):
        return None
    return line[0].upper() + line[1:]


def ask_prompts(split: str, per_topic: int) -> list[tuple[str, int]]:
    """(topic, seed) for `per_topic` model-written requests a topic of `split`: the seed makes each
    sampled request repeatable and different from its topic's others."""
    if not isinstance(per_topic, int) or not 0 <= per_topic <= _SEEDS_PER_TOPIC:
        raise ValueError(f"ask_prompts: per_topic must be an int in [0, {_SEEDS_PER_TOPIC}], got {per_topic!r}")
    base = 0 if split == "train" else 1_000_000  # the splits' seeds never meet
    return [(t, base + _SEEDS_PER_TOPIC * i + k) for i, t in enumerate(topics(split)) for k in range(per_topic)]


def asked_instructions(llm, split: str, per_topic: int, *, temperature: float = 0.8,
                       max_tokens: int = 40) -> dict[str, list[GeneralInstruction]]:
    """Requests the model writes itself, `per_topic` tries a topic of `split` (sampled, each with a
    seed of its own), kept when `clean_request` accepts them and they are new; grouped by topic."""
    import eecore

    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("asked_instructions: the model needs a chat template")
    asks = ask_prompts(split, per_topic)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": ASK.format(topic=t)}],
                                                 add_generation_prompt=True) for t, _ in asks]
    params = [eecore.SamplingParams(temperature=temperature, top_p=0.95, seed=seed, max_tokens=max_tokens)
              for _, seed in asks]
    outs = llm.generate(prompts, params)
    grouped: dict[str, list[GeneralInstruction]] = {}
    seen: set[str] = set()
    for (topic, _), out in zip(asks, outs):
        text = clean_request(out.text)
        if text is not None and text.lower() not in seen:
            seen.add(text.lower())
            grouped.setdefault(topic, []).append(GeneralInstruction(topic, "asked", text))
    return grouped


def general_instruction_records(n: int, split: str, llm=None, asked_per_topic: int = 0) -> list[GeneralInstruction]:
    """`n` everyday requests of `split` (fewer when there are fewer): the templated ones and, with
    `llm` and `asked_per_topic`, the model-written ones, each topic's share as equal as its requests
    allow, interleaved topic by topic (`eecore.evaluation.prompts.balanced_picks`)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"general_instruction_records: n must be an int >= 0, got {n!r}")
    grouped = templated_instructions(split)
    if asked_per_topic:
        if llm is None:
            raise ValueError("general_instruction_records: asked_per_topic needs the llm that writes them")
        for topic, extra in asked_instructions(llm, split, asked_per_topic).items():
            # model-written ones lead their topic's list: balanced_picks takes from it evenly spaced
            grouped[topic] = extra + grouped[topic]
    return balanced_picks(grouped, n)
