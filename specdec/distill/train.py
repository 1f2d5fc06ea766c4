"""Training the draft on the target's own greedy answers.

Loss at every answer position (teacher-forced on the target's tokens), over the kept ids only:
(1 − w)·CE(draft, target's greedy token) + w·CE(draft, softmax of the target's top-k logits),
w = soft_label_weight. Top-k ids outside the kept set are dropped from the soft target.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.distill.config import DistillConfig
from specdec.distill.data import Example
from specdec.draft_model import build_draft, draft_config_from_target


def kept_ids_from_examples(examples: list[Example], extra_ids: list[int], min_count: int = 1,
                           ) -> torch.Tensor:
    """Sorted ids the target emitted at least `min_count` times in `examples`, plus `extra_ids`
    (e.g. EOS). Rare ids cost head width (draft time) and are seldom predicted right anyway."""
    counts: Counter[int] = Counter()
    for example in examples:
        counts.update(example.answer_ids)
    ids = set(extra_ids) | {token for token, count in counts.items() if count >= min_count}
    return torch.tensor(sorted(ids), dtype=torch.long)


def init_draft_from_target(target, num_layers: int, kept_ids: torch.Tensor):
    """A draft with the target's first `num_layers` layers, final norm and head rows for kept ids."""
    config = draft_config_from_target(target.config, num_layers)
    embedding = target.get_input_embeddings().weight.detach().float()
    draft = build_draft(config, kept_ids, embedding)
    for index in range(num_layers):
        draft.model.layers[index].load_state_dict(target.model.layers[index].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    head_weight = target.get_output_embeddings().weight.detach().float()  # (V, H)
    with torch.no_grad():
        draft.lm_head.proj.weight.copy_(head_weight[draft.lm_head.kept_token_ids])
    return draft.float()


def prune_head(draft, keep_ids: torch.Tensor) -> None:
    """Drop the head rows of ids not in `keep_ids` (in place). Rows are independent, so the kept
    rows' logits do not change; a smaller head makes each draft step cheaper."""
    from specdec.draft_model import RestrictedHead

    head = draft.lm_head
    mask = torch.isin(head.kept_token_ids, keep_ids)  # (N_kept,)
    pruned = RestrictedHead(head.proj.in_features, head.kept_token_ids[mask], head.vocab_size)
    with torch.no_grad():
        pruned.proj.weight.copy_(head.proj.weight[mask])
    draft.lm_head = pruned.to(head.proj.weight.device, head.proj.weight.dtype)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) right-padded prompt + answer[:-1]
    attention_mask: torch.Tensor  # (B, T)
    rows: torch.Tensor  # (N,) batch row of each answer position
    cols: torch.Tensor  # (N,) sequence position whose output predicts that answer token
    hard_labels: torch.Tensor  # (N,) index into the kept ids
    soft_ids: torch.Tensor  # (N, k) index into the kept ids, -1 where the id is not kept
    soft_logits: torch.Tensor  # (N, k) float32 target logits

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def make_batch(examples: list[Example], vocab_to_kept: torch.Tensor, pad_id: int) -> Batch:
    """vocab_to_kept: (V,) long, index into the kept ids or -1."""
    sequences = [e.prompt_ids + e.answer_ids[:-1] for e in examples]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    rows, cols, labels, soft_ids, soft_logits = [], [], [], [], []
    for row, (example, sequence) in enumerate(zip(examples, sequences)):
        input_ids[row, :len(sequence)] = torch.tensor(sequence)
        attention_mask[row, :len(sequence)] = 1
        count = len(example.answer_ids)
        start = len(example.prompt_ids) - 1
        rows.append(torch.full((count,), row, dtype=torch.long))
        cols.append(torch.arange(start, start + count))
        labels.append(vocab_to_kept[torch.tensor(example.answer_ids)])
        soft_ids.append(vocab_to_kept[example.top_ids.long()])
        soft_logits.append(example.top_logits.float())
    return Batch(input_ids, attention_mask, torch.cat(rows), torch.cat(cols), torch.cat(labels),
                 torch.cat(soft_ids), torch.cat(soft_logits))


def restricted_logits(draft, batch: Batch) -> torch.Tensor:
    """(N, N_kept) draft logits over the kept ids at every answer position of the batch."""
    hidden = draft.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         use_cache=False).last_hidden_state  # (B, T, H)
    return draft.lm_head.restricted_logits(hidden[batch.rows, batch.cols])


def distill_loss(logits: torch.Tensor, batch: Batch, soft_weight: float) -> torch.Tensor:
    """logits: (N, N_kept). Hard CE on the greedy token plus soft CE on the target's top-k."""
    log_probs = logits.log_softmax(-1)
    valid = batch.hard_labels >= 0
    hard = -log_probs[valid].gather(-1, batch.hard_labels[valid, None]).mean()
    if soft_weight == 0.0:
        return hard
    kept = batch.soft_ids >= 0  # (N, k)
    teacher_probs = batch.soft_logits.masked_fill(~kept, float("-inf")).softmax(-1)
    teacher_probs = torch.nan_to_num(teacher_probs, nan=0.0)  # rows with no kept id
    draft_log_probs = log_probs.gather(-1, batch.soft_ids.clamp(min=0))  # (N, k)
    soft = -(teacher_probs * draft_log_probs).sum(-1).mean()
    return (1.0 - soft_weight) * hard + soft_weight * soft


def train_draft(draft, train: list[Example], config: DistillConfig, pad_id: int,
                validate: Callable[[object], float] | None = None,
                autocast_dtype: torch.dtype = torch.float32) -> dict:
    """Train in place; returns a summary (steps done, seconds, final loss).

    With autocast_dtype other than float32 the draft's forward and backward passes run under
    torch.autocast in it; the loss, weights, gradients and optimizer stay float32.

    With config.eval_every_steps > 0 and `validate` (model -> score, higher is better), the
    weights with the best score seen are restored at the end.
    """
    vocab_to_kept = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    kept = draft.lm_head.kept_token_ids
    vocab_to_kept[kept] = torch.arange(kept.numel())
    device = next(draft.parameters()).device
    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    rng = random.Random(config.seed)
    draft.train()
    started = time.monotonic()
    losses: list[float] = []
    bar = tqdm(total=config.steps, desc="distill: training", unit="step",
               disable=not config.progress)
    step = 0
    best: tuple[float, int, dict] | None = None
    for step in range(1, config.steps + 1):
        elapsed = time.monotonic() - started
        progress = step / config.steps
        if config.max_train_seconds is not None:
            if elapsed >= config.max_train_seconds:
                step -= 1
                break
            progress = max(progress, elapsed / config.max_train_seconds)
        lr = _learning_rate(config, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(rng.sample(train, min(config.batch_size, len(train))), vocab_to_kept,
                           pad_id).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype != torch.float32):
            logits = restricted_logits(draft, batch)
        loss = distill_loss(logits.float(), batch, config.soft_label_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if validate is not None and config.eval_every_steps and step % config.eval_every_steps == 0:
            best = _checkpoint(draft, validate, step, best)
            draft.train()
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", lr=f"{lr:.2e}")
    bar.close()
    draft.eval()
    summary = {"steps": step, "train_dtype": str(autocast_dtype).removeprefix("torch.")}
    if validate is not None and config.eval_every_steps:
        best = _checkpoint(draft, validate, step, best)
        draft.load_state_dict(best[2])
        summary.update(best_step=best[1], best_validation_agreement=round(best[0], 4))
    tail = losses[-20:] or [float("nan")]
    summary.update(train_seconds=round(time.monotonic() - started, 1),
                   final_train_loss=round(sum(tail) / len(tail), 4))
    return summary


def _checkpoint(draft, validate, step: int, best: tuple[float, int, dict] | None,
                ) -> tuple[float, int, dict]:
    draft.eval()
    score = validate(draft)
    print(f"[distill] step {step}: validation agreement {score:.4f}", flush=True)
    if best is not None and best[0] >= score:
        return best
    return score, step, {k: v.detach().clone() for k, v in draft.state_dict().items()}


def _learning_rate(config: DistillConfig, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay to 10% by progress (fraction of steps or time used)."""
    if step <= config.warmup_steps:
        return config.learning_rate * step / max(1, config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.learning_rate * (0.1 + 0.9 * cosine)
