"""Distillation prompts, built offline from Python's own documentation plus templated chat.

Sources: the docstrings and signatures of public functions and classes in a fixed list of standard
library modules (read with `inspect`, nothing executed beyond import), turned into code, explanation
and translation requests; and general chat requests from templates. The set is deterministic for a
given Python version and seed, and disjoint from specdec/prompt_sets.py (a test checks).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from dataclasses import dataclass

# Imported for their docstrings; chosen to have no import-time side effects.
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmath",
    "codecs", "collections", "colorsys", "concurrent.futures", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "filecmp", "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "http.client", "imaplib", "inspect", "io", "ipaddress",
    "itertools", "json", "keyword", "linecache", "locale", "logging", "lzma", "math",
    "mimetypes", "numbers", "operator", "os", "os.path", "pathlib", "pickle", "pkgutil",
    "platform", "pprint", "queue", "quopri", "random", "re", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "ssl", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time",
    "timeit", "tokenize", "traceback", "types", "typing", "unicodedata", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "wave", "xml.etree.ElementTree", "zipfile",
    "zlib",
)

CODE_TEMPLATES = (
    "Write a short Python example that uses {qualname}.",
    "Show how to call {qualname}{signature} in Python, with a brief explanation.",
    "Write a small Python script that demonstrates {qualname} from the {module} module.",
    "How would I use {qualname} in a Python program? Give a code example.",
)
EXPLAIN_TEMPLATES = (
    "Explain what {qualname} does in Python.",
    "What is {qualname} in Python's {module} module used for?",
    "Summarise this Python documentation in plain words:\n\n{doc}",
    "Explain the following description from the Python docs:\n\n{doc}",
    "When should I use {qualname} in Python, and what are its pitfalls?",
)
MODULE_TEMPLATES = (
    "What is the {module} module in Python's standard library used for?",
    "Give an overview of the most useful functions in Python's {module} module.",
    "Write a short Python program that shows typical use of the {module} module.",
)
TRANSLATE_TEMPLATES = (
    "Translate into {language}: \"{sentence}\"",
    "Please translate this sentence into {language}:\n{sentence}",
    "How do you say \"{sentence}\" in {language}?",
)
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")

CHAT_TEMPLATES = (
    "Give me {n} tips for {activity}.",
    "What should I keep in mind when {situation}?",
    "Write a short {form} about {topic}.",
    "Can you help me plan {plan}?",
    "What are the pros and cons of {choice}?",
    "My friend says {claim}. Is that true?",
    "Describe {topic} to someone who has never heard of it.",
    "Suggest {n} ideas for {plan}.",
)
CHAT_FILLERS = {
    "n": ("three", "four", "five"),
    "activity": ("running a first 5k race", "keeping a tidy desk", "writing clear emails",
                 "saving money on groceries", "learning to swim", "painting with watercolours",
                 "starting a vegetable garden", "taking better phone photos", "reading more books",
                 "staying focused while studying", "hiking in hot weather", "baking bread at home",
                 "speaking in public", "organising a small library", "learning chess openings"),
    "situation": ("moving to a new city", "adopting a cat", "buying a used bicycle",
                  "starting a new job", "travelling alone for the first time",
                  "choosing a laptop for programming", "renting my first apartment",
                  "writing a cover letter", "training a puppy", "cooking for a large group"),
    "form": ("poem", "story", "limerick", "dialogue", "diary entry", "product description"),
    "topic": ("the ocean at night", "a lighthouse keeper", "autumn leaves", "a robot gardener",
              "the first snow of winter", "a busy train station", "a lost umbrella",
              "an old clock tower", "volcanoes", "honeybees", "the moon landing",
              "a mountain village", "glaciers", "the printing press", "coral reefs"),
    "plan": ("a picnic in the park", "a family game night", "a study schedule for exams",
             "a road trip along the coast", "a surprise dinner for my parents",
             "a week of simple lunches", "a small community clean-up day",
             "a reading challenge for the summer"),
    "choice": ("working from home", "electric cars", "living in a big city",
               "learning two languages at once", "renting versus buying a home",
               "using a paper notebook instead of an app", "public transport",
               "owning a dog"),
    "claim": ("we only use ten percent of our brains", "goldfish have a three-second memory",
              "lightning never strikes the same place twice", "bats are blind",
              "the Great Wall of China is visible from space", "bulls hate the colour red",
              "cracking your knuckles causes arthritis", "carrots improve your night vision"),
}


@dataclass(frozen=True)
class DocItem:
    module: str
    qualname: str  # e.g. "json.dumps"
    signature: str  # "(obj, *, skipkeys=False, ...)" or ""
    doc: str  # first paragraph, whitespace normalised
    first_sentence: str


def _first_paragraph(doc: str) -> str:
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return re.sub(r"\s+", " ", paragraph).strip()


def _first_sentence(paragraph: str) -> str:
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return (match.group(1) if match else paragraph).strip()


def collect_doc_items(modules: tuple[str, ...] = STDLIB_MODULES) -> list[DocItem]:
    """Public, documented functions and classes of `modules`, in a deterministic order."""
    items: list[DocItem] = []
    seen: set[str] = set()
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            if name.startswith("_"):
                continue
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            paragraph = _first_paragraph(doc) if doc else ""
            if len(paragraph) < 25:
                continue
            qualname = f"{module_name}.{name}"
            if qualname in seen:
                continue
            seen.add(qualname)
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                signature = ""
            if len(signature) > 80:
                signature = ""
            items.append(DocItem(module_name, qualname, signature, paragraph[:500],
                                 _first_sentence(paragraph)))
    return items


def _fill(template: str, rng: random.Random) -> str:
    fields = {key: rng.choice(values) for key, values in CHAT_FILLERS.items()}
    return template.format(**fields)


def build_prompts(num_prompts: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`num_prompts` distinct single-turn chat conversations (lists of messages).

    Mix: about 35% code, 35% explanation, 15% translation, 15% chat.
    """
    rng = random.Random(seed)
    items = collect_doc_items()
    texts: list[str] = []
    seen: set[str] = set()

    def add(text: str) -> None:
        if text not in seen:
            seen.add(text)
            texts.append(text)

    kinds = ["code"] * 7 + ["explain"] * 7 + ["translate"] * 3 + ["chat"] * 3
    modules = sorted({item.module for item in items})
    attempts = 0
    while len(texts) < num_prompts and attempts < num_prompts * 50:
        attempts += 1
        kind = rng.choice(kinds)
        item = rng.choice(items)
        if kind == "code":
            add(rng.choice(CODE_TEMPLATES).format(qualname=item.qualname, module=item.module,
                                                  signature=item.signature or "()"))
        elif kind == "explain":
            if rng.random() < 0.1:
                add(rng.choice(MODULE_TEMPLATES).format(module=rng.choice(modules)))
            else:
                add(rng.choice(EXPLAIN_TEMPLATES).format(qualname=item.qualname,
                                                         module=item.module, doc=item.doc))
        elif kind == "translate":
            if 20 <= len(item.first_sentence) <= 140:
                add(rng.choice(TRANSLATE_TEMPLATES).format(language=rng.choice(LANGUAGES),
                                                           sentence=item.first_sentence))
        else:
            add(_fill(rng.choice(CHAT_TEMPLATES), rng))
    return [[{"role": "user", "content": text}] for text in texts]
