"""``xsched run``: results against the in-memory reference loop, resume after SIGKILL, refusals.

Plans are built here from a Policy and the discrete-event simulator (the Plan contract of
xscheduler/plan.py), so these tests do not depend on the scheduler's search.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
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

    prof = load_profile(profile) if isinstance(profile, str) else profile
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
def test_a_key_spelled_nearly_like_one_xsched_reads_is_warned_about_once(tmp_path):
    """A typo ("max_new_token") was ignored like any metadata key, and the request silently got the
    plan's longest output; keys of the job's own ("category") still pass without a word."""
    import warnings

    from xrunner.jobfiles import read_prompts

    path = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi", "max_new_token": 3},
                                                {"id": "b", "prompt": "yo", "category": "x", "temprature": 0.5},
                                                {"id": "c", "prompt": "hey", "max_new_token": 3}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_prompts(path)
    assert sorted(str(w.message) for w in caught) == [
        f'{path}:1: key "max_new_token" is not one xsched reads and is ignored; did you mean "max_new_tokens"?',
        f'{path}:2: key "temprature" is not one xsched reads and is ignored; did you mean "temperature"?']
    assert [r.max_new_tokens for r in records] == [None, None, None]


def test_prompt_file_errors_name_the_line(tmp_path):
    from xrunner.jobfiles import read_prompts

    cases = [
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate id 'a' (first on line 1)"),
        ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n', ":2: not valid JSON"),
        ('{"id": "a"}\n', "give exactly one of"),
        ('{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}\n', "give exactly one of"),
        ('{"id": "a", "messages": []}\n', ':1: "messages" must be a non-empty list'),
        ('{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "user"}]}\n',
         ':1: message 2 must be an object with a "role"'),
        ('{"id": "a", "messages": [{"role": "user", "content": "\\ud800"}]}\n', "message 1's content holds a lone"),
        ('{"id": "a", "prompt": "x", "stop": ""}\n', ':1: "stop" must be a non-empty string or a list'),
        ('{"id": "a", "prompt": "x", "stop": ["a", 3]}\n', '"stop" must be'),
        ('{"id": "a", "prompt": "x", "temperature": "hot"}\n', ':1: "temperature" must be a number'),
        ('{"id": "a", "prompt": "x", "top_k": 1.5}\n', '"top_k" must be a whole number'),
        ('{"id": "a", "prompt": "x", "seed": true}\n', '"seed" must be a whole number'),
        ('{"id": "a", "prompt": "x", "max_new_tokens": 0}\n', "max_new_tokens"),
        ('{"id": "a", "prompt": "x", "n": 0}\n', ':1: "n" must be an integer >= 1, got 0'),
        ('{"id": "a", "prompt": "x", "n": "2"}\n', '"n" must be an integer'),
        # 10^12 outputs of one prompt filled the 24 GiB machine before the job began (stop 61's audit)
        ('{"id": "a", "prompt": "x", "n": 1000000000000}\n', ':1: "n" asks for 1,000,000,000,000 outputs of one prompt; at most 4,096'),
        ('{"id": "a", "prompt_ids": [1, -2]}\n', "non-negative integers"),
        ('{"id": "a", "prompt": "x", "chat_template": "no"}\n', ':1: "chat_template" must be true or false'),
        ('[1, 2]\n', "JSON object"),
        ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}\n',  # (said: "id" must be a string)
         ':1: an OpenAI batch line (it has "custom_id") needs a "body"'),
        ('{"id": 1.5, "prompt": "x"}\n', '"id" must be a string or an integer'),
        # a file `workload fit` read: said "must be a string or an integer, got None", as if given wrong
        ('{"prompt": "x"}\n', ':1: no "id"; give each request a unique "id"'),
        # an integer past Python's 4300 digits raised ValueError with a traceback (a fault audit)
        ('{"id": ' + "1" * 5001 + ', "prompt": "x"}\n', ":1: not valid JSON (Exceeds the limit"),
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
    p.write_text('{"id": 7, "prompt": "hi", "meta": 1}\n\n{"id": "7", "prompt_ids": [3, 4], "max_new_tokens": 2}\n'
                 '{"id": "c", "messages": [{"role": "system", "content": "be brief"}, '
                 '{"role": "user", "content": "hi"}]}\n')
    recs = read_prompts(p)
    assert [(r.id, r.prompt, r.prompt_ids, r.max_new_tokens, r.line, r.messages) for r in recs] == [
        (7, "hi", None, None, 1, None), ("7", None, (3, 4), 2, 3, None),  # 7 and "7" are different ids
        ("c", None, None, None, 4, (("system", "be brief"), ("user", "hi")))]
    # A byte-order mark is dropped; a raw U+2028 / U+0085 inside a prompt does not end its line.
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"id": "s", "prompt": "a\u2028b\x85c"}, ensure_ascii=False)
                                     + "\r\n").encode())
    assert [(r.id, r.prompt, r.line) for r in read_prompts(p)] == [("s", "a\u2028b\x85c", 1)]


def openai_line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "any", **body}}


def test_an_openai_batch_file_reads_as_the_requests_it_holds(tmp_path):
    """OpenAI Batch API input lines (chat and completion bodies) become the same records as the
    native lines that ask for the same; a field xsched cannot honour is refused, naming it."""
    from xrunner.jobfiles import read_prompts

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    openai = write_prompts(tmp_path / "openai.jsonl", [
        openai_line("a", {"messages": chat, "max_completion_tokens": 5, "max_tokens": 9, "n": 2, "stop": ["x"],
                          "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 4, "presence_penalty": 0,
                          "tool_choice": "auto", "stream": False, "metadata": {"k": 1}}),
        openai_line("b", {"prompt": "w3 w4", "max_tokens": 2, "top_k": -1}, url="/v1/completions"),
        openai_line("c", {"prompt": [3, 4, 5]}, url="/v1/completions")])
    native = write_prompts(tmp_path / "native.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
         "max_new_tokens": 5, "n": 2, "stop": ["x"], "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 4},
        {"id": "b", "prompt": "w3 w4", "max_new_tokens": 2, "chat_template": False, "top_k": 0},
        {"id": "c", "prompt_ids": [3, 4, 5]}])
    with pytest.warns(UserWarning, match="xsched takes max_completion_tokens"):  # line "a" gives 5 and 9
        assert [replace(r, openai=False) for r in read_prompts(openai)] == read_prompts(native)
    assert all(r.openai for r in read_prompts(openai))  # their results go out in OpenAI's format by default
    bad = [({"frequency_penalty": 0.5}, 'body "frequency_penalty" = 0.5 is not supported by xsched run; drop it'),
           ({"logprobs": True, "top_logprobs": 2}, '"top_logprobs" = 2'),
           ({"prompt": "x", "logprobs": 3}, "the chosen tokens' log-probabilities only"),
           ({"response_format": {"type": "json_object"}}, '"response_format"'),
           ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text models"),
           ({"prompt": ["one", "two"]}, "one prompt per line")]
    for i, (body, message) in enumerate(bad):
        p = write_prompts(tmp_path / f"bad{i}.jsonl", [openai_line("z", {"messages": chat, **body})])
        with pytest.raises(UserError, match=r":1: .*" + message.replace("(", r"\(")):
            read_prompts(p)
    for line, message in (({**openai_line("z", {"prompt": "x"}), "url": "/v1/embeddings"}, "/v1/embeddings"),
                          ({**openai_line("z", {"prompt": "x"}), "method": "GET"}, '"method" must be "POST"'),
                          ({"custom_id": "z", "body": "x"}, '"body" must be a JSON object'),
                          # a body that is not the url's kind came back as the other kind of reply (a walkthrough)
                          (openai_line("z", {"prompt": "x"}), 'for /v1/chat/completions takes "messages", and only '
                                                              'it; this one has "prompt"'),
                          (openai_line("z", {"messages": chat}, url="/v1/completions"),
                           'for /v1/completions takes "prompt", and only it; this one has "messages"'),
                          # no custom_id: said 'no "id"', a key no batch line has
                          ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
                           'it has "body" and "url" or "method"\\) needs a "custom_id"')):
        with pytest.raises(UserError, match=message):
            read_prompts(write_prompts(tmp_path / "bad.jsonl", [line]))


def test_openai_output_ids_follow_the_request_and_its_tokens():
    """Every job's output for custom_id "a" was batch_req_b297ad24... (a walkthrough): merged
    batch outputs collided. The same tokens still give the same ids, so a resume writes the same line."""
    from xsched.openai_batch import openai_result_line

    def line(ids):
        row = {"id": "a", "text": "x", "output_ids": ids, "output_tokens": len(ids), "prompt_tokens": 3}
        return openai_result_line("a", [row], model="m", chat=True, created=0)

    assert line([5, 6]) == line([5, 6])
    assert line([5, 6])["id"] != line([5, 7])["id"]
    assert line([5, 6])["response"]["body"]["id"] != line([5, 7])["response"]["body"]["id"]


def test_an_openai_batch_file_runs_and_fits_as_its_native_twin(tiny_dir, tmp_path, capsys):
    """`xsched run` on an OpenAI batch file writes OpenAI batch output lines, one per request with
    its samples as choices, whose rows are the native twin's results; `workload fit` reads the
    input and the output alike; a job cut short resumes to the same lines, and a file of the
    other format is refused."""
    from workloads import Workload
    from xsched.openai_batch import openai_result_rows
    from xsimulator.policy import Policy

    texts = ["w3 w4 w5", "w9 w8", "w7 w7 w7 w6"]
    openai = write_prompts(tmp_path / "openai.jsonl", [
        openai_line(f"q{i}", {"prompt": t, "max_tokens": 3 + i, "n": 2 if i == 1 else 1, "seed": i,
                              **({"logprobs": 0} if i == 0 else {})}, url="/v1/completions")
        for i, t in enumerate(texts[:2])]
        + [openai_line("q2", {"messages": [{"role": "user", "content": texts[2]}], "max_tokens": 5, "seed": 2,
                              "logprobs": True})])
    native = write_prompts(tmp_path / "native.jsonl", [
        {"id": f"q{i}", "prompt": t, "max_new_tokens": 3 + i, "n": 2 if i == 1 else 1, "seed": i,
         "chat_template": False, **({"logprobs": True} if i == 0 else {})} for i, t in enumerate(texts[:2])]
        + [{"id": "q2", "messages": [{"role": "user", "content": texts[2]}], "max_new_tokens": 5, "seed": 2,
            "logprobs": True}])
    from xrunner.loaders import open_model

    model = tmp_path / "model"  # the tiny model with a chat template
    shutil.copytree(tiny_dir, model)
    tok = open_model(model, dtype="float32").tokenizer()
    tok.chat_template = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"  # w1 marks a templated turn
    tok.save_pretrained(model)
    plan = tiny_plan(model, tmp_path / "plan.json", Policy(gbs=2, nb=2))
    flags = ["--plan", str(plan), "--model", str(model), "--quiet", "--adapt", "none", "--temperature", "0.7"]
    outs = {}
    for name, prompts in (("openai", openai), ("native", native)):
        outs[name] = tmp_path / f"{name}.out.jsonl"
        assert main(["run", *flags, "--prompts", str(prompts), "--out", str(outs[name])]) == 0
    lines = read_rows(outs["openai"])
    by_id = {line["custom_id"]: line for line in lines}
    assert sorted(by_id) == ["q0", "q1", "q2"] and all(line["response"]["status_code"] == 200 for line in lines)
    q1 = by_id["q1"]["response"]["body"]
    assert q1["object"] == "text_completion" and [c["index"] for c in q1["choices"]] == [0, 1]
    assert q1["usage"]["completion_tokens"] == sum(c["xsched"]["output_tokens"] for c in q1["choices"])
    q2 = by_id["q2"]["response"]["body"]
    assert q2["object"] == "chat.completion" and q2["choices"][0]["message"]["role"] == "assistant"
    # Log-probabilities where a request asked (OpenAI's shapes, the engine's values), nowhere else.
    chosen = q2["choices"][0]
    assert [c["logprob"] for c in chosen["logprobs"]["content"]] == chosen["xsched"]["logprobs"]
    texts = [tok.decode([t]) for t in chosen["xsched"]["output_ids"]]
    assert [c["token"] for c in chosen["logprobs"]["content"]] == texts
    q0 = by_id["q0"]["response"]["body"]["choices"][0]
    assert q0["logprobs"]["token_logprobs"] == q0["xsched"]["logprobs"] and len(q0["logprobs"]["tokens"]) == \
        q0["xsched"]["output_tokens"] and all(x <= 0 for x in q0["xsched"]["logprobs"])
    assert all(c["logprobs"] is None and "logprobs" not in c["xsched"] for c in q1["choices"])
    # A completion continues its text as it is; a chat goes through the template (w1 + 4 words).
    assert by_id["q0"]["response"]["body"]["usage"]["prompt_tokens"] == 3 and q2["usage"]["prompt_tokens"] == 5
    assert all(c["finish_reason"] == ("stop" if c["xsched"]["stopped_on_eos"] else "length")
               for line in lines for c in line["response"]["body"]["choices"])
    back = [row for line in lines for row in openai_result_rows(line, "test")]
    assert without_timing(back) == without_timing(read_rows(outs["native"])) and len(back) == 4
    for kind in ("openai", "native"):  # the input files fit alike, and so do the two results files
        assert main(["workload", "fit", str(openai if kind == "openai" else native), "--tokenizer", str(model),
                     "-o", str(tmp_path / f"{kind}.fit.json")]) == 0
    fits = [Workload.load(tmp_path / f"{k}.fit.json") for k in ("openai", "native")]
    assert fits[0].prompt == fits[1].prompt and fits[0].output == fits[1].output
    assert fits[0].prompt.mean == pytest.approx((3 + 2 * 2 + 5) / 4)  # completions bare, q1 twice, the chat templated
    results = [Workload.from_file(outs[k]) for k in ("openai", "native")]
    assert results[0].prompt == results[1].prompt and results[0].output == results[1].output

    def stable(rows: list[dict]) -> set[str]:  # what differs between runs: the time stamp, latencies, and
        for line in rows:  # log-probabilities in their last bits (other batch shapes)
            line["response"]["body"]["created"] = 0
            for c in line["response"]["body"]["choices"]:
                c["xsched"]["latency_s"] = 0
                if "logprobs" in c["xsched"]:
                    c["xsched"]["logprobs"] = [round(x, 4) for x in c["xsched"]["logprobs"]]
                    for item in (c["logprobs"].get("content") or []):
                        item["logprob"] = round(item["logprob"], 4)
                    if "token_logprobs" in c["logprobs"]:
                        c["logprobs"]["token_logprobs"] = [round(x, 4) for x in c["logprobs"]["token_logprobs"]]
        return {json.dumps(r, sort_keys=True) for r in rows}

    cut = tmp_path / "cut.jsonl"
    cut.write_text(outs["openai"].read_text().splitlines(keepends=True)[0] + '{"id": "batch_req_to')
    assert main(["run", *flags, "--prompts", str(openai), "--out", str(cut), "--resume"]) == 0
    assert stable(read_rows(cut)) == stable(lines) and len(read_rows(cut)) == 3
    capsys.readouterr()
    assert main(["run", *flags, "--prompts", str(openai), "--out", str(outs["native"]), "--resume"]) == 2
    assert "resume with --out-format xsched" in capsys.readouterr().err
    assert main(["run", *flags, "--prompts", str(openai), "--out", str(cut), "--resume", "--out-format", "xsched"]) == 2
    assert "resume with --out-format openai" in capsys.readouterr().err


def test_a_lone_surrogate_in_the_prompt_file_is_refused_up_front(random_plan, tmp_path, capsys):
    """"\\ud800" is valid JSON but no text: as an id it ended the job with a UnicodeEncodeError
    traceback when its results line was written (after a block had run); as a prompt, with a
    TypeError from the tokenizer (review)."""
    rows = {"id": '{"id": "q\\ud800", "prompt_ids": [5, 6]}', "prompt": '{"id": "a", "prompt": "hi \\udc00 there"}'}
    for i, (field, row) in enumerate(rows.items()):
        prompts, out = tmp_path / f"p{i}.jsonl", tmp_path / f"o{i}.jsonl"
        prompts.write_text('{"id": "ok", "prompt_ids": [5]}\n' + row + "\n")
        assert main(["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts),
                     "--out", str(out), "--quiet", "--adapt", "none"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f':2: "{field}" holds a lone surrogate' in err, err
        assert not out.exists()


def test_results_writer_refuses_old_file_and_drops_a_torn_line_on_resume(tmp_path):
    from xrunner.jobfiles import ResultsWriter

    out = tmp_path / "r.jsonl"
    ResultsWriter.open(out, resume=False).close()
    assert not out.exists()  # created (and locked) at open, removed by a job that ends before its first write
    w = ResultsWriter.open(out, resume=False)
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
    with pytest.raises(RuntimeError, match="finished twice"), ResultsWriter.open(out, resume=True) as w:
        w.write([{"id": "a"}])
    out.write_bytes(good + b"garbage\n" + good)
    with pytest.raises(UserError, match=r":3: not a results line|:2: not a results line"):
        ResultsWriter.open(out, resume=True)
    out.write_bytes(good + b'{"id": "r5", "output_tokens": ' + b"1" * 5001 + b"}\n" + good)  # (a traceback before)
    with pytest.raises(UserError, match=r":3: not a results line"):
        ResultsWriter.open(out, resume=True)
    out.write_bytes(good + good)  # (two jobs' lines concatenated): resuming would keep duplicates
    with pytest.raises(UserError, match=r":3: id 'a' appears twice; pass another --out"):
        ResultsWriter.open(out, resume=True)
    assert out.read_bytes() == good + good  # refused, and kept as it was


def test_resume_refuses_results_of_another_model_in_either_format(tmp_path):
    """Resumed, one file would hold two models' outputs (a plan for another model given by
    mistake): lines naming another model are refused and kept; lines of the same model, or
    written before lines named their model, resume."""
    from xrunner.jobfiles import OpenAIOutput, ResultsWriter

    row = {"id": "a", "text": "x", "prompt_tokens": 3, "output_tokens": 1, "stopped_on_eos": True, "output_ids": [5]}
    for fmt, openai in (("xsched", None), ("openai", OpenAIOutput("opt-125m", frozenset(), {'"a"': 1, '"b"': 1}))):
        out = tmp_path / f"{fmt}.jsonl"
        with ResultsWriter.open(out, resume=False, openai=openai, model="opt-125m") as w:
            w.write([{**row, "model": "opt-125m"}])
        kept = out.read_bytes()
        with pytest.raises(UserError, match="holds results of model opt-125m, this job runs opt-350m"):
            ResultsWriter.open(out, resume=True, openai=openai, model="opt-350m")
        assert out.read_bytes() == kept
        with ResultsWriter.open(out, resume=True, openai=openai, model="opt-125m") as w:
            assert w.is_done("a") and w.done['"a"']["model"] == "opt-125m"
    old = tmp_path / "old.jsonl"  # no "model" on its lines
    old.write_text(json.dumps(row) + "\n")
    with ResultsWriter.open(old, resume=True, model="opt-350m") as w:
        assert w.is_done("a")


def test_resume_refuses_a_file_that_is_not_results_and_keeps_it(tmp_path):
    """A torn tail is the start of a row without its newline; any other line that is not a results
    row says the file is not ours. A one-line notes file given as --out --resume was truncated to
    nothing as if torn (review); two such lines were refused."""
    from xrunner.jobfiles import ResultsWriter

    row = b'{"id": "a", "text": "x"}\n'
    for i, text in enumerate((b"important notes\n", b"important notes", row + b"not json\n",
                              row + b'{"no_id": 1}\n', row + b"not json\n\n")):
        out = tmp_path / f"r{i}.jsonl"
        out.write_bytes(text)
        with pytest.raises(UserError, match="not a results line"):
            ResultsWriter.open(out, resume=True)
        assert out.read_bytes() == text
    for i, tail in enumerate((b'{"id": "b", "te', b"   ")):  # a torn append and a blank end are dropped
        out = tmp_path / f"t{i}.jsonl"
        out.write_bytes(row + tail)
        assert list(ResultsWriter.open(out, resume=True).done) == ['"a"'] and out.read_bytes() == row


def test_a_full_disk_leaves_the_results_file_at_its_last_complete_line(tmp_path, monkeypatch):
    """An append cut short by ENOSPC is cut back: the file stays valid JSONL for --resume, `workload
    fit` and `replan`, and a file the failed append created is removed."""
    import errno

    import xrunner.jobfiles as jobfiles

    real_write = os.write
    room = [10**9]

    def write(fd, data):  # a disk with `room` bytes left
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[:room[0]]))
        room[0] -= n
        return n

    monkeypatch.setattr(jobfiles.os, "write", write)
    out = tmp_path / "r.jsonl"
    w = jobfiles.ResultsWriter.open(out, resume=False)
    room[0] = 5
    with pytest.raises(UserError, match="no space left"):
        w.write([{"id": "a", "text": "first"}])
    assert not out.exists()  # the failed first append created it: removed
    room[0] = 10**9
    w = jobfiles.ResultsWriter.open(out, resume=False)
    w.write([{"id": "a", "text": "first"}])
    good = out.read_bytes()
    room[0] = 30
    with pytest.raises(UserError, match="no space left"):
        w.write([{"id": "b", "text": "second"}, {"id": "c", "text": "third"}])
    w.close()
    assert out.read_bytes() == good and not w.is_done("b")
    room[0] = 10**9
    w = jobfiles.ResultsWriter.open(out, resume=True)
    w.write([{"id": "b", "text": "second"}])
    w.close()
    assert [r["id"] for r in read_rows(out)] == ["a", "b"]


def test_a_second_job_on_the_same_results_file_is_refused_until_the_first_ends(random_plan, tmp_path, capsys):
    """Two `xsched run` on one --out both appended every id, and --resume then refused the file
    ("appears twice"); the job holding the file's lock refuses the second up front, and a killed
    holder's lock goes with it (the kernel drops it), so --resume after SIGKILL still opens it."""
    from xrunner.jobfiles import ResultsWriter

    out = tmp_path / "r.jsonl"
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7]}])
    with ResultsWriter.open(out, resume=False) as first:
        for resume in ([], ["--resume"]):
            assert main(["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts),
                         "--out", str(out), "--quiet", *resume]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "another xsched run is writing this file" in err, err
        first.write([{"id": "a", "text": "x"}])
    ResultsWriter.open(out, resume=True).close()  # released at the end of the job

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom xrunner.jobfiles import ResultsWriter\n"
                               f"w = ResultsWriter.open({str(out)!r}, resume=True)\nprint('locked', flush=True)\n"
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(UserError, match="another xsched run is writing this file"):
        ResultsWriter.open(out, resume=True)
    holder.kill()
    holder.communicate(timeout=60)
    with ResultsWriter.open(out, resume=True) as w:
        assert w.is_done("a")


def test_run_result_percentiles_match_the_simulator_and_round_trip():
    from types import SimpleNamespace

    from xrunner.result import RunResult, build_run_result
    from xsimulator.discrete_event import quantile
    from xsimulator.policy import Policy

    lat = list(np.random.default_rng(0).gamma(2.0, 1.5, size=101))
    stats = SimpleNamespace(wall_s=10.0, generated_tokens=500, prompt_tokens=300, padded_prompt_tokens=400,
                            num_prefill_steps=3, num_decode_steps=40, peak_bytes={"gpu": 10, "cpu": 5, "disk": 0},
                            planned_peak_bytes={"gpu": 12.0, "cpu": 5.0, "disk": 0.0},
                            busy_s={"compute": 8.0, "dtoc": 1.0}, device_reserved_peak_bytes=None)
    r = build_run_result(model="m", policy=Policy(gbs=4, nb=2), device="cpu", dtype="float32", stats=stats,
                         latencies_s=lat, num_stopped_on_eos=3, num_skipped=2, capacity_bytes={"gpu": 1e9},
                         max_prompt=8, max_output=9, predicted=None)
    arr = np.array(lat)
    assert r.latency_p99_s == quantile(arr, 0.99) == np.sort(arr)[99]  # inverted CDF: ceil(0.99 * 101) - 1
    assert r.latency_p50_s == np.sort(arr)[50] and r.latency_max_s == max(lat)
    assert r.latency_p90_s == np.sort(arr)[90] and r.latency_mean_s == pytest.approx(arr.mean(), rel=1e-12)
    assert (r.throughput_tokens_per_s, r.total_throughput_tokens_per_s, r.padded_throughput_tokens_per_s) == (50, 80, 90)
    assert r.fits and RunResult.from_json(r.to_json()) == r
    assert r.describe().splitlines()[4].split() == ["measured", "plan"]  # (a plan column, no simulated one)
    assert "simulated" not in r.describe()
    assert r.device_reserved_peak_bytes is None and "reserved" not in r.describe()
    # A CUDA run also carries the caching allocator's peak, which the tier ledger does not see.
    stats.device_reserved_peak_bytes = 3 * 2**30
    g = build_run_result(model="m", policy=Policy(gbs=4, nb=2), device="cuda:0", dtype="float16", stats=stats,
                         latencies_s=lat, num_stopped_on_eos=3, num_skipped=2, capacity_bytes={"gpu": 1e9},
                         max_prompt=8, max_output=9, predicted=None)
    assert g.device_reserved_peak_bytes == 3 * 2**30 and RunResult.from_json(g.to_json()) == g
    assert "gpu reserved GiB" in g.describe() and "3.000" in g.describe()
    # A measured peak above the plan on any tier (here cpu, 6 against 5 planned) breaks the memory
    # contract, and the summary says so.
    stats.peak_bytes, stats.device_reserved_peak_bytes = {"gpu": 10, "cpu": 6, "disk": 0}, None
    over = build_run_result(model="m", policy=Policy(gbs=4, nb=2), device="cpu", dtype="float32", stats=stats,
                            latencies_s=lat, num_stopped_on_eos=3, num_skipped=2, capacity_bytes={"gpu": 1e9},
                            max_prompt=8, max_output=9, predicted=None)
    assert not over.fits and "MEASURED PEAK ABOVE PLAN" in over.describe() and "ABOVE PLAN" not in r.describe()


def test_the_summary_of_a_run_whose_policy_changed_names_the_policy_at_start_and_at_end():
    """After a drift re-plan the summary's "policy:" line showed the plan's policy, which ran only
    until the change, and the plan column read as a prediction of the job: both are labelled."""
    from dataclasses import replace
    from types import SimpleNamespace

    from xrunner.result import Adaptation, build_run_result
    from xsimulator.policy import Policy

    start, end = Policy(gbs=4, nb=1), Policy(gbs=1, nb=2, compress_cache=True)
    stats = SimpleNamespace(wall_s=10.0, generated_tokens=500, prompt_tokens=300, padded_prompt_tokens=400,
                            num_prefill_steps=3, num_decode_steps=40, peak_bytes={"gpu": 10, "cpu": 5, "disk": 0},
                            planned_peak_bytes={"gpu": 12.0, "cpu": 5.0, "disk": 0.0}, busy_s={"compute": 8.0},
                            device_reserved_peak_bytes=None)
    plain = build_run_result(model="m", policy=start, device="cpu", dtype="float32", stats=stats, latencies_s=[1.0],
                             num_stopped_on_eos=0, num_skipped=0, capacity_bytes={"gpu": 1e9}, max_prompt=8,
                             max_output=9, predicted=simulate_small(start))
    text = plain.describe()
    assert "  policy: block of 1 GPU batch(es) x 4" in text and "at start" not in text and "at end" not in text
    adapted = replace(plain, adaptations=(Adaptation(at_s=4.0, stall_s=0.5, reason="drift: prompt mean 8.0 -> 24.0",
                                                     old_policy=start, new_policy=end),))
    lines = adapted.describe().splitlines()
    assert not any(line.startswith("  policy:") for line in lines)
    assert any(line.startswith("  policy at start (the plan's): block of 1 GPU batch(es) x 4") for line in lines)
    at_end = [line for line in lines if line.startswith("  policy at end (after 1 change(s)")]
    assert len(at_end) == 1 and "block of 2 GPU batch(es) x 1" in at_end[0] and "KV cache: 100% gpu (4-bit)" in at_end[0]
    assert any(line.startswith("  (plan: ") and line.endswith(", for the policy at start)") for line in lines)
    assert any("no simulated column: the policy changed mid-run" in line for line in lines)


def simulate_small(policy):
    from workloads.workload import fixed_workload
    from xprofiler.presets import load_profile
    from xsimulator.discrete_event import simulate

    return simulate(random_spec(), load_profile("t4"), policy, fixed_workload(8, 6), num_requests=4)


def test_the_adapt_line_names_every_knob_a_replan_changes(random_plan, monkeypatch, capsys):
    """The stderr line of a re-plan gave only gbs, nb and refill, so a switch to a 4-bit cache (and
    the calibration pass the job then waits for) went unsaid."""
    from argparse import Namespace
    from dataclasses import replace

    from xprofiler.presets import load_profile
    from xrunner.engine import BlockInfo
    from xrunner.run_cli import _adapt_hook
    from xscheduler.plan import Plan
    from xscheduler.replan import DriftWatcher

    plan = Plan.load(random_plan)
    new = replace(plan.policy, gbs=1, compress_cache=True, prefix_cache_positions=900)
    monkeypatch.setattr(DriftWatcher, "__call__", lambda self, info: (new, "drift: test"))
    args = Namespace(adapt="drift", budget_file=None, replan_compress="auto", replan_scope="full")
    hook, _watcher = _adapt_hook(args, plan, {"gpu": 1e12, "cpu": 1e12, "disk": 1e12}, load_profile("t4"), None,
                                 horizon=16)
    assert hook(BlockInfo(3, 1.5, plan.policy)) == (new, "drift: test")
    err = capsys.readouterr().err
    assert err == ("xsched: adapt at block 3 (1.5 s): drift: test; policy change: GPU batch size: 2 -> 1, "
                   "4-bit KV cache: False -> True, prefix cache (positions): default -> 900\n"), err


# ----------------------------------------------------------------------------- CLI errors
@pytest.fixture(scope="module")
def random_plan(tmp_path_factory):
    from xsimulator.policy import Policy

    d = tmp_path_factory.mktemp("plan")
    return make_plan(d / "plan.json", random_spec(), Policy(gbs=2, nb=2, refill_every=2), 8, 6)


def test_the_simulated_column_prices_the_placement_the_engine_runs(tmp_path):
    """A hand-written plan may split a batch's rows or the layers in fractions the engine cannot
    place; the run's like-for-like prediction prices the whole rows and layers it did place (its
    disk peak was 15x the measured one when it priced the fractions)."""
    from xprofiler.presets import load_profile
    from xrunner.engine import rounded_policy
    from xrunner.run_cli import simulate_job
    from xscheduler.plan import Plan
    from xsimulator.discrete_event import simulate
    from xsimulator.policy import Policy

    policy = Policy(gbs=2, nb=2, wg=0.5, wc=0.3, wd=0.2, cg=0.4, cc=0.3, cd=0.3, hg=0.0, hc=0.5, hd=0.5)
    plan = Plan.load(make_plan(tmp_path / "plan.json", random_spec(), policy, 8, 6))
    placed = rounded_policy(policy, plan.model.num_layers)
    assert placed != policy
    got = simulate_job(plan, load_profile("t4"), [8, 5, 7], [6, 6, 2])
    want = simulate(plan.model, load_profile("t4"), placed, plan.workload, requests=([8, 5, 7], [6, 6, 2]))
    assert got.policy == placed and got.peak_bytes == want.peak_bytes


def test_the_simulated_column_prices_the_prefixes_the_jobs_prompts_share(tmp_path, capsys):
    """Prompts behind one of two 40-token system prompts, alternating, under a plan priced without
    any shared prefix: the run's like-for-like simulation takes the prefixes from the prompts
    themselves (the tokens they share, and which prompt begins with which), so its prefill
    positions are the engine's to within 5%; the plan's workload would price 1.5x as many."""
    from xprofiler.presets import load_profile
    from xrunner.result import RunResult
    from xrunner.run_cli import simulate_job
    from xscheduler.plan import Plan
    from xsimulator.policy import Policy

    rng = np.random.default_rng(8)
    systems = [rng.integers(4, 50000, size=40).tolist() for _ in range(2)]
    rows = [{"id": i, "prompt_ids": systems[i % 2] + rng.integers(4, 50000, size=int(rng.integers(2, 12))).tolist(),
             "max_new_tokens": 3} for i in range(16)]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    plan = make_plan(tmp_path / "plan.json", random_spec(), Policy(gbs=4, nb=2), 52, 3)
    with pytest.warns(UserWarning, match="begin with"):
        assert main(["run", "--plan", str(plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--out",
                     str(tmp_path / "out.jsonl"), "--quiet", "--adapt", "none", "--ignore-eos", "--json"]) == 0
    result = RunResult.from_json(capsys.readouterr().out)
    assert result.simulated.padded_prompt_tokens == pytest.approx(result.padded_prompt_tokens, rel=0.05)
    guess = simulate_job(Plan.load(plan), load_profile("t4"), [len(r["prompt_ids"]) for r in rows], [3] * 16)
    assert guess.padded_prompt_tokens > 1.5 * result.padded_prompt_tokens


def test_a_plans_prefix_cache_size_is_the_runs(tmp_path, capsys):
    """Prompts behind six 20-token templates, two by two, under two plans for a workload that describes no
    prefix: one with the default room (one prompt's worth: one template kept) and one whose
    policy sets the cache to 150 positions (``Policy.prefix_cache_positions``, which the planner
    sets where memory allows). The run gives the engine the plan's room: the same outputs, fewer
    prefill positions, its planned cpu peak larger by the cache's bytes and the measured peaks
    within it; the simulated column prices the same cache."""
    from dataclasses import replace

    from xrunner.result import RunResult
    from xsimulator.policy import Policy

    rng = np.random.default_rng(3)
    heads = [rng.integers(4, 50000, size=20).tolist() for _ in range(6)]
    rows = [{"id": i, "prompt_ids": heads[i // 2 % 6] + rng.integers(4, 50000, size=int(rng.integers(2, 10))).tolist(),
             "max_new_tokens": 2} for i in range(36)]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    policy = Policy(gbs=4, nb=1)
    results = {}
    for name, pol in (("default", policy), ("grown", replace(policy, prefix_cache_positions=150))):
        plan = make_plan(tmp_path / f"{name}.json", random_spec(), pol, 30, 2)
        with pytest.warns(UserWarning, match="begin with"):
            assert main(["run", "--plan", str(plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--out",
                         str(tmp_path / f"{name}.jsonl"), "--quiet", "--adapt", "none", "--ignore-eos", "--json"]) == 0
        results[name] = RunResult.from_json(capsys.readouterr().out)
        assert results[name].fits
    default, grown = results["default"], results["grown"]
    assert without_timing(read_rows(tmp_path / "default.jsonl")) == without_timing(read_rows(tmp_path / "grown.jsonl"))
    assert grown.padded_prompt_tokens < default.padded_prompt_tokens
    assert grown.planned_peak_bytes["cpu"] > default.planned_peak_bytes["cpu"]
    assert grown.simulated.padded_prompt_tokens < default.simulated.padded_prompt_tokens


def _job_planned_on_a_cpu_profile(tmp_path: Path) -> tuple[Path, list[str]]:
    """A 4-prompt job planned on a profile of a host without a GPU, as the engine here runs (re-plans
    size its buffers so): the plan, and `xsched run`'s arguments up to the output flags."""
    from xprofiler.profile import HardwareProfile
    from xsimulator.policy import Policy

    cpu = HardwareProfile.load(Path(__file__).parent / "data" / "perturbed_cpu_profile.json")
    cpu = replace(cpu, gpu_bytes=2 * 2**30, cpu_bytes=8 * 2**30)
    cpu.save(tmp_path / "cpu.json")
    plan = make_plan(tmp_path / "plan.json", random_spec(), Policy(gbs=2, nb=2), 8, 6, profile=cpu)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": i, "prompt_ids": [5 + i, 6, 7]} for i in range(4)])
    return plan, ["run", "--plan", str(plan), "--model", RANDOM_MODEL, "--prompts", str(prompts),
                  "--profile", str(tmp_path / "cpu.json"), "--adapt", "none"]


def test_a_budget_file_below_the_plan_at_the_start_is_planned_for_before_the_first_block(tmp_path, capsys):
    """The budget file was read between blocks only: a 1000-byte gpu budget ran a one-block job
    whole (exit 0) and a longer job's first block over it (a walkthrough). Now a budget below the
    plan's needs is planned for before the engine loads, or refused then; and the end-of-run table
    drops the plan's column, whose prediction is for another policy."""
    from xscheduler.plan import Plan

    plan, base = _job_planned_on_a_cpu_profile(tmp_path)
    base = base + ["--budget-file"]
    budget = tmp_path / "budget.json"
    budget.write_text('{"gpu_bytes": 1000}')
    assert main(base + [str(budget), "--out", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "the budget file gives gpu 0.0 MiB, and no policy fits it" in err and err.count("\n") == 1, err
    assert not (tmp_path / "none.jsonl").exists()
    planned_gpu = Plan.load(plan).predicted.peak_bytes["gpu"]
    budget.write_text(json.dumps({"gpu_bytes": int(0.75 * planned_gpu)}))
    out = tmp_path / "o.jsonl"
    assert main(base + [str(budget), "--out", str(out), "--result", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "below the plan's needs; re-planned before starting" in err, err
    assert "no plan column: it was re-planned for the budget file before starting" in err, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["peak_bytes"]["gpu"] <= 0.75 * planned_gpu and result["predicted"] is None
    assert sorted(r["id"] for r in read_rows(out)) == [0, 1, 2, 3] and not result["adaptations"]


def test_a_plan_whose_policy_was_edited_by_hand_gets_no_plan_column(random_plan, tmp_path, capsys):
    """The end-of-run table printed the plan's prediction (for the policy it was made with) beside
    a hand-edited policy's measurements (a walkthrough: plan wall 0.90 s and no disk beside a
    measured 2.82 s and 0.21 GiB on disk). The simulated column prices the policy that ran."""
    data = json.loads(Path(random_plan).read_text())
    data["policy"]["nb"] = 1  # the prediction still prices nb = 2
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": i, "prompt_ids": [5 + i, 6]} for i in range(2)])
    for plan, column in ((random_plan, True), (edited, False)):
        out = tmp_path / f"o-{column}.jsonl"
        assert main(["run", "--plan", str(plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--out",
                     str(out), "--adapt", "none", "--result", str(tmp_path / f"r-{column}.json")]) == 0
        captured = capsys.readouterr()
        assert ("(plan: " in captured.out) == column, captured.out
        assert ("no plan column: the plan's policy is not the one its prediction priced" in captured.err) != column
        assert (json.loads((tmp_path / f"r-{column}.json").read_text())["predicted"] is None) != column


def test_bad_inputs_exit_2_with_one_line(random_plan, tmp_path, capsys):
    import torch

    ok = write_prompts(tmp_path / "ok.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7]}])
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"id": "a", "prompt_ids": [5]}\n{"id": "b", "prompt_ids": [5\n')
    dup = write_prompts(tmp_path / "dup.jsonl", [{"id": "a", "prompt_ids": [5]}, {"id": "a", "prompt_ids": [6]}])
    text = write_prompts(tmp_path / "text.jsonl", [{"id": "a", "prompt": "hello"}])
    old = tmp_path / "old.jsonl"
    old.write_text('{"id": "z", "text": null}\n')
    hot = write_prompts(tmp_path / "hot.jsonl", [{"id": "a", "prompt_ids": [5], "temperature": -1}])
    far = write_prompts(tmp_path / "far.jsonl", [{"id": "a", "prompt_ids": [5, 10**6]}])
    two = write_prompts(tmp_path / "two.jsonl", [{"id": "a", "prompt_ids": [5, 9, 3], "n": 2}])
    # a plan measured with another thread count, whose warning (and thread change) came before these errors
    other = json.loads(Path(random_plan).read_text())
    other["profile_threads"] = 1 if torch.get_num_threads() > 1 else 2
    other["profile_name"], other["profile_source"] = "measured-elsewhere", "measured"  # (no preset's threads)
    threads_plan = tmp_path / "threads.json"
    threads_plan.write_text(json.dumps(other))
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
        (["--prompts", str(ok), "--out", str(tmp_path / "nodir" / "o")], "does not exist; create it or pass another --out"),
        (["--prompts", str(ok), "--out", str(tmp_path / "o8"), "--trace", str(tmp_path / "nodir" / "t.json")],
         "pass another --trace"),  # refused before the job runs, not after it
        (["--prompts", str(ok), "--out", str(tmp_path / "o8"), "--result", str(tmp_path)], "is a directory"),
        (["--prompts", str(ok), "--out", str(tmp_path / "o8"), "--result", str(tmp_path / "o8")],
         "--out and --result both write"),  # the summary would replace every result line
        (["--prompts", str(ok), "--out", str(ok), "--resume"], "--out and --prompts are the same file"),
        (["--prompts", str(ok), "--out", str(tmp_path / "o8"), "--profile", "nope"], "neither a profile file nor"),
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--offload-dir", str(ok)], "is not a directory"),
        (["--prompts", str(text), "--out", str(tmp_path / "o9"), "--tokenizer", str(tmp_path / "none")],
         "--tokenizer " + str(tmp_path / "none") + ": not a directory"),
        (["--prompts", str(text), "--out", str(tmp_path / "o9"), "--tokenizer", str(tmp_path)],
         "holds none of tokenizer.json, tokenizer_config.json"),
        # bad options are the only line: no warning of the plan's thread count before them (a review)
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--temperature", "-1", "--plan", str(threads_plan)],
         "--temperature must be a finite number >= 0"),
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--top-p", "2", "--plan", str(threads_plan)],
         "--top-p is a fraction in (0, 1]"),
        (["--prompts", str(hot), "--out", str(tmp_path / "o9"), "--plan", str(threads_plan)],
         "hot.jsonl:1: temperature must be"),
        (["--prompts", str(far), "--out", str(tmp_path / "o9"), "--plan", str(threads_plan)],
         "far.jsonl:1:"),  # ids past the vocabulary
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--plan", str(threads_plan), "--model",
          str(tmp_path / "none.gguf")], "none.gguf"),
        (["--prompts", str(two), "--out", str(tmp_path / "o9"), "--plan", str(threads_plan), "--model",
          str(tmp_path / "none.gguf")], "none.gguf"),  # (n > 1, greedy, another n than the plan's: warned after)
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--plan", str(threads_plan), "--budget-file",
          str(tmp_path / "later.json")], "--profile"),  # re-plans need the plan's profile
        # a budget file that is there but cannot be used stops the job before it starts
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--budget-file", str(tmp_path)],
         "cannot be read as JSON"),
        (["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--budget-file", str(dup)],
         "cannot be read as JSON"),
    ]
    threads = torch.get_num_threads()
    try:
        for extra, message in cases:
            with warnings.catch_warnings(record=True) as caught:  # (the CLI prints them as lines of their own)
                warnings.simplefilter("always")
                assert main(base + extra) == 2, extra
            err = capsys.readouterr().err
            assert err.startswith("xsched: error: ") and err.count("\n") == 1 and message in err, err
            assert not caught, (extra, [str(w.message) for w in caught])
    finally:
        torch.set_num_threads(threads)
    # an empty --offload-dir was checked as the current directory, then the job used the system
    # temporary directory
    with pytest.raises(SystemExit) as exc:
        main(base + ["--prompts", str(ok), "--out", str(tmp_path / "o9"), "--offload-dir", ""])
    assert exc.value.code == 2 and "--offload-dir: is empty" in capsys.readouterr().err
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


def test_outputs_under_a_tilde_go_to_the_home_directory(random_plan, tmp_path, monkeypatch, capsys):
    """`--out=~/r.jsonl` (no shell expands a "~" after "=") passed the up-front check, which took
    "~" as the home directory, then the job failed after its first block with "directory does not
    exist" writing ./~/r.jsonl; --trace and --result the same at the end (review)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6], "max_new_tokens": 2}])
    assert main(["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--quiet",
                 "--adapt", "none", "--out=~/r.jsonl", "--trace=~/t.json", "--result=~/run.json"]) == 0, \
        capsys.readouterr().err
    assert [r["id"] for r in read_rows(home / "r.jsonl")] == ["a"]
    assert (home / "t.json").is_file() and (home / "run.json").is_file() and not (tmp_path / "~").exists()


def test_outputs_may_not_replace_the_profile_or_the_budget_file(random_plan, tmp_path, capsys, monkeypatch):
    """`--result prof.json --profile prof.json` replaced a measured profile with the RunResult at the
    end of the job (review); `--out` on the budget file appended results to it."""
    from xprofiler.presets import load_preset

    profile = load_preset("t4").save(tmp_path / "prof.json")
    before = profile.read_bytes()
    budget = tmp_path / "budget.json"
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6], "max_new_tokens": 2}])
    base = ["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--quiet",
            "--profile", str(profile)]
    for extra, message in ((["--out", str(tmp_path / "o.jsonl"), "--result", str(profile)],
                            "--result and --profile are the same file"),
                           (["--out", str(budget), "--budget-file", str(budget)],
                            "--out and --budget-file are the same file")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert profile.read_bytes() == before and not budget.exists() and not (tmp_path / "o.jsonl").exists()
    # A preset name is not a file: an output that happens to be called "t4" is fine.
    monkeypatch.chdir(tmp_path)
    assert main(base[:-1] + ["t4", "--out", "t4", "--adapt", "none"]) == 0


# ----------------------------------------------------------------------------- end to end
def reference_outputs(model: str, dtype: str, prompts: list[list[int]], new_tokens: list[int],
                      stops: list[int]) -> list[list[int]]:
    """Greedy outputs of the in-memory loop, one request at a time (the independent reference)."""
    from xrunner.reference import generate
    from xrunner.loaders import load_weights, open_model

    weights = load_weights(open_model(model, dtype=dtype))
    return [generate(weights, [p], n, stop_token_ids=stops).tokens[0] for p, n in zip(prompts, new_tokens)]


def tiny_job(tiny_dir, tmp_path, n: int, seed: int = 0) -> tuple[Path, list[dict]]:
    rng = np.random.default_rng(seed)
    rows = [{"id": f"q{i}", "prompt": " ".join(f"w{t}" for t in rng.integers(3, 300, size=int(rng.integers(1, 12)))),
             "max_new_tokens": int(rng.integers(1, 10))} for i in range(n)]
    return write_prompts(tmp_path / f"prompts-{n}-{seed}.jsonl", rows), rows


def tiny_plan(tiny_dir, path: Path, policy) -> Path:
    from xrunner.loaders import open_model

    return make_plan(path, open_model(tiny_dir, dtype="float32").spec, policy, 16, 10)


def test_run_matches_the_reference_loop_and_writes_a_trace(tiny_dir, tmp_path, capsys):
    """Text prompts through the tokenizer, weights half on disk, refill, two GPU batches, --trace, --json."""
    from xrunner.result import RunResult
    from xsimulator.policy import Policy
    from xsimulator.trace import TRACKS, read_chrome_trace

    prompts, rows = tiny_job(tiny_dir, tmp_path, 9)
    plan = tiny_plan(tiny_dir, tmp_path / "plan.json",
                     Policy(gbs=2, nb=2, wg=0.5, wc=0.0, wd=0.5, refill_every=2))
    out, trace, offload = tmp_path / "out.jsonl", tmp_path / "trace.json", tmp_path / "offload"
    offload.mkdir()
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--trace", str(trace), "--offload-dir", str(offload), "--json", "--quiet"]) == 0
    result = RunResult.from_json(capsys.readouterr().out)
    got = {r["id"]: r for r in read_rows(out)}
    assert sorted(got) == sorted(r["id"] for r in rows)  # every request once
    from xrunner.loaders import open_model

    tok = open_model(tiny_dir, dtype="float32").tokenizer()
    ids = [tok(r["prompt"])["input_ids"] for r in rows]
    ref = reference_outputs(str(tiny_dir), "float32", ids, [r["max_new_tokens"] for r in rows], [2])
    for r, p, want in zip(rows, ids, ref):
        g = got[r["id"]]
        assert g["output_ids"] == want and g["text"] == tok.decode(want, skip_special_tokens=True)
        assert g["output_tokens"] == len(want) and g["prompt_tokens"] == len(p)
        assert g["stopped_on_eos"] == (want[-1] == 2 and len(want) <= r["max_new_tokens"])
        assert g["latency_s"] > 0 and "logprobs" not in g  # only with --logprobs
    assert result.num_requests == 9 and result.generated_tokens == sum(len(w) for w in ref)
    assert result.latency_max_s == max(g["latency_s"] for g in got.values())
    assert result.predicted is not None and result.fits  # measured peak within the planned peak
    assert all(result.peak_bytes[t] <= result.planned_peak_bytes[t] for t in ("gpu", "cpu", "disk"))
    # The plan's preset profile is at hand, so the run also simulates exactly these requests.
    sim = result.simulated
    assert sim is not None and sim.num_requests == 9 and sim.seed is None
    assert sim.throughput_tokens_per_s * sim.wall_s == pytest.approx(result.generated_tokens)
    assert RunResult.from_json(result.to_json()) == result and "simulated" in result.describe()
    assert result.peak_bytes["disk"] > 0 and result.throughput_tokens_per_s > 0
    events, _ = read_chrome_trace(trace)
    assert events and {e.track for e in events} <= set(TRACKS) and {"compute", "dtoc"} <= {e.track for e in events}
    assert max(e.start_s + e.dur_s for e in events) <= result.wall_s * 1.05 + 0.05
    assert list(offload.iterdir()) == []  # offload files removed at the end


def test_workload_fit_counts_prompt_tokens_as_run_feeds_them(tiny_dir, tmp_path, capsys):
    """`workload fit --tokenizer` sizes prompt text with the model's tokenizer, so a plan on the fit covers
    the job; without it the lengths are an estimate, and the fit, `plan` and `run` say so and how to fix it."""
    from workloads import Workload

    # The tiny tokenizer's tokens are words; "w3".."w9" take 3 bytes each with the space, so 4 bytes per
    # token underestimates them.
    rows = [{"id": i, "prompt": " ".join(f"w{3 + (i + j) % 7}" for j in range(2 + i % 9)), "max_new_tokens": 3}
            for i in range(24)]
    prompts, words = write_prompts(tmp_path / "p.jsonl", rows), [2 + i % 9 for i in range(24)]
    counted, estimated = tmp_path / "counted.json", tmp_path / "estimated.json"
    assert main(["workload", "fit", str(prompts), "--tokenizer", str(tiny_dir), "-o", str(counted)]) == 0
    assert main(["workload", "fit", str(prompts), "-o", str(estimated)]) == 0
    got, est = Workload.load(counted), Workload.load(estimated)
    assert got.prompt.max_len == max(words) and "estimated" not in got.source
    assert est.prompt.max_len == max(-(-len(r["prompt"].encode()) // 4) for r in rows) < max(words)
    assert "estimated" in est.source and "--tokenizer" in est.source
    capsys.readouterr()
    assert main(["plan", "--workload", str(prompts), "--latency", "inf"]) == 0
    assert "note: workload" in capsys.readouterr().out  # the plan says its prompt lengths are a guess

    assert main(["workload", "fit", str(prompts), "--no-chat-template"]) == 2
    assert main(["workload", "fit", str(prompts), "--tokenizer", RANDOM_MODEL]) == 2
    assert "no tokenizer" in capsys.readouterr().err

    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    plan = make_plan(tmp_path / "plan.json", open_model(tiny_dir, dtype="float32").spec, Policy(gbs=4, nb=1),
                     est.prompt.max_len, 3)
    with pytest.warns(UserWarning, match=f"xsched workload fit {prompts} --tokenizer {tiny_dir}`"):
        assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts),
                     "--out", str(tmp_path / "out.jsonl"), "--quiet", "--adapt", "none"]) == 0
    # Requests without max_new_tokens run with the plan's longest output: the suggested fit says so, and works.
    partial = write_prompts(tmp_path / "partial.jsonl", [{k: v for k, v in r.items() if k != "max_new_tokens"
                                                          or r["id"] % 2} for r in rows])
    with pytest.warns(UserWarning, match=f"--tokenizer {tiny_dir} --max-new-tokens 3`") as caught:
        assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(partial),
                     "--out", str(tmp_path / "out2.jsonl"), "--quiet", "--adapt", "none"]) == 0
    command = re.search(r"`(xsched workload fit [^`]*)`", str(caught[0].message)).group(1)
    assert main(command.split()[1:] + ["-o", str(tmp_path / "partial.json")]) == 0
    fitted = Workload.load(tmp_path / "partial.json")
    assert fitted.output.min_len == fitted.output.max_len == 3 and fitted.prompt.max_len == max(words)


def test_chat_messages_run_through_the_template_with_its_variables(tiny_dir, tmp_path, capsys):
    """A job's "messages" (a system prompt, then the user's turn) are formatted by the tokenizer's chat
    template, with --chat-template-kwargs as its variables (Qwen3's enable_thinking); the engine is fed
    exactly those ids, and `workload fit` counts them the same way. A template that raises, a
    tokenizer without one and --no-chat-template each refuse messages with the file and line."""
    import shutil

    import transformers

    from xrunner.cli import encode_prompt
    from xsimulator.policy import Policy

    model = tmp_path / "chat-model"
    shutil.copytree(tiny_dir, model)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% if greet %}w5 {% endif %}{% for m in messages %}{% if m['role'] == 'system' %}w7 "
                         "{% elif m['role'] == 'user' %}w8 {% else %}{{ raise_exception('no ' + m['role']) }}"
                         "{% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}")
    tok.save_pretrained(model)
    chat = [{"role": "system", "content": "w11"}, {"role": "user", "content": "w12 w13"}]
    rows = [{"id": "m", "messages": chat, "max_new_tokens": 4}, {"id": "p", "prompt": "w12 w13", "max_new_tokens": 4}]
    prompts = write_prompts(tmp_path / "chat.jsonl", rows)
    plan = tiny_plan(model, tmp_path / "plan.json", Policy(gbs=2, nb=1))
    want_ids = {False: {"m": [7, 11, 8, 12, 13, 9], "p": [8, 12, 13, 9]},
                True: {"m": [5, 7, 11, 8, 12, 13, 9], "p": [5, 8, 12, 13, 9]}}
    for greet in (False, True):
        out = tmp_path / f"out-{greet}.jsonl"
        extra = ["--chat-template-kwargs", json.dumps({"greet": True})] if greet else []
        assert main(["run", "--plan", str(plan), "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                     "--quiet", "--adapt", "none", *extra]) == 0
        got = {r["id"]: r for r in read_rows(out)}
        ids = want_ids[greet]
        ref = reference_outputs(str(model), "float32", [ids["m"], ids["p"]], [4, 4], [2])
        assert [got["m"]["output_ids"], got["p"]["output_ids"]] == ref
        assert [got["m"]["prompt_tokens"], got["p"]["prompt_tokens"]] == [len(ids["m"]), len(ids["p"])]
        fitted = tmp_path / f"fit-{greet}.json"
        assert main(["workload", "fit", str(prompts), "--tokenizer", str(model), "-o", str(fitted), *extra]) == 0
        from workloads import Workload

        assert Workload.load(fitted).prompt.max_len == len(ids["m"])
    with pytest.raises(UserError, match="the chat template refused these messages: .?no assistant"):
        encode_prompt(tok, (("assistant", "w3"),), True)
    capsys.readouterr()
    bad = write_prompts(tmp_path / "bad.jsonl", [rows[1], {"id": "x", "messages": [{"role": "tool", "content": "w4"}]}])
    assert main(["run", "--plan", str(plan), "--model", str(model), "--prompts", str(bad), "--out",
                 str(tmp_path / "bad-out.jsonl"), "--quiet"]) == 2
    assert re.search(f"{re.escape(str(bad))}:2: the chat template refused these messages: .?no tool",
                     capsys.readouterr().err)
    for model_dir, extra, message in [(model, ["--no-chat-template"], '"messages" need the chat template'),
                                      (tiny_dir, [], "tokenizer has no chat template")]:
        assert main(["run", "--plan", str(plan), "--model", str(model_dir), "--prompts", str(prompts), "--out",
                     str(tmp_path / "refused.jsonl"), "--quiet", *extra]) == 2
        assert f"{prompts}:1: " in (err := capsys.readouterr().err) and message in err
    assert main(["workload", "fit", str(prompts), "--chat-template-kwargs", "{}"]) == 2
    with pytest.raises(SystemExit) as exc:  # argparse's one-line usage error
        main(["run", "--plan", str(plan), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
              "--chat-template-kwargs", "[1]"])
    assert exc.value.code == 2 and "must be a JSON object" in capsys.readouterr().err


def test_stop_strings_end_a_request_where_they_first_appear(tiny_dir, random_plan, tmp_path, capsys):
    """"stop" ends a request at the token that completes the string's first appearance: its text ends
    just before the string (OpenAI's rule), "stop_string" names it, and output_ids are the reference
    loop's up to that token. A string that never appears changes nothing."""
    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    prompts, rows = tiny_job(tiny_dir, tmp_path, 6, seed=3)
    tok = open_model(tiny_dir, dtype="float32").tokenizer()
    rows = [{**r, "max_new_tokens": 9} for r in rows]
    ref = reference_outputs(str(tiny_dir), "float32", [tok(r["prompt"])["input_ids"] for r in rows], [9] * 6, [2])
    texts = [tok.decode(w, skip_special_tokens=True).split() for w in ref]
    stopping = [i for i, words in enumerate(texts) if len(words) >= 4][:3]
    assert len(stopping) == 3
    for i in stopping:
        rows[i]["stop"] = [texts[i][3], "never-said"]  # the 4th word
    rows[0 if 0 not in stopping else 5]["stop"] = "never-said"
    prompts = write_prompts(tmp_path / "stop.jsonl", rows)
    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=2, nb=2, wg=0.5, wd=0.5, refill_every=2))
    out = tmp_path / "out.jsonl"
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--quiet", "--adapt", "none"]) == 0
    got = {r["id"]: r for r in read_rows(out)}
    for r, want in zip(rows, ref):
        g = got[r["id"]]
        stops = [r["stop"]] if isinstance(r.get("stop"), str) else r.get("stop", [])
        # the first token whose text completes a stop string (a word may also contain one: "w1" in "w17")
        end = next((k + 1 for k in range(len(want))
                    if any(s in tok.decode(want[:k + 1], skip_special_tokens=True) for s in stops)), len(want))
        full = tok.decode(want[:end], skip_special_tokens=True)
        hit = min(((full.find(s), s) for s in stops if s in full), default=(None, None))
        assert g["output_ids"] == want[:end] and g["text"] == (full if hit[0] is None else full[:hit[0]])
        assert ("stop_string" in g) == bool(stops) and g.get("stop_string") == hit[1]
    assert sum(g.get("stop_string") is not None for g in got.values()) == 3
    capsys.readouterr()
    ids = write_prompts(tmp_path / "ids.jsonl", [{"id": "a", "prompt_ids": [5, 6], "stop": "x"}])
    assert main(["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(ids),
                 "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f'{ids}:1: "stop" strings need the model\'s tokenizer' in capsys.readouterr().err


def test_a_request_samples_with_its_own_parameters(tiny_dir, tmp_path, capsys):
    """A prompt file's "temperature" / "top_k" / "top_p" / "seed" override the command line's for that
    request only: each output equals the reference loop with that request's parameters; an invalid
    one is refused with its line."""
    from xrunner.reference import generate
    from xrunner.loaders import load_weights, open_model
    from xrunner.sampling import SamplingParams
    from xsimulator.policy import Policy

    _, rows = tiny_job(tiny_dir, tmp_path, 4, seed=5)
    own = [{}, {"temperature": 1.0, "seed": 11}, {"temperature": 0.8, "top_k": 20}, {"top_p": 0.5}]
    rows = [{**r, **o, "max_new_tokens": 8} for r, o in zip(rows, own)]
    prompts = write_prompts(tmp_path / "own.jsonl", rows)
    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=2, nb=2))
    out = tmp_path / "out.jsonl"
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--quiet", "--adapt", "none", "--temperature", "0.5", "--seed", "4"]) == 0
    got = {r["id"]: r["output_ids"] for r in read_rows(out)}
    source = open_model(tiny_dir, dtype="float32")
    weights, tok = load_weights(source), source.tokenizer()
    base = SamplingParams(temperature=0.5, seed=4)
    for r, o in zip(rows, own):
        want = generate(weights, [tok(r["prompt"])["input_ids"]], 8, SamplingParams(**{**base.__dict__, **o}),
                        stop_token_ids=[2], request_ids=[r["id"]]).tokens[0]
        assert got[r["id"]] == want, r["id"]
    capsys.readouterr()
    bad = write_prompts(tmp_path / "bad.jsonl", [rows[0], {**rows[1], "top_p": 0}])
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(bad), "--out",
                 str(tmp_path / "bad.out"), "--quiet"]) == 2
    assert f"{bad}:2: top-p is a fraction in (0, 1]" in capsys.readouterr().err


def test_a_job_smaller_than_the_plans_block_runs_in_buffers_for_its_own_rows(tmp_path, capsys):
    """A plan of 4 GPU batches x 8 rows and a job of 5 requests (a walkthrough: a plan priced for
    2000 requests refused 40 for memory): the run says so and runs one batch of 5, the rows the
    full block would have run, in buffers for 5 rows; the outputs equal the reference loop's and
    the planned peak is the smaller policy's. 12 requests fill 2 batches of 8."""
    from xrunner.reference import generate
    from xprofiler.presets import load_profile
    from xrunner.loaders import load_weights, open_model
    from xrunner.result import RunResult
    from xsimulator.costmodel import CostModel
    from xsimulator.policy import Policy

    rng = np.random.default_rng(9)
    rows = [{"id": i, "prompt_ids": rng.integers(4, 50000, size=int(rng.integers(3, 9))).tolist(),
             "max_new_tokens": 4} for i in range(12)]
    plan = make_plan(tmp_path / "plan.json", random_spec(), Policy(gbs=8, nb=4, cg=0.5, cc=0.5), 30, 4)
    flags = ["--plan", str(plan), "--model", RANDOM_MODEL, "--adapt", "none", "--json"]
    for n, want_policy in ((5, (5, 1)), (12, (8, 2))):
        prompts = write_prompts(tmp_path / f"p{n}.jsonl", rows[:n])
        out = tmp_path / f"out{n}.jsonl"
        assert main(["run", *flags, "--prompts", str(prompts), "--out", str(out)]) == 0
        captured = capsys.readouterr()
        result = RunResult.from_json(captured.out)
        assert (result.policy.gbs, result.policy.nb) == want_policy
        assert f"the job's {n} requests fill {want_policy[1]} GPU batch(es) of {want_policy[0]}" in captured.err
        full = CostModel(random_spec(), load_profile("t4")).peak_bytes(Policy(gbs=8, nb=4, cg=0.5, cc=0.5),
                                                                       result.max_prompt, result.max_output)
        assert result.planned_peak_bytes["cpu"] < full["cpu"]
        weights = load_weights(open_model(RANDOM_MODEL, dtype="float32"))
        for r in read_rows(out):
            want = generate(weights, [rows[r["id"]]["prompt_ids"]], 4, stop_token_ids=[2]).tokens[0]
            assert r["output_ids"] == want, r["id"]


def test_a_run_beside_busy_cores_says_so(tmp_path, capsys, monkeypatch):
    """Other processes busy on the cores during the run (a walkthrough on 2 busy cores ran 17x
    slower than planned, silently): the summary names the cores they kept busy; not when idle."""
    from xprofiler import measure
    from xsimulator.policy import Policy

    rows = [{"id": i, "prompt_ids": [5 + i, 6, 7], "max_new_tokens": 2} for i in range(3)]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    plan = make_plan(tmp_path / "plan.json", random_spec(), Policy(gbs=3, nb=1), 30, 4)
    flags = ["run", "--plan", str(plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--adapt", "none"]
    for busy, said in ((1.3, True), (0.0, False)):
        monkeypatch.setattr(measure.LoadMeter, "others_cores", lambda self, b=busy: b)
        assert main([*flags, "--out", str(tmp_path / f"o{busy}.jsonl")]) == 0
        err = capsys.readouterr().err
        assert ("other processes kept 1.30 of" in err) == said, err  # (its advice: the busy-machine test below)


def test_a_job_whose_prompts_share_a_prefix_warns_a_plan_priced_without_it(tmp_path):
    """Prompts that all begin with the same 24 tokens under a plan whose workload does not know it:
    `xsched run` says so and names the flags to plan with; the outputs equal the reference loop's;
    a plan priced with that prefix runs without the warning, one priced for eight such prefixes
    (a job mixing templates) with it again. Templates of unlike lengths under a plan that prices
    them alike: the warning names the fit, which lists each one's length (the flags cannot)."""
    import warnings

    from workloads.workload import fixed_workload
    from xrunner.reference import generate
    from xrunner.loaders import load_weights, open_model
    from xscheduler.plan import Plan
    from xsimulator.policy import Policy

    rng = np.random.default_rng(5)
    system = rng.integers(4, 50000, size=24).tolist()
    rows = [{"id": i, "prompt_ids": system + rng.integers(4, 50000, size=int(rng.integers(1, 6))).tolist(),
             "max_new_tokens": 4} for i in range(5)]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    plan = make_plan(tmp_path / "plan.json", random_spec(), Policy(gbs=3, nb=2), 30, 4)
    out = tmp_path / "out.jsonl"
    flags = ["--model", RANDOM_MODEL, "--prompts", str(prompts), "--quiet", "--adapt", "none"]
    with pytest.warns(UserWarning, match=r"begin with 24 tokens they share, the plan's workload's prompts with 0 tokens "
                                         r"they share; .*plan with `--prefix-tokens 24 --prefix-groups 1 --prefix-share 1`"):
        assert main(["run", "--plan", str(plan), *flags, "--out", str(out)]) == 0
    weights = load_weights(open_model(RANDOM_MODEL, dtype="float32"))
    for r in read_rows(out):
        want = generate(weights, [rows[r["id"]]["prompt_ids"]], 4, stop_token_ids=[2]).tokens[0]
        assert r["output_ids"] == want, r["id"]
    priced = Plan.load(plan)
    priced = replace(priced, workload=replace(fixed_workload(30, 4), prefix_tokens=24))
    priced.save(tmp_path / "priced.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["run", "--plan", str(tmp_path / "priced.json"), *flags, "--out", str(tmp_path / "o2.jsonl")]) == 0
    mixed = replace(priced, workload=replace(priced.workload, prefix_groups=8))  # planned for 8 templates, not 1
    mixed.save(tmp_path / "mixed.json")
    with pytest.warns(UserWarning, match=r"the plan's workload's prompts with 24 tokens they share, one of 8 prefixes; "
                                         r".*plan with `--prefix-tokens 24 --prefix-groups 1 --prefix-share 1`"):
        assert main(["run", "--plan", str(tmp_path / "mixed.json"), *flags, "--out", str(tmp_path / "o3.jsonl")]) == 0
    # Templates of 24 and 4 tokens under a plan of two 24-token ones: the flags cannot say that, the fit can.
    heads = [rng.integers(4, 50000, size=n).tolist() for n in (24, 4)]
    unlike = write_prompts(tmp_path / "u.jsonl", [{"id": i, "prompt_ids": heads[i % 2] + rng.integers(4, 50000, size=3)
                                                   .tolist(), "max_new_tokens": 4} for i in range(6)])
    replace(priced, workload=replace(priced.workload, prefix_groups=2)).save(tmp_path / "two.json")
    with pytest.warns(UserWarning, match=r"one of 2 prefixes of 4-24 tokens, the plan's workload's prompts with 24 "
                                         r"tokens they share, one of 2 prefixes;.*fit the job with `xsched workload "
                                         r"fit .*u\.jsonl` and plan with `xsched plan --workload`"):
        assert main(["run", "--plan", str(tmp_path / "two.json"), "--model", RANDOM_MODEL, "--prompts", str(unlike),
                     "--quiet", "--adapt", "none", "--out", str(tmp_path / "o4.jsonl")]) == 0


def test_n_samples_per_prompt_each_get_a_line_and_their_own_draws_and_resume(random_plan, tmp_path, capsys):
    """--n 2 (and a prompt's own "n": 3, or 1): one results line per sample, with the prompt's id
    and its "sample" index, each equal to the reference loop keyed by [id, sample]; the samples
    of a prompt differ. A job cut to its first lines and resumed writes the same set of lines."""
    from xrunner.reference import generate
    from xrunner.loaders import load_weights, open_model
    from xrunner.sampling import SamplingParams

    rng = np.random.default_rng(4)
    rows = [{"id": i, "prompt_ids": rng.integers(4, 50000, size=int(rng.integers(2, 8))).tolist(),
             "max_new_tokens": 5} for i in range(4)]
    rows[1]["n"], rows[2]["n"] = 3, 1
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    flags = ["--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--quiet",
             "--adapt", "none", "--n", "2", "--temperature", "1.0", "--seed", "9"]
    out = tmp_path / "out.jsonl"
    with pytest.warns(UserWarning, match=r"asks for 2 output\(s\) per prompt, the plan's workload for 1; .*"
                                         r"plan with `--samples 2`"):  # 8 outputs of 4 prompts
        assert main(["run", *flags, "--out", str(out)]) == 0
    got = read_rows(out)
    assert sorted((g["id"], g.get("sample")) for g in got) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, None),
                                                                 (3, 0), (3, 1)]
    weights = load_weights(open_model(RANDOM_MODEL, dtype="float32"))
    sampling = SamplingParams(temperature=1.0, seed=9)
    by_prompt = {r["id"]: r for r in rows}
    for g in got:
        key = g["id"] if "sample" not in g else [g["id"], g["sample"]]
        want = generate(weights, [by_prompt[g["id"]]["prompt_ids"]], 5, sampling, stop_token_ids=[2],
                        request_ids=[tuple(key) if isinstance(key, list) else key]).tokens[0]
        assert g["output_ids"] == want, key
    assert len({tuple(g["output_ids"]) for g in got if g["id"] == 1}) > 1  # drawn apart
    lines = out.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]))
    with pytest.warns(UserWarning, match="plan with `--samples 2`"):
        assert main(["run", *flags, "--out", str(cut), "--resume"]) == 0

    def strip(rows_: list[dict]) -> set[str]:
        return {json.dumps({k: v for k, v in r.items() if k != "latency_s"}, sort_keys=True) for r in rows_}

    assert strip(read_rows(cut)) == strip(got) and len(read_rows(cut)) == len(got)
    with pytest.warns(UserWarning) as warned:  # --n 2, greedy
        assert main(["run", *flags[:-4], "--out", str(tmp_path / "greedy.jsonl")]) == 0
    assert any("under greedy decoding get n equal outputs" in str(w.message) for w in warned)
    with warnings.catch_warnings(record=True) as caught:  # an error stops it: then the error is all it says
        warnings.simplefilter("always")
        assert main(["run", *flags[:-4], "--out", str(tmp_path / "greedy2.jsonl"), "--model", "gpt-9"]) == 2
    assert not caught, [str(w.message) for w in caught]


def test_resume_refuses_results_of_a_request_line_that_changed_since(random_plan, tmp_path, capsys):
    """A resumed job whose prompt file changed a line's prompt (or its options) under the same id
    printed "nothing to run" and kept the old answer (a review): each results line carries its
    request's digest, and --resume refuses rows whose line, or whose sampling or length flags,
    changed, the file untouched (a seed under greedy decoding changes nothing). Rows written
    without a digest are taken as they are; results of another --n say so."""
    rows = [{"id": "a", "prompt_ids": [5, 6, 7]}, {"id": "b", "prompt_ids": [8, 9], "max_new_tokens": 3}]
    flags = ["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--quiet", "--adapt", "none"]
    out = tmp_path / "out.jsonl"
    assert main(flags + ["--prompts", str(write_prompts(tmp_path / "p.jsonl", rows)), "--out", str(out)]) == 0
    written = out.read_text()
    for changed in ({"id": "b", "prompt_ids": [8, 10], "max_new_tokens": 3},
                    {"id": "b", "prompt_ids": [8, 9], "max_new_tokens": 4},
                    {"id": "b", "prompt_ids": [8, 9], "max_new_tokens": 3, "temperature": 0.5}):
        edited = write_prompts(tmp_path / "q.jsonl", [rows[0], changed])
        capsys.readouterr()
        assert main(flags + ["--prompts", str(edited), "--out", str(out), "--resume"]) == 2, changed
        err = capsys.readouterr().err
        assert "the result of id 'b' was made from another request than line 2 of" in err and err.count("\n") == 1
        assert out.read_text() == written
    same = write_prompts(tmp_path / "same.jsonl", [rows[1], rows[0]])  # moved lines: the same requests
    for changed, said in ((["--temperature", "0.7"], "none of the 2 results in"),  # every line: the flags
                          (["--ignore-eos"], "none of the 2 results in"),
                          (["--max-new-tokens", "2"], "the result of id 'a' was made")):  # b has its own length
        assert main(flags + ["--prompts", str(same), "--out", str(out), "--resume", *changed]) == 2, changed
        assert said in capsys.readouterr().err
    # the same outputs asked another way are no change: a seed under greedy decoding, the template of
    # lines that are token ids, a line's own length equal to the default it had (the plan's, 6)
    for args_, lines in ((["--seed", "3"], [rows[1], rows[0]]), (["--no-chat-template"], [rows[1], rows[0]]),
                         ([], [rows[1], {**rows[0], "max_new_tokens": 6}])):
        again = write_prompts(tmp_path / "again.jsonl", lines)
        assert main(flags + ["--prompts", str(again), "--out", str(out), "--resume", *args_]) == 0, args_
    assert out.read_text() == written
    # an OpenAI batch's results carry the digest too (in each choice's "xsched")
    batch = write_prompts(tmp_path / "batch.jsonl", [openai_line("a", {"prompt": [5, 6, 7], "max_tokens": 3},
                                                                 url="/v1/completions")])
    first = tmp_path / "openai.jsonl"
    assert main(flags + ["--prompts", str(batch), "--out", str(first)]) == 0
    assert '"request_digest"' in first.read_text()
    batch.write_text(json.dumps(openai_line("a", {"prompt": [5, 6, 8], "max_tokens": 3}, url="/v1/completions")) + "\n")
    assert main(flags + ["--prompts", str(batch), "--out", str(first), "--resume"]) == 2
    assert "the result of id 'a' was made from another request than line 1" in capsys.readouterr().err
    bare = [{k: v for k, v in r.items() if k != "request_digest"} for r in read_rows(out)]
    out.write_text("".join(json.dumps(r) + "\n" for r in bare))
    assert main(flags + ["--prompts", str(edited), "--out", str(out), "--resume"]) == 0  # no digest: taken
    assert main(flags + ["--prompts", str(same), "--out", str(out), "--resume", "--n", "2"]) == 2
    assert "result(s) of samples this job does not ask for (its prompts were run with another --n" in \
        capsys.readouterr().err


def test_default_tokenizer_counts_the_chat_template():
    """The default model's ids are transformers' own tokenization of the chat-wrapped prompt."""
    from xrunner.cli import prompt_tokenizer
    from xrunner.loaders import open_model

    tok = open_model(None).tokenizer()
    text = "Who wrote Hamlet?"
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = prompt_tokenizer(None)(text)
    assert ids == list(chat["input_ids"]) and len(ids) > len(tok(text)["input_ids"])
    # A registry name has no tokenizer offline, and random weights none at all: the advice is not
    # open_model's "random:NAME", which failed next (review).
    for name in ("opt-125m", "random:opt-125m"):
        with pytest.raises(UserError, match="pass a local HF directory or .gguf file to count tokens") as e:
            prompt_tokenizer(name)
        assert "random:opt-125m for random weights" not in str(e.value)


@pytest.mark.slow
def test_random_model_takes_prompt_ids(tmp_path, random_plan, capsys):
    rng = np.random.default_rng(1)
    rows = [{"id": i, "prompt_ids": rng.integers(4, 50000, size=int(rng.integers(2, 8))).tolist(),
             "max_new_tokens": int(rng.integers(1, 6))} for i in range(5)]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--out",
                 str(out), "--quiet", "--logprobs"]) == 0
    got = {r["id"]: r for r in read_rows(out)}
    ref = reference_outputs(RANDOM_MODEL, "float32", [r["prompt_ids"] for r in rows],
                            [r["max_new_tokens"] for r in rows], [2])
    assert [got[r["id"]]["output_ids"] for r in rows] == ref
    assert all(got[r["id"]]["text"] is None for r in rows)
    for g in got.values():  # --logprobs: one per output token (their values: test_engine)
        assert len(g["logprobs"]) == g["output_tokens"] and all(-1e9 < x <= 0 for x in g["logprobs"])


def test_a_tokenizer_directory_stands_in_for_the_models_own(tiny_dir, random_plan, tmp_path):
    """--tokenizer DIR: text prompts through that tokenizer (here a random model, which has none of
    its own; a gpt-oss GGUF, whose metadata transformers cannot convert, is the other case), and
    the outputs decoded with it."""
    from xrunner.loaders import open_model

    rows = [{"id": i, "prompt": " ".join(f"w{t}" for t in (5 + i, 17, 40 + i)), "max_new_tokens": 4}
            for i in range(3)]
    prompts, out = write_prompts(tmp_path / "text.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["run", "--plan", str(random_plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--out",
                 str(out), "--quiet", "--tokenizer", str(tiny_dir), "--no-chat-template", "--ignore-eos"]) == 0
    tok = open_model(tiny_dir, dtype="float32").tokenizer()
    ids = [tok(r["prompt"])["input_ids"] for r in rows]
    want = reference_outputs(RANDOM_MODEL, "float32", ids, [4] * 3, [])
    got = {r["id"]: r for r in read_rows(out)}
    for r, p, w in zip(rows, ids, want):
        assert got[r["id"]]["prompt_tokens"] == len(p) and got[r["id"]]["output_ids"] == w
        assert got[r["id"]]["text"] == tok.decode(w, skip_special_tokens=True)


def test_plan_larger_than_capacity_is_refused(tiny_dir, tmp_path, capsys):
    from dataclasses import replace

    from xprofiler.presets import load_preset
    from xsimulator.policy import Policy

    small = replace(load_preset("t4"), gpu_bytes=10_000)
    plan = make_plan(tmp_path / "plan.json", __import__("xrunner.loaders").loaders.open_model(
        tiny_dir, dtype="float32").spec, Policy(gbs=2, nb=2), 12, 10, profile=small)
    prompts, _ = tiny_job(tiny_dir, tmp_path, 2)
    out = tmp_path / "out.jsonl"
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpu tier" in err and "short by" in err, err
    assert not out.exists()


def test_a_cuda_run_keeps_the_allocators_slack_free(tmp_path, monkeypatch):
    """The CUDA allocator reserved 191-332 MiB more than the planned gpu tier on two GPUs: a plan
    that fills the device's free memory to the byte would run out mid-job, so it is refused first."""
    import torch

    from xrunner.run_cli import CUDA_ALLOCATOR_SLACK_BYTES, check_machine_room, machine_capacity_bytes

    free = 2 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    machine = machine_capacity_bytes("cuda:0", tmp_path)
    assert machine["gpu"] == free - CUDA_ALLOCATOR_SLACK_BYTES
    check_machine_room("cuda:0", {"gpu": free - CUDA_ALLOCATOR_SLACK_BYTES, "cpu": 1e15}, machine)  # cpu: not shared
    with pytest.raises(UserError, match=r"gpu tier but cuda:0 leaves 1\.62 GiB once 384 MiB of its free memory are kept"):
        check_machine_room("cuda:0", {"gpu": free - 2**20, "cpu": 0.0}, machine)
    with pytest.raises(UserError, match="RAM for its gpu and cpu tiers"):  # without CUDA the tiers share RAM
        check_machine_room("cpu", {"gpu": 2**30, "cpu": 2**30}, {"gpu": 1.5 * 2**30, "cpu": 1.5 * 2**30})


def test_full_disk_stops_with_one_line_and_keeps_written_results(tiny_dir, tmp_path, monkeypatch, capsys):
    """KV rows on disk; the disk fills up after some results were written."""
    import errno

    from xprofiler import diskio
    from xsimulator.policy import Policy

    prompts, rows = tiny_job(tiny_dir, tmp_path, 12)
    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=2, nb=1, cg=0.5, cc=0.0, cd=0.5))
    out, offload = tmp_path / "out.jsonl", tmp_path / "offload"
    offload.mkdir()
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd, data, offset):  # the disk tier writes with os.pwrite (xprofiler.diskio.DirectFile)
        if out.exists() and out.stat().st_size > 0:
            calls["n"] += 1
            if calls["n"] > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(diskio.os, "pwrite", pwrite)
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--offload-dir", str(offload), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err.lower(), err
    kept = read_rows(out)
    assert 0 < len(kept) < len(rows)
    assert list(offload.iterdir()) == []
    # The rest completes with --resume once there is space again, without duplicates.
    monkeypatch.setattr(diskio.os, "pwrite", real)
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--offload-dir", str(offload), "--resume", "--quiet"]) == 0
    assert sorted(r["id"] for r in read_rows(out)) == sorted(r["id"] for r in rows)


def _start(args: list[str]) -> subprocess.Popen:
    # SIGINT back to its default in the child: a test session started in the background by a
    # non-interactive shell ignores SIGINT, the child would inherit that, and Python then installs
    # no KeyboardInterrupt handler (Ctrl-C would be silently ignored).
    return subprocess.Popen([sys.executable, "-m", "xsched", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_lines(proc: subprocess.Popen, out: Path, lines: int, timeout_s: float = 120.0) -> int:
    """Poll until ``out`` has at least ``lines`` complete lines (or the process ends)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= lines:
            break
        time.sleep(0.005)
    return out.read_bytes().count(b"\n") if out.exists() else 0


def test_sigkill_then_resume_and_ctrl_c(tiny_dir, tmp_path, capsys):
    """A SIGKILL in the middle of a job, then --resume, gives the uninterrupted run's lines (minus
    latencies); Ctrl-C (exit 130) and SIGTERM (exit 143) stop with no traceback, results kept and
    offload files removed."""
    from xsimulator.policy import Policy

    rng = np.random.default_rng(3)
    n = 64
    rows = [{"id": f"q{i}", "prompt_ids": rng.integers(3, 300, size=int(rng.integers(1, 14))).tolist(),
             "max_new_tokens": int(rng.integers(1, 10))} for i in range(n)]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=2, nb=2, cg=0.5, cc=0.0, cd=0.5, refill_every=1))
    offload_kill = tmp_path / "off-kill"
    offload_kill.mkdir()
    killed = tmp_path / "killed.jsonl"
    common = ["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--quiet"]
    p_kill = _start(common + ["--out", str(killed), "--offload-dir", str(offload_kill)])
    at_kill = _wait_for_lines(p_kill, killed, 3)
    p_kill.send_signal(signal.SIGKILL)
    p_kill.communicate(timeout=60)
    assert p_kill.returncode == -signal.SIGKILL and 3 <= at_kill < n, at_kill  # really killed mid-job
    # Started only now: run beside the first one, it could finish its whole job while the first was still
    # starting up, and then the SIGINT met an exiting interpreter (exit -2 instead of 130).
    for sig, status, word in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
        offload, stopped = tmp_path / f"off-{word}", tmp_path / f"{word}.jsonl"
        offload.mkdir()
        p_stop = _start(common + ["--out", str(stopped), "--offload-dir", str(offload)])
        at_stop = _wait_for_lines(p_stop, stopped, 3)
        p_stop.send_signal(sig)
        _, err = p_stop.communicate(timeout=60)
        assert p_stop.returncode == status and 3 <= at_stop < n and "Traceback" not in err and word in err, err
        assert f"requests are in {stopped}; the same command with --resume runs the rest" in err, err
        assert list(offload.iterdir()) == []  # offload files removed after Ctrl-C or kill
        assert len(read_rows(stopped)) >= at_stop  # results written before the signal kept

    # A crash can also tear the line being appended; resume drops it.
    with killed.open("ab") as fh:
        fh.write(b'{"id": "q1", "text": "w')
    before = killed.read_bytes()
    assert main(common + ["--out", str(killed), "--offload-dir", str(offload_kill), "--resume"]) == 0
    resumed = read_rows(killed)
    assert killed.read_bytes().startswith(before[: before.rindex(b"\n") + 1])  # complete lines kept as they were
    assert len(resumed) == n and len({r["id"] for r in resumed}) == n  # no gaps, no duplicates
    fresh = tmp_path / "fresh.jsonl"
    assert main(common + ["--out", str(fresh), "--offload-dir", str(offload_kill)]) == 0
    assert without_timing(resumed) == without_timing(read_rows(fresh))
    for word in ("interrupted", "terminated"):
        stopped = tmp_path / f"{word}.jsonl"
        assert main(common + ["--out", str(stopped), "--offload-dir", str(tmp_path / f"off-{word}"), "--resume"]) == 0
        assert without_timing(read_rows(stopped)) == without_timing(read_rows(fresh))
    # Resuming a finished job says so without loading the model (a path with no model proves it).
    done = killed.read_bytes()
    capsys.readouterr()
    assert main(["run", "--plan", str(plan), "--model", str(tmp_path / "no-model"), "--prompts", str(prompts),
                 "--out", str(killed), "--resume", "--result", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"all {n} requests are already in {killed}; nothing to run (--result not written" in err, err
    assert killed.read_bytes() == done and not (tmp_path / "r.json").exists()
    from xscheduler.plan import Plan

    assert {r["model"] for r in resumed} == {Plan.load(plan).model.name}  # what --resume and replan check


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test: a shell that starts the suite in the background
    hands it SIGINT ignored, and the restored handler is then SIG_IGN."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_a_run_is_raised_between_items_not_inside_a_queue(tiny_dir, tmp_path, python_sigint):
    """Raised wherever it landed, a Ctrl-C once fell inside the I/O pool's submit, between a
    Condition's lock acquire and its with block: the lock stayed held and the run's cleanup
    waited on it for ever (a py-spy dump of a hung test run, stop 64). The run records it and
    raises it at the next item; the engine is then usable (its queues drained) and closes."""
    import os

    from xrunner.engine import Engine, Request, _SignalGate
    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    with _SignalGate() as gate:
        os.kill(os.getpid(), signal.SIGINT)
        assert gate.caught == [signal.SIGINT]  # recorded, not raised
        with pytest.raises(KeyboardInterrupt):
            gate.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    source = open_model(tiny_dir, dtype="float32")
    on_disk = Policy(gbs=2, nb=2, wg=0.0, wc=0.0, wd=1.0, cg=0.5, cc=0.0, cd=0.5, refill_every=1)
    reqs = [Request(id=i, prompt_ids=(5 + i, 6, 7), max_new_tokens=6) for i in range(8)]
    steps = []

    def on_step(n: int) -> None:
        steps.append(n)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with Engine(source, on_disk, max_prompt=4, max_output=6, offload_dir=tmp_path) as eng:
        with pytest.raises(KeyboardInterrupt):
            eng.run(reqs, on_step=on_step)
        assert len(steps) == 3  # raised at the next item, before another step ended
        finished = []
        eng.run(reqs[:2], on_finished=finished.extend)  # the queues were drained: the engine runs again
        assert sorted(f.id for f in finished) == [0, 1] and all(len(f.output_ids) == 6 for f in finished)
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_during_a_change_of_policy_inside_a_run_lands_between_layers(tiny_dir, tmp_path, python_sigint):
    """A re-plan between blocks that reads the weights again (here to 4-bit) ran under two
    signal gates: the reload's handed a Ctrl-C to the run's, which raised it only after every
    layer had been read again and the next step begun: minutes, for a real model (a review)."""
    import os
    from dataclasses import replace

    from xrunner.engine import Engine, Request
    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    source = open_model(tiny_dir, dtype="float32")
    real, loaded = source.load_layer, []

    def load_layer(i):
        if armed and i == 0:
            os.kill(os.getpid(), signal.SIGINT)  # pressed while the change reads layer 0
        loaded.append(i)
        return real(i)

    armed = False
    with Engine(source, Policy(gbs=2, nb=1), max_prompt=4, max_output=4, offload_dir=tmp_path) as eng:
        source.load_layer = load_layer

        def hook(info):
            nonlocal armed
            armed = True
            loaded.clear()
            return replace(info.policy, compress_weight=True), "to 4-bit"

        with pytest.raises(KeyboardInterrupt):
            eng.run([Request(id=i, prompt_ids=(5 + i, 6), max_new_tokens=3) for i in range(4)], between_blocks=hook)
        assert loaded[:1] == [0] and 1 not in loaded  # raised before layer 1 was read
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_while_the_weights_load_lands_between_layers_and_removes_the_offload_files(
        tiny_dir, tmp_path, python_sigint):
    """A layer of random weights fills in a thread pool, whose submit a Ctrl-C could leave with a
    lock held, as in a run (the test above). Loading records it and raises it before the next
    layer; the half-built engine then closes and its offload files go."""
    import os

    from xrunner.engine import Engine
    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    source = open_model(tiny_dir, dtype="float32")
    real, loaded = source.load_layer, []

    def load_layer(i):
        if i == 0:
            os.kill(os.getpid(), signal.SIGINT)  # pressed while layer 0 is read
        weights = real(i)
        loaded.append(i)
        return weights

    source.load_layer = load_layer
    on_disk = Policy(gbs=2, nb=1, wg=0.0, wc=0.0, wd=1.0, cg=0.0, cc=0.0, cd=1.0)
    with pytest.raises(KeyboardInterrupt):
        Engine(source, on_disk, max_prompt=8, max_output=4, offload_dir=tmp_path)
    assert loaded == [0]  # layer 0 finished reading; layer 1 never started
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_during_cleanup_still_removes_the_offload_files(tiny_dir, tmp_path, python_sigint):
    """Ctrl-C pressed twice (or SIGTERM then Ctrl-C) within ~50 ms interrupted the first one's
    cleanup and left the offload files behind (review): the cleanup now finishes, then the
    second signal is delivered."""
    from xrunner.engine import Engine
    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    on_disk = Policy(gbs=2, nb=1, wg=0.0, wc=0.0, wd=1.0, cg=0.0, cc=0.0, cd=1.0)
    offload = None
    with pytest.raises(KeyboardInterrupt):
        with Engine(open_model(tiny_dir, dtype="float32"), on_disk, max_prompt=8, max_output=4,
                    offload_dir=tmp_path) as eng:
            offload, pool = eng.offload_path, eng._pools[0]
            assert offload is not None and any(offload.iterdir())
            real = pool.shutdown

            def shutdown(*args, **kwargs):
                signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, while the first one's cleanup runs
                real(*args, **kwargs)

            pool.shutdown = shutdown
            raise KeyboardInterrupt  # the first Ctrl-C
    assert not offload.exists() and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


@pytest.mark.slow
def test_default_model_on_real_prompts_matches_generate(tmp_path, capsys):
    """SmolLM2-135M-Instruct (the default), chat template, greedy: the same text as the reference loop,
    for prompt text and for a chat with its own system prompt."""
    from xrunner.cli import encode_prompt
    from xrunner.reference import generate
    from xrunner.loaders import load_weights, open_model
    from xsimulator.policy import Policy

    source = open_model(None, dtype="float32")
    tok = source.tokenizer()
    questions = ["What is the capital of France?", "Name three primary colors.",
                 (("system", "You answer in French."), ("user", "What is the capital of France?"))]
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"id": f"q{i}", **({"prompt": q} if isinstance(q, str) else
                           {"messages": [{"role": r, "content": c} for r, c in q]}), "max_new_tokens": 12}
        for i, q in enumerate(questions)])
    plan = make_plan(tmp_path / "plan.json", source.spec, Policy(gbs=3, nb=1, wg=0.5, wc=0.5, wd=0.0), 64, 12)
    out = tmp_path / "out.jsonl"
    assert main(["run", "--plan", str(plan), "--prompts", str(prompts), "--out", str(out), "--quiet"]) == 0
    got = {r["id"]: r for r in read_rows(out)}
    weights = load_weights(source)
    stops = sorted({t for t in (source.spec.eos_token_id, tok.eos_token_id) if t is not None})
    for i, q in enumerate(questions):
        ids = encode_prompt(tok, q, chat=True)
        want = generate(weights, [ids], 12, stop_token_ids=stops).tokens[0]
        assert got[f"q{i}"]["output_ids"] == want and got[f"q{i}"]["prompt_tokens"] == len(ids)
        assert got[f"q{i}"]["text"] == tok.decode(want, skip_special_tokens=True)
    assert "Paris" in got["q0"]["text"] and got["q2"]["prompt_tokens"] < got["q0"]["prompt_tokens"]  # own system


def test_plan_measured_on_another_machine_warns(tmp_path):
    from dataclasses import replace

    from xprofiler.presets import ProfileMismatchWarning, load_preset
    from xrunner.run_cli import warn_if_plan_from_other_machine
    from xscheduler.plan import Plan
    from xsimulator.policy import Policy

    t4 = load_preset("t4")  # a preset never warns: it describes no machine in particular
    plan = Plan.load(make_plan(tmp_path / "preset.json", random_spec(), Policy(gbs=1, nb=1), 4, 4, profile=t4))
    assert warn_if_plan_from_other_machine(plan, None) == []
    measured = replace(t4, source="measured", fingerprint=replace(t4.fingerprint, cpu_model="Imaginary CPU 9000"))
    plan = Plan.load(make_plan(tmp_path / "measured.json", random_spec(), Policy(gbs=1, nb=1), 4, 4,
                               profile=measured))
    with pytest.warns(ProfileMismatchWarning, match="Imaginary CPU 9000"):
        diffs = warn_if_plan_from_other_machine(plan, None)
    assert any("cpu_model" in d for d in diffs)


def test_weight_rounding_calibrates_only_when_4bit_weights_or_cache_are_packed(tiny_dir, tmp_path, monkeypatch, capsys):
    """--weight-rounding gptq (default) tokenizes the calibration text once, and only for a plan with 4-bit
    weights (GPTQ) or a 4-bit KV cache (its centers); nearest never does. Every run finishes every request."""
    import xrunner.gptq as gptq
    from xsimulator.policy import Policy

    calls = []
    real = gptq.calibration_ids
    monkeypatch.setattr(gptq, "calibration_ids", lambda tok, *a, **k: calls.append(k["sequences"]) or real(tok, 2, 16))
    prompts, rows = tiny_job(tiny_dir, tmp_path, 4)
    packed = tiny_plan(tiny_dir, tmp_path / "packed.json", Policy(gbs=2, nb=1, wg=0.5, wc=0.5, compress_weight=True))
    plain = tiny_plan(tiny_dir, tmp_path / "plain.json", Policy(gbs=2, nb=1, wg=0.5, wc=0.5))
    kv4 = tiny_plan(tiny_dir, tmp_path / "kv4.json", Policy(gbs=2, nb=1, compress_cache=True))
    cases = ((plain, [], []), (packed, ["--weight-rounding", "nearest"], []),
             (packed, [], [gptq.CALIBRATION_SEQUENCES]), (kv4, ["--calibration-sequences", "5"], [5]),
             (kv4, ["--weight-rounding", "nearest"], []))
    for i, (plan, extra, want_calls) in enumerate(cases):
        out = tmp_path / f"out-{i}.jsonl"
        calls.clear()
        assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out",
                     str(out), "--adapt", "none", "--quiet", *extra]) == 0
        assert calls == want_calls and len(read_rows(out)) == len(rows)
    capsys.readouterr()
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit) as e:
            main(["run", "--plan", str(packed), "--prompts", str(prompts), "--out", str(tmp_path / "x.jsonl"),
                  "--calibration-sequences", bad])
        assert e.value.code == 2 and "--calibration-sequences: must be a whole number >= 1" in capsys.readouterr().err


def test_lines_written_by_random_weights_name_them_and_a_resume_with_real_ones_is_refused(tiny_dir, tmp_path,
                                                                                          capsys):
    """`random:` weights of the plan's shape write lines that say so, not the plan's model name: a
    --resume with the real weights on that file would otherwise mix junk outputs with real ones."""
    from xsimulator.policy import Policy

    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=2, nb=1))
    first = write_prompts(tmp_path / "first.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 3}])
    both = write_prompts(tmp_path / "both.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 3},
                                                    {"id": "b", "prompt_ids": [8, 9], "max_new_tokens": 3}])
    out = tmp_path / "out.jsonl"
    fake = f"random:{tiny_dir}"
    assert main(["run", "--plan", str(plan), "--model", fake, "--prompts", str(first), "--out", str(out),
                 "--quiet"]) == 0
    assert [r["model"] for r in read_rows(out)] == [fake]
    capsys.readouterr()
    before = out.read_bytes()
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(both), "--out", str(out),
                 "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"holds results of model {fake}" in err and out.read_bytes() == before, err


def test_a_refused_run_says_only_why(tiny_dir, tmp_path, capsys):
    """A run refused for its model, or for a request past the model's positions, is one line on
    stderr: the note that the job fills fewer GPU batches than the plan's, and advice to plan for
    the job's lengths, were printed before the error (review)."""
    from xsimulator.policy import Policy

    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=8, nb=2))
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 3}])
    capsys.readouterr()
    assert main(["run", "--plan", str(plan), "--model", "random:opt-125m", "--prompts", str(prompts), "--out",
                 str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "differs" in err[0], err
    # Nor does a request past the model's positions get advice to plan for its length first.
    long = write_prompts(tmp_path / "long.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 10**6}])
    assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(long), "--out",
                 str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "positions; shorten the prompts or max_new_tokens" in err[0], err


def test_the_busy_machine_note_advises_one_thread_only_to_a_run_on_more(tiny_dir, tmp_path, monkeypatch, capsys):
    """Other processes' load is said after a run; the advice to profile with --threads 1 was given
    to runs that already computed on 1 thread, and a finished job's resume warned about threads it
    would not use (review)."""
    import torch

    import xprofiler.measure as measure
    from xsimulator.policy import Policy

    monkeypatch.setattr(measure.LoadMeter, "others_cores", lambda self: 1.5)
    plan = tiny_plan(tiny_dir, tmp_path / "plan.json", Policy(gbs=2, nb=1))
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 2}])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            capsys.readouterr()
            assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out",
                         str(tmp_path / f"o{threads}.jsonl"), "--adapt", "none"]) == 0
            err = capsys.readouterr().err
            assert f"beside its {threads} compute thread(s): the measured times include that" in err, err
            assert ("profile with --threads 1" in err) == (threads > 1), err
        # A finished job says only that: no word on the threads it would have computed with.
        from dataclasses import replace

        from xscheduler.plan import Plan

        replace(Plan.load(plan), profile_threads=1).save(plan)
        assert main(["run", "--plan", str(plan), "--model", str(tiny_dir), "--prompts", str(prompts), "--out",
                     str(tmp_path / "o2.jsonl"), "--resume"]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "nothing to run" in err[0] and torch.get_num_threads() == 2, err
    finally:
        torch.set_num_threads(before)


def test_calibration_text_puts_the_jobs_own_text_first(tiny_dir, tmp_path, monkeypatch, capsys):
    """--calibration-text prompts calibrates on the job's tokenized prompts (every one) and a FILE
    on its text, both before the docstrings; a file that cannot be read stops the run before any
    work with a one-line error (exit 2)."""
    import xrunner.gptq as gptq
    from xrunner.loaders import open_model
    from xsimulator.policy import Policy

    firsts = []
    real = gptq.calibration_ids
    monkeypatch.setattr(gptq, "calibration_ids", lambda tok, *a, first=(), **k: firsts.append(
        [list(f) for f in first]) or real(tok, 2, 16, first=first))
    prompts, rows = tiny_job(tiny_dir, tmp_path, 5)
    kv4 = tiny_plan(tiny_dir, tmp_path / "kv4.json", Policy(gbs=2, nb=1, compress_cache=True))
    text = tmp_path / "domain.txt"
    text.write_text("Invoices and contracts.")
    tok = open_model(tiny_dir, dtype="float32").tokenizer()
    for i, extra in enumerate((["--calibration-text", "prompts"], ["--calibration-text", str(text)], [])):
        out = tmp_path / f"out-{i}.jsonl"
        assert main(["run", "--plan", str(kv4), "--model", str(tiny_dir), "--prompts", str(prompts), "--out",
                     str(out), "--adapt", "none", *extra]) == 0
        assert len(read_rows(out)) == len(rows)
    job, own, default = firsts
    assert sorted(map(len, job)) == sorted(r["prompt_tokens"] for r in read_rows(tmp_path / "out-0.jsonl"))
    assert own == [tok(text.read_text(), add_special_tokens=False)["input_ids"]] and default == []
    err = capsys.readouterr().err
    n = len(own[0])  # (2 x 16 tokens calibrate here: the prompts have more, the file fewer)
    assert sum(map(len, job)) > 32 > n and "calibrating on 32 tokens of the prompts\n" in err
    assert f"calibrating on {n} tokens of {text} and {32 - n} of the standard-library docstrings\n" in err
    assert main(["run", "--plan", str(kv4), "--model", str(tiny_dir), "--prompts", str(prompts), "--out",
                 str(tmp_path / "x.jsonl"), "--calibration-text", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.txt: cannot read it" in err, err
    assert len(firsts) == 3 and not (tmp_path / "x.jsonl").exists()


def test_calibration_ids_take_the_jobs_tokens_in_a_fixed_shuffle_then_the_docstrings():
    """A job's own tokens fill the calibration sequences first, each prompt whole, in an order that
    depends on nothing but their count (a resumed job calibrates the same); the docstrings fill
    what is left, and a job with more tokens than the pass needs gives only its own."""
    from xrunner.gptq import calibration_ids, calibration_text

    def tok(text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    prompts = [[1000 + 10 * i + j for j in range(i + 1)] for i in range(6)]  # 21 tokens, each its own
    ids = calibration_ids(tok, sequences=3, length=10, first=prompts)
    assert ids.shape == (3, 10) and ids.tolist() == calibration_ids(tok, sequences=3, length=10, first=prompts).tolist()
    flat = ids.flatten().tolist()
    by_start, k, order = {p[0]: p for p in prompts}, 0, []
    while k < 21:  # whole prompts, one after another
        p = by_start[flat[k]]
        assert flat[k:k + len(p)] == p
        order.append(prompts.index(p))
        k += len(p)
    assert sorted(order) == list(range(6)) and order != list(range(6))
    assert flat[21:] == tok(calibration_text())["input_ids"][:9]
    few = calibration_ids(tok, sequences=1, length=8, first=prompts).flatten().tolist()
    assert few == [t for i in order for t in prompts[i]][:8]


def test_the_run_computes_with_the_profiles_thread_count():
    """A profile measured with 1 thread priced the plan for 1 thread; torch's default of 2 beside
    another job ran 15x slower than predicted."""
    import dataclasses
    import warnings

    import torch

    from xprofiler.presets import load_preset
    from xrunner.run_cli import match_profile_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            match_profile_threads(dataclasses.replace(load_preset("t4"), compute_threads=1))
            assert torch.get_num_threads() == 1 and "1 torch thread" in str(caught[-1].message)
            match_profile_threads(load_preset("t4"))  # a preset records no count: left alone
            assert torch.get_num_threads() == 1 and len(caught) == 1
            match_profile_threads(dataclasses.replace(load_preset("t4"), compute_threads=10**5))
            assert torch.get_num_threads() == len(os.sched_getaffinity(0))  # no more than this machine has
            # Without the profile file (no --profile) the plan's record of the count serves: six
            # prompts planned on a 1-thread profile generated 3x slower on 2 threads beside another job.
            from workloads import get_workload
            from xprofiler.specs import get_model_spec
            from xscheduler import SLA, plan_search

            one = dataclasses.replace(load_preset("t4"), compute_threads=1)
            plan = plan_search(get_model_spec("opt-125m"), one, get_workload("fixed:32:8"), SLA("p99", 3600),
                               num_requests=16, confirm_seeds=())
            assert plan.profile_threads == 1 and type(plan).from_json(plan.to_json()) == plan
            torch.set_num_threads(2)
            match_profile_threads(None, plan)
            assert torch.get_num_threads() == 1 and f"as profile {plan.profile_name!r} was" in str(caught[-1].message)
            torch.set_num_threads(2)
            match_profile_threads(None, dataclasses.replace(plan, profile_threads=0))  # an older plan: left alone
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_offload_dir_that_takes_no_files_is_refused_up_front(tmp_path, monkeypatch):
    """As root, os.access passes /proc and read-only mounts; `calibrate --offload-dir /proc` then
    failed later with "directory does not exist" (review). A file is now created to find out."""
    import errno
    import tempfile

    from xrunner.run_cli import check_offload_dir

    check_offload_dir(str(tmp_path))  # a writable directory passes

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(UserError, match="cannot create files there \\(Read-only file system\\)"):
        check_offload_dir(str(tmp_path))


def test_an_output_path_that_takes_no_files_is_refused_before_the_job(tmp_path, monkeypatch):
    """`run --result /proc/r.json` ran the whole job, then failed to write the summary (as root,
    os.access passes /proc): `check_writable` now creates a file to find out, before the job."""
    import errno

    from xsched.fileio import check_writable

    check_writable(tmp_path / "r.json", "--result")
    assert list(tmp_path.iterdir()) == []  # (the probe is removed)
    if Path("/proc/self").is_dir():
        with pytest.raises(UserError, match=r"/proc/r.json: cannot create a file in /proc .*pass another --result"):
            check_writable("/proc/r.json", "--result")

    real_open = os.open

    def read_only(path, *a, **k):
        if ".xsched-check-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UserError, match=r"cannot create a file in .* \(Read-only file system\); pass another --trace"):
        check_writable(tmp_path / "t.json", "--trace")


def test_a_plan_for_a_dense_model_is_refused_for_a_mixture_of_experts_of_its_shape():
    """Every expert's weights change the bytes a plan placed, so a plan for the dense shape does not
    run a mixture of experts (or one with other expert counts) of the same widths."""
    from dataclasses import replace

    from xprofiler.specs import get_model_spec
    from xrunner.run_cli import check_model_matches

    dense = get_model_spec("smollm2-135m")
    check_model_matches(dense, replace(dense, name="copy"), None)
    moe = replace(dense, num_experts=8, experts_per_token=2)
    for other, field in [(moe, "num_experts 0 vs 8"), (replace(moe, shared_expert_ffn=64), "shared_expert_ffn")]:
        with pytest.raises(UserError, match=field):
            check_model_matches(dense if other is moe else moe, other, "m")
    # The advice for random weights names what `--model random:...` accepts: a registry name, or a
    # directory for a model read from a file (a GGUF's name is no registry entry).
    with pytest.raises(UserError, match="or random:smollm2-135m for random ones"):
        check_model_matches(dense, moe, "m")
    with pytest.raises(UserError, match=r"or random:DIR \(a directory with its config.json\) for random ones"):
        check_model_matches(replace(dense, name="SmolLM2-135M-Instruct.Q4_1"), moe, "m")


def test_openai_output_says_why_a_request_stopped_and_counts_every_token():
    """A stop string ends a completion with finish_reason "stop" (only EOS and the budget were
    checked), and usage totals prompt and completion tokens (a mutation audit)."""
    from xsched.openai_batch import openai_result_line

    row = {"id": "a", "text": "x", "output_ids": [5, 6], "output_tokens": 2, "prompt_tokens": 3,
           "stopped_on_eos": False, "stop_string": "y"}
    body = openai_result_line("a", [row], model="m", chat=True, created=0)["response"]["body"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = openai_result_line("a", [{**row, "stop_string": None}], model="m", chat=True, created=0)["response"]["body"]
    assert body["choices"][0]["finish_reason"] == "length"


def test_results_reach_the_disk_block_by_block_and_count_as_done(tmp_path, monkeypatch):
    """A crash loses at most the block in flight: every block's lines are fsynced as written (seen
    here with their bytes), and a written id counts as done in the same job (a mutation audit)."""
    import xrunner.jobfiles as jobfiles

    sizes, real = [], os.fsync
    monkeypatch.setattr(jobfiles.os, "fsync", lambda fd: (sizes.append(os.fstat(fd).st_size), real(fd)))
    out = tmp_path / "r.jsonl"
    with jobfiles.ResultsWriter.open(out, resume=False) as w:
        w.write([{"id": "a"}])
        first = out.stat().st_size
        w.write([{"id": "b"}, {"id": 2}])
        assert w.is_done("a") and w.is_done(2) and not w.is_done("2") and len(w.done) == 3
    assert sizes == [first, out.stat().st_size]


def test_the_summary_table_puts_each_number_in_its_column():
    """Measured, simulated and plan columns swapped, or the planned peak printed as the measured
    one, passed every test: none read the table's cells (a mutation audit)."""
    from types import SimpleNamespace

    from workloads.workload import fixed_workload
    from xprofiler.presets import load_profile
    from xrunner.result import build_run_result
    from xsimulator.discrete_event import simulate
    from xsimulator.policy import Policy

    pol, gib = Policy(gbs=4, nb=1), 2**30
    stats = SimpleNamespace(wall_s=10.0, generated_tokens=500, prompt_tokens=300, padded_prompt_tokens=400,
                            num_prefill_steps=3, num_decode_steps=40, peak_bytes={"gpu": gib, "cpu": 0, "disk": 0},
                            planned_peak_bytes={"gpu": 2.0 * gib, "cpu": 0.0, "disk": 0.0}, busy_s={"compute": 8.0},
                            device_reserved_peak_bytes=None)
    r = build_run_result(model="m", policy=pol, device="cpu", dtype="float32", stats=stats, latencies_s=[1.0] * 3,
                         num_stopped_on_eos=0, num_skipped=0, capacity_bytes={"gpu": 4 * gib}, max_prompt=8,
                         max_output=6, predicted=simulate_small(pol),  # 4 requests
                         simulated=simulate(random_spec(), load_profile("t4"), pol, fixed_workload(8, 6),
                                            num_requests=3))
    rows = {row[0]: row for row in r.comparison_rows()}
    assert rows["requests"] == ("requests", "3", "3", "4")
    assert rows["peak gpu GiB"][:2] == ("peak gpu GiB", "1.000")
    assert r.describe().splitlines()[4].split() == ["measured", "simulated", "plan"]


def test_a_prompt_file_mixing_openai_and_native_lines_writes_native_results(tmp_path):
    """--out-format auto answers in OpenAI's format only when every line is an OpenAI line."""
    from xsimulator.policy import Policy

    plan = make_plan(tmp_path / "plan.json", random_spec(), Policy(gbs=2, nb=1), 8, 6)
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6, 7], "max_tokens": 2}},
        {"id": "b", "prompt_ids": [8, 9], "max_new_tokens": 2}])
    out = tmp_path / "o.jsonl"
    assert main(["run", "--plan", str(plan), "--model", RANDOM_MODEL, "--prompts", str(prompts), "--out", str(out),
                 "--quiet", "--adapt", "none"]) == 0
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ["a", "b"] and not any("custom_id" in r for r in rows)


def test_a_budget_file_above_the_plan_at_the_start_caps_the_run_at_it(tmp_path):
    """A budget below the profile's tier but above the plan's peak is the run's capacity from the
    start (only budgets below the plan were tested; a mutation that kept the profile's 2 GiB
    passed), and the plan's prediction stays."""
    _plan, base = _job_planned_on_a_cpu_profile(tmp_path)
    base = base + ["--quiet"]
    assert main(base + ["--out", str(tmp_path / "a.jsonl"), "--result", str(tmp_path / "a.json")]) == 0
    first = json.loads((tmp_path / "a.json").read_text())
    budget_bytes = int(1.2 * first["planned_peak_bytes"]["gpu"])
    assert budget_bytes < first["capacity_bytes"]["gpu"]
    (tmp_path / "budget.json").write_text(json.dumps({"gpu_bytes": budget_bytes}))
    assert main(base + ["--budget-file", str(tmp_path / "budget.json"), "--out", str(tmp_path / "b.jsonl"),
                        "--result", str(tmp_path / "b.json")]) == 0
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["capacity_bytes"]["gpu"] == budget_bytes and second["predicted"] is not None
