"""The fixed prompt set for the demo and the benchmarks, as chat messages.

Four task kinds: code, explanation, chat, translation. DEMO_PROMPTS (6) are what `specdec demo`
streams; BENCHMARK_PROMPTS (24, six per kind) are what benchmarks/ measure. Both are disjoint from
the prompts `specdec distill` trains the default draft on (tests/unit/test_distill.py checks).
Do not edit a prompt without noting it: published figures refer to this set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TASK_KINDS = ("code", "explanation", "chat", "translation")


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # one of TASK_KINDS
    messages: tuple[dict[str, str], ...]  # chat messages, rendered with the model's chat template

    @property
    def text(self) -> str:
        """The last user message."""
        return self.messages[-1]["content"]


def _user(name: str, kind: str, content: str) -> Prompt:
    assert kind in TASK_KINDS, kind
    return Prompt(name=name, kind=kind, messages=({"role": "user", "content": content},))


DEMO_PROMPTS: tuple[Prompt, ...] = (
    _user("demo-code-fizzbuzz", "code",
          "Write a Python function fizzbuzz(n) that returns a list of strings for 1..n."),
    _user("demo-code-reverse-words", "code",
          "Write a Python function that reverses the order of the words in a sentence."),
    _user("demo-explain-recursion", "explanation",
          "Explain recursion to a beginner programmer, with a small example."),
    _user("demo-explain-photosynthesis", "explanation",
          "Explain how photosynthesis works in a few sentences."),
    _user("demo-chat-weekend", "chat",
          "I have a free weekend and a small budget. What could I do?"),
    _user("demo-translate-french", "translation",
          "Translate into French: \"The library opens at nine o'clock every morning.\""),
)

BENCHMARK_PROMPTS: tuple[Prompt, ...] = (
    # code
    _user("code-palindrome", "code",
          "Write a Python function is_palindrome(s) that ignores case and punctuation."),
    _user("code-fibonacci", "code",
          "Write a Python function that returns the first n Fibonacci numbers as a list."),
    _user("code-word-count", "code",
          "Write a Python program that counts how often each word appears in a text file."),
    _user("code-binary-search", "code",
          "Implement binary search in Python for a sorted list of integers."),
    _user("code-stack-class", "code",
          "Write a Python class Stack with push, pop, peek and is_empty methods."),
    _user("code-celsius", "code",
          "Write a Python function that converts a temperature from Celsius to Fahrenheit."),
    # explanation
    _user("explain-hash-table", "explanation",
          "Explain how a hash table works and why lookups are fast."),
    _user("explain-internet", "explanation",
          "Explain in simple terms how data travels across the internet."),
    _user("explain-seasons", "explanation",
          "Why does the Earth have seasons? Explain briefly."),
    _user("explain-vaccines", "explanation",
          "Explain how vaccines help the immune system."),
    _user("explain-big-o", "explanation",
          "What does Big O notation mean in computer science?"),
    _user("explain-inflation", "explanation",
          "Explain what inflation is and what causes it."),
    # chat
    _user("chat-sleep", "chat",
          "I keep waking up tired. Do you have any advice for sleeping better?"),
    _user("chat-birthday", "chat",
          "Can you suggest a fun birthday party idea for a ten-year-old?"),
    _user("chat-learn-guitar", "chat",
          "I want to learn the guitar as an adult. Where should I start?"),
    _user("chat-interview", "chat",
          "I have a job interview tomorrow and I am nervous. Any tips?"),
    _user("chat-houseplants", "chat",
          "Which houseplants are easy to keep alive for someone who travels a lot?"),
    _user("chat-dinner", "chat",
          "What is a quick and healthy dinner I can cook in twenty minutes?"),
    # translation
    _user("translate-spanish-weather", "translation",
          "Translate into Spanish: \"It is going to rain tomorrow, so bring an umbrella.\""),
    _user("translate-german-train", "translation",
          "Translate into German: \"The train to Berlin leaves from platform four.\""),
    _user("translate-french-friends", "translation",
          "Translate into French: \"My friends and I are going to the cinema tonight.\""),
    _user("translate-italian-restaurant", "translation",
          "Translate into Italian: \"Could we have a table for two by the window, please?\""),
    _user("translate-spanish-book", "translation",
          "Translate into Spanish: \"She has read this book three times.\""),
    _user("translate-german-coffee", "translation",
          "Translate into German: \"I would like a cup of coffee with milk.\""),
)

ALL_PROMPTS: tuple[Prompt, ...] = DEMO_PROMPTS + BENCHMARK_PROMPTS


def prompts_by_kind(kind: str, prompts: tuple[Prompt, ...] = BENCHMARK_PROMPTS) -> list[Prompt]:
    return [p for p in prompts if p.kind == kind]


# The topics of the prompts above. Distillation prompts steer clear of them, not only of their exact
# texts, so the default draft is not trained on near-copies of what is measured.
TOPICS: tuple[str, ...] = (
    "palindrome", "fibonacci", "word count", "counts how often each word", "binary search",
    "stack", "celsius", "fahrenheit", "fizzbuzz", "reverses the order", "hash table", "internet",
    "seasons", "vaccine", "big o", "inflation", "recursion", "photosynthesis", "sleep", "birthday",
    "guitar", "interview", "houseplant", "dinner i can cook",
)
_TOPIC_PATTERN = re.compile(r"\b(" + "|".join(re.escape(t) for t in TOPICS) + r")s?\b",
                            re.IGNORECASE)


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


_MEASURED_TEXTS = frozenset(_normalise(p.text) for p in ALL_PROMPTS)
_MEASURED_SENTENCES = tuple(_normalise(sentence) for p in ALL_PROMPTS
                            for sentence in re.findall(r'"([^"]+)"', p.text))


def overlaps_measured(text: str) -> bool:
    """Whether `text` is a demo or benchmark prompt, quotes one's sentence, or names a topic of one
    (whole words, plural "s" included: "stacks" counts, "stackable" does not)."""
    normalised = _normalise(text)
    return (normalised in _MEASURED_TEXTS
            or any(sentence in normalised for sentence in _MEASURED_SENTENCES)
            or _TOPIC_PATTERN.search(normalised) is not None)
