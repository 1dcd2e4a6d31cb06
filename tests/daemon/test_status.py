"""The one status model (`grpod.daemon.status`): the table an operator reads (`grpod ctl status`)
rendered from the reply's own fields, and a new field added in one place."""

import dataclasses
import json

from grpod.daemon import status as status_model
from grpod.daemon.progress import RunPhase
from grpod.daemon.status import STATUS_FIELDS, StatusField, render_table, status_table


def _render_status(reply: dict) -> str:
    return render_table(status_table(reply))


def test_status_shows_rates_over_training_time_and_each_startup_phase():
    table = _render_status({
        "rates": {"steps_per_s": 2.5, "tokens_per_s": 1234.4, "generated_tokens_per_s": 321.0},
        "startup": {"resume_point_s": 0.01, "trainer_load_s": 7.2, "engines_healthy_s": 31.0, "first_probe_s": 0.4},
    })
    assert "2.50 steps/s, 1234 trained tok/s, 321 generated tok/s" in table
    assert "resume_point 0.0, trainer_load 7.2, engines_healthy 31.0, first_probe 0.4" in table
    before_first_step = _render_status({"rates": {"steps_per_s": None}})
    assert "steps/s" not in before_first_step


def test_status_lists_each_engine_with_its_node_and_each_agent():
    local = {"name": "engine-0", "node": "local", "base_url": "http://127.0.0.1:8000", "state": "serving", "version": 3,
             "restarts": 0, "launches": 1, "pid": 11}
    agent = {"url": "http://10.0.0.2:7900", "engine": "engine-0", "reachable": False, "last_answer_age_s": 31.5,
             "error": "agent http://10.0.0.2:7900 /engines/engine-0/ended: no response: timed out after 30 s"}
    remote = {"name": "10.0.0.2:7900/engine-0", "node": "http://10.0.0.2:7900", "base_url": None, "state": "down",
              "version": 2, "restarts": 1, "launches": 2, "pid": 42, "agent": agent}
    table = _render_status({"bridge": {"engines": [local, remote],
                                       "last_sync": {"version": 3, "phases": {"broadcast": 0.05, "probe": 0.02}}}})
    assert "engine-0  node local  http://127.0.0.1:8000  serving  v3  restarts 0  launches 1  pid 11" in table
    assert "10.0.0.2:7900/engine-0  node http://10.0.0.2:7900  -  down  v2  restarts 1  launches 2  pid 42" in table
    assert "agent http://10.0.0.2:7900: 1 engines, UNREACHABLE (agent http://10.0.0.2:7900" in table
    assert "last sync v3 (s): broadcast 0.050, probe 0.020" in table


def test_status_shows_the_config_changes_and_what_the_bridge_did_not_its_whole_table():
    """The table left out `config_changes` (operations.md says `ctl status` shows them), and under
    "bridge transitions" printed the mode's static table, PROBE_FAIL --> FAILED included, on a
    healthy run."""
    changes = [{"version": 1, "step": 12, "origin": "ctl set", "key": "train.lr", "old": 2e-05, "new": 1e-05},
               {"version": 2, "step": 30, "origin": "reload etc/grpod.toml", "key": "bridge.sync_every", "old": 2, "new": 4}]
    bridge = {"transitions": ["PROBING --PROBE_FAIL--> FAILED"],
              "recent": [{"from": "SERVING", "to": "SYNCING", "event": "SYNC", "elapsed_s": 4.2},
                         {"from": "SYNCING", "to": "SERVING", "event": "PROBE_OK", "elapsed_s": 0.31}]}
    table = _render_status({"config_changes": changes, "bridge": bridge})
    assert "#1 step 12: train.lr 2e-05 -> 1e-05 (ctl set)" in table
    assert "#2 step 30: bridge.sync_every 2 -> 4 (reload etc/grpod.toml)" in table
    assert "SERVING --SYNC--> SYNCING  (4.2 s in SERVING)" in table and "PROBE_FAIL" not in table
    assert "config changes" not in _render_status({"config_changes": []})


def test_status_says_how_many_trainer_ranks_and_whether_they_are_in_step():
    assert "trainer ranks           1 process" in _render_status({})
    ranks = {"world_size": 2, "restarts": 1, "backend": "gloo", "out_of_step": None}
    assert "2 (FSDP2 over gloo, torchrun restart 1)" in _render_status({"trainer_ranks": ranks})
    broken = _render_status({"trainer_ranks": ranks | {"out_of_step": "plan: Connection reset by peer"}})
    assert "OUT OF STEP since plan: Connection reset by peer" in broken


def test_status_says_what_evaluation_runs_and_how_many_threads_the_engine_has():
    running = {"when": "periodic", "step": 20, "running_s": 41.5, "beside_training": True}
    assert "running 41.5 s (periodic, step 20, beside training)" in _render_status({"evaluation": running})
    last = {"eval_accuracy": 0.25, "step": 15, "eval_s": 62.0}
    assert "last: accuracy 0.250 at step 15 (62.0 s)" in _render_status({"evaluation": None, "last_eval": last})
    loan = {"enabled": True, "reason": "on", "engine_threads": 1, "borrowed_threads": 2, "lent": True, "loans": 7,
            "lent_s": 80.2}
    assert "2 now; 1, or 2 while the trainer waits (7 loans, 80.2 s)" in _render_status({"core_loan": loan})
    off = loan | {"enabled": False, "reason": "auto: 1.7 MiB of weights", "borrowed_threads": 1}
    assert "1 (no loan: auto: 1.7 MiB of weights)" in _render_status({"core_loan": off})
    trainer = {"enabled": True, "reason": "on", "threads": 1, "borrowed_threads": 2, "micro_batches": 12}
    shown = _render_status({"core_loan": loan | {"trainer": trainer}})
    assert "trainer threads" in shown and "1, or 2 while generation is parked and the engine idle (12 micro-batches)" in shown
    shown = _render_status({"core_loan": loan | {"trainer": trainer | {"enabled": False, "reason": "train.borrow_engine_cores = false"}}})
    assert "1 (no loan: train.borrow_engine_cores = false)" in shown


def test_a_dataset_sources_reward_workers_and_function_means_show():
    source = {"kind": "dataset", "generated": 40, "dropped": 3, "drop_reasons": {"reward_timeout": 3},
              "reward_pool": {"workers": 2, "size": 2, "calls": 120, "mean_call_ms": 1.2, "replaced": 3,
                              "failed": {"reward_timeout": 3}}}
    table = _render_status({"source": source, "last_metrics": {"reward/correct": 0.5, "loss": 0.1}})
    assert "dataset: 40 generated, 3 dropped {'reward_timeout': 3}" in table
    assert "2/2 up, 120 calls (1.2 ms mean), 3 replaced, failed {'reward_timeout': 3}" in table
    assert "reward/correct" in table
    curriculum = {"level": 1, "levels": [0, 1, 2], "window_pass_rate": 0.4375, "window_groups": 6, "moves_up": 3,
                  "moves_down": 2, "draws": {"0": 50, "1": 41}}  # as the reply's JSON carries them
    shown = _render_status({"source": source | {"curriculum": curriculum}})
    assert "level 1 of [0, 1, 2], window pass rate 0.4375 (6 groups), 3 up, 2 down, draws {0: 50, 1: 41}" in shown
    assert "window pass rate - (0 groups)" in _render_status(
        {"source": source | {"curriculum": curriculum | {"window_pass_rate": None, "window_groups": 0}}})


class _Run:
    """Enough of a Reporter for every field's reader: nothing attached yet, as at start-up."""

    def __init__(self, tmp_path):
        from grpod.config import parse_config
        from grpod.daemon.alarms import CheckpointAlarm, LogprobGapAlarm, SourceErrorAlarm, SyncAlarm
        from grpod.daemon.progress import RunProgress
        from grpod.rollouts.buffer import RolloutBuffer
        from grpod.rollouts.validation import RejectionCounter
        from grpod.service.notify import Heartbeat

        self.cfg = parse_config({})
        self.progress, self.buffer, self.rejections = RunProgress(4), RolloutBuffer(4), RejectionCounter()
        self.heartbeat, self.run_dir = Heartbeat(60.0), tmp_path
        self.logprob_gap, self.source_alarm, self.checkpoint_alarm = LogprobGapAlarm(0.05), SourceErrorAlarm(60, None), CheckpointAlarm()
        self.sync_alarm = SyncAlarm()
        self.desk = self.bridge = self.source = self.admission = self.world = self.evaluations = self.cores = None
        self.memory = None

    def inference_endpoint(self):
        return None


def test_the_reply_is_the_fields_and_the_table_they_render(tmp_path):
    reply = status_model.build_status(_Run(tmp_path))
    assert set(reply) == {f.key for f in STATUS_FIELDS} | {"table"}
    json.dumps(reply)  # what the socket sends
    assert reply["table"] == status_table({k: v for k, v in reply.items() if k != "table"})
    assert ["state", "starting"] in reply["table"]


def test_a_resumed_runs_step_shows_as_unknown_until_the_resume_point_is_read(tmp_path):
    """While a start reads its resume point the progress still says step 0: the table says the
    step is not known yet, and shows it once the resume point's counts are in."""
    run = _Run(tmp_path)
    assert ["step", "?/4 (resume point not read yet)"] in status_model.build_status(run)["table"]
    run.progress.restore_counts(3, {})
    run.progress.startup["resume_point_s"] = 0.2
    assert ["step", "3/4"] in status_model.build_status(run)["table"]
    run.progress.phase = RunPhase.RUNNING
    run.progress.startup.clear()  # a start that reached training knows its step whatever it timed
    assert ["step", "3/4"] in status_model.build_status(run)["table"]


def test_a_new_field_is_one_entry(tmp_path, monkeypatch):
    """What adding a status field takes: one StatusField (its key, its reader, its rows)."""
    field = StatusField("reward_workers_up", lambda r: 2, lambda v, s: [("reward workers up", v)])
    monkeypatch.setattr(status_model, "STATUS_FIELDS", (*STATUS_FIELDS, field))
    reply = status_model.build_status(_Run(tmp_path))
    assert reply["reward_workers_up"] == 2  # --json and Prometheus read it
    assert "reward workers up" in render_table(reply["table"])  # the operator's table shows it
    assert dataclasses.is_dataclass(field)


def test_the_closing_lines_and_the_log_count_every_dropped_group(loop_config, capsys):
    """The failures' warnings are rate-limited (one per 30 s, with a count of those held back), so
    a run's log undercounted them and nothing at the end said how many groups were lost and why."""
    import structlog.testing

    from tests.daemon.conftest import make_loop

    loop = make_loop(loop_config("run.progress=true"), trainer=None)
    for reason in ["reward_error"] * 27 + ["reward_timeout"]:
        loop.source.stats.drop(reason)
    with structlog.testing.capture_logs() as events:
        loop.reporter.summary()
    assert "groups dropped by the source: 28 (reward_error 27, reward_timeout 1)" in capsys.readouterr().err
    (drops,) = [e for e in events if e["event"] == "source_drops"]
    assert drops["dropped"] == 28 and drops["drop_reasons"] == {"reward_error": 27, "reward_timeout": 1}
    # An evaluation whose every reward call failed is not an accuracy of 0 without a word.
    loop.reporter.eval_done({"eval_accuracy": 0.0, "eval_size": 8, "eval_reward_failures": 8}, "start", step=0)
    said = capsys.readouterr().err
    assert "no accuracy: none of the 8 held-out problems was scored (every reward call failed" in said
    assert "accuracy 0.000" not in said
    loop.reporter.eval_done({"eval_accuracy": 0.25, "eval_size": 8, "eval_reward_failures": 2}, "end", step=5)
    assert "accuracy 0.250 on 8 held-out problems (2 not scored: reward failures" in capsys.readouterr().err
    loop.reporter.summary()
    assert "held-out accuracy: none scored (step 0) -> 0.250 (step 5) on 8 problems" in capsys.readouterr().err


def test_a_resumed_start_says_on_the_console_which_checkpoint_it_resumes(loop_config, capsys):
    """A resumed run said so only in grpod.log, at info level (the console shows warnings)."""
    from pathlib import Path

    from tests.daemon.conftest import make_loop

    loop = make_loop(loop_config("run.progress=true", "train.steps=100"), trainer=None)
    loop.reporter.resumed(Path("/runs/x/checkpoints/step-000040"), 40, 20, 3)
    assert ("grpod: resuming /runs/x/checkpoints/step-000040 at step 40/100 (policy version 20, 3 groups buffered)"
            in capsys.readouterr().err)
