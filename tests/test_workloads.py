"""workloads: length distributions, presets, request files, fits and the drift test."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from workloads import DriftMonitor, LengthDistribution, Workload, fit_lengths, get_workload, preset_names
from workloads.distributions import skewnorm_parameters
from xsched.errors import UserError

# ExeGPT Table 3: (input mean, std, max), (output mean, std, p99, max).
TABLE3 = {
    "S": ((256, 252, 512), (32, 13, 63, 80)),
    "T": ((128, 81, 256), (128, 68, 292, 320)),
    "G": ((64, 23, 128), (192, 93, 417, 480)),
    "C1": ((256, 115, 512), (64, 30, 137, 160)),
    "C2": ((512, 252, 1024), (256, 134, 579, 640)),
}


@pytest.mark.parametrize("name", list(TABLE3))
def test_presets_reproduce_exegpt_table3(name):
    (im, isd, imax), (om, osd, o99, omax) = TABLE3[name]
    w = get_workload(name)
    assert (w.prompt.max_len, w.output.max_len) == (imax, omax)
    assert w.output.mean == pytest.approx(om, rel=0.005)
    assert w.output.std == pytest.approx(osd, rel=0.005)
    # The table's 99th-percentile column was not used to build the preset: an independent check.
    assert abs(w.output.quantile(0.99) - o99) <= 1
    assert w.prompt.mean == pytest.approx(im, rel=0.01)
    uniform_std = math.sqrt(((imax - 1 + 1) ** 2 - 1) / 12)
    if isd < uniform_std:  # reachable by a truncated normal on 1..max
        assert w.prompt.std == pytest.approx(isd, rel=0.005)
    else:  # S and T inputs: Table 3's std exceeds a uniform's; the preset is the closest (near uniform)
        assert w.prompt.std == pytest.approx(uniform_std, rel=0.01)


def test_preset_names_fixed_and_scale():
    assert preset_names() == ["S", "T", "G", "C1", "C2"]
    fixed = get_workload("fixed:512:32")
    p, o = fixed.sample(10, seed=3)
    assert set(p) == {512} and set(o) == {32}
    quarter = get_workload("T@0.25")
    full = get_workload("T")
    assert quarter.output.max_len == 80 and quarter.prompt.max_len == 64
    assert quarter.output.mean == pytest.approx(full.output.mean / 4, rel=0.01)
    assert get_workload("fixed:64:16@0.5").output.params["value"] == 8
    tiny = get_workload("S@0.01")  # lengths shrink to a single possible value, not an error
    assert tiny.output.max_len >= 1 and tiny.sample(5, seed=0)[1].min() >= 1
    assert get_workload("c1").name == "C1"
    # silently truncated or refused in numpy's or Python's words (an audit)
    for bad, words in ((lambda: LengthDistribution.fixed(2.5), "a length is a whole number of tokens, got 2.5"),
                       (lambda: full.scaled(float("nan")), "scale factor must be a finite number > 0, got nan"),
                       (lambda: full.scaled(math.inf), "scale factor must be a finite number > 0, got inf")):
        with pytest.raises(UserError, match=re.escape(words)):
            bad()


def test_truncnorm_pmf_matches_scipy_truncnorm():
    d = LengthDistribution.truncnorm(100, 40, 180)
    lengths, probs = d.pmf()
    a, b = (0.5 - 100) / 40, (180.5 - 100) / 40
    ref = stats.truncnorm(a, b, loc=100, scale=40)
    expected = ref.cdf(lengths + 0.5) - ref.cdf(lengths - 0.5)
    np.testing.assert_allclose(probs, expected, rtol=1e-9, atol=1e-14)
    assert probs.sum() == pytest.approx(1.0)
    assert d.mean == pytest.approx(float(np.dot(lengths, expected)), rel=1e-9)


def test_skewnorm_and_lognorm_parameters_match_scipy_moments():
    shape, loc, scale = skewnorm_parameters(100, 20, 0.6)
    m, v, sk = stats.skewnorm.stats(shape, loc=loc, scale=scale, moments="mvs")
    assert (float(m), math.sqrt(v), float(sk)) == pytest.approx((100, 20, 0.6), rel=1e-9)
    wide = LengthDistribution.lognorm(50, 30, 100_000)  # truncation far away: moments survive rounding
    assert wide.mean == pytest.approx(50, rel=0.01)
    assert wide.std == pytest.approx(30, rel=0.02)
    left = LengthDistribution.skewnorm(200, 30, -0.8, 1000)
    right = LengthDistribution.skewnorm(200, 30, 0.8, 1000)
    assert left.quantile(0.99) < right.quantile(0.99)


def test_sampling_is_seeded_and_follows_the_pmf():
    d = get_workload("G").output
    a, b = d.sample(200_000, seed=7), d.sample(200_000, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, d.sample(200_000, seed=8))
    assert a.min() >= d.min_len and a.max() <= d.max_len
    assert a.mean() == pytest.approx(d.mean, rel=0.01)
    assert np.quantile(a, 0.99) == pytest.approx(d.quantile(0.99), abs=3)
    # percentile is the inverse CDF: smallest length with cdf >= q
    q = d.quantile(0.9)
    assert d.cdf(q) >= 0.9 > d.cdf(q - 1)


def test_empirical_mixture_and_round_trip():
    e = LengthDistribution.empirical([3, 3, 5, 9])
    lengths, probs = e.pmf()
    assert dict(zip(lengths.tolist(), probs.tolist()))[3] == pytest.approx(0.5)
    assert e.mean == pytest.approx(5.0)
    mix = LengthDistribution.mixture([LengthDistribution.fixed(10), LengthDistribution.truncnorm(100, 10, 200)],
                                     [0.25, 0.75])
    assert mix.mean == pytest.approx(0.25 * 10 + 0.75 * LengthDistribution.truncnorm(100, 10, 200).mean)
    w = Workload("mixed", prompt=mix, output=e, correlation=0.3)
    again = Workload.from_json(w.to_json())
    assert again == w
    assert again.output.mean == e.mean
    four = replace(w, samples=4)
    assert Workload.from_json(four.to_json()) == four != w
    for bad in (0, 2.5, True):
        with pytest.raises(UserError, match="samples"):
            replace(w, samples=bad)


def test_correlated_sampling_reaches_the_requested_rank_correlation():
    base = get_workload("T")
    w = Workload("corr", base.prompt, base.output, correlation=0.8)
    p, o = w.sample(20_000, seed=1)
    rho_s = stats.spearmanr(p, o).statistic
    assert 2 * math.sin(math.pi * rho_s / 6) == pytest.approx(0.8, abs=0.03)
    p0, o0 = base.sample(20_000, seed=1)
    assert abs(stats.spearmanr(p0, o0).statistic) < 0.03
    # Four outputs per prompt: runs of four share a prompt; each output keeps the coupling.
    p4, o4 = replace(w, samples=4).sample(20_001, seed=1)
    assert (p4[:20_000].reshape(-1, 4) == p4[:20_000:4, None]).all() and len(p4) == 20_001
    assert 2 * math.sin(math.pi * stats.spearmanr(p4, o4).statistic / 6) == pytest.approx(0.8, abs=0.03)
    assert (o4.reshape(-1)[:20_000].reshape(-1, 4).std(axis=1) > 0).mean() > 0.9


def test_from_file_jsonl_and_csv(tmp_path):
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, 200, 400)
    outputs = prompts // 2 + rng.integers(1, 20, 400)  # strongly correlated
    jl = tmp_path / "req.jsonl"
    jl.write_text("\n".join(json.dumps({"id": i, "prompt_tokens": int(p), "output_tokens": int(o)})
                            for i, (p, o) in enumerate(zip(prompts, outputs))) + "\n")
    w = Workload.from_file(jl)
    assert w.prompt.mean == pytest.approx(prompts.mean())
    assert w.output.max_len == outputs.max()
    assert w.correlation > 0.9
    csv_path = tmp_path / "req.csv"
    csv_path.write_text("prompt,max_new_tokens\n" + "".join(f"{'word ' * int(p)},{int(o)}\n"
                                                            for p, o in zip(prompts[:50], outputs[:50])))
    wc = Workload.from_file(csv_path)
    assert "estimated" in wc.source  # no tokenizer: 4 bytes per token
    assert wc.prompt.mean == pytest.approx(np.ceil(5 * prompts[:50] / 4).mean())
    counted = Workload.from_file(csv_path, count_tokens=lambda text: len(text.split()))
    assert counted.prompt.mean == pytest.approx(prompts[:50].mean())
    assert get_workload(str(jl)).name == "req"
    # A spreadsheet's byte-order mark, and a raw U+2028 inside a JSON string (json.dumps with
    # ensure_ascii=False writes one; str.splitlines() would break the line there).
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfprompt_tokens,output_tokens\r\n10,5\r\n12,7\r\n")
    assert Workload.from_file(bom).prompt.mean == pytest.approx(11)
    past = tmp_path / "past.jsonl"  # an observed output past its own cap: the cap was silently ignored
    past.write_text('{"prompt_tokens": 10, "output_tokens": 50, "max_new_tokens": 32}\n')
    with pytest.raises(UserError, match="request 1: output_tokens 50 is more than its max_new_tokens 32"):
        Workload.from_file(past)
    comma = tmp_path / "comma.csv"  # an unquoted comma in a prompt: its cells were dropped without a word
    comma.write_text("prompt,output_tokens\nhello there,5\nhi, you,6\n")
    with pytest.raises(UserError, match=r"comma\.csv:3: 3 cells under a header of 2; quote a cell"):
        Workload.from_file(comma)
    sep = tmp_path / "sep.jsonl"
    sep.write_text(json.dumps({"prompt": "one\u2028two\x85", "output_tokens": 3}, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    assert Workload.from_file(sep).output.mean == 3
    sampled = tmp_path / "n.jsonl"  # "n" outputs of a prompt are n requests of `xsched run`
    sampled.write_text('{"prompt_tokens": 10, "max_new_tokens": 4, "n": 3}\n'
                       '{"prompt_tokens": 30, "max_new_tokens": 8}\n')
    fitted = Workload.from_file(sampled)
    assert fitted.prompt.mean == pytest.approx(15) and fitted.source.startswith("4 requests")
    assert fitted.samples == 2  # 4 requests of 2 prompts: the simulator prefills runs of 2 once
    assert "2 outputs per prompt" in fitted.describe()
    from xsched.cli import main

    assert main(["workload", "fit", str(sampled), "-o", str(tmp_path / "fit.json")]) == 0  # the fitting CLI too
    assert Workload.load(tmp_path / "fit.json").samples == 2
    sampled.write_text('{"prompt_tokens": 10, "max_new_tokens": 4, "n": 0}\n')
    with pytest.raises(UserError, match="request 1"):
        Workload.from_file(sampled)
    sampled.write_text('{"prompt_tokens": 10, "max_new_tokens": 4, "n": 100000}\n')  # named "samples" before
    with pytest.raises(UserError, match='request 1: "n" asks for 100,000 outputs of one prompt; at most 4,096'):
        Workload.from_file(sampled)


def test_a_lone_surrogate_in_a_prompt_is_a_one_line_error(tmp_path, capsys):
    """"\\ud800" is valid JSON but no text: `workload fit` raised UnicodeEncodeError from the
    4-bytes-per-token estimate, and TypeError from the tokenizer with --tokenizer (review)."""
    from xsched.cli import main

    req = tmp_path / "sur.jsonl"
    req.write_text('{"prompt": "hello", "output_tokens": 6}\n{"prompt": "hi \\ud800 there", "output_tokens": 5}\n')
    out = tmp_path / "w.json"
    assert main(["workload", "fit", str(req), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'request 2: "prompt" holds a lone surrogate' in err, err
    assert not out.exists()

    def tokenizer(text: str) -> int:  # refuses such a string, as the HF tokenizer does (with a TypeError)
        if "\ud800" in text:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        return len(text.split())

    with pytest.raises(UserError, match="lone surrogate"):
        Workload.from_file(req, count_tokens=tokenizer)


@pytest.mark.parametrize("text,match", [
    ("fixed:0:5", ">= 1"),
    ("fixed:10:-3", ">= 1"),
    ("fixed:10", "fixed:PROMPT_TOKENS:OUTPUT_TOKENS"),
    ("Q", "unknown workload preset 'Q'"),
    ("T@zero", "not a number"),
    ("T@-1", "scale must be a finite number > 0, e.g. T@0.5"),
    ("T@inf", "scale must be a finite number > 0"),
    ("missing.jsonl", "no such file"),
    ("S@1e6", "beyond any model's context"),  # not a gigabyte-sized pmf table
    ("T@1e300", r"max_len=2.56e\+302 tokens is beyond"),  # (not a 300-digit number in a 530-character line)
])
def test_bad_workload_specs(text, match):
    with pytest.raises(UserError, match=match):
        get_workload(text)


def test_a_summarys_min_and_max_are_lengths_it_can_draw():
    """`replan` printed an observed pmf of 6-token outputs, kept in 6..8 for the cap, as "p99 6, max 8"."""
    assert LengthDistribution.empirical([6, 6, 6], 8).summary()["max"] == 6
    assert LengthDistribution.empirical([3, 6], 8).summary()["min"] == 3
    assert LengthDistribution.truncnorm(100, 50, 300).summary()["max"] == 300


def test_scaling_keeps_the_mean_inside_the_range():
    """Rounding min_len after scaling could pass the scaled mean (3 x 0.5 -> 2 > 1.6)."""
    d = LengthDistribution.truncnorm(3.2, 1.0, 10, min_len=3).scaled(0.5)
    assert d.min_len <= d.params["mean"] == pytest.approx(1.6) and d.max_len == 5
    assert d.mean == pytest.approx(float(np.dot(*d.pmf()[::-1])))


def test_bad_distributions_and_files(tmp_path):
    with pytest.raises(UserError, match="max must be >= mean"):
        LengthDistribution.truncnorm(600, 50, 512)
    with pytest.raises(UserError, match="std must be > 0"):
        LengthDistribution.lognorm(100, 0, 512)
    with pytest.raises(UserError, match=">= 1 token"):
        LengthDistribution.empirical([5, 0, 3])
    with pytest.raises(UserError, match="skew"):
        LengthDistribution.skewnorm(100, 10, 1.5, 300)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 5, "output_tokens": 3}\n{"prompt_tokens": 5,\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid JSON"):
        Workload.from_file(bad)
    zero = tmp_path / "zero.jsonl"
    zero.write_text('{"prompt_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(UserError, match="request 1: prompt_tokens=0"):
        Workload.from_file(zero)
    zero.write_text('{"prompt_tokens": true, "output_tokens": 3}\n')
    with pytest.raises(UserError, match="request 1: prompt_tokens=True"):
        Workload.from_file(zero)
    zero.write_text('{"prompt_tokens": 10000000000000000000, "output_tokens": 3}\n')  # past int64
    with pytest.raises(UserError, match="beyond any model's context"):
        Workload.from_file(zero)
    # a line `xsched run` refuses (which of the two would it run?) was fitted by its prompt alone
    both = tmp_path / "both.jsonl"
    both.write_text('{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "output_tokens": 3}\n')
    with pytest.raises(UserError, match="request 1: give exactly one of \"prompt\" \\(text\\), \"messages\""):
        Workload.from_file(both)
    zero.write_text('{"prompt_tokens": 1' + '0' * 400 + ', "output_tokens": 3}\n')  # past float: OverflowError
    with pytest.raises(UserError, match="beyond any model's context"):
        Workload.from_file(zero)
    zero.write_text('{"prompt_tokens": 1' + '0' * 5000 + ', "output_tokens": 3}\n')  # past json's digit limit
    with pytest.raises(UserError, match="zero.jsonl:1: not a usable request"):
        Workload.from_file(zero)
    partial = tmp_path / "partial.jsonl"
    partial.write_text('{"prompt_tokens": 4, "output_tokens": 3}\n{"prompt_tokens": 5}\n')
    with pytest.raises(UserError, match="request 2 has no output length"):
        Workload.from_file(partial)
    ids = tmp_path / "ids.jsonl"  # `xsched run`'s pre-tokenized form counts its ids
    ids.write_text('{"id": "a", "prompt_ids": [5, 6, 7], "max_new_tokens": 4}\n{"id": "b", "prompt_ids": [1], '
                   '"max_new_tokens": 2}\n')
    w_ids = Workload.from_file(ids)
    assert (w_ids.prompt.min_len, w_ids.prompt.max_len, w_ids.output.max_len) == (1, 3, 4)
    chat = tmp_path / "chat.jsonl"  # `xsched run`'s chat form, estimated from its contents' bytes (17 and 5)
    chat.write_text('{"messages": [{"role": "system", "content": "Be brief."}, '
                    '{"role": "user", "content": "Hi there"}], "max_new_tokens": 4}\n'
                    '{"messages": [{"role": "user", "content": "Hello"}], "max_new_tokens": 4}\n')
    w_chat = Workload.from_file(chat)
    assert (w_chat.prompt.min_len, w_chat.prompt.max_len) == (2, 5) and "estimated" in w_chat.source
    chat.write_text('{"messages": [{"role": "user"}], "max_new_tokens": 4}\n')
    with pytest.raises(UserError, match="request 1: message 1 must be an object"):
        Workload.from_file(chat)
    none = tmp_path / "none.jsonl"
    none.write_text('{"prompt": "hello there"}\n')
    with pytest.raises(UserError, match="no output length"):
        Workload.from_file(none)
    assert Workload.from_file(none, output=LengthDistribution.fixed(7)).output.mean == 7
    not_workload = tmp_path / "w.json"
    not_workload.write_text('{"schema": "xsched.Policy/1", "gbs": 1}')
    with pytest.raises(UserError, match="schema"):
        get_workload(str(not_workload))
    # a value the distribution's own check refuses: the error names the file and the field it read
    bad = tmp_path / "neg.json"
    data = get_workload("T").to_dict()
    data["output"]["params"]["std"] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"neg\.json\.output: truncnorm: std must be > 0"):
        get_workload(str(bad))


def test_ks_distance_is_the_largest_gap_between_the_two_cdfs_on_the_integers():
    """The fit's family choice and the drift tests rest on this distance: checked against a
    brute-force count over each integer length (side="left" in the ECDF read one step late)."""
    from workloads.fit import ks_distance

    assert ks_distance(LengthDistribution.fixed(10), np.full(100, 10)) == 0.0
    assert ks_distance(LengthDistribution.fixed(10), np.full(100, 11)) == 1.0
    dist = LengthDistribution.truncnorm(40, 12, max_len=90)
    for seed in range(3):
        x = np.random.default_rng(seed).integers(5, 80, size=37)
        want = max(abs(np.count_nonzero(x <= k) / x.size - float(dist.cdf(np.array([k]))[0]))
                   for k in range(1, 91))
        assert ks_distance(dist, x) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("truth", [LengthDistribution.lognorm(120, 70, 1500),
                                   LengthDistribution.truncnorm(200, 60, 500)])
def test_fit_picks_the_generating_family(truth):
    data = truth.sample(4000, seed=11)
    report = fit_lengths(data)
    assert report.best.family == truth.family
    assert report.best.mean == pytest.approx(data.mean(), rel=0.02)
    assert report.best.std == pytest.approx(data.std(), rel=0.05)
    best = report.candidates[0]
    assert best.ks_pvalue > 0.01
    assert all(c.bic >= best.bic for c in report.candidates)
    # 100 lengths: the empirical pmf (a parameter per distinct length) fits them closest but says
    # least about the next ones; BIC's log(n) per parameter keeps the family (AIC took the pmf)
    assert fit_lengths(truth.sample(100, seed=11)).best.family == truth.family


def test_fit_falls_back_to_empirical_for_many_samples_of_an_odd_shape():
    bimodal = np.concatenate([np.full(3000, 20), np.full(3000, 400), np.arange(1, 500)])
    report = fit_lengths(bimodal)
    assert report.best.family == "empirical"
    assert fit_lengths([7, 7, 7]).best.family == "fixed"
    with pytest.raises(UserError):
        fit_lengths([])


def test_a_fit_the_ks_test_rejects_is_not_chosen_and_fits_start_at_the_shortest_length_seen():
    """BIC chose a skew-normal with KS p = 3e-6 for 200 + exponential lengths (a walkthrough):
    its p99 fell 15% short. And a family spread from length 1 put mass below every prompt."""
    rng = np.random.default_rng(3)
    skewed = 200 + np.round(rng.exponential(30, 300)).astype(int)
    report = fit_lengths(skewed)
    chosen = next(c for c in report.candidates if c.distribution == report.best)
    assert chosen.ks_pvalue >= 0.01 and report.best.min_len >= 200
    assert report.best.quantile(0.99) == pytest.approx(np.percentile(skewed, 99), rel=0.05)
    two_peaks = fit_lengths(np.concatenate([np.full(300, 20), np.full(300, 400), np.arange(1, 500)]))
    assert two_peaks.best.family == "empirical" and "rejected (KS p < 0.01)" in two_peaks.describe()
    # a normal cut at 200 tokens (every prompt behind a 200-token template) is fitted as one, from 200
    cut = LengthDistribution.truncnorm(230, 60, 600, min_len=200).sample(2000, seed=5)
    report = fit_lengths(cut)
    assert report.best.family == "truncnorm" and report.best.min_len == 200
    assert report.best.mean == pytest.approx(cut.mean(), rel=0.01)


def test_sampling_a_workload_says_what_its_lines_cannot_carry(tmp_path, capsys):
    """A fitted workload of 3 outputs per prompt was sampled to one line per output without a word:
    a plan for the file then prices a job that prefills each of them."""
    from xsched.cli import main

    reqs = tmp_path / "n3.jsonl"
    reqs.write_text('{"prompt_tokens": 10, "output_tokens": 5, "n": 3}\n{"prompt_tokens": 12, "output_tokens": 4, "n": 3}\n')
    assert main(["workload", "fit", str(reqs), "-o", str(tmp_path / "w.json")]) == 0
    capsys.readouterr()
    assert main(["workload", "sample", str(tmp_path / "w.json"), "-n", "4", "-o", str(tmp_path / "s.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "wrote 4 requests" in err and "do not carry its 3 outputs per prompt" in err, err
    assert main(["workload", "sample", "T", "-n", "1", "-o", str(tmp_path / "t.jsonl")]) == 0
    assert capsys.readouterr().err.strip() == f"wrote 1 request of T to {tmp_path / 't.jsonl'}"


def _stream_alarms(workload, shift, seed, block=64, blocks=12, alpha=0.05):
    """First request count at which the monitor fires on a stream (None if never)."""
    rng = np.random.default_rng(seed)
    p, o = workload.sample(block * blocks, seed=int(rng.integers(1 << 31)))
    o = np.maximum(1, np.round(o * (1 + shift))).astype(int)
    monitor = DriftMonitor(workload, false_alarm_rate=alpha)
    for k in range(1, blocks + 1):
        if monitor.check(p[: k * block], o[: k * block]).drifted:
            return k * block
    return None


def test_drift_false_alarm_rate_is_bounded_on_unshifted_streams():
    w = get_workload("T")
    alpha = 0.05
    streams = 200
    alarms = sum(_stream_alarms(w, 0.0, seed, alpha=alpha) is not None for seed in range(streams))
    # Binomial(200, alpha) exceeds 1.6x its mean with probability ~2%; the monitor is conservative
    # (5 alarms here), while testing every look at alpha/4 without spending fires on ~15% of streams.
    assert alarms <= 1.6 * alpha * streams


def test_drift_detects_a_15_percent_mean_shift_within_a_few_hundred_requests():
    w = get_workload("T")  # the hardest preset: output std is 53% of the mean
    delays = [_stream_alarms(w, 0.15, seed, alpha=0.01) for seed in range(40)]
    detected = [d for d in delays if d is not None]
    assert len(detected) >= 38
    assert np.median(detected) <= 512


def test_drift_monitor_input_checks():
    w = get_workload("S")
    with pytest.raises(UserError, match="fraction"):
        DriftMonitor(w, false_alarm_rate=5)
    monitor = DriftMonitor(w)
    report = monitor.check([10] * 5, None)
    assert not report.drifted and report.look == 0  # too few lengths: no look spent
    with pytest.raises(UserError, match="whole numbers"):
        monitor.check([0] * 50, None)
    ks_only = DriftMonitor(w, tests=("ks",)).check(w.prompt.sample(100, seed=1), None, windows=(64,))
    assert {s.test for s in ks_only.stats} == {"ks"} and len(ks_only.stats) == 2  # whole stream + one window
    with pytest.raises(UserError, match="ks, mean"):
        DriftMonitor(w, tests=("t",))


def test_skewnorm_pmf_matches_scipy_skewnorm():
    d = LengthDistribution.skewnorm(80, 25, 0.7, 200)
    lengths, probs = d.pmf()
    shape, loc, scale = skewnorm_parameters(80, 25, 0.7)
    ref = stats.skewnorm(shape, loc=loc, scale=scale)
    expected = ref.cdf(lengths + 0.5) - ref.cdf(lengths - 0.5)
    expected /= ref.cdf(200.5) - ref.cdf(0.5)
    np.testing.assert_allclose(probs, expected, rtol=1e-8, atol=1e-14)


def _cusum_alarm(workload, factor, seed, n=2000, change=1000, alpha=0.01, step=32):
    """Request count at which the CUSUMs fire when outputs are scaled by ``factor`` from ``change`` on."""
    from workloads.drift import CusumMonitor

    a = workload.sample(change, seed=2 * seed)
    b = replace(workload, output=workload.output.scaled(factor)).sample(n - change, seed=2 * seed + 1)
    p, o = np.concatenate((a[0], b[0])), np.concatenate((a[1], b[1]))
    monitor = CusumMonitor(workload, alpha, horizon=n, seed=seed)
    for i in range(0, n, step):
        monitor.update(p[i:i + step], o[i:i + step])
        if monitor.drifted():
            return i + step
    return None


def test_cusum_threshold_holds_the_false_alarm_rate_over_the_job_by_simulation():
    """Null streams drawn from the planned distribution itself: at a generous level (so that a
    threshold set too low shows), the alarms stay within the level; they are not vanishingly rare
    either (a threshold set far too high would cost detection delay). 600 streams, so that a
    monitor giving each of its four CUSUMs the whole level (0.28 of streams alarm) fails: at 150
    it passed (42 alarms against a limit of 43; a mutation audit)."""
    w = get_workload("T")
    alpha, streams = 0.2, 600
    alarms = sum(_cusum_alarm(w, 1.0, 100 + s, n=1000, change=500, alpha=alpha) is not None for s in range(streams))
    assert alarms <= stats.binom.ppf(0.995, streams, alpha), alarms
    assert alarms >= 1, alarms


def test_cusum_detects_15_percent_shifts_both_ways_within_500_requests():
    w = get_workload("T")  # output std is 53% of the mean
    for factor in (1.15, 0.85):
        delays = [_cusum_alarm(w, factor, s) for s in range(12)]
        assert all(d is not None and d > 1000 for d in delays), (factor, delays)  # none before the change
        assert np.median(delays) - 1000 <= 350 and sum(d - 1000 > 500 for d in delays) <= 1, (factor, delays)


def test_cusum_scores_are_standard_normal_under_the_plan_and_extreme_outside_it():
    from workloads.drift import CusumMonitor, cusum_threshold, siegmund_arl

    w = get_workload("C2")
    m = CusumMonitor(w, 0.01, 1000)
    scores = m._streams["output"]["scores"]
    z = scores(w.output.sample(20000, seed=3))
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.03
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert scores(np.array([w.output.max_len + 50]))[0] > 6  # a length the plan says cannot happen
    h = cusum_threshold(0.15, 3000, 0.001)
    assert siegmund_arl(h, 0.15) == pytest.approx(3000 / -np.log1p(-0.001), rel=1e-6)
    with pytest.raises(UserError, match="fraction"):
        CusumMonitor(w, 2.0)


def test_short_lengths_with_a_mode_at_one_fit_without_overflow():
    """Nelder-Mead drove lognorm's std to 1e200 on data like this, and squaring it overflowed: a
    traceback from ``xsched workload fit`` (stop 36). 150 small geometric samples all fit now."""
    rng = np.random.default_rng(0)
    for n in range(2, 32):
        for _ in range(5):
            report = fit_lengths(rng.geometric(0.3, n))
            assert report.best.min_len >= 1
    assert fit_lengths([1, 1, 1, 2, 5]).best.mean == pytest.approx(2.0)


def test_distributions_refuse_weights_and_stds_that_break_the_pmf():
    for weights in ((math.inf, 1.0), (1e308, 1e308), (math.nan, 1.0)):  # NaN pmf / a sum that overflows
        with pytest.raises(UserError, match="finite"):
            LengthDistribution("empirical", 10, 1, {}, (1, 2), weights)
    with pytest.raises(UserError, match="std"):
        LengthDistribution("lognorm", 100, 1, {"mean": 5.0, "std": 1e200})


def test_scaling_keeps_a_declared_max_len():
    """A re-plan's fitted empirical distribution declares a max_len past its sample (memory is
    sized by it); scaling rebuilt it from the values alone and dropped it (100 x 2 gave 60)."""
    emp = LengthDistribution.empirical([10, 20, 30], max_len=100)
    assert emp.scaled(2).max_len == 200 and emp.scaled(2).mean == pytest.approx(40.0)
    mix = LengthDistribution.mixture([emp, LengthDistribution.fixed(5)], [1.0, 1.0])
    assert mix.scaled(2).max_len == 200


def test_a_cusum_whose_every_threshold_is_too_strict_fires_at_zero():
    """With a narrow reference (k ~ 3.5), a short horizon and a high false-alarm rate even a zero
    threshold fires by mistake less often than asked; brentq had no bracket and raised (stop 36).
    The first positive sum fires, and a sum at 0 does not."""
    from workloads.drift import CusumMonitor, cusum_threshold, siegmund_arl

    assert cusum_threshold(3.5, 1, 0.2) == 0.0
    assert siegmund_arl(0.0, 3.5) > 1 / -math.log1p(-0.2)  # the premise
    mon = CusumMonitor(get_workload("fixed:512:32"), 0.2, 1)
    # A sum at 0 has seen nothing that departs: at h = 0 it still reported drift, with no data at all
    # and after lengths the plan holds.
    assert not mon.drifted()
    mon.update([512] * 5, [32] * 5)
    assert not mon.drifted() and all(s.statistic == 0 for s in mon.stats())
    mon.update([600], [32])  # past the plan's one length: the first positive sum fires
    assert {(s.stream, s.test) for s in mon.stats() if s.fired_at(mon.level)} == {("prompt", "cusum+")}


def test_probabilities_at_lengths_match_the_pmf_table():
    """A fit's likelihood reads probabilities at the observed lengths only (``probs_at``); it built
    the whole table per Nelder-Mead step, and a file of prompts near 2**23 tokens took over 5
    minutes to fit (9 s now). The values must be the table's."""
    rng = np.random.default_rng(0)
    dists = [LengthDistribution.truncnorm(100, 30, 512), LengthDistribution.skewnorm(300, 80, 0.7, 1024),
             LengthDistribution.lognorm(50, 60, 4000), LengthDistribution.truncnorm(299, 10, 300),
             LengthDistribution.skewnorm(10, 10, -0.9, 64), LengthDistribution.truncnorm(10, 1, 1000),
             LengthDistribution.empirical([3, 3, 7, 9], 20)]
    for d in dists:
        x = rng.integers(d.min_len, d.max_len + 1, 300)
        np.testing.assert_allclose(d.probs_at(x), d.pmf()[1][x - d.min_len], rtol=1e-12, atol=1e-300)


def test_a_files_shared_leading_tokens_become_the_workloads_prefix(tmp_path):
    """Prompts that begin alike (a system prompt) give the workload's ``prefix_tokens``: the mean,
    over the prompts that share, of the leading tokens each shares with another, each kept below
    its own length, when their ids are known (given in the file, or from a tokenizer that returns
    them); 0 when any prompt's ids are unknown. Two system prompts give about their lengths, not
    the 0 tokens all prompts share. A prompt that shares nothing is no prefix of its own; it lowers
    ``prefix_share``. It survives JSON and scales with the lengths."""
    def ids_file(rows: list[list[int]], extra: str = "") -> Workload:
        path = tmp_path / "ids.jsonl"
        path.write_text("".join(json.dumps({"id": i, "prompt_ids": r, "max_new_tokens": 4}) + "\n"
                                for i, r in enumerate(rows)) + extra)
        return Workload.from_file(path)

    rows = [[9, 8, 7, 6, 1, 2], [9, 8, 7, 6, 3], [9, 8, 7, 6, 1, 5, 5, 5]]
    w = ids_file(rows)
    assert w.prefix_tokens == 5 and Workload.from_json(w.to_json()) == w  # (5 + 4 + 5) / 3, rounded
    assert w.scaled(0.5).prefix_tokens == 2 and "begin with 5 tokens they share" in w.describe()
    assert ids_file(rows + [[9, 8, 7]]).prefix_tokens == 4  # the short prompt counts 2: it keeps a token
    assert ids_file(rows, json.dumps({"id": 3, "prompt_tokens": 9, "max_new_tokens": 4}) + "\n").prefix_tokens == 0
    two = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [8, 8, 8, 9], [8, 8, 8, 10]]
    assert ids_file(two).prefix_tokens == 4 and ids_file(two[:1]).prefix_tokens == 0  # (5 + 5 + 3 + 3) / 4
    assert w.prefix_groups == 1 and ids_file(two).prefix_groups == 2 and ids_file(two[:1]).prefix_groups == 1
    assert "share, one of 2 such prefixes" in ids_file(two).describe()
    loner = ids_file(two + [[7, 7, 7, 7]])  # shares nothing: not a prefix, and outside the share
    assert (loner.prefix_tokens, loner.prefix_groups, loner.prefix_share) == (4, 2, 0.8)
    assert Workload.from_json(loner.to_json()) == loner and "80% of the prompts begin with 4" in loner.describe()
    old = loner.to_dict()
    for key in ("prefix_share", "prefix_lengths", "prefix_weights"):
        del old[key]  # a workload saved before the fields: every prompt behind a prefix, all alike
    assert Workload.from_dict(old).prefix_share == 1.0
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 3}) + "\n"
                            for p in ("you are terse . hi", "you are terse . what now", "you are kind . x")))
    words = {}
    by_word = Workload.from_file(text, count_tokens=lambda t, *a: [words.setdefault(x, len(words)) for x in t.split()])
    assert by_word.prefix_tokens == 3 and by_word.prompt.max_len == 6  # (4 + 4 + 2) / 3
    assert Workload.from_file(text, count_tokens=lambda t, *a: len(t.split())).prefix_tokens == 0
    with pytest.raises(UserError, match="prefix_tokens"):
        replace(w, prefix_tokens=-1)
    with pytest.raises(UserError, match="prefix_groups"):
        replace(w, prefix_groups=0)
    for share in (0.0, 1.5, 25):
        with pytest.raises(UserError, match="prefix_share"):
            replace(w, prefix_share=share)


def test_requests_draw_their_prefix_per_prompt():
    """``Workload.prefix_ids``: each request's prefix among ``prefix_groups``, the same for a
    prompt's samples, every prefix as often as the others (to one prompt) in a random order, the
    same draw for the same seed."""
    w = replace(get_workload("S"), samples=3, prefix_tokens=20, prefix_groups=5)
    ids = w.prefix_ids(3001, seed=2)
    assert ids.shape == (3001,) and set(ids.tolist()) == set(range(5))
    assert all(len(set(ids[i:i + 3])) == 1 for i in range(0, 3001, 3))
    counts = np.bincount(ids[::3], minlength=5)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 1001, counts
    assert len(np.flatnonzero(np.diff(ids[::3]))) > 600  # shuffled, not in runs
    assert np.array_equal(ids, w.prefix_ids(3001, seed=2)) and not np.array_equal(ids, w.prefix_ids(3001, seed=3))
    some = replace(w, prefix_share=0.25).prefix_ids(3001, seed=2)  # a quarter of the prompts behind one of 5
    assert all(len(set(some[i:i + 3])) == 1 for i in range(0, 3001, 3))
    first = some[::3]
    assert np.count_nonzero(first < 5) == 250 and np.bincount(first[first < 5]).tolist() == [50] * 5
    assert sorted(first[first >= 5].tolist()) == list(range(5, 5 + 751))  # the others: one prefix each


def test_templates_of_unlike_lengths_and_popularity_get_a_table_that_the_draws_follow(tmp_path):
    """A file of prompts behind a 30-token template (half of them), a 6-token one (a third) and a
    12-token one (the rest): the fit lists each template's length and share (``prefix_lengths``,
    ``prefix_weights``), with ``prefix_tokens`` and ``prefix_share`` their weighted mean and sum,
    through JSON and ``@scale``; the short templates are runs of their own (a cut at half the job's
    mean took them for prompts sharing nothing). Drawn prefixes come as often as their weights say,
    and, given the prompts' lengths, the long template goes to the long prompts. Lists that
    disagree with the summary fields are refused; a CLI's ``--prefix-tokens`` drops them."""
    from workloads.workload import with_samples

    rng = np.random.default_rng(4)
    heads = {30: list(range(1000, 1030)), 6: list(range(2000, 2006)), 12: list(range(3000, 3012))}
    which = [30] * 60 + [6] * 40 + [12] * 20
    rows = [heads[n] + rng.integers(5, 900, size=int(rng.integers(3, 8))).tolist() for n in which]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt_ids": r, "max_new_tokens": 4}) + "\n"
                            for i, r in enumerate(rows)))
    w = Workload.from_file(path)
    table = dict(zip(w.prefix_lengths, w.prefix_weights))
    assert w.prefix_groups == 3 and w.prefix_share == 1.0 and set(table) == {30, 6, 12}, table
    assert table[30] == pytest.approx(0.5) and table[6] == pytest.approx(1 / 3) and table[12] == pytest.approx(1 / 6)
    assert w.prefix_tokens == round(0.5 * 30 + 6 / 3 + 12 / 6)  # 19
    assert Workload.from_json(w.to_json()) == w and "30: 50%" in w.describe()
    half = w.scaled(0.5)
    assert sorted(half.prefix_lengths) == [3, 6, 15] and half.prefix_tokens == round(7.5 + 1 + 1)
    ids = w.prefix_ids(1200, seed=1)
    assert np.bincount(ids, minlength=3)[[w.prefix_lengths.index(n) for n in (30, 6, 12)]].tolist() == [600, 400, 200]
    lengths = np.array([n + 5 for n in which] * 10)  # each template's prompts 5 tokens past it
    coupled = w.prefix_ids(1200, seed=1, prompt_lens=lengths)
    assert np.array_equal(w.prefix_lengths_of(coupled), lengths - 5)
    with pytest.raises(UserError, match="one entry per prefix"):
        replace(w, prefix_lengths=w.prefix_lengths[:2])
    with pytest.raises(UserError, match="make them agree"):
        replace(w, prefix_tokens=36)
    plain = with_samples(w, None, prefix_tokens=36)
    assert plain.prefix_tokens == 36 and plain.prefix_lengths == () and plain.prefix_groups == 3


def test_counts_past_what_the_simulators_can_hold_are_refused_in_one_line(tmp_path):
    """Outputs per prompt, prefix tokens and prefixes each have an upper bound (10^20 of any was
    a traceback, 10^12 samples a 7 TiB array); a prefix longer than the longest prompt cannot be;
    a count given as text in JSON is refused as `xsched run` refuses it (a CSV cell is text by
    nature and is read as the number it spells); an empty workload name says what to give."""
    from workloads.workload import MAX_PREFIX_GROUPS, MAX_SAMPLES

    t = get_workload("T")
    for change, message in ((dict(samples=MAX_SAMPLES + 1), "samples 4097 must be a whole number from 1 to 4096"),
                            (dict(samples=10 ** 300), r"samples 10000000000000000000\.\.\. must be"),
                            (dict(prefix_tokens=t.prompt.max_len + 1), "from 0 to the longest prompt's 256 tokens"),
                            (dict(prefix_groups=MAX_PREFIX_GROUPS + 1), "from 1 to 1,048,576")):
        with pytest.raises(UserError, match=message):
            replace(t, **change)
    assert replace(t, samples=MAX_SAMPLES, prefix_tokens=t.prompt.max_len).samples == MAX_SAMPLES
    with pytest.raises(UserError, match="got an empty name; give a preset"):
        get_workload(" ")
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt_tokens": "12", "max_new_tokens": 4}\n')
    with pytest.raises(UserError, match=r"request 1: prompt_tokens='12' must be a JSON number, not text"):
        Workload.from_file(text)
    cells = tmp_path / "cells.csv"
    cells.write_text("prompt_tokens,max_new_tokens,n\n12,4,2\n15,8,1\n")
    w = Workload.from_file(cells)
    assert w.prompt.max_len == 15 and w.output.max_len == 8
    cells.write_text("prompt_tokens,max_new_tokens\n12,four\n")
    with pytest.raises(UserError, match="max_new_tokens='four' is not a number"):
        Workload.from_file(cells)


def _kept_with_the_workload(w: Workload, field: str, shown: str, **flag: float) -> None:
    """``w``'s length distribution ``field``: saved and read back, shown by ``describe``, scaled
    with the workload, dropped with the prefix table (by a prefix ``flag``), refused past the
    longest prompt; a file of old format reads as None."""
    from workloads.workload import with_samples

    assert Workload.from_json(w.to_json()) == w and shown in w.describe()
    assert getattr(w.scaled(2.0), field).max_len == pytest.approx(2 * getattr(w, field).max_len, abs=1)
    assert getattr(with_samples(w, None, **flag), field) is None
    with pytest.raises(UserError, match=f"{field} reaches"):
        replace(w, **{field: LengthDistribution.fixed(w.prompt.max_len + 1)})
    old = json.loads(w.to_json())
    del old[field]
    assert getattr(Workload.from_dict(old), field) is None


def _fitted(tmp_path, rows: list[list[int]]) -> Workload:
    """The workload ``workload fit`` finds in a file of these prompts' token ids."""
    path = tmp_path / "reqs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt_ids": r, "max_new_tokens": 4}) + "\n"
                            for i, r in enumerate(rows)))
    return Workload.from_file(path)


def test_a_fitted_workload_keeps_the_prompts_own_parts_after_their_prefix(tmp_path):
    """``own_part``: the tokens after each sharing prompt's prefix, kept where the prefixes
    differ in length (what pairs them with prompt lengths in the simulator); saved and read
    back, scaled with the workload, dropped with the prefix table, refused past the longest
    prompt; a file of old format reads as None."""
    rng = np.random.default_rng(4)
    heads = [rng.integers(5, 900, n).tolist() for n in (40, 80, 120)]
    rows = [heads[k] + rng.integers(5, 900, int(q)).tolist()
            for k, q in zip(rng.integers(0, 3, 90), rng.integers(10, 21, 90))]
    w = _fitted(tmp_path, rows)
    assert sorted(w.prefix_lengths) == [40, 80, 120] and 10 <= w.own_part.min_len <= w.own_part.max_len <= 20
    assert w.own_part.mean == pytest.approx(np.mean([len(r) for r in rows]) - w.mean_prefix_tokens, abs=0.5)
    _kept_with_the_workload(w, "own_part", "after the prefix: mean", prefix_tokens=50)
    assert w.unshared_prompt is None  # (every prompt shares a template)


def test_a_fitted_workload_keeps_the_lengths_of_the_prompts_that_share_nothing(tmp_path):
    """``unshared_prompt``: the lengths of the prompts that share no prefix, beside ``own_part``
    (what tells them apart from the sharing ones in the simulator); saved and read back, shown,
    scaled, dropped with the prefix table, refused past the longest prompt; a file of old format
    reads as None."""
    rng = np.random.default_rng(5)
    heads = [rng.integers(5, 900, n).tolist() for n in (40, 120)]
    rows = [heads[k] + rng.integers(5, 900, int(q)).tolist()
            for k, q in zip(rng.integers(0, 2, 90), rng.integers(10, 21, 90))]
    rows += [rng.integers(5, 900, int(n)).tolist() for n in rng.integers(60, 90, 30)]
    w = _fitted(tmp_path, rows)
    alone = w.unshared_prompt
    assert w.prefix_share == pytest.approx(0.75) and 60 <= alone.min_len <= alone.max_len < 90
    assert alone.mean == pytest.approx(np.mean([len(r) for r in rows[90:]]))
    _kept_with_the_workload(w, "unshared_prompt", "prompts sharing nothing: mean", prefix_share=0.5)
    lens = np.tile([len(r) for r in rows], 30)  # the file's prompts, in the simulator's draw:
    alone_ids = w.prefix_ids(len(lens), prompt_lens=lens) >= w.prefix_groups
    assert alone_ids.sum() == 0.25 * len(lens)  # as many as share nothing, of the lengths such prompts have
    assert 60 <= lens[alone_ids].min() and lens[alone_ids].max() < 90  # (the sharing ones: 50-60 and 130-140)


def test_a_workload_files_scale_suffix_scales_it(tmp_path):
    """``reqs.jsonl@0.5`` halves the file's lengths, as ``T@0.5`` does a preset's (file@X appeared
    only in a test that never looked at the lengths)."""
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"prompt_tokens": 100 + 10 * (i % 7), "output_tokens": 40 + 4 * (i % 5)}) + "\n"
                            for i in range(60)))
    full, half = get_workload(str(reqs)), get_workload(f"{reqs}@0.5")
    assert half.prompt.max_len == pytest.approx(full.prompt.max_len / 2, abs=1)
    assert half.output.mean == pytest.approx(full.output.mean / 2, rel=0.05)


def test_unequally_common_prefixes_count_as_fewer_groups():
    """(sum w)^2 / sum w^2: three templates used 50/25/25% count as 2.67 equally common ones, not 3
    (every test used equally common prefixes, where the two agree)."""
    w = replace(get_workload("G"), prefix_tokens=20, prefix_groups=3, prefix_share=1.0, prefix_lengths=(20, 20, 20),
                prefix_weights=(0.5, 0.25, 0.25))
    assert w.effective_prefix_groups == pytest.approx(1 / (0.25 + 2 * 0.0625))
