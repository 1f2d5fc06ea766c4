"""A stand-in pair with the default pair's shapes, for measuring where the default target's weights
cannot go (a machine that gets only a small upload, such as a rented GPU box).

The target has SmolLM2-135M-Instruct's configuration (30 layers, hidden 576, vocabulary 49152,
its tokenizer and chat template) and random weights; the draft has the default draft's (the
target's first 2 layers, its embeddings and head). So each pass costs what the real pair's costs on
the same device. To make them agree about as often as a good draft does, the target's layers past
the draft's add little to the residual stream (their output projections scaled by
--deep-scale), the draft is a copy of the target's first layers with Gaussian noise of
--perturbation times each parameter's spread, and the head is sharpened (so that greedy choices are
seldom near ties) and never picks end-of-sequence (so answers run to max_new_tokens).

Their text is not language: the figures this pair gives are pass costs, batching, the serving
path's overhead and the speedup at the agreement it reports, not a real pair's acceptance.

    python benchmarks/shaped_pair.py --config-dir ~/.cache/specdec/SmolLM2-135M-Instruct-v1 --out /tmp/pair
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from emulated_pair import perturb, save_pair  # benchmarks/: a script's own folder is first on sys.path

DRAFT_LAYERS = 2


def build_shaped_pair(config_dir: Path, out: Path, deep_scale: float = 0.02, perturbation: float = 0.02,
                      head_scale: float = 8.0, seed: int = 0) -> tuple[Path, Path]:
    """Writes out/target and out/draft (Hugging Face directories with config_dir's tokenizer);
    returns their paths."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(config_dir)
    config.tie_word_embeddings = False  # a head of its own, sharpened without touching the embeddings
    tokenizer = AutoTokenizer.from_pretrained(config_dir)
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config).eval()
    specials = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id,
                config.eos_token_id, config.pad_token_id, config.bos_token_id} - {None}
    with torch.no_grad():
        target.lm_head.weight.mul_(head_scale)
        for special in specials:
            target.lm_head.weight[special] = 0.0
        for layer in target.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    draft_config = copy.deepcopy(config)
    draft_config.num_hidden_layers = DRAFT_LAYERS
    draft = AutoModelForCausalLM.from_config(draft_config).eval()
    draft.load_state_dict({name: value for name, value in target.state_dict().items()
                           if not name.startswith("model.layers.") or int(name.split(".")[2]) < DRAFT_LAYERS})
    perturb(draft, perturbation, seed + 1)
    target_path, draft_path = save_pair(out, target, draft, tokenizer)
    (out / "shaped_pair.json").write_text(json.dumps(
        {"deep_scale": deep_scale, "perturbation": perturbation, "head_scale": head_scale, "seed": seed,
         "target_layers": config.num_hidden_layers, "draft_layers": DRAFT_LAYERS}, indent=1) + "\n")
    return target_path, draft_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-dir", type=Path, required=True,
                        help="a directory with the default target's config.json and tokenizer files (no weights needed)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deep-scale", type=float, default=0.02)
    parser.add_argument("--perturbation", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    target, draft = build_shaped_pair(args.config_dir, args.out, deep_scale=args.deep_scale,
                                      perturbation=args.perturbation, seed=args.seed)
    print(f"target {target}\ndraft  {draft}")


if __name__ == "__main__":
    main()
