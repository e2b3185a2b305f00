"""Reconfiguring the engine mid-job (issue 8, engine side) against the in-memory reference loop.

A policy change between blocks must leave greedy outputs identical to ``xrunner.reference``,
move only the weight layers whose tier changed, re-read from the source only when the weight
compression changes, lose or duplicate no request (refill on), and after a budget cut keep the
measured peak per tier under the new budget.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from dataclasses import replace

import pytest
from sim_profiles import cpu_host
from test_engine import LLAMA, MAX_OUTPUT, MAX_PROMPT, _quantized_weights, make_requests, reference

from workloads.workload import fixed_workload
from xrunner.budget import BudgetWarning, CallbackBudget, FileBudget, budget_hook, plan_fn_for
from xrunner.engine import Engine, Request
from xrunner.loaders import RandomSource, load_weights
from xscheduler.plan import SLA
from xsched.errors import UserError
from xsimulator.policy import Policy

TIERS = ("gpu", "cpu", "disk")
PROFILE = cpu_host(compute_dtype="float32")  # the planner's memory terms in the dtype the engine runs


@pytest.fixture(scope="module")
def job():
    src = RandomSource(LLAMA, seed=3)
    reqs = make_requests(24, seed=5, vocab=LLAMA.vocab_size)
    return src, reqs, reference(load_weights(src), reqs)


def run(src, policy, reqs, tmp_path, hook=None, capacity_bytes=None, on_finished=None):
    """Run a job; returns outputs, every finished id in order, stats and the engine's layer size."""
    got, ids = {}, []

    def finished(fs):
        ids.extend(f.id for f in fs)
        got.update({f.id: list(f.output_ids) for f in fs})
        if on_finished is not None:
            on_finished(fs)

    with Engine(src, policy, max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT, offload_dir=tmp_path, profile=PROFILE,
                capacity_bytes=capacity_bytes) as eng:
        stats = eng.run(reqs, on_finished=finished, between_blocks=hook)
        layer_bytes = eng.layout.nbytes
    return got, ids, stats, layer_bytes


def sequence_hook(policies):
    """A hook that switches to the next policy at every boundary until the list is used up."""
    todo = list(policies)

    def hook(info):
        return (todo.pop(0), f"test change at boundary {info.block}") if todo else None
    return hook


CHANGES = [  # weights gpu -> cpu, cpu -> disk (+ gbs/nb, KV and activations off the gpu), back, CPU attention
    Policy(gbs=2, nb=2, wg=0.34, wc=0.66, cg=0.5, cd=0.5),
    Policy(gbs=3, nb=1, wg=0.0, wc=0.34, wd=0.66, hg=0.34, hc=0.33, hd=0.33),
    Policy(gbs=1, nb=3, wg=1.0),
    Policy(gbs=2, nb=1, wg=0.0, wd=1.0, cg=0.0, cc=0.5, cd=0.5, cpu_attention=True),
]


@pytest.mark.parametrize("refill", [0, 2])
def test_outputs_after_several_changes_equal_reference(job, tmp_path, refill):
    src, reqs, want = job
    changes = [replace(p, refill_every=refill) for p in CHANGES]
    got, ids, stats, layer_bytes = run(src, Policy(gbs=2, nb=2, refill_every=refill), reqs, tmp_path,
                                       hook=sequence_hook(changes))
    assert got == want
    assert sorted(ids) == sorted(r.id for r in reqs) and len(ids) == len(set(ids))
    assert [r.new_policy for r in stats.reconfigurations] == changes
    assert [m.name for m in stats.markers] == ["reconfigure"] * len(changes)
    # Only the layers whose tier changed were copied (3 layers: counts from Policy.layer_counts).
    assert stats.reconfigurations[0].moved_bytes == {"gpu->cpu": 2 * layer_bytes}
    assert stats.reconfigurations[1].moved_bytes == {"gpu->cpu": layer_bytes, "cpu->disk": 2 * layer_bytes}
    assert stats.reconfigurations[2].moved_bytes == {"cpu->gpu": layer_bytes, "disk->gpu": 2 * layer_bytes}
    assert stats.reconfigurations[3].moved_bytes == {"gpu->disk": 3 * layer_bytes}
    assert all(r.reloaded_bytes == 0 and r.stall_s > 0 for r in stats.reconfigurations)
    for tier in TIERS:  # under the last policy, measured peak <= its plan
        assert stats.peak_bytes_since_change[tier] <= stats.reconfigurations[-1].planned_peak_bytes[tier]
        # and over the run, the run's peak <= the largest plan of the policies it ran (a run whose
        # planned peak kept only the first policy's reported cpu 0.83 MB planned against 1.62 measured)
        assert stats.peak_bytes[tier] <= stats.planned_peak_bytes[tier], tier


def test_a_change_moves_layers_off_a_tier_before_it_moves_layers_onto_it(job, tmp_path):
    """gpu -> cpu and cpu -> disk in one change: the layer leaving the cpu tier goes first, so the
    cpu tier never holds more than its two layers plus the one being moved (one mutation moved the
    gpu layer first: three layers and a copy, still under the plan's loose bound)."""
    src, _, _ = job
    with Engine(src, Policy(gbs=1, nb=1, wg=0.34, wc=0.66), max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT,
                offload_dir=tmp_path, profile=PROFILE) as eng:
        rec = eng.reconfigure(Policy(gbs=1, nb=1, wg=0.0, wc=0.67, wd=0.33))
        assert rec.moved_bytes == {"cpu->disk": eng.layout.nbytes, "gpu->cpu": eng.layout.nbytes}
        assert rec.transition_peak_bytes["cpu"] < 3 * eng.layout.nbytes, (rec.transition_peak_bytes, eng.layout.nbytes)


def test_refill_change_at_every_boundary_loses_and_duplicates_nothing(job, tmp_path):
    """With refill a change drains the rows in flight first; ping-pong between two shapes every interval."""
    src, reqs, want = job
    a = Policy(gbs=3, nb=2, wg=0.34, wc=0.66, cg=0.34, cc=0.66, refill_every=1)
    b = Policy(gbs=2, nb=1, wg=0.0, wd=1.0, hg=0.5, hd=0.5, refill_every=3)
    seen = []

    def hook(info):
        seen.append(info)
        return (b if info.policy == a else a), "ping-pong"

    got, ids, stats, _ = run(src, a, reqs, tmp_path, hook=hook)
    assert got == want
    assert Counter(ids) == Counter(r.id for r in reqs)  # each exactly once
    assert len(stats.reconfigurations) >= 4
    assert [i.block for i in seen] == list(range(len(seen)))
    assert all(x.clock_s <= y.clock_s for x, y in zip(seen, seen[1:]))


def test_only_changed_layers_move_and_the_ledger_frees_what_left(job, tmp_path):
    src, reqs, want = job
    policy = Policy(gbs=2, nb=2, wg=1.0)
    with Engine(src, policy, max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT, offload_dir=tmp_path,
                profile=PROFILE) as eng:
        n = eng.layout.nbytes
        homes = list(eng.w_home)
        same = eng.reconfigure(policy, "nothing changes")
        assert same.moved_bytes == {} and same.reloaded_bytes == 0
        assert all(a is b for a, b in zip(homes, eng.w_home))
        kv_before = eng.ledger.by_name["gpu", "kv_home"]
        rec = eng.reconfigure(Policy(gbs=1, nb=2, wg=0.67, wc=0.33, cg=0.0, cc=1.0), "last layer to cpu")
        assert rec.moved_bytes == {"gpu->cpu": n}
        assert eng.w_home[0] is homes[0] and eng.w_home[1] is homes[1]  # unchanged layers untouched
        assert eng.ledger.by_name["gpu", "weights_home"] == 2 * n and eng.ledger.by_name["cpu", "weights_home"] == n
        assert eng.ledger.by_name["gpu", "kv_home"] == 0 < kv_before
        assert rec.freed_bytes["gpu"] >= n + kv_before  # the layer and the KV cache left the gpu tier
        assert rec.freed_bytes["cpu"] == 0  # nothing was on the cpu tier before
        assert eng.ledger.live["gpu"] == pytest.approx(sum(v for (t, _), v in eng.ledger.by_name.items() if t == "gpu"))
        got = {}
        stats = eng.run(reqs, on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
    assert got == want
    for tier in TIERS:
        assert stats.peak_bytes_since_change[tier] <= rec.planned_peak_bytes[tier]


def test_a_run_after_a_reconfiguration_measures_its_own_peak(job, tmp_path):
    """A run's measured peak covers the policies in force during it, as its planned peak does: after
    a change to a smaller plan between two runs, the first policy's peak is not the second run's
    (it reported the ledger's lifetime peak: 3.6 MB on the cpu tier of a run that planned 0.8 MB there;
    found by a differential fuzz)."""
    src, reqs, want = job
    with Engine(src, Policy(gbs=3, nb=2, wg=0.0, wc=1.0, cg=0.0, cc=1.0), max_prompt=MAX_PROMPT,
                max_output=MAX_OUTPUT, offload_dir=tmp_path, profile=PROFILE) as eng:
        first = eng.run(reqs[:6])
        eng.reconfigure(Policy(gbs=2, nb=1), "all on the gpu tier")
        got = {}
        second = eng.run(reqs, on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
    assert got == want
    assert first.peak_bytes["cpu"] > second.planned_peak_bytes["cpu"]  # the first plan was larger there
    for tier in TIERS:
        assert first.peak_bytes[tier] <= first.planned_peak_bytes[tier], tier
        assert second.peak_bytes[tier] <= second.planned_peak_bytes[tier], tier
        assert second.peak_bytes[tier] == second.peak_bytes_since_change[tier], tier  # no change during the run


def test_a_run_ended_by_an_error_leaves_nothing_in_flight(job, tmp_path):
    """A request refused while a refill block still has rows running ends run() with a UserError;
    those rows went with it, so the engine can be reconfigured and run again at once (reconfigure
    refused with "rows are in flight" until another run had reset the flag; found by a
    differential fuzz)."""
    src, reqs, want = job
    too_long = Request("too-long", (1,) * (MAX_PROMPT + 1), 1)
    with Engine(src, Policy(gbs=2, nb=1, wg=0.34, wd=0.66, cg=0.5, cd=0.5, refill_every=1), max_prompt=MAX_PROMPT,
                max_output=MAX_OUTPUT, offload_dir=tmp_path, profile=PROFILE) as eng:
        with pytest.raises(UserError, match="longer than the plan's max prompt"):
            eng.run(reqs[:3] + [too_long] + reqs[3:])
        eng.reconfigure(Policy(gbs=3, nb=1, wg=0.0, wc=0.34, wd=0.66, cg=0.34, cd=0.66), "after the error")
        got = {}
        eng.run(reqs, on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
    assert got == want


@pytest.mark.parametrize("start, policy", [
    (Policy(gbs=2, nb=2, wg=1.0), Policy(gbs=2, nb=2, wg=0.67, wc=0.33)),
    (Policy(gbs=2, nb=2, wg=1.0), Policy(gbs=3, nb=1, wg=0.34, wd=0.66, hg=0.34, hc=0.33, hd=0.33)),
    (Policy(gbs=2, nb=2, wg=0.0, wc=0.34, wd=0.66), Policy(gbs=2, nb=2, wg=1.0)),
], ids=["layer-to-cpu", "layers-kv-activations-off-gpu", "staged-layers-back-to-gpu"])
def test_host_memory_follows_the_ledger_through_a_reconfiguration(job, tmp_path, start, policy):
    """What the ledger frees is really freed: on a host without CUDA the gpu tier is host memory
    too, and neither the store nor a view kept for compute may hold a buffer the ledger let go."""
    import gc
    import tracemalloc

    src, reqs, want = job
    tracemalloc.start()  # before the engine, so that its buffers' frees are traced too
    try:
        with Engine(src, start, max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT,
                    offload_dir=tmp_path, profile=PROFILE) as eng:
            eng.run(reqs[:4])  # computes from every layer's buffer
            gc.collect()
            traced0, live0 = tracemalloc.get_traced_memory()[0], eng.ledger.live["gpu"] + eng.ledger.live["cpu"]
            eng.reconfigure(policy, "test change")
            gc.collect()
            traced1, live1 = tracemalloc.get_traced_memory()[0], eng.ledger.live["gpu"] + eng.ledger.live["cpu"]
            got = {}
            eng.run(reqs, on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
            layer_bytes = eng.layout.nbytes
    finally:
        tracemalloc.stop()
    assert abs((traced1 - traced0) - (live1 - live0)) < layer_bytes / 8
    assert got == want


@pytest.mark.parametrize("start, policy", [
    (Policy(gbs=1, nb=1), Policy(gbs=1, nb=1, wg=0.0, wd=1.0)),
    (Policy(gbs=1, nb=1, wg=0.0, wc=1.0), Policy(gbs=1, nb=1, wg=0.0, wd=1.0)),
    (Policy(gbs=1, nb=1, wg=0.0, wd=1.0), Policy(gbs=1, nb=1)),
], ids=["gpu-to-disk", "cpu-to-disk", "disk-to-gpu"])
def test_layers_moving_to_or_from_disk_stay_within_the_larger_plan(job, tmp_path, start, policy):
    """On a host without CUDA both ends of a disk move are aligned host buffers, so a layer goes
    straight between its home and the file. Borrowing a record buffer while the old home still
    existed put the change's peak one record above both plans (one-row blocks of a tiny model,
    where the freed KV cache is smaller than a record)."""
    src, reqs, want = job
    with Engine(src, start, max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT, offload_dir=tmp_path, profile=PROFILE,
                head_layout="rows") as eng:
        before = dict(eng.planned_peak_bytes)
        rec = eng.reconfigure(policy, "test move")
        assert sum(rec.moved_bytes.values()) == LLAMA.num_layers * eng.layout.nbytes
        for tier in TIERS:
            assert rec.transition_peak_bytes[tier] <= max(before[tier], rec.planned_peak_bytes[tier]), tier
        got = {}
        eng.run(reqs[:6], on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
    assert got == {k: want[k] for k in got} and len(got) == 6


def test_compression_change_rereads_from_the_source(job, tmp_path):
    src, reqs, want = job
    with Engine(src, Policy(gbs=2, nb=2, wg=0.34, wc=0.33, wd=0.33), max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT,
                offload_dir=tmp_path, profile=PROFILE) as eng:
        rec = eng.reconfigure(Policy(gbs=2, nb=2, wg=0.34, wc=0.33, wd=0.33, compress_weight=True), "4-bit weights")
        got = {}
        eng.run(reqs[:8], on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
    source_bytes = sum(t.numel() * t.element_size() for i in range(LLAMA.num_layers)
                       for t in src.load_layer(i).values())
    assert rec.moved_bytes == {} and rec.reloaded_bytes == source_bytes
    assert rec.freed_bytes["cpu"] > 0 and rec.freed_bytes["disk"] > 0  # 4-bit homes are smaller
    assert got == reference(_quantized_weights(load_weights(src)), reqs[:8])


def test_reconfigure_refuses_a_policy_over_the_budget_and_keeps_running(job, tmp_path):
    src, reqs, want = job
    policy = Policy(gbs=2, nb=2)
    with Engine(src, policy, max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT, offload_dir=tmp_path, profile=PROFILE,
                capacity_bytes={"gpu": 1e9, "cpu": 1e9}) as eng:
        with pytest.raises(UserError, match="cpu tier .*short by"):
            eng.reconfigure(Policy(gbs=2, nb=2, wg=0.0, wc=1.0), capacity_bytes={"gpu": 1e9, "cpu": 1000})
        assert eng.policy == policy and eng.reconfigurations == []
        got = {}
        eng.run(reqs, on_finished=lambda fs: got.update({f.id: list(f.output_ids) for f in fs}))
    assert got == want


# --------------------------------------------------------------------------- budgets
def _plan_fn():
    """The real planner for this job, uncompressed so outputs stay comparable with the plain reference."""
    from xscheduler.plan import Plan, SearchStats
    from xsimulator.discrete_event import simulate

    workload = fixed_workload(MAX_PROMPT, MAX_OUTPUT)
    policy = Policy(gbs=2, nb=2)
    plan = Plan(policy=policy, predicted=simulate(LLAMA, PROFILE, policy, workload, num_requests=24),
                sla=SLA("p99", float("inf")), model=LLAMA, workload=workload, profile_name=PROFILE.name,
                profile_source=PROFILE.source, profile_fingerprint=PROFILE.fingerprint,
                search=SearchStats(method="exhaustive", evaluations=1, grid_points=1, lp_solves=0, wall_s=0.0),
                version="test")
    return plan_fn_for(plan, PROFILE, compress="off", num_requests=24, confirm_seeds=())


@pytest.mark.parametrize("refill", [0, 2])
def test_budget_cut_by_callback_replans_and_peak_stays_under_the_new_budget(job, tmp_path, refill):
    src, reqs, want = job
    plan_fn = _plan_fn()
    # A starting policy of six blocks (boundaries to change at, whatever the planner would pick) that
    # fills the starting budget past 70% on the gpu tier, so the cut forces a change; 70% still fits one.
    start = {"gpu": 3.2e6, "cpu": 8e6}
    policy = Policy(gbs=2, nb=2, refill_every=refill)
    cut = {"gpu": 0.7 * start["gpu"]}  # the gpu-tier budget cut by 30%
    with Engine(src, policy, max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT, profile=PROFILE) as probe:
        assert probe.planned_peak_bytes["gpu"] > cut["gpu"]  # the starting policy does not fit the cut
    polls = []

    def budget():
        polls.append(1)
        return cut if len(polls) >= 2 else None  # the cut arrives at the second boundary

    hook = budget_hook(CallbackBudget(budget), plan_fn, capacity_bytes=start)
    got, ids, stats, _ = run(src, policy, reqs, tmp_path, hook=hook, capacity_bytes=start)
    assert got == want and sorted(ids) == sorted(r.id for r in reqs)
    [rec] = stats.reconfigurations
    assert rec.capacity_bytes == {"gpu": cut["gpu"], "cpu": start["cpu"]}
    assert rec.freed_bytes["gpu"] > 0 and "budget: gpu" in rec.reason
    for tier, budget_bytes in rec.capacity_bytes.items():
        assert stats.peak_bytes_since_change[tier] <= budget_bytes, tier
        assert rec.planned_peak_bytes[tier] <= budget_bytes
    assert rec.peak_before_bytes["gpu"] > cut["gpu"]  # the cut was real: before it the job used more
    assert hook.capacity_bytes == rec.capacity_bytes


def test_budget_file_changes_apply_and_malformed_files_only_warn(job, tmp_path):
    src, reqs, want = job
    path = tmp_path / "budget.json"
    plan_fn = _plan_fn()
    start = {"gpu": 3.2e6, "cpu": 8e6}
    policy = Policy(gbs=2, nb=2)  # fills the budget past 70%: the cut below forces a change
    writes = iter([
        "{not json",  # half-written: warn, keep
        json.dumps({"gpu_bytes": "lots"}),  # wrong type: warn, keep
        json.dumps({"gpu_bytes": int(0.7 * start["gpu"])}),  # the cut (cpu key missing: cpu keeps its budget)
    ])

    def write_next(_finished):
        text = next(writes, None)
        if text is not None:
            path.write_text(text)

    path.write_text(json.dumps({"gpu_bytes": start["gpu"], "cpu_bytes": start["cpu"]}))  # the budget at the start
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, ids, stats, _ = run(src, policy, reqs, (tmp_path / "off"), hook=budget_hook(FileBudget(path), plan_fn),
                                 capacity_bytes=start, on_finished=write_next)
    assert got == want and sorted(ids) == sorted(r.id for r in reqs)
    msgs = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    assert len(msgs) == 2 and all("keeping the budget as it was" in m and "\n" not in m for m in msgs)
    [rec] = stats.reconfigurations
    assert rec.capacity_bytes == {"gpu": int(0.7 * start["gpu"]), "cpu": start["cpu"]}
    for tier, budget_bytes in rec.capacity_bytes.items():
        assert stats.peak_bytes_since_change[tier] <= budget_bytes


def test_file_budget_reports_only_changes(tmp_path):
    path = tmp_path / "b.json"
    fb = FileBudget(path)
    with pytest.warns(BudgetWarning, match="not found"):
        assert fb.poll() is None
    path.write_text(json.dumps({"gpu_bytes": 1000}))
    assert fb.poll() == {"gpu": 1000.0}
    assert fb.poll() is None  # unchanged
    path.write_text(json.dumps({"cpu_bytes": 5000}))
    assert fb.poll() == {"gpu": 1000.0, "cpu": 5000.0}  # a missing key keeps that tier's budget
    path.write_text(json.dumps([1, 2]))
    with pytest.warns(BudgetWarning, match="JSON object"):
        assert fb.poll() is None
    path.write_text(json.dumps({"gpu_bytes": -3}))
    with pytest.warns(BudgetWarning, match="positive"):
        assert fb.poll() is None
    # integers past float's range or past json's 4300 digits ended the job with a traceback (review)
    path.write_text('{"gpu_bytes": 1' + "0" * 400 + "}")
    with pytest.warns(BudgetWarning, match="positive, finite number of bytes, got 1000.*401 digits"):
        assert fb.poll() is None
    path.write_text('{"gpu_bytes": 1' + "0" * 5000 + "}")
    with pytest.warns(BudgetWarning, match="cannot be read as JSON"):
        assert fb.poll() is None


def _info(policy, peak):
    from xrunner.engine import BlockInfo

    return BlockInfo(3, 1.0, policy, peak, {"gpu": 100.0, "cpu": 100.0})


def test_no_policy_fits_the_new_budget():
    """Keep the policy in force (with a warning) if it still fits; else a UserError naming the short tier."""
    policy = Policy(gbs=1, nb=1)

    def nothing_fits(caps):
        raise UserError("nothing fits")

    keep = budget_hook(CallbackBudget(lambda: {"gpu": 90.0}), nothing_fits)
    with pytest.warns(BudgetWarning, match="still fits"):
        answer = keep(_info(policy, {"gpu": 80.0, "cpu": 0.0, "disk": 0.0}))
    assert answer[0] is policy and answer[2] == {"gpu": 90.0, "cpu": 100.0}
    stop = budget_hook(CallbackBudget(lambda: {"gpu": 50.0}), nothing_fits)
    with pytest.raises(UserError, match="30 bytes more on the gpu tier"):
        stop(_info(policy, {"gpu": 80.0, "cpu": 0.0, "disk": 0.0}))


def test_a_budget_above_the_machine_is_capped_at_what_it_had():
    """A budget file raised to 1e300 bytes mid-run was planned for as is (review): a new budget
    now stops at what the machine had when the job started, with a warning."""
    policy = Policy(gbs=1, nb=1)
    seen = []
    hook = budget_hook(CallbackBudget(lambda: {"gpu": 1e300, "cpu": 50.0}), lambda caps: seen.append(caps) or policy,
                       capacity_bytes={"gpu": 100.0, "cpu": 100.0}, machine_bytes={"gpu": 400.0, "cpu": 800.0})
    with pytest.warns(BudgetWarning, match="above what this machine had"):
        answer = hook(_info(policy, {"gpu": 80.0, "cpu": 0.0, "disk": 0.0}))
    assert seen == [{"gpu": 400.0, "cpu": 50.0}] and answer[2] == {"gpu": 400.0, "cpu": 50.0}


def test_a_budget_file_the_run_cannot_use_is_said_at_the_start_once(tmp_path):
    """A job of one block never reads the budget file, so a typo in its name or its JSON went
    unsaid: the run checks it at the start, with the words (and the one warning) a poll would
    give; a good file's budget is still news at the first poll."""
    for name, text, problem in (("budjet.json", None, "not found"),
                                ("empty.json", " \n", "empty"),  # (made first, written next: no JSON error)
                                ("bad.json", "{bad", "cannot be read as JSON"),
                                ("odd.json", '{"gpu_bytes": -1}', "gpu_bytes must be a positive, finite number")):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        source = FileBudget(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            source.check()
            assert source.poll() is None
        msgs = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
        assert len(msgs) == 1 and msgs[0].startswith(f"budget file {path}: {problem}"), msgs
    (tmp_path / "there.json").write_text('{"cpu_bytes": 1000}')
    source = FileBudget(tmp_path / "there.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source.check()
    assert not caught and source.poll() == {"cpu": 1000.0}


def test_a_budget_of_zero_bytes_is_warned_of_and_ignored(tmp_path):
    """0 bytes is no budget a run can keep (only negative ones were tested; a mutation that took 0
    passed): warned of, and the budget in force stays."""
    p = tmp_path / "b.json"
    p.write_text('{"gpu_bytes": 0}')
    with pytest.warns(BudgetWarning, match="gpu_bytes must be a positive, finite number of bytes, got 0"):
        assert FileBudget(p).poll() is None
