"""``xsched run``: results against the in-memory reference loop, resume after SIGKILL, refusals.

Plans are built here from a Policy and the discrete-event simulator (the Plan contract of
xscheduler/plan.py), so these tests do not depend on the scheduler's search.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from xsched.cli import main
from xsched.errors import UserError

RANDOM_MODEL = "random:opt-125m"


# ----------------------------------------------------------------------------- helpers
def make_plan(path: Path, spec, policy, prompt_len: int, output_len: int, profile: str = "t4",
              requests: int = 16) -> Path:
    from workloads.workload import fixed_workload
    from xprofiler.presets import load_profile
    from xscheduler.plan import SLA, Plan, SearchStats
    from xsimulator.discrete_event import simulate

    prof = load_profile(profile)
    spec = prof.model_for(spec) if prof.compute_dtype else spec
    workload = fixed_workload(prompt_len, output_len)
    predicted = simulate(spec, prof, policy, workload, num_requests=requests)
    Plan(policy=policy, predicted=predicted, sla=SLA("p99", float("inf")), model=spec, workload=workload,
         profile_name=prof.name, profile_source=prof.source, profile_fingerprint=prof.fingerprint,
         search=SearchStats(method="exhaustive", evaluations=1, grid_points=1, lp_solves=0, wall_s=0.0),
         version="test").save(path)
    return path


def random_spec(dtype: str = "float32"):
    from xprofiler.specs import get_model_spec

    return get_model_spec(RANDOM_MODEL.split(":", 1)[1]).with_dtype(dtype)


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def without_timing(rows: list[dict]) -> set[str]:
    return {json.dumps({k: v for k, v in r.items() if k != "latency_s"}, sort_keys=True) for r in rows}


# ----------------------------------------------------------------------------- job files (no engine)
def test_prompt_file_errors_name_the_line(tmp_path):
    from xrunner.jobfiles import read_prompts

    cases = [
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate id 'a' (first on line 1)"),
        ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n', ":2: not valid JSON"),
        ('{"id": "a"}\n', "give exactly one of"),
        ('{"id": "a", "prompt": "x", "max_new_tokens": 0}\n', "max_new_tokens"),
        ('{"id": "a", "prompt_ids": [1, -2]}\n', "non-negative integers"),
        ('[1, 2]\n', "JSON object"),
        ('{"id": 1.5, "prompt": "x"}\n', '"id" must be a string or an integer'),
        ('\n\n', "no prompts"),
    ]
    for i, (text, message) in enumerate(cases):
        p = tmp_path / f"p{i}.jsonl"
        p.write_text(text)
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_prompts(p)
    with pytest.raises(UserError, match="no such prompt file"):
        read_prompts(tmp_path / "missing.jsonl")
    p = tmp_path / "ok.jsonl"
    p.write_text('{"id": 7, "prompt": "hi", "meta": 1}\n\n{"id": "7", "prompt_ids": [3, 4], "max_new_tokens": 2}\n')
    recs = read_prompts(p)
    assert [(r.id, r.prompt, r.prompt_ids, r.max_new_tokens, r.line) for r in recs] == [
        (7, "hi", None, None, 1), ("7", None, (3, 4), 2, 3)]  # 7 and "7" are different ids


def test_results_writer_refuses_old_file_and_drops_a_torn_line_on_resume(tmp_path):
    from xrunner.jobfiles import ResultsWriter

    out = tmp_path / "r.jsonl"
    w = ResultsWriter.open(out, resume=False)
    assert not out.exists()  # created by the first write, not by a job that fails early
    w.write([{"id": "a", "text": "x"}, {"id": 2, "text": "y"}])
    w.write([])
    w.close()
    with pytest.raises(UserError, match="pass --resume to continue that job or another --out path"):
        ResultsWriter.open(out, resume=False)
    good = out.read_bytes()
    out.write_bytes(good + b'{"id": "c", "te')  # a crash in the middle of an append
    w = ResultsWriter.open(out, resume=True)
    assert out.read_bytes() == good and w.is_done("a") and w.is_done(2) and not w.is_done("2")
    w.write([{"id": "c", "text": "z"}])
    w.close()
    assert [r["id"] for r in read_rows(out)] == ["a", 2, "c"]
    with pytest.raises(RuntimeError, match="finished twice"):
        ResultsWriter.open(out, resume=True).write([{"id": "a"}])
    out.write_bytes(good + b"garbage\n" + good)
    with pytest.raises(UserError, match=r":3: not a results line|:2: not a results line"):
        ResultsWriter.open(out, resume=True)


def test_run_result_percentiles_match_the_simulator_and_round_trip():
    from types import SimpleNamespace

    from xrunner.result import RunResult, build_run_result
    from xsimulator.discrete_event import quantile
    from xsimulator.policy import Policy

    lat = list(np.random.default_rng(0).gamma(2.0, 1.5, size=101))
    stats = SimpleNamespace(wall_s=10.0, generated_tokens=500, prompt_tokens=300, padded_prompt_tokens=400,
                            num_prefill_steps=3, num_decode_steps=40, peak_bytes={"gpu": 10, "cpu": 5, "disk": 0},
                            planned_peak_bytes={"gpu": 12.0, "cpu": 5.0, "disk": 0.0},
                            busy_s={"compute": 8.0, "dtoc": 1.0})
    r = build_run_result(model="m", policy=Policy(gbs=4, nb=2), device="cpu", dtype="float32", stats=stats,
                         latencies_s=lat, num_stopped_on_eos=3, num_skipped=2, capacity_bytes={"gpu": 1e9},
                         max_prompt=8, max_output=9, predicted=None)
    arr = np.array(lat)
    assert r.latency_p99_s == quantile(arr, 0.99) == np.sort(arr)[99]  # inverted CDF: ceil(0.99 * 101) - 1
    assert r.latency_p50_s == np.sort(arr)[50] and r.latency_max_s == max(lat)
    assert (r.throughput_tokens_per_s, r.total_throughput_tokens_per_s, r.padded_throughput_tokens_per_s) == (50, 80, 90)
    assert r.fits and RunResult.from_json(r.to_json()) == r
    assert "measured" in r.describe() and "predicted" in r.describe()


# ----------------------------------------------------------------------------- CLI errors
@pytest.fixture(scope="module")
def random_plan(tmp_path_factory):
    from xsimulator.policy import Policy

    d = tmp_path_factory.mktemp("plan")
    return make_plan(d / "plan.json", random_spec(), Policy(gbs=2, nb=2, refill_every=2), 8, 6)


def test_bad_inputs_exit_2_with_one_line(random_plan, tmp_path, capsys):
    ok = write_prompts(tmp_path / "ok.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7]}])
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"id": "a", "prompt_ids": [5]}\n{"id": "b", "prompt_ids": [5\n')
    dup = write_prompts(tmp_path / "dup.jsonl", [{"id": "a", "prompt_ids": [5]}, {"id": "a", "prompt_ids": [6]}])
    text = write_prompts(tmp_path / "text.jsonl", [{"id": "a", "prompt": "hello"}])
    old = tmp_path / "old.jsonl"
    old.write_text('{"id": "z", "text": null}\n')
    base = ["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--quiet"]
    cases = [
        (["--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o1")], "no such prompt file"),
        (["--prompts", str(bad_json), "--out", str(tmp_path / "o2")], "bad.jsonl:2: not valid JSON"),
        (["--prompts", str(dup), "--out", str(tmp_path / "o3")], "duplicate id 'a'"),
        (["--prompts", str(ok), "--out", str(old)], "pass --resume to continue that job or another --out path"),
        (["--prompts", str(ok), "--out", str(old), "--resume"], "whose ids are not in"),
        (["--prompts", str(text), "--out", str(tmp_path / "o4")], "give \"prompt_ids\""),
        (["--prompts", str(ok), "--out", str(tmp_path / "o5"), "--offload-dir", str(tmp_path / "none")],
         "offload dir"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("xsched: error: ") and err.count("\n") == 1 and message in err, err
    assert main(["run", "--plan", str(random_plan), "--model", "gpt-9", "--prompts", str(ok), "--out",
                 str(tmp_path / "o6"), "--quiet"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err
    assert main(["run", "--plan", str(random_plan), "--model", "random:opt-1.3b", "--prompts", str(ok), "--out",
                 str(tmp_path / "o7"), "--quiet"]) == 2
    assert "the plan is for opt-125m" in capsys.readouterr().err
    assert main(["run", "--plan", str(tmp_path / "noplan.json"), "--prompts", str(ok), "--out",
                 str(tmp_path / "o8"), "--quiet"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 9))  # failed jobs leave no results file
