"""The trainer on the tiny built-in model: learning direction, split invariance, save/load, resume."""

import copy
import math
import random

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpod.config import parse_config
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.group import RolloutGroup
from grpod.training.optim import OptimizerUnavailable
from grpod.training.trainer import build_trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    save_model(*build_model(seed=0), out)
    return out


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tied")
    save_model(*build_model(seed=0, tie_word_embeddings=True), out)
    return out


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def config(lora=False, **train):
    tree = {"train": {"threads": 1, "lora": lora, **train}}
    if lora:
        tree["bridge"] = {"mode": "lora_only"}
    return parse_config(tree)


def random_groups(n_groups=4, size=4, seed=0, temperature=1.0):
    """Groups shaped like the arithmetic task's: a 15-25 token prompt, 2-16 token completions."""
    rng = random.Random(seed)
    groups = []
    for _ in range(n_groups):
        prompt = [rng.randrange(3, 52) for _ in range(rng.randint(15, 25))]
        tokens, masks, logprobs = [], [], []
        for _ in range(size):
            completion = [rng.randrange(3, 52) for _ in range(rng.randint(2, 16))]
            tokens.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
            logprobs.append([0.0] * len(prompt) + [rng.uniform(-4.5, -3.5) for _ in completion])
        scores = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(size - 2)]
        groups.append(RolloutGroup(tokens, masks, scores, inference_logprobs=logprobs, temperature=temperature))
    return groups


def params(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def completion_logprob(trainer, prompt, completion):
    return sum(trainer.score(prompt + completion)[len(prompt) - 1 :])


def test_positive_advantage_completion_rises_and_negative_falls(model_dir):
    trainer = build_trainer(config(lr=1e-3, loss={"tis_mode": "off"}), model_dir)
    prompt, good, bad = [1, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32]
    group = RolloutGroup(
        tokens=[prompt + good, prompt + bad], loss_mask=[[0] * 5 + [1] * 3] * 2, scores=[1.0, 0.0]
    )
    before = completion_logprob(trainer, prompt, good), completion_logprob(trainer, prompt, bad)
    metrics = trainer.train_step([group])
    after = completion_logprob(trainer, prompt, good), completion_logprob(trainer, prompt, bad)
    assert metrics["skipped"] == 0.0 and trainer.step == 1
    assert after[0] > before[0]
    assert after[1] < before[1]


def step_with_gradients(trainer, groups):
    """Run `train_step` and capture the accumulated gradients as the optimizer is about to use them."""
    grads = {}

    def snapshot(optimizer, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    handle = trainer.optimizer.register_step_pre_hook(snapshot)
    try:
        metrics = trainer.train_step(groups)
    finally:
        handle.remove()
    return metrics, grads


ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the trainer keeps


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_split_gives_the_same_step(model_dir, aggregation):
    """Accumulating over micro-batches equals one big batch.

    Tolerances (fp32; the splits differ only in summation order and padded shapes; measured
    differences are below 1e-6): the accumulated gradient of every tensor to 5e-6 relative (norm of
    the difference over the norm), which catches any normaliser error; the parameters after the
    AdamW step to 5 % of one step (lr) absolute where the gradient entry is at least 100x Adam's
    eps. Below that, Adam's first update lr * g / (|g| + eps) turns float noise into a sizable
    fraction of lr: measured, an entry of 1.65e-8 in one split and 2.15e-8 in another (the tensor's
    norm agreeing to 5e-6) moved its weight by 0.62 and 0.68 lr. Those entries are held to one step.
    """
    lr = 2e-5
    groups = random_groups(seed=1)
    results = []
    for budget, floor in ((16, 0.0), (200, 0.0), (100_000, 0.0), (100_000, 0.95)):
        cfg = config(
            lr=lr, micro_batch_tokens=budget, micro_batch_min_efficiency=floor, share_prompt=False,
            loss={"aggregation": aggregation, "kl_coef": 0.01},
        )
        trainer = build_trainer(cfg, model_dir)
        metrics, grads = step_with_gradients(trainer, groups)
        results.append((metrics, grads, params(trainer)))
    micro_batches = [m["micro_batches"] for m, _, _ in results]
    assert micro_batches[0] == 16 and micro_batches[2] == 1
    assert 1 < micro_batches[1] < 16 and 1 < micro_batches[3] < 16 and micro_batches[1] != micro_batches[3]
    base_metrics, base_grads, base_params = results[0]
    for metrics, grads, after in results[1:]:
        assert metrics["grad_norm"] == pytest.approx(base_metrics["grad_norm"], rel=5e-6)
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=5e-6)
        assert grads.keys() == base_grads.keys()
        for name, grad in grads.items():
            assert (grad - base_grads[name]).norm() <= 5e-6 * base_grads[name].norm(), name
        for name, value in after.items():
            moved = (value - base_params[name]).abs()
            assert moved.max() <= 1.01 * lr, name
            grad = base_grads.get(name)
            settled = grad.abs() >= 100 * ADAM_EPS if grad is not None else torch.ones_like(moved, dtype=torch.bool)
            assert settled.any() and moved[settled].max() <= 0.05 * lr, name


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_groups_prompt_forwarded_once_gives_the_same_step(model_dir, epochs):
    """train.share_prompt: micro-batches of one group each, packed into one row: the prompt once,
    then every completion, no padding. The gradient of every tensor and the loss equal those of
    the full forward per row (fp32: summation order only, as for micro-batch splits), and the
    embedding sees each group once: one row of its prompt and its completions' lengths."""
    groups = random_groups(seed=5)
    results, shapes = [], []
    for share in (False, True):
        trainer = build_trainer(config(share_prompt=share, epochs=epochs, loss={"kl_coef": 0.01}), model_dir)
        seen: list[tuple[int, ...]] = []
        hook = trainer.model.get_input_embeddings().register_forward_hook(
            lambda _m, args, _out, seen=seen: seen.append(tuple(args[0].shape)))
        try:
            metrics, grads = step_with_gradients(trainer, groups)
        finally:
            hook.remove()
        results.append((metrics, grads))
        shapes.append(seen)
    (plain, plain_grads), (shared, shared_grads) = results
    assert shared["loss"] == pytest.approx(plain["loss"], rel=5e-6)
    assert shared["grad_norm"] == pytest.approx(plain["grad_norm"], rel=5e-6)
    for name, grad in plain_grads.items():
        assert (shared_grads[name] - grad).norm() <= 5e-6 * grad.norm(), name
    prompts = [len(g.tokens[0]) - sum(g.loss_mask[0]) - 1 for g in groups]  # the last prompt token predicts
    forwards = epochs + (epochs > 1)  # each update, and pi_old's logprobs first when there are several
    # One micro-batch per group, one row: its prompt once, then every completion unpadded.
    once = [p + sum(len(t) - p for t in g.tokens) for p, g in zip(prompts, groups, strict=True)]
    assert sorted(shapes[1]) == sorted((1, width) for width in once * forwards)
    processed = [sum(rows * width for rows, width in seen) for seen in shapes]
    assert processed[1] == sum(once) * forwards and shared["processed_tokens"] == sum(once) * epochs  # the metrics count updates
    assert shared["tokens"] == plain["tokens"] == epochs * sum(len(t) for g in groups for t in g.tokens)
    assert shared["shared_prompt_tokens"] == epochs * sum(p * (len(g.tokens) - 1) for p, g in zip(prompts, groups, strict=True))
    assert processed[1] < 0.6 * processed[0], processed


@pytest.mark.parametrize("share_prompt", [False, True])
def test_micro_batches_padded_to_a_multiple_give_the_same_step(model_dir, share_prompt):
    """train.pad_to_multiple: every forward's length (a padded block's width, a packed row's
    positions) is a multiple of it, and the loss and every gradient are those of the unrounded
    micro-batches (no real position sees the padding; nothing reads its outputs). The step's
    processed tokens count the padding."""
    groups = random_groups(seed=11)
    results, shapes = [], []
    for multiple in (0, 32):
        trainer = build_trainer(config(share_prompt=share_prompt, pad_to_multiple=multiple, epochs=2), model_dir)
        seen: list[tuple[int, ...]] = []
        hook = trainer.model.get_input_embeddings().register_forward_hook(
            lambda _m, args, _out, seen=seen: seen.append(tuple(args[0].shape)))
        try:
            results.append(step_with_gradients(trainer, groups))
        finally:
            hook.remove()
        shapes.append(seen)
    (plain, plain_grads), (rounded, rounded_grads) = results
    assert any(width % 32 for _, width in shapes[0]), "the unrounded widths are not multiples already"
    assert all(width % 32 == 0 for _, width in shapes[1]), shapes[1]
    assert rounded["loss"] == pytest.approx(plain["loss"], rel=5e-6)
    assert rounded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=5e-6)
    for name, grad in plain_grads.items():
        assert (rounded_grads[name] - grad).norm() <= 5e-6 * grad.norm(), name
    # pi_old's logprobs are forwarded once before the two updates: the metrics count the updates.
    updates = [sum(rows * width for rows, width in seen) * 2 // 3 for seen in shapes]
    assert (plain["processed_tokens"], rounded["processed_tokens"]) == tuple(updates)
    assert rounded["padding_efficiency"] < plain["padding_efficiency"]


@pytest.mark.parametrize("epochs", [1, 2])
def test_micro_batches_run_on_the_threads_the_step_loop_lends_and_the_thread_gets_its_own_back(model_dir, epochs):
    """`threads_now` is asked before every micro-batch (pi_old's too), in the thread that forwards
    it; the micro-batches of the updates above train.threads are counted, and the thread leaves
    on its own threads."""
    import threading

    trainer = build_trainer(config(epochs=epochs, micro_batch_tokens=64, share_prompt=False), model_dir)
    told: list[int] = []  # alternately the idle engines' thread too, and not
    asked_in: set[int] = set()

    def threads_now() -> int:
        asked_in.add(threading.get_ident())
        told.append(2 if len(told) % 2 == 0 else 1)
        return told[-1]

    trainer.threads_now = threads_now
    ran: list[int] = []
    hook = trainer.model.get_input_embeddings().register_forward_pre_hook(lambda *_: ran.append(torch.get_num_threads()))
    results: list = []
    worker = threading.Thread(target=lambda: results.extend([trainer.train_step(random_groups()), torch.get_num_threads()]))
    worker.start()
    worker.join()
    hook.remove()
    metrics, threads_after = results
    updates = int(metrics["micro_batches"])  # pi_old's pass (epochs > 1) forwards the batch once more
    assert len(told) == updates + (updates // epochs if epochs > 1 else 0) and updates >= 4
    assert asked_in == {worker.ident}
    assert ran == told, "each micro-batch on the threads it was given"
    assert metrics["borrowed_core_micro_batches"] == told[-updates:].count(2) > 0
    assert threads_after == 1, "train.threads again once the phase is over"


def test_gradient_checkpointing_gives_the_same_step(model_dir):
    groups = random_groups(seed=2)
    plain = build_trainer(config(), model_dir).train_step(groups)
    cfg = config()
    cfg.model.gradient_checkpointing = True
    checkpointed = build_trainer(cfg, model_dir).train_step(groups)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    # A packed group needs no key/value cache, so checkpointing keeps the prompt forwarded once.
    assert checkpointed["shared_prompt_tokens"] == plain["shared_prompt_tokens"] > 0


def test_inference_logprobs_equal_to_the_trainers_give_zero_diff_at_any_temperature(model_dir):
    trainer = build_trainer(config(), model_dir)
    groups = random_groups(n_groups=2, seed=3, temperature=0.7)
    for g in groups:
        g.inference_logprobs = [[0.0] + trainer.score(seq, temperature=0.7) for seq in g.tokens]
    metrics = trainer.train_step(groups)
    assert metrics["logprob_diff_max"] < 1e-5
    assert metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["kl"] < 1e-9


def test_score_is_the_temperature_scaled_fp32_logprob_of_each_next_token(model_dir):
    trainer = build_trainer(config(), model_dir)
    ids = [1, 20, 21, 22, 2, 30]
    got = trainer.score(ids, temperature=0.8)
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([ids])).logits[0, :-1]
    want = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert len(got) == len(ids) - 1
    assert got == pytest.approx(want.tolist(), abs=1e-6)


def test_all_zero_variance_batch_is_skipped_without_touching_the_weights(model_dir):
    trainer = build_trainer(config(), model_dir)
    before = params(trainer)
    groups = random_groups(n_groups=2)
    for g in groups:
        g.scores = [1.0] * len(g.scores)
    metrics = trainer.train_step(groups)
    assert metrics["skipped"] == 1.0 and metrics["dropped_zero_variance"] == 2.0 and metrics["sequences"] == 0.0
    assert trainer.step == 0
    for name, value in params(trainer).items():
        assert torch.equal(value, before[name])


def test_non_finite_gradient_skips_the_update(model_dir):
    trainer = build_trainer(config(advantages={"use_source_advantages": True}), model_dir)
    before = params(trainer)
    groups = random_groups(n_groups=1)
    groups[0].advantages = [float("inf"), 1.0, -1.0, 0.0]
    metrics = trainer.train_step(groups)
    assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    assert trainer.step == 0
    for name, value in params(trainer).items():
        assert torch.equal(value, before[name])
    assert all(p.grad is None for p in trainer.model.parameters())


def test_step_metrics_are_reported(model_dir):
    metrics = build_trainer(config(), model_dir).train_step(random_groups())
    for key in (
        "loss", "reward_mean", "ratio_mean", "ratio_min", "ratio_max", "clipped_low_fraction",
        "clipped_high_fraction", "kl", "entropy", "grad_norm", "lr", "tokens", "padding_efficiency",
        "sequences", "dropped_zero_variance", "logprob_diff_mean", "logprob_diff_abs_mean", "logprob_diff_max",
    ):
        assert isinstance(metrics[key], float), key
    assert metrics["sequences"] == 16.0 and metrics["lr"] == pytest.approx(2e-5)
    assert 0 < metrics["padding_efficiency"] <= 1 and metrics["entropy"] > 0


def test_reward_mean_leaves_out_completions_no_reward_function_scored(model_dir):
    """The dataset source puts a placeholder score where every function answered None
    (`unscorable`); the step's reward_mean (progress line, Prometheus, plot) is over the scored."""
    groups = random_groups(n_groups=1)
    groups[0].scores = [0.0, 1.0, 0.0, 0.0]  # the last two stand in for unscorable completions
    groups[0].overrides = [{}, {}, {"unscorable": True}, {"unscorable": True}]
    metrics = build_trainer(config(), model_dir).train_step(groups)
    assert metrics["reward_mean"] == 0.5


def test_tied_embeddings_stay_one_parameter_after_a_step_and_a_save(tied_model_dir, tmp_path):
    trainer = build_trainer(config(lr=1e-3), tied_model_dir)
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = model.lm_head.weight.detach().clone()
    trainer.train_step(random_groups())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, before)
    # One optimizer state for the shared matrix, not two.
    assert len(trainer.optimizer.state) == len(list(model.parameters()))

    trainer.save_weights(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_a_tied_embeddings_lookup_gradient_is_sparse_and_the_step_is_the_same(tied_model_dir, model_dir, share_prompt):
    """The tied lookup's gradient comes sparse (no vocab x hidden zero-fill per micro-batch) and
    autograd adds it into the head's dense one: the weight's gradient is dense, equal to the dense
    lookup's, over several micro-batches. An untied embedding keeps a dense gradient."""
    groups = random_groups(seed=7)
    cfg = config(share_prompt=share_prompt, micro_batch_tokens=64, lr=1e-3)
    results = []
    for sparse in (True, False):
        trainer = build_trainer(cfg, tied_model_dir)
        embedding = trainer.model.get_input_embeddings()
        assert embedding.sparse  # what the trainer set
        embedding.sparse = sparse
        metrics, grads = step_with_gradients(trainer, groups)
        assert metrics["micro_batches"] > 1
        results.append((metrics, grads, trainer))
    (sparse_metrics, sparse_grads, trainer), (dense_metrics, dense_grads, _) = results
    weight = trainer.model.get_input_embeddings().weight
    name = next(n for n, p in trainer.model.named_parameters() if p is weight)
    assert sparse_grads[name].layout == torch.strided  # what the optimizer got
    assert sparse_metrics["loss"] == pytest.approx(dense_metrics["loss"], rel=1e-6)
    for key, grad in dense_grads.items():
        assert (sparse_grads[key] - grad).norm() <= 1e-6 * grad.norm(), key
    untied = build_trainer(cfg, model_dir)
    assert not untied.model.get_input_embeddings().sparse
    _, untied_grads = step_with_gradients(untied, groups)
    assert untied_grads["model.embed_tokens.weight"].layout == torch.strided


def test_full_save_loads_with_from_pretrained_and_the_copied_tokenizer(model_dir, tmp_path):
    trainer = build_trainer(config(lr=1e-3), model_dir)
    trainer.train_step(random_groups())
    out = tmp_path / "weights"
    trainer.save_weights(out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = [1, 20, 21, 22, 2, 30]
    with torch.no_grad():
        got = torch.log_softmax(loaded(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        got = got.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert got.tolist() == pytest.approx(trainer.score(ids), abs=1e-6)
    assert AutoTokenizer.from_pretrained(out)("12+3=")["input_ids"] == trainer.tokenizer("12+3=")["input_ids"]


def test_lora_adapter_loads_in_peft_and_matches_the_trainer(model_dir, tmp_path):
    trainer = build_trainer(config(lora=True, lr=1e-2), model_dir)
    trainer.train_step(random_groups())
    out = tmp_path / "adapter"
    trainer.save_weights(out)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        base_logits = base(input_ids=torch.tensor([[1, 20, 21, 22, 2, 30]])).logits
    peft_model = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[1, 20, 21, 22, 2, 30]])
    trainer.model.eval()
    with torch.no_grad():
        loaded_logits = peft_model(input_ids=ids).logits
        own_logits = trainer.model(input_ids=ids).logits
    assert (loaded_logits - base_logits).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(loaded_logits, own_logits, rtol=1e-5, atol=1e-5)


def test_lora_trains_only_adapters_with_no_dropout_by_default(model_dir):
    trainer = build_trainer(config(lora=True), model_dir)
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    dropouts = [m for n, m in trainer.model.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Identity) for m in dropouts)


def test_a_resumed_adapter_takes_the_configs_dropout(model_dir, tmp_path):
    """The saved adapter's shape is kept; its dropout (a training setting, like the learning rate)
    is the config's: it was the checkpoint's, so `train.lora_config.dropout` changed nothing."""
    build_trainer(config(lora=True), model_dir).save_weights(tmp_path / "w")
    resumed = build_trainer(config(lora=True, disable_dropout=False, lora_config={"dropout": 0.1}), model_dir,
                            adapter_path=tmp_path / "w")
    dropouts = [m for n, m in resumed.model.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in dropouts)


@pytest.mark.parametrize("lora", [False, True])
def test_resume_from_saved_weights_and_state_continues_identically(model_dir, tmp_path, lora):
    cfg = config(lora=lora, lr=1e-3, warmup_steps=3)
    first, second = random_groups(seed=4), random_groups(seed=5)
    original = build_trainer(cfg, model_dir)
    original.train_step(first)
    original.save_weights(tmp_path / "w")
    state = copy.deepcopy(original.state_dict())  # as if written to disk: no shared tensors
    if lora:
        resumed = build_trainer(cfg, model_dir, adapter_path=tmp_path / "w")
    else:
        resumed = build_trainer(cfg, tmp_path / "w")
    resumed.load_state_dict(state)
    assert resumed.step == 1
    a, b = original.train_step(second), resumed.train_step(second)
    assert a["lr"] == b["lr"] == pytest.approx(2 / 3 * 1e-3)
    for (name, p), (_, q) in zip(original.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_a_frozen_reference_model_starts_at_zero_and_grows(model_dir, lora):
    cfg = config(lora=lora, lr=1e-2, loss={"kl_coef": 0.1, "kl_reference": "model"})
    cfg.model.path = model_dir
    trainer = build_trainer(cfg, model_dir)
    groups = random_groups()
    first = trainer.train_step(groups)
    second = trainer.train_step(groups)
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)
    assert second["kl"] > 1e-6


def test_kl_reference_model_is_the_initial_policy_even_after_resume(model_dir, tmp_path):
    cfg = config(lr=1e-2, loss={"kl_coef": 0.1, "kl_reference": "model"})
    cfg.model.path = model_dir
    trainer = build_trainer(cfg, model_dir)
    trainer.train_step(random_groups())
    trainer.save_weights(tmp_path / "w")
    resumed = build_trainer(cfg, tmp_path / "w")
    assert resumed.train_step(random_groups(seed=9))["kl"] > 1e-6


def test_kl_reference_model_missing_is_a_clear_error(model_dir, tmp_path):
    cfg = config(loss={"kl_coef": 0.1, "kl_reference": "model"})
    cfg.model.path = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="kl_reference = 'model' needs the initial policy"):
        build_trainer(cfg, model_dir)


def test_adafactor_takes_a_step(model_dir):
    trainer = build_trainer(config(optimizer="adafactor", lr=1e-3), model_dir)
    before = params(trainer)
    metrics = trainer.train_step(random_groups())
    assert metrics["skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in params(trainer).items())


def test_adamw_8bit_without_bitsandbytes_or_cuda_fails_at_start(model_dir):
    with pytest.raises(OptimizerUnavailable, match="adamw_8bit"):
        build_trainer(config(optimizer="adamw_8bit"), model_dir)


# ---- the algorithm audit's defects (each failed before its fix) and PPO epochs -------------------


def test_turning_kl_on_live_with_a_model_reference_loads_it_instead_of_crashing(model_dir):
    # F3: kl_coef 0 at start, then `ctl set train.loss.kl_coef` > 0 with kl_reference = "model".
    cfg = config(loss={"kl_coef": 0.0, "kl_reference": "model"})
    cfg.model.path = model_dir
    trainer = build_trainer(cfg, model_dir)
    assert trainer.reference_model is None
    trainer.train_step(random_groups())
    cfg.train.loss.kl_coef = 0.1
    metrics = trainer.train_step(random_groups(seed=3))
    assert trainer.reference_model is not None
    assert metrics["skipped"] == 0.0 and metrics["kl"] > 0


def test_one_update_per_batch_cannot_clip_but_ppo_epochs_do(model_dir):
    # F8: with one update the ratio is 1 and the clip metrics are constants; with 2 epochs x 2
    # minibatches pi_old is recorded before the first update and the later updates see r != 1.
    one = build_trainer(config(lr=1e-2, loss={"clip_low": 0.01, "clip_high": 0.01}), model_dir).train_step(random_groups())
    assert one["ratio_min"] == one["ratio_max"] == 1.0 and one["clipped_fraction"] == 0.0
    assert one["updates"] == 1.0
    ppo = build_trainer(config(lr=1e-2, epochs=2, minibatches=2, loss={"clip_low": 0.01, "clip_high": 0.01}), model_dir
    ).train_step(random_groups())
    assert ppo["updates"] == 4.0 and ppo["optimizer_steps"] == 4.0
    assert ppo["ratio_max"] > 1.01 or ppo["ratio_min"] < 0.99
    assert ppo["clipped_fraction"] > 0


def test_first_update_of_ppo_epochs_sees_ratio_one(model_dir):
    # pi_old is the policy before the first update: the first minibatch's ratios are 1 (to float
    # noise from a different micro-batch shape), so one epoch of one minibatch equals the old path.
    groups = random_groups()
    a = build_trainer(config(lr=1e-3), model_dir)
    b = build_trainer(config(lr=1e-3, epochs=1, minibatches=1), model_dir)
    a.train_step(groups)
    b.train_step(groups)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    forced = build_trainer(config(lr=1e-3, epochs=2), model_dir)
    metrics = forced.train_step(random_groups())
    assert metrics["updates"] == 2.0


def test_a_skipped_batch_advances_the_schedule(model_dir):
    # F12: the cosine follows train.steps (batches), skipped or not.
    trainer = build_trainer(config(schedule="cosine", steps=4, lr=1e-3), model_dir)
    zero = random_groups(n_groups=1)
    zero[0].scores = [1.0] * 4
    assert trainer.train_step(zero)["skipped"] == 1.0
    lr_after_skip = trainer.scheduler.get_last_lr()[0]
    assert lr_after_skip == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert trainer.step == 0


def test_resume_applies_a_train_lr_changed_in_the_config(model_dir, tmp_path):
    # F12: a train.lr changed between runs used to be overridden by the checkpoint's.
    trainer = build_trainer(config(lr=1e-4), model_dir)
    trainer.train_step(random_groups())
    state = copy.deepcopy(trainer.state_dict())
    resumed = build_trainer(config(lr=1e-5), model_dir)
    resumed.load_state_dict(state)
    assert resumed.scheduler.base_lrs[0] == pytest.approx(1e-5)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)
    same = build_trainer(config(lr=1e-4), model_dir)
    same.load_state_dict(copy.deepcopy(state))
    assert same.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


@pytest.fixture(scope="module")
def dropout_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-dropout")
    model, tokenizer = build_model(seed=0)
    model.config.attention_dropout = 0.5
    save_model(model, tokenizer, out)
    return out


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_the_training_forward_runs_without_dropout_by_default(dropout_model_dir, disable_dropout):
    # F13: a base config with dropout trained with it on, while vLLM serves without it.
    from grpod.training.advantages import compute_advantages
    from grpod.training.batching import collate, training_sequences
    from grpod.training.loss import StepNormalizer

    trainer = build_trainer(config(disable_dropout=disable_dropout), dropout_model_dir)
    result = compute_advantages(random_groups(), trainer.train_cfg.advantages)
    sequences = training_sequences(result, mask_truncated=False)
    norm = StepNormalizer.for_step([len(s.loss_positions) for s in sequences], 16)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        trainer._forward_mode()
        losses.append(trainer._micro_batch_loss(collate(sequences, trainer.pad_id), norm)[0].item())
    assert (losses[0] == losses[1]) is disable_dropout


def test_completion_budget_of_dr_grpo_follows_the_source():
    # F11: M was source.max_tokens even for Atropos (the builtin source's knob).
    assert parse_config({"source": {"max_tokens": 24}}).completion_budget == 24
    atropos = parse_config({"source": {"kind": "atropos"}, "model": {"max_seq_len": 512}})
    assert atropos.completion_budget == 512
    explicit = parse_config({"source": {"kind": "atropos"}, "train": {"loss": {"max_completion_tokens": 300}}})
    assert explicit.completion_budget == 300
    # An environment's max_tokens caps one model turn; the loss sees every turn of the episode.
    env = {"kind": "environment", "max_tokens": 48, "environment": {"adapter": "verifiers", "name": "x", "max_turns": 4}}
    assert parse_config({"source": env, "model": {"max_seq_len": 1024}}).completion_budget == 192
    env["environment"]["max_episode_tokens"] = 100
    assert parse_config({"source": env}).completion_budget == 100


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "cispo", "gspo"])
def test_every_loss_type_trains_with_ppo_epochs(model_dir, loss_type):
    trainer = build_trainer(config(lr=1e-3, epochs=2, loss={"type": loss_type}), model_dir)
    before = params(trainer)
    metrics = trainer.train_step(random_groups())
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"]) and metrics["updates"] == 2.0
    assert any(not torch.equal(v, before[k]) for k, v in params(trainer).items())


def test_entropy_bonus_changes_the_step(model_dir):
    groups = random_groups()
    plain = build_trainer(config(lr=1e-3), model_dir)
    bonus = build_trainer(config(lr=1e-3, loss={"entropy_coef": 0.5}), model_dir)
    m_plain, m_bonus = plain.train_step(groups), bonus.train_step(groups)
    assert m_bonus["entropy"] == pytest.approx(m_plain["entropy"])
    assert m_bonus["loss"] == pytest.approx(m_plain["loss"] - 0.5 * m_plain["entropy"], rel=1e-4)


def test_the_lm_head_runs_only_from_the_first_position_that_predicts_a_loss_token(model_dir, tied_model_dir):
    """Prompt positions need no logits: the head sees [rows, length - first, hidden], and the
    logits it gives for the loss tokens are those of a forward over every position."""
    from grpod.training.batching import TrainingSequence, collate
    from grpod.training.forward import predicting_logits

    for path in (model_dir, tied_model_dir):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        sequences = [  # prompts of 9 and 6 tokens, right-padded to 14
            TrainingSequence(list(range(3, 17)), [0] * 9 + [1] * 5, 1.0, 1.0),
            TrainingSequence(list(range(20, 30)), [0] * 6 + [1] * 4, -1.0, 1.0),
        ]
        batch = collate(sequences, pad_id=0)
        seen: list[tuple[int, ...]] = []
        hook = model.get_output_embeddings().register_forward_hook(
            lambda _m, args, _out, seen=seen: seen.append(tuple(args[0].shape))
        )
        try:
            with torch.no_grad():
                kept = predicting_logits(model, batch)
                full = model(input_ids=batch.input_ids, use_cache=False).logits[batch.rows, batch.positions - 1]
        finally:
            hook.remove()
        assert seen[0][:2] == (2, 14 - 5), seen  # from position 5 (predicts the second row's first loss token)
        assert seen[1][:2] == (2, 14)
        assert kept.shape == full.shape == (9, model.config.vocab_size)
        torch.testing.assert_close(kept, full, rtol=0, atol=1e-5)


def test_a_sequence_sampled_by_two_versions_is_corrected_with_each_tokens_own_logprob(model_dir):
    """An episode whose first turn the trainer's policy sampled and whose second an engine 0.5 nats
    less sure of each token (another version) sampled: token-level IS masks exactly the second
    turn's tokens (rho = e^0.5 > cap), from each token's own inference logprob."""
    trainer = build_trainer(config(lr=1e-4, loss={"tis_mode": "token_mask", "tis_cap": 1.2}), model_dir)
    prompt, first, tool, second = [1, 10, 11, 12], [20, 21, 22], [5, 6], [30, 31, 32, 33]
    tokens = prompt + first + tool + second
    mask = [0] * 4 + [1] * 3 + [0] * 2 + [1] * 4
    versions = [0] * 4 + [7] * 3 + [0] * 2 + [8] * 4
    scored = [0.0] + trainer.score(tokens)  # scored[t]: the trainer's logprob of tokens[t]
    logprobs = [lp - (0.5 if v == 8 else 0.0) if m else 0.0 for lp, m, v in zip(scored, mask, versions, strict=True)]
    group = RolloutGroup(
        tokens=[tokens, tokens], loss_mask=[mask, mask], scores=[1.0, 0.0], inference_logprobs=[logprobs, logprobs],
        token_versions=[versions, versions], policy_version=7,
    )
    metrics = trainer.train_step([group])
    assert metrics["loss_tokens"] == 14 and math.isfinite(metrics["loss"])
    assert metrics["tis_masked_fraction"] == pytest.approx(4 / 7)
    assert metrics["logprob_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert metrics["logprob_diff_mean"] == pytest.approx(0.5 * 4 / 7, abs=1e-4)


def test_an_export_carries_the_tokenizer_after_the_directory_it_was_loaded_from_is_gone(model_dir, tmp_path):
    """A resumed trainer loads from a checkpoint's model/, which rotation prunes a few checkpoints
    later; every export after that still carries the tokenizer files (read at load), or vLLM
    relaunched on it and the next resume would have no tokenizer."""
    import shutil

    resumed_from = tmp_path / "checkpoints" / "step-000010" / "model"
    shutil.copytree(model_dir, resumed_from)
    trainer = build_trainer(config(), resumed_from)
    shutil.rmtree(tmp_path / "checkpoints")
    trainer.save_weights(tmp_path / "v000011")
    written = sorted(p.name for p in (tmp_path / "v000011").iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert name in written
        assert (tmp_path / "v000011" / name).read_bytes() == (model_dir / name).read_bytes()
    assert AutoTokenizer.from_pretrained(tmp_path / "v000011").encode("12+7=") == trainer.tokenizer.encode("12+7=")


def test_a_model_directory_without_a_tokenizer_is_refused_by_name(model_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json", "vocab*"))
    with pytest.raises((OSError, ValueError), match="bare"):
        build_trainer(config(), bare)


def test_the_logged_lr_is_the_one_the_step_uses_after_a_ctl_set(model_dir):
    """`ctl set train.lr` changes the optimizer's rate at the boundary; the step's `lr` metric read
    the scheduler's cached rate, the old one, for the very step an operator checks."""
    trainer = build_trainer(config(lr=1e-3), model_dir)
    trainer.train_step(random_groups(seed=1))
    trainer.set_learning_rate(1e-4)
    metrics = trainer.train_step(random_groups(seed=2))
    assert metrics["lr"] == pytest.approx(1e-4), metrics["lr"]
