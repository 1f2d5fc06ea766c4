"""`specdec distill-head`: train a draft head (specdec/draft_head.py) for a target on the target's
own greedy answers.

The target answers prompts built offline (specdec/distill/prompts.py), then one pass over each
prompt and answer gives its last hidden states h_i. The head learns, at every answer position,
(h_i, C[i + 1]) -> C[i + 2] and, chained on its own state, -> C[i + 3] (weight `second_weight`),
by cross-entropy over the token ids the answers use. A held-out share of the answers picks the
best weights (validated every `eval_every` steps) and gives the figures the run reports: how often
the head's first draft is the target's next token, and its second given the first.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.distill.config import COMPUTE_DTYPES
from specdec.distill.data import Example, encode_prompt, generate_examples, load_examples, save_examples
from specdec.draft_head import DraftHead, new_head, save_head


@dataclass(frozen=True)
class HeadDistillConfig:
    """Everything `specdec distill-head` decides. The defaults made the default target's head."""

    target: str  # "default" or a Hugging Face directory
    out_dir: Path
    num_prompts: int = 4000
    max_new_tokens: int = 96
    max_prompt_tokens: int = 384
    generation_batch_size: int = 128
    dtype: str = "auto"  # the target's dtype while it answers and gives its hidden states, and
    # the training passes' autocast (auto: bfloat16 on CUDA or a CPU with native bfloat16)
    inner_size: int = 1536
    steps: int = 4000
    batch_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    second_weight: float = 0.5  # the chained second draft's share of the loss
    holdout_fraction: float = 0.05
    eval_every: int = 250
    seed: int = 0
    device: str = "cpu"
    data_path: Path | None = None  # cache of generated answers: loaded if present, else written
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens", "generation_batch_size",
                     "inner_size", "steps", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prompts < 20:
            raise ValueError("num_prompts must be >= 20 (some are held out)")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        if self.learning_rate <= 0 or self.weight_decay < 0 or not 0.0 <= self.second_weight <= 1.0:
            raise ValueError("learning_rate must be > 0, weight_decay >= 0, second_weight in [0, 1]")


@dataclass
class Positions:
    """Answer positions: the hidden state h_i, the token it chose C[i + 1], and the two after it
    (-1 where the answer ends first)."""

    hidden: torch.Tensor  # (n, H) float32
    token: torch.Tensor  # (n,)
    first: torch.Tensor  # (n,) C[i + 2]
    second: torch.Tensor  # (n,) C[i + 3] or -1

    def __len__(self) -> int:
        return len(self.token)


def answer_positions(model, examples: list[Example], batch_size: int = 16, progress: bool = False) -> Positions:
    """One pass over each prompt and answer (right-padded batches): every answer position's
    last hidden state and tokens."""
    device = next(model.parameters()).device
    hidden, token, first, second = [], [], [], []
    bar = tqdm(total=len(examples), desc="distill-head: hidden states", unit="answer", disable=not progress)
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            batch = examples[start:start + batch_size]
            sequences = [list(e.prompt_ids) + list(e.answer_ids) for e in batch]
            width = max(len(s) for s in sequences)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, sequence in enumerate(sequences):
                ids[row, :len(sequence)] = torch.tensor(sequence)
                mask[row, :len(sequence)] = 1
            states = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                           output_hidden_states=True).hidden_states[-1].float().cpu()
            for row, (example, sequence) in enumerate(zip(batch, sequences)):
                seq = torch.tensor(sequence)
                index = torch.arange(len(example.prompt_ids) - 1, len(sequence) - 2)
                if index.numel() == 0:
                    continue
                after = torch.full_like(index, -1)
                inside = index + 3 < len(sequence)
                after[inside] = seq[index[inside] + 3]
                hidden.append(states[row, index])
                token.append(seq[index + 1])
                first.append(seq[index + 2])
                second.append(after)
            bar.update(len(batch))
    bar.close()
    return Positions(torch.cat(hidden), torch.cat(token), torch.cat(first), torch.cat(second))


def agreement(head: DraftHead, positions: Positions, batch_size: int = 4096) -> tuple[float, float]:
    """(how often the head's first draft is C[i + 2], how often its second is C[i + 3] where the
    first was right)."""
    right_first = right_both = both_counted = 0
    with torch.no_grad():
        for start in range(0, len(positions), batch_size):
            end = start + batch_size
            drafts, _ = head.draft(positions.hidden[start:end], positions.token[start:end], 2)
            first = drafts[:, 0] == positions.first[start:end]
            counted = first & (positions.second[start:end] >= 0)
            right_first += int(first.sum())
            both_counted += int(counted.sum())
            right_both += int((counted & (drafts[:, 1] == positions.second[start:end])).sum())
    return right_first / max(1, len(positions)), right_both / max(1, both_counted)


def train_head(head: DraftHead, train: Positions, held_out: Positions, config: HeadDistillConfig,
               autocast_dtype: torch.dtype | None) -> dict:
    """Trains `head` in place (float32 weights; passes under autocast in autocast_dtype if given),
    keeping the weights that did best on held_out. Returns the run's figures."""
    generator = torch.Generator().manual_seed(config.seed)
    remap = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    remap[head.token_ids] = torch.arange(len(head.token_ids))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    warmup = max(1, config.steps // 50)

    def rate(step: int) -> float:  # linear warm-up, cosine to 10 %
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, config.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    best = (-1.0, 0.0, 0, {k: v.clone() for k, v in head.state_dict().items()})
    curve = []
    bar = tqdm(total=config.steps, desc="distill-head: training", unit="step", disable=not config.progress)
    for step in range(1, config.steps + 1):
        rows = torch.randint(0, len(train), (config.batch_size,), generator=generator)
        token, first, second = train.token[rows], train.first[rows], train.second[rows]
        with torch.autocast(head.up.weight.device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            state, logits = head.step(train.hidden[rows], token)
            known = remap[first] >= 0
            loss = torch.nn.functional.cross_entropy(logits.float()[known], remap[first][known])
            if config.second_weight > 0:
                _, logits2 = head.step(state, first)  # chained on its own state, fed the true token
                valid = (second >= 0) & (remap[second.clamp(min=0)] >= 0)
                if valid.any():
                    loss = loss + config.second_weight * torch.nn.functional.cross_entropy(
                        logits2.float()[valid], remap[second[valid]])
        optimizer.zero_grad()
        loss.backward()
        loss = loss.detach()
        optimizer.step()
        schedule.step()
        bar.update(1)
        if step % config.eval_every == 0 or step == config.steps:
            first_rate, second_rate = agreement(head, held_out)
            curve.append({"step": step, "loss": round(float(loss), 4), "held_out_first": round(first_rate, 4),
                          "held_out_second_given_first": round(second_rate, 4)})
            bar.set_postfix(loss=f"{float(loss):.3f}", held_out=f"{first_rate:.3f}")
            if first_rate > best[0]:
                best = (first_rate, second_rate, step, {k: v.clone() for k, v in head.state_dict().items()})
    bar.close()
    head.load_state_dict(best[3])
    return {"best_step": best[2], "held_out_first": round(best[0], 4),
            "held_out_second_given_first": round(best[1], 4), "curve": curve}


def run(config: HeadDistillConfig) -> dict:
    """The whole recipe: answers, hidden states, training; writes the head to config.out_dir and
    returns the run's record (also in the head's specdec_head.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.distill.prompts import build_prompts
    from specdec.distill.recipe import compute_dtype, resolve_target

    started = time.perf_counter()
    torch.manual_seed(config.seed)
    target_dir = resolve_target(config.target)
    dtype = compute_dtype(config.dtype, config.device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(config.device).eval()
    if config.data_path is not None and Path(config.data_path).is_file():
        examples = load_examples(config.data_path)
    else:
        prompts = [encode_prompt(tokenizer, messages) for messages in build_prompts(config.num_prompts, config.seed)]
        prompts = [p for p in prompts if len(p) <= config.max_prompt_tokens]
        with torch.inference_mode():
            examples = generate_examples(model, tokenizer, prompts, config.max_new_tokens,
                                         config.generation_batch_size, top_k=1, progress=config.progress)
        if config.data_path is not None:
            save_examples(examples, config.data_path)
    answered = time.perf_counter()
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    held = max(1, int(len(order) * config.holdout_fraction))
    held_out = answer_positions(model, [examples[i] for i in order[:held]], progress=config.progress)
    train = answer_positions(model, [examples[i] for i in order[held:]], progress=config.progress)
    ids = torch.unique(torch.cat([train.token, train.first])).tolist()
    head = new_head(model.float(), ids, config.inner_size)
    autocast = dtype if dtype != torch.float32 else None
    figures = train_head(head, train, held_out, config, autocast)
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "answers": len(examples), "train_positions": len(train), "held_out_positions": len(held_out),
        "head_token_ids": len(ids), "seconds_answers": round(answered - started, 1),
        "seconds_total": round(time.perf_counter() - started, 1), **figures,
    }
    save_head(head, config.out_dir, training=record)
    return record
