"""Worker pools' bookkeeping without Ray: controller ids of replaced and added rollout slots, resize plans, the
replacement limit, the supervisor's loop over pools, and the controller's side of draining a leaving worker."""

import pytest

from actors.controller import SyncRequest
from cluster.pools import ROLES
from cluster.supervisor import Supervisor
from cluster.scale_requests import check_size
from cluster.worker_pool import PoolContext, WorkerIds, WorkerLost, check_replacement_allowed, drop_slots, resize_plan
from protocols.config import load_config
from tests.test_control_plane import controller
from tests.test_replay_queue import make_group


def test_a_fixed_pools_replacements_take_slot_plus_k_times_num_workers():
    ids = WorkerIds(2)
    assert ids.ids == [0, 1]
    # slot 0 replaced twice: 0 + 2 = 2, then 2 + 2 = 4; slot 1 once: 1 + 2 = 3
    assert [ids.renew(0), ids.renew(0), ids.renew(1)] == [2, 4, 3]
    assert ids.ids == [4, 3]


def test_added_slots_never_take_an_id_used_before():
    ids = WorkerIds(2)
    assert ids.add() == 2  # slot 2: id 2 is free (slot 0 was never replaced)
    assert ids.renew(0) == 4  # slot 0's next would be 2, taken by slot 2: 2 + 2 = 4
    assert ids.remove() == 2 and ids.ids == [4, 1]  # slot 2 leaves; its id stays retired
    assert ids.add() == 6  # slot 2 again: 2 and 4 used, so 6
    assert ids.renew(1) == 3 and len(ids.used) == 6  # ids 0, 1, 2, 3, 4, 6


def test_resize_plan_starts_at_the_end_in_bundles_first_and_drains_from_the_end():
    # 2 -> 4 with 3 bundles reserved at launch: slots 2 and 3 start, slot 2 in the last bundle, slot 3 outside
    grow = resize_plan(2, 4, bundles=3)
    assert (grow.start, grow.in_bundles, grow.leave) == ([2, 3], [2], [])
    # 3 -> 1: slots 2 then 1 leave
    shrink = resize_plan(3, 1, bundles=3)
    assert (shrink.start, shrink.in_bundles, shrink.leave) == ([], [], [2, 1])
    same = resize_plan(2, 2, bundles=2)
    assert (same.start, same.leave) == ([], [])


def test_a_resize_whose_middle_worker_fails_keeps_the_others_in_order_and_retires_its_id():
    # 2 -> 5: slots 2, 3, 4 start with ids 2, 3, 4; slot 3's engine fails to start
    ids, workers, run_refs = WorkerIds(2), ["w0", "w1"], ["r0", "r1"]
    for slot in resize_plan(2, 5, bundles=2).start:
        workers.append(f"w{ids.add()}")
        run_refs.append(None)  # its run starts once it loaded the weights
    failed = {3: "its start failed"}
    drop_slots(workers, failed)
    drop_slots(run_refs, failed)
    assert [ids.discard(slot) for slot in sorted(failed, reverse=True)] == [3]
    # 4 slots, each list the same length: the pool's size is the workers it has; slot 4's worker moved to slot 3
    assert workers == ["w0", "w1", "w2", "w4"] and ids.ids == [0, 1, 2, 4] and run_refs == ["r0", "r1", None, None]
    # the next new slot (4) would take id 4, used: 4 + the stride (the launch size, 2) = 6; id 3 is never given again
    assert ids.add() == 6 and 3 not in ids.ids


def test_a_pool_size_is_a_whole_number_of_at_least_one_worker():
    assert check_size("rollout", 3) == 3
    with pytest.raises(ValueError, match=r"rollout pool resize to 0: a running job keeps at least one rollout worker"):
        check_size("rollout", 0)
    with pytest.raises(ValueError, match=r"rollout pool resize to 2.5: a size is a whole number of workers, got "
                                         r"float; give an integer >= 1"):
        check_size("rollout", 2.5)
    for bad in ("3", True, None):  # a hand-written request file's string, a flag, nothing
        with pytest.raises(ValueError, match="a size is a whole number of workers"):
            check_size("reward", bad)


def test_the_replacement_limit_names_the_role_the_count_and_the_setting():
    check_replacement_allowed("reward", 1, replaced=2, max_replacements=3, err=RuntimeError())  # the 3rd: allowed
    with pytest.raises(WorkerLost, match=r"^reward worker 1 died \(RuntimeError\) after 3 replacements of reward "
                                         r"workers; fault.max_replacements=3 allows no more"):
        check_replacement_allowed("reward", 1, replaced=3, max_replacements=3, err=RuntimeError())


def test_every_role_has_a_pool_sized_by_its_config_and_the_rollout_pool_starts_last():
    cfg = load_config(None, ["algorithm.preset=grpo", "reference.num_workers=2", "reward.num_workers=3",
                             "rollout.num_workers=4", "teacher.path=/models/teacher", "teacher.num_workers=1"])
    assert [role.name for role in ROLES] == ["critic", "reward", "reference", "teacher", "rollout"]
    assert {role.name: role.launch_size(cfg) for role in ROLES} == {"critic": 0, "reward": 3, "reference": 2,
                                                                   "teacher": 1, "rollout": 4}


class StandInPool:
    """A pool's face to the supervisor and the rollout workers, without actors."""

    def __init__(self, name: str, handles: list, replaced: int = 0, scores: bool = False,
                 calls: list | None = None) -> None:
        self.name, self._handles, self.replaced, self.scores = name, handles, replaced, scores
        self.restart_seconds = [1.5] * replaced
        self.calls = calls if calls is not None else []
        self.resent_publishes = self.first_load_failures = 0
        self.start_failures = 0

    def handles(self) -> list:
        return list(self._handles)

    def check(self) -> None:
        self.calls.append(self.name)


def test_the_supervisor_loops_over_pools_in_order_and_counts_by_role():
    calls: list[str] = []
    pools = {"critic": StandInPool("critic", [], calls=calls),
             "reward": StandInPool("reward", ["r0", "r1"], replaced=2, scores=True, calls=calls),
             "rollout": StandInPool("rollout", ["w0"], replaced=1, calls=calls)}
    sup = Supervisor(load_config(None, []), controller=None, pools=pools)
    sup.check()
    assert calls == ["critic", "reward", "rollout"]
    assert sup.replaced_counts() == {"critic": 0, "reward": 2, "rollout": 1}
    assert sup.replaced["reward"] == 2 and sup.replaced["teacher"] == 0  # a role that is not there counts 0
    pools["rollout"].start_failures = 1
    assert sup.metrics() == {"fault/replaced_critic": 0.0, "fault/replaced_reward": 2.0,
                             "fault/replaced_rollout": 1.0, "fault/resent_publishes": 0.0,
                             "fault/first_load_failures": 0.0,
                             "fault/start_failures_critic": 0.0, "fault/start_failures_reward": 0.0,
                             "fault/start_failures_rollout": 1.0}
    assert sup.restart_seconds == [1.5, 1.5, 1.5] and sup.workers("reward") == ["r0", "r1"]
    # what the controller's scoring stage is given: every pool that scores groups, by role
    ctx = PoolContext(load_config(None, []), controller=None, placement=None, model_path="unused", pools=pools)
    assert ctx.scoring_lists() == {"reward": ["r0", "r1"]}


def test_a_retired_worker_gets_no_new_groups_and_its_groups_still_come_back():
    c = controller(max_staleness=1)  # budget (0 + 1 + 1) * 2 = 4
    assert [g for g, _ in c.sync(SyncRequest(worker_id=0, version=0, want=3)).granted] == ["g0", "g1", "g2"]
    assert c.retire_worker(0) == ["g0", "g1", "g2"]
    assert c.sync(SyncRequest(worker_id=0, version=0, want=1)).granted == []  # leaving: nothing new
    # g0 finishes and is queued as usual; the other 2 are released when the drain ends
    c.sync(SyncRequest(worker_id=0, version=0, scored=[("g0", make_group("g0", [1, 0], 0))]))
    assert c.release_worker(0, "rollout_worker_drained") == ["g1", "g2"]
    s = c.stats()
    assert s["queue/depth"] == 1 and s["queue/dropped_rollout_worker_drained"] == 2 and s["queue/leased"] == 0
    assert s["queue/admitted"] == s["queue/depth"] + s["queue/dropped_rollout_worker_drained"]  # 3 = 1 + 2
    # their budget is free again for the workers that stay: 4 - (3 admitted - 2 dropped) = 3
    assert [g for g, _ in c.sync(SyncRequest(worker_id=1, version=0, want=4)).granted] == ["g3", "g4", "g5"]


def test_the_fair_share_follows_the_pools_size():
    c = controller(max_staleness=0, prompts_per_step=4, num_workers=2)
    assert c.fair_share == 2  # ceil(4 / 2)
    c.set_num_workers(3)
    assert c.fair_share == 2  # ceil(4 / 3)
    c.set_num_workers(1)
    assert c.fair_share == 4


class StandInCriticGroup:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def save_state(self, folder: str) -> int:
        return 7

    def load_state(self, folder: str) -> int:
        self.loaded.append(folder)
        return 7


def test_the_critic_pool_checkpoints_its_group_and_refuses_a_checkpoint_without_one(tmp_path):
    from cluster.checkpoint import CheckpointError
    from cluster.critic_pool import CriticPool

    off = CriticPool(PoolContext(load_config(None, []), controller=None, placement=None, model_path="unused"))
    assert off.save_state(tmp_path) == {"critic_version": None} and off.handles() == []  # no critic: nothing kept
    off.load_state(tmp_path, {})
    cfg = load_config(None, ["algorithm.preset=ppo", "critic.num_workers=2"])
    pool = CriticPool(PoolContext(cfg, controller=None, placement=None, model_path="unused"))
    pool.group = StandInCriticGroup()
    assert pool.save_state(tmp_path) == {"critic_version": 7} and (tmp_path / "critic").is_dir()
    pool.load_state(tmp_path, {"critic_version": 7})
    assert pool.group.loaded == [str(tmp_path / "critic")]
    with pytest.raises(CheckpointError, match=r"this run has a critic \(critic.num_workers=2\) but the checkpoint "
                                              r"holds none"):
        pool.load_state(tmp_path, {"critic_version": None})
    with pytest.raises(ValueError, match="the critic group does not resize"):
        pool.resize(3)


def test_a_token_scorer_named_once_is_placed_resourced_counted_and_carried_to_the_batch():
    """What follows from naming a frozen token scorer in protocols.trajectory.TOKEN_SCORERS (reference, teacher):
    its pool, its placement bundles, its resources outside the placement, its metrics section and counters, and
    its per-token field from the trajectories to the training batch. A new role that is named there, has a worker
    class in actors/<role>_worker.py and a config section gets all of these without another file naming it."""
    from cluster.placement import ROLES as PLACED, plan_placement
    from cluster.ray_setup import _legacy_options
    from protocols.metrics import SECTIONS
    from protocols.training_batch import PER_TOKEN, TrainingBatch
    from protocols.trajectory import TOKEN_SCORERS

    pools = {role.name: role for role in ROLES}
    for role, field in TOKEN_SCORERS.items():
        settings = ["algorithm.preset=grpo", f"{role}.num_workers=2", f"{role}.cpus=3",
                    f"{role}.resources={{judge_node: 1}}"]
        if role == "teacher":
            settings.append("teacher.path=/models/teacher")
        cfg = load_config(None, settings)
        pool = pools[role]
        assert pool.token_scorer and pool.launch_size(cfg) == 2 and role in PLACED
        # served by actors/<role>_worker.py's <Role>Worker, which names the folder its model loads from
        assert pool.actor.__name__ == f"{role.capitalize()}Worker" and pool.actor.__module__ == f"actors.{role}_worker"
        assert pool.actor.model_folder(cfg, "/models/policy") == ("/models/teacher" if role == "teacher"
                                                                  else "/models/policy")
        assert plan_placement(cfg).role(role).bundles == [{"CPU": 3.0, "judge_node": 1.0}] * 2
        assert _legacy_options(cfg, role) == {"num_cpus": 3.0, "num_gpus": 0, "resources": {"judge_node": 1.0},
                                              "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
        assert f"{role}_worker/" in SECTIONS
        counted = pool.counter_metrics([
            {"groups": 2, "samples": 8, "tokens": 300, "micro_batches": 2, "seconds": 1.5},
            {"groups": 1, "samples": 4, "tokens": 100, "micro_batches": 1, "seconds": 0.5}])
        # 3 groups in 2 s, 400 tokens in 2 s
        assert counted == {f"{role}_worker/groups": 3, f"{role}_worker/samples": 12,
                           f"{role}_worker/micro_batches": 3, f"{role}_worker/seconds_per_group": 2.0 / 3,
                           f"{role}_worker/tokens_per_s": 200.0}
        # the field: stamped per token on each trajectory, padded into the batch, trimmed by select like the others
        group = make_group("g", [1.0, 0.0], version=0)
        longer = group.trajectories[0].model_copy(update={"response_token_ids": [5, 6, 7],
                                                          "behavior_logprobs": [-0.5] * 3, "token_versions": [0] * 3})
        group = group.model_copy(update={"trajectories": [longer, group.trajectories[1]]})
        rows = [[-0.5, -1.5, -2.5], [-3.5, -4.5]]
        batch = TrainingBatch.from_trajectories(group.with_token_scores(role, rows).trajectories)
        assert field in PER_TOKEN and getattr(batch, field).tolist() == [[-0.5, -1.5, -2.5], [-3.5, -4.5, 0.0]]
        assert getattr(batch.select([1]), field).tolist() == [[-3.5, -4.5]]  # trimmed to the shorter response


def test_a_token_scorer_named_without_its_worker_module_is_refused_naming_the_file_to_add():
    from cluster.pools import token_scoring_pool

    with pytest.raises(ImportError, match=r"names the role 'unwritten', so actors/unwritten_worker.py must define "
                                          r"its worker class UnwrittenWorker"):
        token_scoring_pool("unwritten")
