import subprocess
import sys
from pathlib import Path

import pytest

from grpod.config import ConfigError, GrpodConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_default_is_valid_and_mirrors_the_tree():
    cfg = load_config(ROOT / "etc" / "grpod.toml")
    assert cfg.bridge.mode == "none"
    assert cfg.source.kind == "builtin"
    # Every section of the tree appears in the documented default file.
    text = (ROOT / "etc" / "grpod.toml").read_text()
    for section in GrpodConfig.model_fields:
        assert f"[{section}]" in text, section


def _documented_keys(text: str) -> set[tuple[str, str]]:
    """(section, key) of every `key = value` line of a TOML file, commented-out lines included."""
    import re

    section, found = "", set()
    for line in text.splitlines():
        header = re.match(r"^#?\s*\[\[?([\w.]+)\]\]?", line)
        if header:
            section = header.group(1)
            continue
        key = re.match(r"^#?\s*(\w+)\s*=", line)
        if key:
            found.add((section, key.group(1)))
    return found


def _models_in(annotation) -> list:
    """The config models an annotation holds: itself, each member of a (tagged) union, a list's item."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _tree_keys(model, section: str) -> set[tuple[str, str]]:
    """(section, key) of every leaf key of a config model, every kind/mode of a union included."""
    keys = set()
    for name, field in model.model_fields.items():
        members = _models_in(field.annotation)
        for member in members:
            keys |= _tree_keys(member, f"{section}.{name}".strip("."))
        if not members:
            keys.add((section, name))
    return keys


def test_the_embedded_default_documents_every_key_of_every_kind():
    """Issue #11: etc/grpod.toml is the documentation of every knob — every key of the config
    tree, the keys of every source kind and bridge mode included, appears there (set, or as a
    commented example) in its section."""
    documented = _documented_keys((ROOT / "etc" / "grpod.toml").read_text())
    missing = sorted(_tree_keys(GrpodConfig, "") - documented)
    assert not missing, f"keys missing from etc/grpod.toml: {missing}"


def test_unknown_key_names_file_and_path(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "train.stepz: unknown key" in str(err.value)


def test_wrong_type_and_bad_value(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = "many"\n[bridge]\nmode = "teleport"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "train.steps" in message and "'many'" in message
    assert "bridge.mode" in message


def test_missing_file_and_syntax_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="TOML syntax error"):
        load_config(bad)


def test_set_overrides_one_key(tmp_path):
    cfg = load_config(None, ["train.lr=1e-3", "bridge.mode=none", "source.kind=atropos", "source.atropos_url=http://127.0.0.1:9"])
    assert cfg.train.lr == 1e-3
    assert cfg.source.atropos_url == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(None, ["train.lr=-1"])


def test_each_source_kind_and_bridge_mode_has_its_own_keys():
    """Discriminated sections: a key of another kind or mode is refused, naming the kind."""
    with pytest.raises(ConfigError, match="source.atropos_url: unknown key of source.kind = 'builtin'"):
        load_config(None, ["source.atropos_url=http://127.0.0.1:9"])
    with pytest.raises(ConfigError, match="bridge.keep_adapters: unknown key of bridge.mode = 'none'"):
        load_config(None, ["bridge.keep_adapters=2"])
    with pytest.raises(ConfigError, match="source.kind: must be one of 'builtin', 'dataset', 'environment', 'atropos', 'replay'"):
        load_config(None, ["source.kind=batch"])
    assert load_config(None, []).source.kind == "builtin" and load_config(None, []).bridge.mode == "none"
    lora = load_config(None, ["bridge.mode=lora_only", "bridge.keep_adapters=2", "train.lora=true"])
    assert lora.bridge.keep_adapters == 2



def test_set_of_another_kind_switches_the_file_to_it(tmp_path, capsys):
    """`--set bridge.mode=shared` on the shipped file (written for mode "none", with its
    `bridge.reload`) switches the mode: the file's keys of the old kind only are dropped and named;
    a key of the old kind given by `--set` itself, or a key of no kind, is still refused."""
    shipped = ROOT / "etc" / "grpod.toml"
    notes: list[str] = []
    cfg = load_config(shipped, ["bridge.mode=shared"], notes)
    assert cfg.bridge.mode == "shared"
    assert notes == ["bridge.mode = 'shared' (--set) over the file's 'none': ignored the file's bridge.reload "
                     "(keys of bridge.mode = 'none' only)"]
    assert cfg.bridge.sync_every == 2 and cfg.bridge.probe_every == 4  # the keys every mode has are kept
    with pytest.raises(ConfigError, match="bridge.reload: unknown key of bridge.mode = 'shared'"):
        load_config(shipped, ["bridge.mode=shared", "bridge.reload=restart"])
    typo = tmp_path / "typo.toml"
    typo.write_text('[bridge]\nmode = "none"\nreloda = "restart"\n')
    with pytest.raises(ConfigError, match="bridge.reloda: unknown key of bridge.mode = 'shared'"):
        load_config(typo, ["bridge.mode=shared"])
    # Without an override of the kind, a key of another kind in the file is refused as before.
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[bridge]\nmode = "shared"\nreload = "restart"\n')
    with pytest.raises(ConfigError, match="bridge.reload: unknown key of bridge.mode = 'shared'"):
        load_config(wrong, ["train.lr=1e-5"])
    # A section that names no kind means the first one: the default.
    implicit = tmp_path / "implicit.toml"
    implicit.write_text('[source]\ntask_seed = 3\n')
    assert load_config(implicit).source.kind == "builtin"
    switched: list[str] = []
    cfg = load_config(implicit, ["source.kind=replay", "source.replay_path='x.jsonl'"], switched)
    assert cfg.source.kind == "replay" and "ignored the file's source.task_seed" in switched[0]
    # The CLI tells it on stderr and keeps stdout for `--print`'s JSON.
    from grpod.cli import main

    assert main(["check-config", str(shipped), "--set", "bridge.mode=shared", "--print"]) == 0
    out, err = capsys.readouterr()
    assert '"mode": "shared"' in out and "grpod: note:" not in out
    assert "ignored the file's bridge.reload" in err

def test_cross_field_rules():
    with pytest.raises(ConfigError, match="needs train.lora = true"):
        load_config(None, ["bridge.mode=lora_only"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        # Every group of one is dropped as zero-variance: the run would generate for all its steps,
        # train none, and only then fail.
        (["source.group_size=1"], "a group of one has no sibling"),
        (["source.group_size=1", "train.advantages.estimator='rloo'"], "a group of one has no sibling"),
        # A buffer at the budget punishes every completion: a pure length reward.
        (["source.max_tokens=8", "train.advantages.overlong_buffer=8"], "not below the completion budget (8 tokens)"),
        (["metrics.prometheus_port=70000"], "metrics.prometheus_port"),
    ],
)
def test_settings_that_would_validate_and_then_train_nothing_or_break_are_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_a_group_of_one_trains_with_a_baseline_over_the_step_or_the_sources_advantages():
    assert load_config(None, ["source.group_size=1", "train.advantages.estimator='reinforce_pp'"]).source.group_size == 1
    assert load_config(None, ["source.group_size=1", "train.advantages.use_source_advantages=true"]).source.group_size == 1
    assert load_config(None, ["source.max_tokens=8", "train.advantages.overlong_buffer=7"]).train.advantages.overlong_buffer == 7


def test_digest_changes_with_config():
    a = load_config(None)
    b = load_config(None, ["train.lr=1e-3"])
    assert a.digest() != b.digest()
    assert a.digest() == load_config(None).digest()


@pytest.mark.parametrize(
    "override, fragment",
    [("train.steps=0", "train.steps"), ("inference.port=70000", "inference.port"), ("nope.x=1", "nope: unknown key")],
)
def test_check_config_cli_exit_2(tmp_path, override, fragment):
    proc = subprocess.run(
        [sys.executable, "-m", "grpod", "check-config", str(ROOT / "etc" / "grpod.toml"), "--set", override],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert "grpod.toml" in proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "etc" / "examples").glob("**/*.toml")), ids=lambda p: p.name)
def test_example_configs_are_valid(path):
    """Every example loads, and points at a real model or at the tiny one `make model` builds
    (building it when missing is harmless); none builds a tiny model where a real one is named."""
    cfg = load_config(path)
    tiny = cfg.model.path == Path("models/tiny-arith")
    assert tiny or cfg.model.init_if_missing is False, "examples point at a real model"


@pytest.mark.parametrize(
    ("rewards", "fragment"),
    [
        ([{"function": "exactly"}], "source.dataset.rewards.0.function: Value error, 'exactly' is neither a builtin"),
        ([{"function": "regex_format"}], "source.dataset.rewards.0: Value error, function = 'regex_format' needs pattern"),
        ([{"function": "regex_format", "pattern": "("}], "is not a regular expression"),
        ([{"function": "exact", "pattern": "x"}], "pattern is a key of function = 'regex_format' or 'reasoning_gym'"),
        ([{"function": "reasoning_gym", "pattern": "(-)?(\\d+)"}], "has 2 groups; the answer is its first"),
        ([{"function": "reasoning_gym", "pattern": "[0-"}], "is not a regular expression"),
        ([{"function": "exact"}, {"function": "pkg.mod:exact"}], "share a metric name"),
        ([{"function": "exact", "wieght": 2}], "source.dataset.rewards.0.wieght: unknown key"),
    ],
)
def test_dataset_reward_specs_are_checked_naming_the_key(rewards, fragment):
    from grpod.config import parse_config

    tree = {"source": {"kind": "dataset", "dataset": {"path": "train.jsonl", "rewards": rewards}}}
    with pytest.raises(ConfigError) as err:
        parse_config(tree, "my.toml")
    assert fragment in str(err.value) and "my.toml" in str(err.value)
    ok = parse_config({"source": {"kind": "dataset", "dataset": {"path": "t.jsonl", "rewards": [
        {"function": "math", "weight": 0.5}, {"function": "regex_format", "pattern": "^\\d+$", "name": "fmt"},
        {"function": "reasoning_gym", "pattern": "-?\\d+"}, {"function": "reasoning_gym", "name": "tagged"}]}}})
    assert [r.metric_name for r in ok.source.dataset.rewards] == ["math", "fmt", "reasoning_gym", "tagged"]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.lr=inf", "train.lr: Input should be a finite number"),
        ("train.lr=nan", "train.lr: Input should be a finite number"),
        ("train.lr=true", "train.lr: Value error, expected a number, not the boolean true"),
        ("train.lr=2.0", "train.lr: Input should be less than or equal to 1"),
        ("source.temperature=inf", "source.temperature: Input should be a finite number"),
        ("source.temperature=1e-300", "source.temperature: Input should be greater than or equal to 0.01"),
        ("train.loss.kl_coef=1e308", "train.loss.kl_coef: Input should be less than or equal to 100"),
        ("train.loss.clip_high=-inf", "train.loss.clip_high: Input should be a finite number"),
        ("source.fail_after_s=inf", "source.fail_after_s: Input should be a finite number"),
        ("train.steps=false", "train.steps: Value error, expected a number, not the boolean false"),
        ('train.lr="1"', "train.lr: Value error, expected a valid number, not the string '1'"),
        ('inference.block_size="64"', "inference.block_size: Value error, expected a valid number, not the string '64'"),
        ("inference.block_size=true", "inference.block_size: Value error, expected a number, not the boolean true"),
    ],
)
def test_no_infinite_nan_or_boolean_number_anywhere(tmp_path, override, fragment):
    """Issue #30, 1: the values that destroyed a run live are refused at start-up, from the file
    (TOML has `inf` and `nan`) and from --set alike."""
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        load_config(None, [override])
    key, value = override.split("=")
    section, _, name = key.rpartition(".")
    path = tmp_path / "grpod.toml"
    path.write_text(f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=f"{path}: {key}"):
        load_config(path)


def test_assigned_values_are_checked_too():
    """Live changes assign to the running config: JSON's 1e999 (inf) and a boolean are refused."""
    import json

    cfg = GrpodConfig()
    with pytest.raises(ValueError, match="finite number"):
        cfg.train.loss.clip_high = json.loads("1e999")
    with pytest.raises(ValueError, match="not the boolean"):
        cfg.train.lr = True
    cfg.inference.borrow_trainer_cores = True  # a bool where the field takes one stays fine
    cfg.inference.block_size = 64
    cfg.inference.block_size = "auto"  # the word a number field takes beside its numbers stays fine
    assert cfg.train.loss.clip_high == 0.28 and cfg.train.lr == 2e-5


def test_a_config_file_that_is_not_utf8_or_too_deep_is_a_config_error(tmp_path):
    """Issue #30, 4: what SIGHUP re-reads is any file an editor left; each is a ConfigError."""
    path = tmp_path / "grpod.toml"
    path.write_bytes(b"[train]\nlr = 1e-4\n# \xff\xfe latin-1 \xe9\n")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(path)
    path.write_text("[train]\nsteps = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="unusable TOML"):
        load_config(path)
    path.write_text("x = " + "[" * 30000 + "]" * 30000 + "\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)
    with pytest.raises(ConfigError, match="unusable value: Exceeds the limit"):
        load_config(None, ["train.lr=" + "9" * 5000])


def test_an_integer_beyond_int64_is_refused():
    with pytest.raises(ConfigError, match="bridge.sync_every: Value error, 200-bit integer: out of range"):
        load_config(None, [f"bridge.sync_every={10**60}"])
    assert load_config(None, [f"bridge.sync_every={2**63 - 1}"]).bridge.sync_every == 2**63 - 1


@pytest.mark.parametrize(
    ("args", "option", "decider"),
    [
        (["--host", "0.0.0.0"], "--host", "inference.host"),
        (["--hos", "0.0.0.0"], "--host", "inference.host"),  # argparse's abbreviation
        (["--ho=0.0.0.0"], "--host", "inference.host"),
        (["--host.x", "1"], "--host", "inference.host"),  # vLLM's dotted JSON key
        (["--api_key=evil"], "--api-key", "inference.api_key"),  # vLLM reads _ as -
        (["--api-ke", "evil"], "--api-key", "inference.api_key"),
        (["--api_k=evil"], "--api-key", "inference.api_key"),
        (["--max-num-seqs", "8", "--po", "80"], "--port", "inference.port"),
        (["--uds=/tmp/engine.sock"], "--uds", "engines listen on TCP"),
        (["--mod", "/elsewhere"], "--model", "model.path"),
        (["--served_model", "x"], "--served-model-name", "served names"),
        (["--config", "vllm.yaml"], "--config", "the options above"),
    ],
)
def test_inference_extra_args_may_not_set_an_option_grpod_decides(args, option, decider):
    """A reserved option in any spelling vLLM's parser takes would override grpod's bind and key."""
    import json

    with pytest.raises(ConfigError) as err:
        load_config(None, [f"inference.extra_args={json.dumps(args)}"])
    message = str(err.value)
    assert "inference.extra_args" in message and f"vLLM's {option}, which grpod decides" in message, message
    assert decider in message, message


def test_inference_extra_args_in_full_that_set_no_reserved_option_are_kept():
    from grpod.config import InferenceConfig, reserved_vllm_option

    fine = ["--max-num-seqs", "8", "--model-impl", "vllm", "--config-format=hf", "--seed=1", "--max-loras", "2",
            "--generation-config", "/path/--host", "--hf-overrides.x", "1", "-O3"]
    assert InferenceConfig(extra_args=fine).extra_args == fine
    assert [arg for arg in fine if reserved_vllm_option(arg)] == []


def test_valid_settings_most_likely_not_meant_are_said_as_notes():
    """Both were accepted in silence: a sync cadence longer than the run (every rollout from the
    starting weights) and a warm-up longer than the run (train.lr never reached)."""
    notes: list[str] = []
    load_config(ROOT / "etc" / "grpod.toml", ["bridge.sync_every=1000", "train.warmup_steps=200"], notes)
    assert len(notes) == 2, notes
    assert notes[0].startswith("bridge.sync_every = 1000 is more than train.steps = 100")
    assert "never reaches train.lr (at the last step it is 0.5 of it)" in notes[1]
    quiet: list[str] = []
    load_config(ROOT / "etc" / "grpod.toml", [], quiet)
    load_config(ROOT / "etc" / "grpod.toml", ["bridge.mode=shared", "bridge.sync_every=1000"], quiet)
    assert quiet == ["bridge.mode = 'shared' (--set) over the file's 'none': ignored the file's bridge.reload "
                     "(keys of bridge.mode = 'none' only)"], "shared syncs in its fence, not by sync_every"


def test_a_verifiers_evaluation_without_a_held_out_split_is_said_to_play_training_tasks():
    """A verifiers taskset has one stream of tasks: without args.eval, evaluation reads tasks
    0..eval.size-1 of the training stream, which the run trains on first; that was reported as
    held-out accuracy in silence."""
    env = ["source.kind=environment", 'source.environment.adapter="verifiers"', 'source.environment.name="vf_calculator"']
    notes: list[str] = []
    load_config(ROOT / "etc" / "grpod.toml", [*env, "eval.size=32"], notes)
    said = [note for note in notes if "verifiers" in note]
    assert len(said) == 1 and "plays training tasks 0-31" in said[0] and "args.eval" in said[0], notes
    for fine in (["eval.size=0"], ["eval.size=32", "source.environment.args.eval.seed=99"],
                 ["eval.size=32", 'source.environment.adapter="calculator"']):
        notes = []
        load_config(ROOT / "etc" / "grpod.toml", [*env, *fine], notes)
        assert not [note for note in notes if "held-out" in note], (fine, notes)


def test_a_completion_cap_that_leaves_no_room_for_the_prompt_is_refused():
    """source.max_tokens = 300 with model.max_seq_len = 256 passed check-config; vLLM then refused
    every request (max_tokens cannot be greater than max_model_len) and the run dropped 464 groups
    in 30 s, at step 0, for ever. The same for the evaluation's cap."""
    for key in ("source.max_tokens", "eval.max_tokens"):
        with pytest.raises(ConfigError) as caught:
            load_config(ROOT / "etc" / "grpod.toml", ["model.max_seq_len=256", f"{key}=300", "eval.size=8"])
        assert f"{key} = 300 is not below model.max_seq_len = 256" in str(caught.value), caught.value
    load_config(ROOT / "etc" / "grpod.toml", ["model.max_seq_len=256", "source.max_tokens=200"])
    # Atropos decides its own lengths: source.max_tokens is not what vLLM is asked for there.
    load_config(ROOT / "etc" / "grpod.toml", ["model.max_seq_len=256", "source.kind=atropos", "source.max_tokens=300",
                                                 "eval.size=0"])


@pytest.mark.parametrize("raw", ['"/opt/models\\qwen"', '"unterminated', '["a", "b"', "{a = 1"])
def test_a_set_value_meant_as_toml_but_invalid_is_refused_not_kept_with_its_quotes(raw):
    """`--set 'model.path="/opt/models\\qwen"'` (an escape TOML refuses) was taken as a bare word:
    the path '"/opt/models\\qwen"', a relative one starting with a quote, where start would have
    built the tiny model."""
    from grpod.config import parse_assignment

    with pytest.raises(ConfigError, match="not a valid TOML value"):
        parse_assignment(f"model.path={raw}")
    assert parse_assignment("bridge.mode=shared") == (["bridge", "mode"], "shared")
    assert parse_assignment("run.dir='/tmp/x\\5'") == (["run", "dir"], "/tmp/x\\5")


def test_a_number_set_where_text_is_expected_is_taken_as_its_text():
    """TOML reads `--set inference.env.OMP_NUM_THREADS=2` and `inference.kv_cache_bytes=64000000`
    (the documented plain-bytes form) as integers: both were refused ("valid string"), though
    valid; the workaround was quoting twice."""
    cfg = load_config(ROOT / "etc" / "grpod.toml", ["inference.env.OMP_NUM_THREADS=2", "inference.kv_cache_bytes=64000000",
                                                    "metrics.wandb_project=123"])
    assert cfg.inference.env["OMP_NUM_THREADS"] == "2" and cfg.inference.kv_cache_bytes == "64000000"
    assert cfg.metrics.wandb_project == "123"
    with pytest.raises(ConfigError):  # a boolean is still not text, nor a number
        load_config(ROOT / "etc" / "grpod.toml", ["metrics.wandb_project=true"])
