"""`xsched simulate` and `xsched workload`: outputs, traces and one-line errors with exit 2."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
from sim_profiles import t4_like

from workloads import Workload
from xprofiler.specs import get_model_spec
from xsimulator import Policy, SimResult, read_chrome_trace, simulate_timeline, trace_events
from xsimulator.costmodel import CostModel
from xsimulator.trace import TRACKS, TraceEvent, TraceMarker, write_chrome_trace

POLICY = json.dumps({"gbs": 8, "nb": 2, "wg": 0.5, "wc": 0.5, "wd": 0.0, "cg": 0.0, "cc": 1.0, "cd": 0.0,
                     "cpu_attention": True, "refill_every": 4})


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xsched", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof") / "t4.json"
    t4_like().save(path)
    return str(path)


def test_simulate_json_trace_and_plan(profile_path, tmp_path):
    trace = tmp_path / "sim.json"
    out = run("simulate", "--profile", profile_path, "--model", "opt-6.7b", "--workload", "T@0.25",
              "--policy", POLICY, "--requests", "300", "--seed", "2", "--trace", str(trace), "--json")
    assert out.returncode == 0, out.stderr
    result = SimResult.from_json(out.stdout)
    assert result.num_requests == 300 and result.policy.refill_every == 4 and result.model == "opt-6.7b"
    events, _ = read_chrome_trace(trace)
    assert {e.track for e in events} <= set(TRACKS) and events
    compute = sum(e.dur_s for e in events if e.track == "compute")
    assert compute == pytest.approx(result.busy_s["gpu_compute"] + result.busy_s["head"] + result.busy_s["dequant"]
                                    + result.busy_s["quant"], rel=1e-6)
    assert max(e.start_s + e.dur_s for e in events) == pytest.approx(result.wall_s, rel=1e-9)
    # A plan file supplies the policy, model and workload; the human output names the numbers.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"policy": json.loads(POLICY), "model": "opt-6.7b",
                                "workload": json.loads(Workload.from_json(json.dumps(
                                    json.loads(run("workload", "show", "G@0.25", "--json").stdout))).to_json())}))
    human = run("simulate", "--profile", profile_path, "--plan", str(plan), "--requests", "200",
                "--method", "analytic")
    assert human.returncode == 0, human.stderr
    assert "analytic simulation of 200 requests (G@0.25) on opt-6.7b" in human.stdout
    assert "generated tokens/s" in human.stdout and "p99" in human.stdout


BAD_INPUT = [
    (["--workload", "T", "--policy", POLICY, "--seed", "-1"], "--seed: must be in [0, 2**64), got -1"),  # argparse: exits itself
    (["--workload", "T", "--policy", POLICY, "--requests", "0"], "--requests: must be from 1 to 10,000,000, got 0"),
    (["--workload", "T", "--policy", POLICY, "--samples", "0"], "--samples: must be a whole number from 1 to 4,096, got 0"),
    (["--workload", "T", "--policy", POLICY, "--prefix-groups", "0"], "--prefix-groups: must be a whole number from 1"),
    (["--workload", "T", "--policy", POLICY, "--prefix-groups", "x"], "--prefix-groups: must be a whole number, got 'x'"),
    # 3e7 requests was a MemoryError traceback under a 4 GB limit (review)
    (["--workload", "T", "--policy", POLICY, "--requests", "30000000"], "--requests: must be from 1 to 10,000,000"),
    # 10^20 samples, prefix tokens or prefixes were tracebacks (OverflowError; 10^12 samples a 7 TiB array: stop 61's audit)
    (["--workload", "T", "--policy", POLICY, "--samples", "1" + "0" * 20], "--samples: must be a whole number from 1 to 4,096"),
    (["--workload", "T", "--policy", POLICY, "--prefix-tokens", "1" + "0" * 20], "--prefix-tokens: must be a whole number from 0"),
    (["--workload", "T", "--policy", POLICY, "--prefix-tokens", "5", "--prefix-groups", "1" + "0" * 20],
     "--prefix-groups: must be a whole number from 1 to 1,048,576"),
    (["--workload", "T", "--policy", '{"gbs": 8, "nb": 2, "wg": 0.5, "wc": 0.4, "wd": 0}'], "sum to 0.9"),
    (["--workload", "Q", "--policy", POLICY], "unknown workload preset 'Q'"),
    (["--workload", "fixed:0:8", "--policy", POLICY], ">= 1"),
    (["--workload", "T", "--policy", '{"gbs": 8,'], "not valid JSON"),
    (["--workload", "T", "--policy", '{"gbs": 0, "nb": 1}'], "gbs and nb must be >= 1"),
    (["--workload", "T", "--policy", POLICY, "--method", "analytic", "--trace", "x.json"], "discrete-event"),
    (["--workload", "T", "--policy", POLICY, "--output", "/nonexistent-dir/r.json"], "does not exist"),
    (["--workload", "T", "--policy", POLICY, "--output", ""], "-o needs a file path"),  # wrote nothing, exit 0
    (["--workload", "T", "--policy", POLICY, "--prefix-tokens", "300"],  # T's prompts end at 256 tokens
     "prefix_tokens 300 must be a whole number from 0 to the longest prompt's 256 tokens"),
    (["--workload", "T", "--policy", "[1]"], "--policy must be a JSON object"),  # (said: neither JSON nor a file)
    (["--workload", "", "--policy", POLICY], "give --workload"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT[:9])
def test_simulate_bad_input_exits_2_with_one_line(profile_path, args, message):
    out = run("simulate", "--profile", profile_path, "--model", "opt-1.3b", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xsched: error:") and message in lines[0], out.stderr


@pytest.mark.parametrize("args,message", BAD_INPUT[9:])
def test_simulate_bad_input_in_process(profile_path, args, message, capsys):
    """The same CLI entry point in-process (the subprocess cases above check the interpreter exit)."""
    from xsched.cli import main

    assert main(["simulate", "--profile", profile_path, "--model", "opt-1.3b", "--requests", "50", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xsched: error:") and message in err[0], err


@pytest.mark.parametrize("schema", ["xsched.Plan/0", "xsched.Plan/2"])
def test_simulate_refuses_a_plan_of_another_schema(profile_path, tmp_path, schema, capsys):
    """Review: `simulate --plan` read the plan as a dict and never looked at its schema, so a plan
    of an older or newer format was simulated silently (`replan` and `run` refuse it). A plan
    written without a schema key (by hand) is still taken."""
    from xscheduler.plan import Plan
    from xsched.cli import main
    from xsimulator.cli import PLAN_SCHEMA

    assert PLAN_SCHEMA == Plan.SCHEMA  # a copy: the simulator must not import the scheduler
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": schema, "policy": json.loads(POLICY)}))
    argv = ["simulate", "--profile", profile_path, "--model", "opt-1.3b", "--workload", "T", "--requests", "50"]
    assert main([*argv, "--plan", str(plan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"schema '{schema}' is not 'xsched.Plan/1'" in err[0], err
    plan.write_text(json.dumps({"policy": json.loads(POLICY)}))
    assert main([*argv, "--plan", str(plan)]) == 0
    capsys.readouterr()
    plan.write_text('{"policy": ')  # a broken file is named in the error, as `run --plan` names it
    assert main([*argv, "--plan", str(plan)]) == 2
    assert capsys.readouterr().err.startswith(f"xsched: error: {plan}: plan is not valid JSON")


def test_workload_commands_and_malformed_file(tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    out = run("workload", "sample", "C1@0.5", "-n", "400", "--seed", "1", "-o", str(reqs), "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in reqs.read_text().splitlines()]
    assert len(rows) == 400 and set(rows[0]) == {"id", "prompt_tokens", "max_new_tokens"}
    summary = json.loads(out.stdout)
    assert summary["requests"] == 400 and summary["output"] == str(reqs)
    assert summary["mean_output_tokens"] == pytest.approx(sum(r["max_new_tokens"] for r in rows) / 400)
    fitted = tmp_path / "fit.json"
    out = run("workload", "fit", str(reqs), "-o", str(fitted))
    assert out.returncode == 0, out.stderr
    assert "best fit" in out.stdout
    w = Workload.load(fitted)
    assert w.output.mean == pytest.approx(sum(r["max_new_tokens"] for r in rows) / 400, rel=0.03)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 3, "output_tokens": 2}\nnot json\n')
    out = run("workload", "show", str(bad))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "bad.jsonl:2: not valid JSON" in out.stderr
    out = run("workload", "sample", "G", "-n", "1000000000000", "-o", str(tmp_path / "big.jsonl"))  # was 7 TiB
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "at most" in out.stderr, out.stderr


def test_workload_sample_to_standard_output(tmp_path, monkeypatch, capsys):
    """Audit: `-o -` wrote a file named '-'; it now streams the same lines to standard output,
    and refuses --json, whose summary would land in the same stream."""
    from xsched.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["workload", "sample", "C1@0.5", "-n", "20", "--seed", "3", "-o", "-"]) == 0
    streamed = capsys.readouterr().out
    assert not (tmp_path / "-").exists()
    assert main(["workload", "sample", "C1@0.5", "-n", "20", "--seed", "3", "-o", "reqs.jsonl"]) == 0
    capsys.readouterr()
    assert streamed == (tmp_path / "reqs.jsonl").read_text() and streamed.count("\n") == 20
    assert main(["workload", "sample", "C1@0.5", "-n", "20", "-o", "-", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "leave out --json" in captured.err


def test_a_workload_past_the_models_context_is_noted(profile_path):
    out = run("simulate", "--profile", profile_path, "--model", "opt-1.3b", "--workload", "fixed:4000:100",
              "--policy", '{"gbs": 1, "nb": 1}', "--requests", "4")
    assert out.returncode == 0 and "4100 tokens, beyond opt-1.3b's 2048 positions" in out.stderr, out.stderr
    out = run("simulate", "--profile", profile_path, "--model", "opt-1.3b", "--workload", "fixed:1000:100",
              "--policy", '{"gbs": 1, "nb": 1}', "--requests", "4")
    assert out.returncode == 0 and "positions" not in out.stderr, out.stderr


def test_plan_refuses_a_workload_every_request_of_which_run_would_refuse_and_warns_of_odd_ones(profile_path, tmp_path):
    """A walkthrough planned fixed:2049:8 for opt-125m (2048 positions) with a note, priced a
    250-token shared prefix on prompts of median 128 without a word, and simulated a policy 331
    GiB over the gpu tier with exit 0 and no warning."""
    plan = tmp_path / "p.json"
    out = run("plan", "--profile", profile_path, "--model", "opt-125m", "--workload", "fixed:2049:8", "-o", str(plan))
    assert out.returncode == 2 and "every request of workload fixed:2049:8 is beyond" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not plan.exists()
    out = run("plan", "--profile", profile_path, "--model", "opt-125m", "--workload", "T", "--requests", "64",
              "--prefix-tokens", "250", "--latency", "600", "--quiet")
    assert out.returncode == 0 and "warning: " in out.stderr and "no longer than the 250-token prefix" in out.stderr
    assert out.stderr.count("no longer than the 250-token prefix") == 1, out.stderr  # warned, not noted again
    out = run("plan", "--profile", profile_path, "--model", "opt-125m", "--workload", "T", "--requests", "64",
              "--prefix-tokens", "20", "--latency", "600", "--quiet")  # a preset's short tail (8% of T) is no job's
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    out = run("simulate", "--profile", profile_path, "--model", "opt-175b", "--workload", "T", "--requests", "8",
              "--policy", '{"gbs": 8, "nb": 1}')
    assert out.returncode == 0 and "DOES NOT FIT" in out.stdout, out.stdout
    assert "warning: the policy does not fit" in out.stderr and "over gpu by" in out.stderr, out.stderr


def test_trace_writer_round_trip_and_markers(tmp_path):
    events = [TraceEvent("compute", "layers", 0.0, 0.5, {"block": 0}), TraceEvent("ctog", "ctog", 0.1, 0.2)]
    path = write_chrome_trace(tmp_path / "t.json", events, [TraceMarker("replan", 0.4, {"reason": "drift"})])
    data = json.loads(path.read_text())
    x = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert x[0]["ts"] == 0.0 and x[0]["dur"] == pytest.approx(5e5) and x[1]["tid"] == "ctog"
    back, markers = read_chrome_trace(path)
    assert back[0] == events[0] and markers[0].name == "replan" and markers[0].time_s == pytest.approx(0.4)
    with pytest.raises(ValueError, match="unknown trace track"):
        write_chrome_trace(tmp_path / "u.json", [TraceEvent("gpu", "x", 0, 1)])


def test_simulated_trace_lays_channels_inside_steps():
    spec = get_model_spec("opt-1.3b")
    pol = Policy(gbs=4, nb=2, wg=0.0, wc=1.0, wd=0.0)
    from workloads import get_workload

    result, tl = simulate_timeline(spec, t4_like(), pol, get_workload("fixed:32:4"), num_requests=8)
    events = trace_events(CostModel.for_policy(spec, t4_like(), pol), tl)
    steps = {(e.args["block"], e.args["step"]) for e in events}
    assert len(steps) == 4  # one prefill and three decode steps
    for key in steps:
        evs = [e for e in events if (e.args["block"], e.args["step"]) == key]
        start = min(e.start_s for e in evs)
        assert all(e.start_s == start for e in evs if e.name in ("layers", "ctog"))  # overlapped (CUDA)
    assert sum(e.dur_s for e in events if e.track == "ctog") == pytest.approx(result.busy_s["ctog"])


def test_a_measured_profile_without_the_models_layer_fits_says_so(tmp_path):
    """A plan priced from the roofs where the user profiled another model was silent about it (3x off
    for SmolLM2 under an opt-125m calibration); presets never hold fits, so they stay quiet."""
    from pathlib import Path

    from xprofiler.profile import HardwareProfile

    data = Path(__file__).parent / "data" / "perturbed_cpu_profile.json"  # measured, fits for smollm2-135m only
    profile = HardwareProfile.load(data)
    spec = profile.model_for(get_model_spec("opt-125m"))
    assert "has no layer fits for opt-125m (float32; it has: smollm2-135m (float32))" in profile.unfitted_note(spec)
    assert profile.unfitted_note(profile.model_for(get_model_spec("smollm2-135m"))) is None
    assert t4_like().unfitted_note(spec) is None
    out = run("simulate", "--profile", str(data), "--model", "opt-125m", "--workload", "S@0.125",
              "--policy", '{"gbs": 4, "nb": 1}', "--requests", "20")
    assert out.returncode == 0, out.stderr
    assert "xsched profile --model opt-125m" in out.stderr


def test_samples_per_prompt_from_the_command_line_are_priced_in_simulate_and_plan(profile_path, capsys):
    """--samples N: the workload's prompts each ask for N outputs; simulate and plan price one
    prefill per prompt in a GPU batch, as `xsched run` computes it, and plan says so."""
    from xsched.cli import main

    base = ["--profile", profile_path, "--model", "opt-1.3b", "--workload", "S@0.25", "--requests", "64"]
    policy = json.dumps({"gbs": 8, "nb": 1})
    got = {}
    for n in ("1", "8"):
        assert main(["simulate", *base, "--policy", policy, "--samples", n, "--json"]) == 0
        got[n] = SimResult.from_json(capsys.readouterr().out)
    assert got["8"].padded_prompt_tokens * 4 < got["1"].padded_prompt_tokens
    assert got["8"].throughput_tokens_per_s > 2 * got["1"].throughput_tokens_per_s
    assert main(["plan", *base, "--samples", "8", "--latency", "inf", "--quiet"]) == 0
    assert "64 requests (8 per prompt, prefilled once per GPU batch)" in capsys.readouterr().out


def test_prompts_mixing_prefixes_from_the_command_line_are_priced_in_simulate_and_plan(profile_path, capsys):
    """--prefix-tokens 96 --prefix-groups G: every prompt begins with one of G 96-token prefixes;
    simulate prices each GPU batch computing each of its prefixes once, so more prefixes compute
    more prompt positions and run slower (never slower than sharing none), and plan says so."""
    from xsched.cli import main

    base = ["--profile", profile_path, "--model", "opt-1.3b", "--workload", "fixed:128:16", "--requests", "256"]
    policy = json.dumps({"gbs": 16, "nb": 4})
    got = {}
    for flags in ([], ["--prefix-tokens", "96"], ["--prefix-tokens", "96", "--prefix-groups", "4"],
                  ["--prefix-tokens", "96", "--prefix-groups", "64"]):
        assert main(["simulate", *base, "--policy", policy, *flags, "--json"]) == 0
        got[len(flags) and flags[-1]] = SimResult.from_json(capsys.readouterr().out)
    positions = [got[k].padded_prompt_tokens for k in ("96", "4", "64", 0)]
    assert positions == sorted(positions) and positions[0] < positions[1] < positions[3], positions
    assert got["96"].throughput_tokens_per_s > got["4"].throughput_tokens_per_s > got[0].throughput_tokens_per_s
    assert main(["plan", *base, "--prefix-tokens", "96", "--prefix-groups", "4", "--latency", "inf", "--quiet"]) == 0
    assert "(a shared 96-token prefix, one of 4, prefilled once per run)" in capsys.readouterr().out


def test_simulating_a_plan_on_another_model_says_so(tmp_path, capsys):
    """`simulate --plan P --model M` priced the plan's policy on M without a word when the plan was
    made for another model, though another profile gets a note (review)."""
    from xsched.cli import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", "t4", "--model", "opt-125m", "--workload", "fixed:32:8", "--requests", "50",
                 "--quiet", "-o", str(plan)]) == 0
    capsys.readouterr()
    for model, noted in (("opt-1.3b", True), ("opt-125m", False)):
        assert main(["simulate", "--plan", str(plan), "--model", model]) == 0
        err = capsys.readouterr().err
        assert ("the plan was made for model 'opt-125m'; simulating its policy on 'opt-1.3b'" in err) == noted, err


def test_a_plan_prices_the_job_its_workload_file_held(tmp_path, capsys):
    """`workload fit` of an 8-request file, then `plan --workload wl.json`, priced 2000 requests:
    the plan's block (4 x 512) and latencies were for another job than the one `run` then ran
    (review). Without --requests the plan (and `simulate`) now price the file's requests; presets
    keep 2000."""
    from workloads import Workload
    from xsched.cli import main

    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"id": i, "prompt_tokens": 20 + 7 * i, "max_new_tokens": 8 + i}) + "\n"
                            for i in range(8)))
    fitted = tmp_path / "wl.json"
    assert main(["workload", "fit", str(reqs), "-o", str(fitted)]) == 0
    wl = Workload.load(fitted)
    assert wl.file_requests == 8 and Workload.from_file(reqs).file_requests == 8
    assert Workload.from_json(wl.to_json()) == wl and wl.scaled(0.5).file_requests == 8
    capsys.readouterr()
    base = ["plan", "--profile", "t4", "--model", "opt-1.3b", "--latency", "inf", "--json"]
    for workload, extra, want in ((str(fitted), [], 8), (str(reqs), [], 8), (str(fitted), ["--requests", "50"], 50),
                                  ("T", [], 2000)):
        assert main([*base, "--workload", workload, *extra]) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["predicted"]["num_requests"] == want
        noted = "no --requests given; pricing the 8 requests the workload was read from" in out.err
        assert noted == (want == 8), out.err
        # `simulate` samples the same job size from the workload
        assert main(["simulate", "--profile", "t4", "--model", "opt-1.3b", "--workload", workload, *extra,
                     "--policy", '{"gbs": 4, "nb": 1}', "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["num_requests"] == want


def test_the_clis_copies_of_the_default_job_size_match_the_simulators():
    """`simulate` and `plan` keep their own copy of the default request count (importing the
    simulator would slow every command's start); both must price the job the library prices."""
    import xscheduler.cli
    import xsimulator.cli
    from xscheduler.planner import plan_search
    from xsimulator.discrete_event import DEFAULT_REQUESTS, simulate

    assert xsimulator.cli.DEFAULT_REQUESTS == xscheduler.cli.DEFAULT_REQUESTS == DEFAULT_REQUESTS
    assert inspect.signature(simulate).parameters["num_requests"].default == DEFAULT_REQUESTS
    assert inspect.signature(plan_search).parameters["num_requests"].default == DEFAULT_REQUESTS
