"""A checkpoint whose adapter or optimizer state does not fit the config's [train] is refused at the
resume point, before anything launches (review 7: the first step failed with vLLM up, exit 1); a
changed optimizer may start afresh with run.resume_mismatch = "allow"; old checkpoints are checked
on their files. Real trainers on the tiny model, real checkpoints written by RunStore."""

from __future__ import annotations

import hashlib
import json

import pytest
import structlog
import torch

from grpod.config import load_config
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.group import RolloutGroup
from grpod.run.checkpoint import ResumeError
from grpod.run.store import SHARDED_STATE, RunSnapshot, RunStore
from grpod.training.trainer import build_trainer

LORA = ["train.lora=true", "bridge.mode=lora_only"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    save_model(*build_model(seed=0), out)
    return out


def groups(n: int = 2) -> list[RolloutGroup]:
    """Arithmetic-shaped groups: a prompt, four completions, mixed scores."""
    out = []
    for g in range(n):
        prompt = [5 + g, 9, 14, 20, 7, 3, 30, 11]
        tokens = [prompt + [12 + i, 40 - i, 2] for i in range(4)]
        masks = [[0] * len(prompt) + [1, 1, 1] for _ in range(4)]
        logprobs = [[0.0] * len(prompt) + [-4.0, -4.1, -3.9] for _ in range(4)]
        out.append(RolloutGroup(tokens, masks, [1.0, 0.0, 1.0, 0.0], inference_logprobs=logprobs))
    return out


def write_checkpoint(tmp_path, model_dir, *overrides: str, sharded: bool = False) -> list[str]:
    """A checkpoint of one trained step under `overrides`; the run's base overrides back."""
    base = [f"run.dir={str(tmp_path / 'run')!r}", f"model.path={str(model_dir)!r}", "train.threads=1",
            "train.lr=1e-3", "train.warmup_steps=4"]
    cfg = load_config(None, [*base, *overrides])
    trainer = build_trainer(cfg)
    trainer.train_step(groups())
    if sharded:  # as trainer ranks under torchrun write it: the optimizer in DCP shards
        from grpod.training.sharded import save_sharded_state

        trainer.sharded = True
        trainer.save_sharded = lambda path: save_sharded_state(trainer.model, trainer.optimizer, path)
    RunStore(cfg, cfg.run.dir).save(trainer, RunSnapshot(1, 1, [], {"kind": "builtin", "next_index": 9}, {}))
    return base


def resume_point(base, *overrides: str):
    cfg = load_config(None, [*base, *overrides])
    store = RunStore(cfg, cfg.run.dir)
    return store, store.resume_point()


def make_old(checkpoint) -> None:
    """The checkpoint as a grpod from before the training shape was recorded wrote it."""
    state = json.loads((checkpoint / "run_state.json").read_text())
    state.pop("training", None)
    (checkpoint / "run_state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    reseal(checkpoint)


def reseal(checkpoint) -> None:
    """The manifest of an edited checkpoint sealed again (as its writer would have sealed it)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (checkpoint / entry["path"]).read_bytes()
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


@pytest.mark.parametrize("allow", [False, True], ids=["refuse", "allow"])
@pytest.mark.parametrize(
    ("written", "changed", "key", "values"),
    [
        ([*LORA, "train.lora_config.rank=4"], [*LORA], "train.lora_config.rank", "checkpoint 4, config 16"),
        ([*LORA], [*LORA, "train.lora_config.alpha=64.0"], "train.lora_config.alpha", "checkpoint 32.0, config 64.0"),
        ([*LORA, "train.lora_config.target_modules=['q_proj', 'v_proj']"], [*LORA], "train.lora_config.target_modules",
         'checkpoint ["q_proj", "v_proj"], config ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]'),
        ([], [*LORA], "train.lora", "checkpoint false, config true"),
        ([*LORA], [], "train.lora", "checkpoint true, config false"),
    ],
    ids=["rank", "alpha", "target_modules", "full_to_lora", "lora_to_full"],
)
def test_a_lora_change_is_refused_naming_the_checkpoint_key_values_and_remedies_even_with_allow(
    tmp_path, model_dir, written, changed, key, values, allow
):
    # Review 6/7: a changed rank or alpha was ignored (the checkpoint's adapter loaded as saved);
    # LoRA on a full checkpoint failed at the first step, vLLM already up, exit 1.
    base = write_checkpoint(tmp_path, model_dir, *written)
    with pytest.raises(ResumeError) as caught:  # exit 2: the operator's input (supervisor.INPUT_ERRORS)
        resume_point(base, *changed, *(["run.resume_mismatch=allow"] if allow else []))
    message = str(caught.value)
    assert str(tmp_path / "run" / "checkpoints" / "step-000001") in message
    assert f"{key}: {values}" in message, message
    assert f"Put the config back ({key} = " in message
    assert 'run.resume = "never"' in message and "run.resume = PATH" in message
    assert "refused whatever run.resume_mismatch says" in message


def test_an_optimizer_change_is_refused_and_allow_resumes_it_with_the_optimizer_afresh(tmp_path, model_dir):
    # Review 7a: adamw -> adafactor loaded AdamW's state into Adafactor: KeyError 'beta1' at the first step.
    base = write_checkpoint(tmp_path, model_dir)
    with pytest.raises(ResumeError) as caught:
        resume_point(base, "train.optimizer=adafactor")
    message = str(caught.value)
    assert 'train.optimizer: checkpoint "adamw", config "adafactor"' in message
    assert 'Put the config back (train.optimizer = "adamw")' in message
    assert 'run.resume_mismatch = "allow" resumes it with the optimizer started afresh' in message

    with structlog.testing.capture_logs() as logs:
        store, restored = resume_point(base, "train.optimizer=adafactor", "run.resume_mismatch=allow")
    assert restored.fresh_optimizer and restored.step == 1
    warned = [e for e in logs if e["event"] == "resume_optimizer_restarted"]
    assert warned and warned[0]["checkpoint_optimizer"] == "adamw" and warned[0]["config_optimizer"] == "adafactor"
    trainer = store.load_trainer(restored)
    assert type(trainer.optimizer).__name__ == "Adafactor" and not trainer.optimizer.state
    assert trainer.step == 1 and trainer.scheduler.last_epoch == 1
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 / 4), "the schedule's rate at step 1"
    metrics = trainer.train_step(groups())
    assert metrics["skipped"] == 0.0 and trainer.optimizer.state and trainer.step == 2


@pytest.mark.parametrize(
    ("written", "changed", "named"),
    [
        ([*LORA, "train.lora_config.rank=4"], [*LORA], "train.lora_config.rank: checkpoint 4, config 16"),
        ([*LORA], [*LORA, "train.lora_config.alpha=8.0"], "train.lora_config.alpha: checkpoint 32.0, config 8.0"),
        ([], [*LORA], "train.lora: checkpoint false, config true"),
        ([], ["train.optimizer=adafactor"], 'train.optimizer: checkpoint "adamw", config "adafactor"'),
        (["train.optimizer=adafactor"], [], 'train.optimizer: checkpoint "adafactor", config "adamw"'),
    ],
    ids=["rank", "alpha", "full_to_lora", "adamw_to_adafactor", "adafactor_to_adamw"],
)
def test_a_checkpoint_that_does_not_record_its_shape_is_checked_on_its_files(tmp_path, model_dir, written, changed, named):
    base = write_checkpoint(tmp_path, model_dir, *written)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    make_old(checkpoint)
    assert resume_point(base, *written)[1].checkpoint == checkpoint, "unchanged, it resumes"
    with pytest.raises(ResumeError, match=named.replace("(", r"\(")):
        resume_point(base, *changed)


def test_an_old_checkpoint_whose_optimizer_cannot_be_read_is_resumed_with_a_warning(tmp_path, model_dir):
    base = write_checkpoint(tmp_path, model_dir)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    make_old(checkpoint)
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    # Trainer ranks' trainer_state.pt holds no optimizer (it is in their shards).
    torch.save({key: value for key, value in state.items() if key != "optimizer"}, checkpoint / "trainer_state.pt")
    reseal(checkpoint)
    with structlog.testing.capture_logs() as logs:
        restored = resume_point(base)[1]
    assert restored.checkpoint == checkpoint and not restored.fresh_optimizer
    assert [e["checkpoint"] for e in logs if e["event"] == "resume_optimizer_unchecked"] == [str(checkpoint)]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_allow_resumes_the_weights_of_a_sharded_checkpoint_with_another_optimizer_afresh(tmp_path, model_dir):
    base = write_checkpoint(tmp_path, model_dir, sharded=True)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    assert (checkpoint / SHARDED_STATE).is_dir()
    make_old(checkpoint)  # a sharded checkpoint is AdamW's (trainer ranks train AdamW only)
    with pytest.raises(ResumeError, match='train.optimizer: checkpoint "adamw", config "adafactor"'):
        resume_point(base, "train.optimizer=adafactor")
    store, restored = resume_point(base, "train.optimizer=adafactor", "run.resume_mismatch=allow")
    trainer = store.load_trainer(restored)
    saved = build_trainer(load_config(None, base), checkpoint / "model")
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), saved.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert type(trainer.optimizer).__name__ == "Adafactor" and not trainer.optimizer.state and trainer.step == 1
    assert trainer.train_step(groups())["skipped"] == 0.0
