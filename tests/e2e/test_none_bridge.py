"""Bridge mode `none` with a real vLLM (CPU build): in-place reload and restart, the probe's teeth,
and the prefix cache after a weight change. One test, one run (one vLLM start, plus the relaunch
of the restart sync), so it passes alone and in any selection.
"""

from __future__ import annotations

import random

import pytest

from grpod.bridges.probe import ProbeTolerance, run_probe
from grpod.config import GrpodConfig
from grpod.inference.release import group_members
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.group import RolloutGroup
from grpod.training.trainer import build_trainer
from tests.e2e.conftest import bridge_for

pytestmark = pytest.mark.e2e

LONG_PROMPT = "what is the sum of 3 and 4? it is 7. " * 5 + "and the sum of 5 and 9 is"
TOLERANCE = 1e-3


@pytest.fixture()
def bridge(portal, tmp_path):
    root = tmp_path
    # Tied embeddings: vLLM's in-place reload once left a tied output head on its old weights
    # (grpod.weights.reload_ext); an untied model would not show it.
    model, tok = build_model(seed=0, tie_word_embeddings=True)
    save_model(model, tok, root / "model")
    cfg = GrpodConfig.model_validate(
        {
            "run": {"dir": str(root / "run")},
            "model": {"path": str(root / "model"), "init_if_missing": False},
            "inference": {"start_timeout_s": 300.0},
            "train": {"lr": 1e-2, "threads": 1, "advantages": {"drop_zero_variance": False}},
            "bridge": {"mode": "none", "reload": "in_place", "probe_tolerance": TOLERANCE},
        }
    )
    b = bridge_for(cfg, root / "run", build_trainer(cfg))
    portal.call(b.start)
    try:
        yield b
    finally:
        portal.call(b.stop)


def _train(bridge, seed):
    rng = random.Random(seed)
    groups = []
    for g in range(2):
        prompt = [rng.randrange(3, 50) for _ in range(10)]
        toks = [prompt + [rng.randrange(3, 50) for _ in range(5)] for _ in range(4)]
        masks = [[0] * 10 + [1] * 5 for _ in range(4)]
        lps = [[0.0] * 10 + [-3.0] * 5 for _ in range(4)]
        groups.append(RolloutGroup(toks, masks, [1.0, 0.0, 0.5, 0.0], lps, group_id=f"g{g}"))
    metrics = bridge.trainer.train_step(groups)
    assert not metrics.get("skipped")


def _probe(portal, bridge):
    return portal.call(
        lambda: run_probe(bridge.engines[0].client, bridge.trainer, model=bridge.policy.served_name,
                          tolerance=ProbeTolerance(max_abs=TOLERANCE), timeout_s=60)
    )


def _long_prompt_gap(portal, bridge) -> float:
    ids = bridge.trainer.tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]
    served = portal.call(lambda: bridge.engines[0].client.score(ids, model=bridge.policy.served_name))
    own = bridge.trainer.score(ids)
    return max(abs(a - b) for a, b in zip(served, own, strict=True))


def test_probe_syncs_in_place_and_by_restart_without_stale_prefixes(portal, bridge):
    # The probe catches a step that was not synced.
    assert _probe(portal, bridge).ok
    assert _long_prompt_gap(portal, bridge) < TOLERANCE  # and the long prompt is now in the prefix cache
    _train(bridge, 1)
    stale = _probe(portal, bridge)
    assert not stale.ok and stale.max_abs_diff > 10 * TOLERANCE, stale

    # An in-place sync serves the new weights, and not cached prefixes of the old ones.
    process = bridge.engines[0].process
    pid = process.pid
    record = portal.call(bridge.sync_now)
    assert record.probe["ok"] and record.version == 1
    assert "reload" in record.phases and process.pid == pid, "in place: no restart"
    assert portal.call(bridge.engines[0].client.weight_version) == "1"
    assert _long_prompt_gap(portal, bridge) < TOLERANCE, "a cached prefix from the old weights was served"

    # A restart sync relaunches vLLM on the new checkpoint.
    _train(bridge, 2)
    bridge.cfg.reload = "restart"
    record = portal.call(bridge.sync_now)
    assert record.probe["ok"] and record.version == 2
    assert record.phases["launch"] > 0 and process.pid != pid
    assert group_members(pid) == [], "the previous vLLM's process group is gone"
    assert bridge.current_weights.name == "v000002"
    assert _long_prompt_gap(portal, bridge) < TOLERANCE
