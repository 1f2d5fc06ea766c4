"""The fixed prompt set for the demo and the benchmarks, as chat messages.

Four open-ended task kinds (TASK_KINDS): code, explanation, chat, translation; and one
input-grounded kind, "grounded": prompts whose answer mostly repeats text the prompt gives (edit
this code, rewrite this JSON, answer with quotes from a passage, revise the previous turn's answer),
where model-free drafts (prompt lookup, suffix) find their proposals. DEMO_PROMPTS (7: six
open-ended, one grounded) are what `specdec demo` streams; BENCHMARK_PROMPTS (24, six per
open-ended kind) are what benchmarks/ measure; GROUNDED_PROMPTS (6) the input-grounded set that
benchmarks/bench_drafts.py measures beside them. All are disjoint from the prompts `specdec
distill` trains the default draft on (tests/unit/test_distill.py checks).
Do not edit a prompt without noting it: published figures refer to this set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TASK_KINDS = ("code", "explanation", "chat", "translation")  # open-ended: BENCHMARK_PROMPTS' kinds
GROUNDED_KIND = "grounded"  # input-grounded: GROUNDED_PROMPTS (and one demo prompt)
KINDS = (*TASK_KINDS, GROUNDED_KIND)


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # one of KINDS
    messages: tuple[dict[str, str], ...]  # chat messages, rendered with the model's chat template

    @property
    def text(self) -> str:
        """The last user message."""
        return self.messages[-1]["content"]


def _user(name: str, kind: str, content: str) -> Prompt:
    assert kind in KINDS, kind
    return Prompt(name=name, kind=kind, messages=({"role": "user", "content": content},))


def _turns(name: str, *contents: str) -> Prompt:
    """A grounded conversation: user, assistant, user, ... (the last turn the user's)."""
    assert len(contents) % 2 == 1, "the last turn is the user's"
    roles = ("user", "assistant")
    return Prompt(name=name, kind=GROUNDED_KIND, messages=tuple(
        {"role": roles[i % 2], "content": content} for i, content in enumerate(contents)))


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
    # input-grounded: most of the answer is in the prompt (last, so --prompts N keeps the rest)
    _user("demo-grounded-docstrings", GROUNDED_KIND,
          "Add a one-line docstring to each function below and otherwise return the code "
          "unchanged.\n\n"
          "```python\n"
          "def mean(values):\n"
          "    return sum(values) / len(values)\n"
          "\n\n"
          "def clamp(value, low, high):\n"
          "    return max(low, min(value, high))\n"
          "\n\n"
          "def scale(values, factor):\n"
          "    return [value * factor for value in values]\n"
          "```"),
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

# Input-grounded prompts: the answer copies or edits text the prompt gives. Kept apart from
# BENCHMARK_PROMPTS so the open-ended figures (and every benchmark that takes that set) stay as
# they were.
GROUNDED_PROMPTS: tuple[Prompt, ...] = (
    _user("grounded-code-rename", GROUNDED_KIND,
          "Rename the variables of these Python functions to descriptive names. Do not change what "
          "they do; return both functions in full.\n\n"
          "```python\n"
          "def g(d, k, v=0):\n"
          "    t = 0\n"
          "    for a, b in d.items():\n"
          "        if a.startswith(k):\n"
          "            t += b\n"
          "        else:\n"
          "            t += v\n"
          "    return t\n"
          "\n\n"
          "def h(xs):\n"
          "    m = {}\n"
          "    for x in xs:\n"
          "        m[x[0]] = m.get(x[0], 0) + x[1]\n"
          "    return m\n"
          "```"),
    _user("grounded-code-type-hints", GROUNDED_KIND,
          "Add type hints and a docstring to every function of this module; keep the code "
          "otherwise as it is.\n\n"
          "```python\n"
          "import math\n"
          "\n\n"
          "def distance(p, q):\n"
          "    return math.hypot(q[0] - p[0], q[1] - p[1])\n"
          "\n\n"
          "def perimeter(points):\n"
          "    total = 0.0\n"
          "    for i in range(len(points)):\n"
          "        total += distance(points[i], points[(i + 1) % len(points)])\n"
          "    return total\n"
          "\n\n"
          "def centroid(points):\n"
          "    xs = [p[0] for p in points]\n"
          "    ys = [p[1] for p in points]\n"
          "    return sum(xs) / len(xs), sum(ys) / len(ys)\n"
          "```"),
    _user("grounded-json-rewrite", GROUNDED_KIND,
          "Rewrite this JSON: rename every key to snake_case, turn the prices into numbers and add "
          "\"currency\": \"EUR\" to each line item. Return only the JSON.\n\n"
          "```json\n"
          "{\n"
          "  \"orderId\": \"A-1042\",\n"
          "  \"customerName\": \"Marta Lindqvist\",\n"
          "  \"shippingAddress\": {\"streetName\": \"Rosenvej 12\", \"postCode\": \"8000\", "
          "\"cityName\": \"Aarhus\"},\n"
          "  \"lineItems\": [\n"
          "    {\"productName\": \"Ceramic mug\", \"unitPrice\": \"8.50\", \"quantityOrdered\": 2},\n"
          "    {\"productName\": \"Linen tea towel\", \"unitPrice\": \"6.00\", \"quantityOrdered\": 3},\n"
          "    {\"productName\": \"Oak serving board\", \"unitPrice\": \"24.90\", \"quantityOrdered\": 1}\n"
          "  ]\n"
          "}\n"
          "```"),
    _user("grounded-quote-passage", GROUNDED_KIND,
          "Read the passage and answer the question using only sentences quoted word for word "
          "from it.\n\n"
          "Passage: The Harwick canal was dug between 1791 and 1796 to carry coal from the hill "
          "mines to the river port. At its busiest, more than forty narrow boats passed through the "
          "lock at Eldon Bridge every day. Each boat was pulled by a single horse walking on the "
          "towpath beside the water. When the railway reached Harwick in 1848, the coal trade moved "
          "to the trains within ten years. The canal was closed to traffic in 1921 and partly filled "
          "in. Volunteers cleared the lock at Eldon Bridge in 1987, and since then small boats have "
          "used the restored section in summer.\n\n"
          "Question: How did the boats move along the canal, and what happened to the canal after "
          "the railway came?"),
    _turns("grounded-revise-email",
           "Write a short email to my team saying that the Thursday planning meeting moves to "
           "Friday at 10:00 in room B2.",
           "Hi team,\n\n"
           "The planning meeting that was scheduled for Thursday has been moved to Friday at 10:00. "
           "We will meet in room B2. Please bring your notes on the open tasks for the next sprint "
           "so that we can go through them together.\n\n"
           "Thanks,\nSam",
           "Revise your email: keep its wording, but add that the meeting will last one hour and "
           "that remote colleagues can join by video call."),
    _turns("grounded-revise-code",
           "Write a Python function read_rows(path) that reads a CSV file with a header line and "
           "returns its rows as a list of dictionaries.",
           "```python\n"
           "import csv\n"
           "\n\n"
           "def read_rows(path):\n"
           "    with open(path, newline=\"\") as handle:\n"
           "        reader = csv.DictReader(handle)\n"
           "        return [dict(row) for row in reader]\n"
           "```\n\n"
           "The function opens the file, lets csv.DictReader take the column names from the first "
           "line, and returns one dictionary per row.",
           "Revise the function: add a parameter delimiter with the default \",\", skip the rows "
           "whose values are all empty, and keep everything else the same. Return the whole "
           "function."),
)

# Every measured prompt: the demo's, the open-ended benchmark's and the input-grounded ones.
ALL_PROMPTS: tuple[Prompt, ...] = DEMO_PROMPTS + BENCHMARK_PROMPTS + GROUNDED_PROMPTS
# The open-ended ones alone (the four TASK_KINDS).
OPEN_ENDED_PROMPTS: tuple[Prompt, ...] = tuple(p for p in ALL_PROMPTS if p.kind in TASK_KINDS)


def prompts_by_kind(kind: str, prompts: tuple[Prompt, ...] = BENCHMARK_PROMPTS) -> list[Prompt]:
    return [p for p in prompts if p.kind == kind]


# The topics of the open-ended prompts above. Distillation prompts steer clear of them, not only of
# their exact texts, so the default draft is not trained on near-copies of what is measured. The
# grounded prompts add no topic (that would change the committed draft's training data): their
# material -- the code, JSON, passage and first turns they give -- is checked absent from the
# distillation prompts instead (tests/unit/test_distill.py).
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


_MEASURED_TEXTS = frozenset(_normalise(m["content"]) for p in ALL_PROMPTS for m in p.messages
                            if m["role"] == "user")
# Quoted sentences (the translation prompts'): the grounded prompts' JSON quotes single words.
_MEASURED_SENTENCES = tuple(_normalise(sentence) for p in OPEN_ENDED_PROMPTS
                            for sentence in re.findall(r'"([^"]+)"', p.text))


def overlaps_measured(text: str) -> bool:
    """Whether `text` is a demo or benchmark prompt, quotes one's sentence, or names a topic of one
    (whole words, plural "s" included: "stacks" counts, "stackable" does not)."""
    normalised = _normalise(text)
    return (normalised in _MEASURED_TEXTS
            or any(sentence in normalised for sentence in _MEASURED_SENTENCES)
            or _TOPIC_PATTERN.search(normalised) is not None)
