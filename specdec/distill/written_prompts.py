"""Prompts written by the target itself, for variety the hand-written templates cannot give.

Templates top out at a few thousand near-duplicates, and a draft trained on them learns the
templates: held-out agreement 0.56 on its own prompts, 0.36 on the benchmark's (0.39 with these
prompts added). So the recipe also lets the target write user requests. Asked in chat form ("write
a question about X") a 135M model mostly talks about the task instead of doing it; continuing a
numbered list works: the writer's prompt is a plain-text list of three requests drawn from the
templates, left open at "4.", and the target's sampled continuation up to the end of the line is a
new request. Translation requests wrap a sentence the target wrote for a phrase-book list.

Written requests that touch the demo's or the benchmark's prompts are dropped (`overlaps_measured`),
like every distillation prompt.
"""

from __future__ import annotations

import random
import re

import torch
from tqdm.auto import tqdm

from specdec.distill.data import left_pad
from specdec.distill.general_prompts import (
    TRANSLATION_LANGUAGES,
    TRANSLATION_SENTENCES,
    TRANSLATION_TEMPLATES,
    general_prompt,
)
from specdec.prompt_sets import overlaps_measured

# Plain-text list headings per kind; the list's items are drawn from general_prompt(kind).
LIST_HEADINGS = {
    "code": ("Requests that people sent to a Python programming assistant:",
             "Coding tasks that students asked for help with, one per line:",
             "Things people asked an AI to write in Python:"),
    "explain": ("Questions that people asked a teacher, one per line:",
                "Things people asked an assistant to explain:",
                "Questions from a science and technology quiz night:"),
    "chat": ("Messages that people sent to a friendly assistant, asking for advice:",
             "Questions people asked an AI assistant about everyday life:",
             "Requests for ideas and suggestions that people sent to a chatbot:"),
    "translate": ("Everyday sentences from a phrase book:",
                  "Simple English sentences for language learners:"),
}
# How often each kind is written (the translate kind's sentences are wrapped into requests).
WRITTEN_KIND_WEIGHTS = (("code", 30), ("explain", 30), ("chat", 25), ("translate", 15))
NUM_EXAMPLES = 3
MIN_CHARS, MAX_CHARS = 12, 240


def writer_text(kind: str, rng: random.Random) -> str:
    """The plain-text list the target continues to write one request of `kind`."""
    if kind == "translate":
        examples = rng.sample(TRANSLATION_SENTENCES, NUM_EXAMPLES)
    else:
        examples = [general_prompt(kind, rng).replace("\n", " ") for _ in range(NUM_EXAMPLES)]
    lines = "".join(f"{number}. {text}\n" for number, text in enumerate(examples, start=1))
    return f"{rng.choice(LIST_HEADINGS[kind])}\n{lines}{NUM_EXAMPLES + 1}."


def parse_written(kind: str, completion: str, rng: random.Random) -> str | None:
    """The request the target wrote (its completion's first line), or None if unusable."""
    line = completion.split("\n", 1)[0].strip().strip('"').strip()
    if not MIN_CHARS <= len(line) <= MAX_CHARS or not re.match(r"[A-Z]", line):
        return None
    if len(re.findall(r"[A-Za-z]", line)) < 0.6 * len(line) or re.search(r"\b\d+\.\s", line):
        return None  # mostly symbols, or several list items run together
    if kind == "translate":
        if line[-1] not in ".!?" or '"' in line:
            return None
        line = rng.choice(TRANSLATION_TEMPLATES).format(
            language=rng.choice(TRANSLATION_LANGUAGES), sentence=line)
    elif line[-1] not in ".?!:)":
        return None  # cut off by the token limit
    return None if overlaps_measured(line) else line


def _newline_ids(tokenizer) -> list[int]:
    """Token ids whose text contains a line break: the writer stops at the end of its line."""
    vocab = tokenizer.get_vocab()
    return sorted(i for i in vocab.values() if "\n" in tokenizer.decode([i]))


@torch.inference_mode()
def write_prompts(model, tokenizer, num_prompts: int, batch_size: int, seed: int,
                  max_new_tokens: int = 40, temperature: float = 0.9, top_p: float = 0.95,
                  progress: bool = True) -> list[str]:
    """`num_prompts` distinct requests written by `model` (fewer if it keeps repeating itself).

    Sampling uses torch's global generator (seeded by the caller); `seed` draws the list items.
    """
    rng = random.Random(seed)
    kinds = [kind for kind, weight in WRITTEN_KIND_WEIGHTS for _ in range(weight)]
    device = next(model.parameters()).device
    stop_ids = _newline_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    written: list[str] = []
    seen: set[str] = set()
    bar = tqdm(total=num_prompts, desc="distill: target writes prompts", unit="prompt",
               disable=not progress)
    attempts = 0
    while len(written) < num_prompts and attempts < 4 * num_prompts + batch_size:
        batch_kinds = [rng.choice(kinds) for _ in range(batch_size)]
        encoded = [tokenizer(writer_text(kind, rng))["input_ids"] for kind in batch_kinds]
        attempts += batch_size
        input_ids, attention_mask = left_pad(encoded, pad_id)
        width = input_ids.shape[1]
        output = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_p=top_p,
            pad_token_id=pad_id, eos_token_id=stop_ids,
        )
        for kind, row in zip(batch_kinds, output[:, width:].cpu()):
            text = parse_written(kind, tokenizer.decode(row, skip_special_tokens=True), rng)
            if text is not None and text.lower() not in seen and len(written) < num_prompts:
                seen.add(text.lower())
                written.append(text)
                bar.update(1)
    bar.close()
    return written
