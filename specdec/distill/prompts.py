"""Distillation prompts, built offline from Python's own documentation plus general requests.

Sources: the docstrings and signatures of public functions and classes in a fixed list of standard
library modules (read with `inspect`, nothing executed beyond import), turned into code, explanation
and translation requests; and everyday code, explanation, chat and translation requests from the
templates in general_prompts.py. The set is deterministic for a given Python version and seed, and
disjoint from specdec/prompt_sets.py (a test checks).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from dataclasses import dataclass

from specdec.distill.general_prompts import general_prompt
from specdec.prompt_sets import overlaps_measured

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


# Weights of the prompt kinds: general requests (what users ask) outweigh documentation-derived ones.
KIND_WEIGHTS = (("code", 25), ("explain", 25), ("chat", 20), ("translate", 10),
                ("doc-code", 10), ("doc-explain", 7), ("doc-translate", 3))


def build_prompts(num_prompts: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`num_prompts` distinct single-turn chat conversations (lists of messages), mixed by
    KIND_WEIGHTS. Fewer come back if the templates run out of distinct texts."""
    rng = random.Random(seed)
    items = collect_doc_items()
    texts: list[str] = []
    seen: set[str] = set()

    def add(text: str) -> None:
        if text not in seen and not overlaps_measured(text):
            seen.add(text)
            texts.append(text)

    kinds = [kind for kind, weight in KIND_WEIGHTS for _ in range(weight)]
    modules = sorted({item.module for item in items})
    attempts = 0
    while len(texts) < num_prompts and attempts < num_prompts * 50:
        attempts += 1
        kind = rng.choice(kinds)
        if not kind.startswith("doc-"):
            add(general_prompt(kind, rng))
            continue
        item = rng.choice(items)
        if kind == "doc-code":
            add(rng.choice(CODE_TEMPLATES).format(qualname=item.qualname, module=item.module,
                                                  signature=item.signature or "()"))
        elif kind == "doc-explain":
            if rng.random() < 0.1:
                add(rng.choice(MODULE_TEMPLATES).format(module=rng.choice(modules)))
            else:
                add(rng.choice(EXPLAIN_TEMPLATES).format(qualname=item.qualname,
                                                         module=item.module, doc=item.doc))
        elif 20 <= len(item.first_sentence) <= 140:
            add(rng.choice(TRANSLATE_TEMPLATES).format(language=rng.choice(LANGUAGES),
                                                       sentence=item.first_sentence))
    return [[{"role": "user", "content": text}] for text in texts]
