"""Workload: prompt and output length distributions of a job, from a preset, a spec or a file.

``get_workload(text)`` is the one entry point the CLIs use. ``text`` is

- a preset of ExeGPT Table 3 (``S``, ``T``, ``G``, ``C1``, ``C2``),
- ``fixed:PROMPT:OUTPUT`` (FlexGen's benchmarks, e.g. ``fixed:512:32``),
- a path: a saved Workload JSON, or a JSONL/CSV file of requests,

optionally followed by ``@SCALE`` to multiply every length (``T@0.25`` is task T with a quarter of
the lengths: small enough to run for real on a small machine).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
from scipy import special

from workloads.distributions import MAX_LEN_TOKENS, LengthDistribution
from xsched.contract import Contract
from xsched.errors import UserError
from xsched.fileio import chat_messages, check_text, jsonl_lines, path_exists, read_text
from xsched.openai_batch import openai_batch_row, openai_result_rows

PROMPT_KEYS = ("prompt_tokens", "prompt")
# A run of prompts shares at least this fraction of their tokens: less, and the runner computes
# them as if they shared nothing (it shares a batch's prefixes only where they cut its positions
# by 1 - xsimulator.costmodel.SHARE_PREFIX_AT_MOST or more).
RUN_SHARE_AT_LEAST = 0.2
OUTPUT_KEYS = ("output_tokens", "max_new_tokens")
# Outputs one prompt may ask for (OpenAI's batch API allows 128): the samplers draw a prompt per
# output, and a request asking for 10^12 filled the machine's memory.
MAX_SAMPLES = 4096
# Distinct prefixes a workload may describe: the simulators keep per-prefix arrays.
MAX_PREFIX_GROUPS = 2**20
# Without a tokenizer, prompt text is sized with the common rule of thumb for BPE tokenizers on
# English text: about 4 UTF-8 bytes per token. The workload's ``source`` says so when it is used.
BYTES_PER_TOKEN_ESTIMATE = 4
ESTIMATE_NOTE = (f"prompt lengths estimated at {BYTES_PER_TOKEN_ESTIMATE} bytes/token, without a chat template's "
                 "tokens (no tokenizer; `xsched workload fit FILE --tokenizer [MODEL]` counts them as `xsched run` will)")
# Alike prefixes no shorter than this fraction of the prompts describe no real job (Workload.prefix_note).
# Not less: a preset's short tail is not a job's either (8% of T's prompts have 20 tokens or fewer).
SHORT_PROMPTS_NOTED = 0.1


def _shown(value: Any) -> str:
    """A value for an error line: its repr, cut where it runs long (a 300-digit count)."""
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."


@dataclass(frozen=True)
class Workload(Contract):
    """Distributions of prompt and output lengths, and how they correlate.

    ``correlation`` is the correlation of the Gaussian copula that couples the two lengths
    (0 = independent, as ExeGPT §6 assumes; its translation task has 0.57-0.94). ``samples``
    is how many outputs each prompt asks for (a prompts file's ``"n"``): requests come in runs
    of that many with one prompt, and the runner computes a run's prefill once per GPU batch.
    ``prefix_tokens`` is how many leading tokens a prompt shares with the others (a system prompt,
    the same few-shot examples; counted in the prompt lengths; :func:`prefix_fields`), and
    ``prefix_groups`` among how many distinct such prefixes each prompt's is drawn (a job mixing
    task templates), and ``prefix_share`` which fraction of the prompts begins with one (the others
    share nothing): the runner computes each prefix once per block (the first GPU batch holding it
    computes it, later ones take it), after ordering a block's prompts so that those beginning
    alike join one batch, and keeps the first ones it computes for the run's later prefills.
    ``prefix_lengths`` and ``prefix_weights`` (one per prefix, or both empty: every prefix
    ``prefix_tokens`` long and as common as the others) describe templates of unlike lengths and
    popularity, as ``workload fit`` finds them; ``prefix_tokens`` and ``prefix_share`` are then
    their weighted mean and sum. A job of a 300-token template among seven 20-token ones read as
    eight 36-token prefixes, and the simulator priced 1.5-7x the engine's prefill positions: the
    long template's prompts looked like 36 shared tokens before 300 of their own.
    """

    SCHEMA: ClassVar[str] = "xsched.Workload/1"

    name: str
    prompt: LengthDistribution
    output: LengthDistribution
    correlation: float = 0.0
    source: str = ""
    samples: int = 1
    prefix_tokens: int = 0
    prefix_groups: int = 1
    prefix_share: float = 1.0
    prefix_lengths: tuple[int, ...] = ()
    prefix_weights: tuple[float, ...] = ()
    # The sharing prompts' own parts (their tokens after the prefix), where a file showed them
    # (workload fit); prefix_ids pairs prefixes of unlike lengths with prompt lengths by it.
    own_part: LengthDistribution | None = None
    # The lengths of the prompts that share nothing, beside own_part: prefix_ids tells them apart
    # from the sharing ones by length.
    unshared_prompt: LengthDistribution | None = None
    # How many requests a file gave these lengths (0: a preset, or a workload written by hand):
    # `xsched plan` prices that job size unless told another.
    file_requests: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.file_requests, bool) or not isinstance(self.file_requests, int) or self.file_requests < 0:
            raise UserError(f"workload {self.name}: file_requests {_shown(self.file_requests)} must be a whole number "
                            ">= 0 (requests the lengths were read from; 0: none)")
        if not -1.0 < self.correlation < 1.0 and self.correlation != 0.0:
            raise UserError(f"workload {self.name}: correlation {self.correlation} must lie strictly inside -1..1")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or not 1 <= self.samples <= MAX_SAMPLES:
            raise UserError(f"workload {self.name}: samples {_shown(self.samples)} must be a whole number from 1 to "
                            f"{MAX_SAMPLES} (outputs per prompt)")
        longest = self.prompt.max_len
        if isinstance(self.prefix_tokens, bool) or not isinstance(self.prefix_tokens, int) \
                or not 0 <= self.prefix_tokens <= longest:
            raise UserError(f"workload {self.name}: prefix_tokens {_shown(self.prefix_tokens)} must be a whole number "
                            f"from 0 to the longest prompt's {longest:,} tokens (leading tokens the prompts share)")
        if isinstance(self.prefix_groups, bool) or not isinstance(self.prefix_groups, int) \
                or not 1 <= self.prefix_groups <= MAX_PREFIX_GROUPS:
            raise UserError(f"workload {self.name}: prefix_groups {_shown(self.prefix_groups)} must be a whole number "
                            f"from 1 to {MAX_PREFIX_GROUPS:,} (distinct prefixes the prompts begin with)")
        if isinstance(self.prefix_share, bool) or not isinstance(self.prefix_share, (int, float)) \
                or not 0.0 < self.prefix_share <= 1.0:
            raise UserError(f"workload {self.name}: prefix_share {self.prefix_share!r} must lie in (0, 1] "
                            "(the fraction of prompts that begin with a shared prefix)")
        self._check_prefix_table()
        for field_, what in (("own_part", "the part of a prompt after its prefix"),
                             ("unshared_prompt", "the prompts that share no prefix")):
            dist = getattr(self, field_)
            if dist is not None and dist.max_len > self.prompt.max_len:
                raise UserError(f"workload {self.name}: {field_} reaches {dist.max_len:,} tokens, past the longest "
                                f"prompt's {self.prompt.max_len:,} (it is {what})")

    def _check_prefix_table(self) -> None:
        lengths, weights = self.prefix_lengths, self.prefix_weights
        if not lengths and not weights:
            return
        where = f"workload {self.name}: prefix_lengths and prefix_weights"
        if len(lengths) != len(weights) or len(lengths) != self.prefix_groups:
            raise UserError(f"{where} need one entry per prefix ({self.prefix_groups}), got {len(lengths)} and "
                            f"{len(weights)}; give both or neither")
        if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.prompt.max_len for n in lengths) or \
                any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 < w <= 1.0 for w in weights):
            raise UserError(f"{where}: lengths must be whole numbers from 1 to the longest prompt's "
                            f"{self.prompt.max_len:,} tokens and weights fractions in (0, 1]")
        share = float(sum(weights))
        tokens = round(sum(n * w for n, w in zip(lengths, weights)) / share)
        if abs(share - self.prefix_share) > 1e-6 or abs(tokens - self.prefix_tokens) > 1:
            raise UserError(f"{where} give {tokens} tokens on {share:.6g} of the prompts, prefix_tokens and "
                            f"prefix_share say {self.prefix_tokens} and {self.prefix_share:.6g}; drop the two lists "
                            "or make them agree (their weighted mean and sum)")

    @property
    def prefix_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(length, fraction of the prompts) of each of the ``prefix_groups`` prefixes."""
        if self.prefix_lengths:
            return np.array(self.prefix_lengths, np.int64), np.array(self.prefix_weights, float)
        g = self.prefix_groups
        return np.full(g, self.prefix_tokens, np.int64), np.full(g, self.prefix_share / g)

    def sample(self, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``n`` requests ``(prompt_lens, output_lens)``, int64 arrays; same seed, same requests.

        With ``samples`` k > 1, requests ``i`` and ``j`` share a prompt when ``i // k == j // k``
        (each output still drawn on its own, coupled to the shared prompt by ``correlation``).
        """
        if n < 1:
            raise UserError(f"number of requests must be >= 1, got {n}")
        rng = np.random.default_rng(seed)
        k = self.samples
        m = -(-n // k)  # prompts

        def per_request(prompt_draws: np.ndarray) -> np.ndarray:
            return prompt_draws if k == 1 else np.repeat(prompt_draws, k)[:n]

        if self.correlation == 0.0:
            u_prompt, u_output = per_request(rng.random(m)), rng.random(n)
        else:
            z1, z2 = per_request(rng.standard_normal(m)), rng.standard_normal(n)
            rho = self.correlation
            u_prompt = special.ndtr(z1)
            u_output = special.ndtr(rho * z1 + math.sqrt(1 - rho * rho) * z2)
        return self.prompt.ppf(u_prompt), self.output.ppf(u_output)

    def prompt_groups(self, n: int) -> np.ndarray:
        """Which prompt each of ``n`` requests (in queue order) is a sample of: runs of ``samples``."""
        return np.arange(n, dtype=np.int64) // self.samples

    def prefix_ids(self, n: int, seed: int = 0, prompt_lens: Any = None) -> np.ndarray:
        """Which of the ``prefix_groups`` prefixes each of ``n`` requests' prompt begins with:
        ``prefix_share`` of the prompts one of them, each as often as its weight says (equally
        often without ``prefix_weights``, to one prompt), the rest one of their own
        (``prefix_groups`` and up), in random order (a prompt's samples share it); same seed,
        same draw.

        With ``prompt_lens`` (one per request) and prefixes of unlike lengths, the sharing
        prompts' prefixes follow their lengths: sorted by length, they take the prefixes sorted
        by their length plus a normal draw as wide as the prompts' own parts vary, so a long
        template goes to long prompts where the templates' lengths differ by more than the
        questions' do, and at random where they differ by less. The draw is from ``own_part``
        (centered) where the workload has it: a normal one's tails gave a GPU batch's longest own
        part, which every row pads to, a third past a suite's real one (57 templates of 550-650
        tokens, 30-110 token questions: the simulator priced 1.04-1.10x the engine's positions,
        0.997-1.015 drawing from ``own_part``). With ``unshared_prompt`` as well, which prompts share
        nothing follows their lengths (:meth:`_unshared_chance`)."""
        prompts = -(-n // self.samples)
        sharing = round(self.prefix_share * prompts)
        lengths, weights = self.prefix_table
        if self.prefix_lengths:  # as many of each as its weight, largest remainders first
            want = weights / weights.sum() * sharing
            count = np.floor(want).astype(np.int64)
            count[np.argsort(-(want - count), kind="stable")[:sharing - int(count.sum())]] += 1
            shared = np.repeat(np.arange(self.prefix_groups), count)
        else:
            shared = np.arange(sharing) % self.prefix_groups
        ids = np.concatenate([shared, self.prefix_groups + np.arange(prompts - sharing)])
        rng = np.random.default_rng([seed, self.prefix_groups])
        ids = rng.permutation(ids)
        first = None if prompt_lens is None else np.asarray(prompt_lens, np.int64)[::self.samples][:prompts]
        if first is not None and self.own_part is not None and self.unshared_prompt is not None \
                and 0 < sharing < prompts:
            chance = self._unshared_chance(first)
            keep = rng.random(prompts) >= chance
            extra = int(keep.sum()) - sharing  # (then to exactly as many sharing: the least sure change)
            if extra:
                pool = np.flatnonzero(keep if extra > 0 else ~keep)
                odds = np.clip(chance[pool] if extra > 0 else 1.0 - chance[pool], 1e-9, None)
                keep[rng.choice(pool, size=abs(extra), replace=False, p=odds / odds.sum())] = extra < 0
            alone = np.flatnonzero(~keep)
            ids[np.flatnonzero(keep)], ids[alone] = ids[ids < self.prefix_groups], self.prefix_groups + np.arange(
                prompts - sharing)
        if first is not None and sharing > 1 and np.ptp(lengths) > 0:
            at = np.flatnonzero(ids < self.prefix_groups)
            if self.own_part is not None:
                noise = self.own_part.sample(len(at), rng) - self.own_part.mean
            else:
                own_std = math.sqrt(max(float(np.var(first[at])) - float(np.var(lengths[ids[at]])), 0.0))
                noise = rng.normal(0.0, own_std, len(at))
            label = ids[at][np.argsort(lengths[ids[at]] + noise, kind="stable")]
            ids[at[np.argsort(first[at], kind="stable")]] = label
        return ids[self.prompt_groups(n)]

    def _unshared_chance(self, first: np.ndarray) -> np.ndarray:
        """For prompts of lengths ``first``, the chance that each is one sharing nothing: the
        density of ``unshared_prompt`` over it plus the sharing prompts' (each prefix's length
        plus ``own_part``, by its weight). Drawn at random, the prompts sharing nothing took any
        length where they were 40-200 tokens beside templated prompts of 30-340, and the
        simulator priced up to 1.75x the engine's positions (0.88-1.09 drawn so, mean |log| 0.193 ->
        0.025 over 18 such rows of ``benchmarks/prefix_pricing.py``, with the pricing fixes beside it)."""
        lengths, weights = self.prefix_table
        own, own_p = self.own_part.pmf()
        alone = self.unshared_prompt
        sharing = np.zeros(len(first))
        for n, w in zip(lengths, weights):
            at = first - n - own[0]
            ok = (at >= 0) & (at < len(own_p))
            sharing[ok] += w * own_p[at[ok]]
        inside = (first >= alone.min_len) & (first <= alone.max_len)
        lone = np.zeros(len(first))
        lone[inside] = (1.0 - self.prefix_share) * alone.probs_at(first[inside])
        both = lone + sharing
        return np.divide(lone, both, out=np.full(len(first), 1.0 - self.prefix_share), where=both > 0)

    def prefix_lengths_of(self, ids: Any) -> np.ndarray:
        """Each request's prefix length from its :meth:`prefix_ids` (0 for a prompt of its own)."""
        lengths = self.prefix_table[0]
        ids = np.asarray(ids, np.int64)
        return np.where(ids < self.prefix_groups, lengths[np.minimum(ids, self.prefix_groups - 1)], 0)

    @property
    def effective_prefix_groups(self) -> float:
        """As many equally common prefixes as give two sharing prompts the same chance to share
        one, ``(sum w)^2 / sum w^2`` (``prefix_groups`` when they are equally common): what the
        analytic path and the LP count batches' distinct prefixes with."""
        _, w = self.prefix_table
        return float(w.sum() ** 2 / np.sum(w * w)) if w.size else 1.0

    @property
    def mean_prefix_tokens(self) -> int:
        """Leading tokens the mean prompt shares (``prefix_tokens`` times ``prefix_share``): what
        the analytic path and the LP price, which draw no prompt's prefix."""
        return round(self.prefix_tokens * self.prefix_share)

    @property
    def max_context(self) -> int:
        """Longest sequence a request can reach: longest prompt plus longest output."""
        return self.prompt.max_len + self.output.max_len

    def scaled(self, factor: float) -> "Workload":
        prompt = self.prompt.scaled(factor)  # first: it refuses a factor that is no scale (NaN reached round())
        lengths = tuple(max(1, round(n * factor)) for n in self.prefix_lengths)
        tokens = round(self.prefix_tokens * factor) if not lengths else \
            round(sum(n * w for n, w in zip(lengths, self.prefix_weights)) / sum(self.prefix_weights))
        return replace(self, name=f"{self.name}@{factor:g}", prompt=prompt,
                       output=self.output.scaled(factor), prefix_tokens=tokens, prefix_lengths=lengths,
                       own_part=None if self.own_part is None else self.own_part.scaled(factor),
                       unshared_prompt=None if self.unshared_prompt is None else self.unshared_prompt.scaled(factor))

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "prompt": self.prompt.summary(), "output": self.output.summary(),
                "correlation": self.correlation, "source": self.source, "samples": self.samples,
                "prefix_tokens": self.prefix_tokens, "prefix_groups": self.prefix_groups,
                "prefix_share": self.prefix_share, "prefix_lengths": list(self.prefix_lengths),
                "prefix_weights": list(self.prefix_weights),
                "own_part": None if self.own_part is None else self.own_part.summary(),
                "unshared_prompt": None if self.unshared_prompt is None else self.unshared_prompt.summary(),
                "file_requests": self.file_requests}

    def context_note(self, model: str, max_positions: int) -> str | None:
        """A line when the longest prompt plus output passes the model's positions (the plan is
        then for requests that `xsched run` refuses), else None."""
        return context_note("the workload's", self.prompt.max_len + self.output.max_len, model, max_positions,
                            " (scale the workload, e.g. NAME@0.5)")

    def caveats(self, model: str, max_positions: int) -> list[str]:
        """What a plan or simulation of this workload on ``model`` should be warned of."""
        return [n for n in (self.context_note(model, max_positions), self.prefix_note()) if n is not None]

    def prefix_note(self) -> str | None:
        """A line when alike prefixes (``--prefix-tokens``) are no shorter than many prompts, else
        None. Such a prompt would be all prefix, which no job's is; the cost model prices it as
        sharing all but its last token, so the plan counts more sharing than the job can have (a
        250-token prefix on T, median prompt 128, priced 9% faster than none)."""
        if not self.prefix_tokens or self.prefix_lengths:
            return None
        short = float(self.prompt.cdf(self.prefix_tokens))
        if short < SHORT_PROMPTS_NOTED:
            return None
        return (f"{short:.0%} of workload {self.name}'s prompts are no longer than the {self.prefix_tokens}-token prefix "
                f"they share (median prompt {self.prompt.quantile(0.5)} tokens); each is priced as all prefix but "
                "its last token: give the shared part's length as the prompts count it")

    def describe(self) -> str:
        lines = [f"workload {self.name}" + (f" ({self.source})" if self.source else "") + ", lengths in tokens:"]
        for label, dist in (("prompt", self.prompt), ("output", self.output)):
            s = dist.summary()
            lines.append(f"  {label:<6} {dist.describe()}: mean {s['mean']:.1f}, std {s['std']:.1f}, "
                         f"p50 {s['p50']}, p99 {s['p99']}, max {s['max']}")
        if self.correlation:
            lines.append(f"  prompt/output copula correlation {self.correlation:.2f}")
        if self.samples > 1:
            lines.append(f"  {self.samples} outputs per prompt (prefilled once per GPU batch)")
        if self.prefix_tokens:
            among = f", one of {self.prefix_groups} such prefixes" if self.prefix_groups > 1 else ""
            which = "prompts" if self.prefix_share == 1.0 else f"{self.prefix_share:.0%} of the prompts"
            lines.append(f"  {which} begin with {self.prefix_tokens} tokens they share{among} "
                         "(prefilled once per run, as the prefix cache allows)")
            if self.prefix_lengths and len(set(self.prefix_lengths)) > 1:
                top = sorted(zip(self.prefix_weights, self.prefix_lengths), reverse=True)
                lines.append("  prefixes (tokens: share of prompts): " + ", ".join(
                    f"{n}: {w:.0%}" for w, n in top[:8]) + (f", ... {len(top) - 8} more" if len(top) > 8 else ""))
            if self.own_part is not None:
                s = self.own_part.summary()
                lines.append(f"  after the prefix: mean {s['mean']:.1f}, std {s['std']:.1f}, max {s['max']} tokens")
            if self.unshared_prompt is not None:
                s = self.unshared_prompt.summary()
                lines.append(f"  prompts sharing nothing: mean {s['mean']:.1f}, std {s['std']:.1f}, max {s['max']} "
                             "tokens")
        return "\n".join(lines)

    # ------------------------------------------------------------------ files
    @classmethod
    def from_file(cls, path: str | Path, count_tokens: Callable[[str], int] | None = None,
                  output: LengthDistribution | None = None) -> "Workload":
        """An empirical workload from a JSONL or CSV file of requests.

        Each request gives its prompt as ``prompt_tokens`` (a count) or ``prompt`` (text, sized
        with ``count_tokens``, else estimated at 4 bytes per token), and its output length as
        ``output_tokens`` (observed) or ``max_new_tokens``. If no request has an output length,
        ``output`` supplies the distribution. A request with ``"n"`` counts n times (``xsched
        run`` samples n outputs of it, each a request of its own), and ``samples`` is the mean n.
        ``count_tokens`` may return the prompt's token ids instead of their count: ``prefix_tokens``
        is then the leading tokens prompts share (:func:`prefix_fields`).
        """
        p = Path(path)
        lengths = read_request_lengths(p, count_tokens)
        if lengths.outputs is None and output is None:
            raise UserError(f"{p}: requests have no output length; add {' or '.join(OUTPUT_KEYS)} to each, "
                            f"or fit the file with `xsched workload fit {p} --max-new-tokens N -o W.json` and use W.json")
        prompt_dist = LengthDistribution.empirical(lengths.prompts)
        corr = 0.0
        if lengths.outputs is not None:
            output_dist = LengthDistribution.empirical(lengths.outputs)
            corr = spearman_to_copula(lengths.prompts, lengths.outputs)
        else:
            output_dist = output  # type: ignore[assignment]
        note = f"{len(lengths.prompts)} requests from {p.name}"
        if lengths.estimated:
            note += f"; {ESTIMATE_NOTE}"
        return cls(name=p.stem, prompt=prompt_dist, output=output_dist, correlation=corr, source=note,
                   samples=lengths.samples, file_requests=len(lengths.prompts), **lengths.prefix)


@dataclass(frozen=True)
class RequestLengths:
    """Lengths read from a requests file; ``outputs`` is None when no request gives one."""

    prompts: np.ndarray
    outputs: np.ndarray | None
    estimated: bool  # prompt text was sized without a tokenizer
    num_prompts: int = 0  # rows of the file; fewer than the requests when some ask for "n" outputs
    # Leading tokens a prompt shares with others (prefix_fields); 0 unless every prompt's ids were
    # known (token ids in the file, or a tokenizer that returns them)
    prefix_tokens: int = 0
    prefix_groups: int = 1  # distinct prefixes among them (prefix_fields)
    prefix_share: float = 1.0  # the prompts that begin with one (prefix_fields)
    prefix_lengths: tuple[int, ...] = ()  # each prefix's length and share, where they differ (prefix_fields)
    prefix_weights: tuple[float, ...] = ()
    own_part: LengthDistribution | None = None  # the sharing prompts' tokens after their prefix (prefix_fields)
    unshared_prompt: LengthDistribution | None = None  # the lengths of the prompts sharing nothing (prefix_fields)

    @property
    def prefix(self) -> dict[str, Any]:
        """The prefix fields, as :class:`Workload` takes them."""
        return dict(prefix_tokens=self.prefix_tokens, prefix_groups=self.prefix_groups,
                    prefix_share=self.prefix_share, prefix_lengths=self.prefix_lengths,
                    prefix_weights=self.prefix_weights, own_part=self.own_part,
                    unshared_prompt=self.unshared_prompt)

    @property
    def samples(self) -> int:
        """Outputs per prompt for :class:`Workload` (the mean, rounded: the total prefill work)."""
        return max(1, round(len(self.prompts) / self.num_prompts)) if self.num_prompts else 1


def read_request_lengths(path: Path, count_tokens: Callable[..., int | Sequence[int]] | None = None,
                         rows: list[dict[str, Any]] | None = None,
                         default_output: int | None = None) -> RequestLengths:
    """Prompt and output lengths of every request in a JSONL or CSV file (see ``from_file``);
    ``rows``: the file's rows when the caller already read them with :func:`read_rows`;
    ``default_output``: the output length of a request that gives none (``xsched run``'s
    ``--max-new-tokens``, which such a request runs with)."""
    rows = read_rows(path) if rows is None else rows
    if not rows:
        raise UserError(f"{path}: no requests in the file")
    prompts, outputs, estimated = [], [], False
    known_ids: list[Sequence[int]] | None = []  # every prompt's ids while all are known
    for i, row in enumerate(rows, start=1):
        n_prompt, est, ids = _prompt_length(row, count_tokens, f"{path}: request {i}")
        estimated |= est
        if ids is None:
            known_ids = None
        elif known_ids is not None:
            known_ids.append(ids)
        length = _optional_length(row, OUTPUT_KEYS, f"{path}: request {i}")
        cap = _optional_length(row, ("max_new_tokens",), f"{path}: request {i}")
        if length is not None and cap is not None and length > cap:  # observed past its own cap: a column mixed up
            raise UserError(f"{path}: request {i}: output_tokens {length} is more than its max_new_tokens {cap}, "
                            "which caps it; check the two columns")
        copies = request_copies(row, f"{path}: request {i}")
        prompts += [n_prompt] * copies
        outputs += [default_output if length is None else length] * copies
    known = [o for o in outputs if o is not None]
    if known and len(known) != len(outputs):
        first = outputs.index(None) + 1
        raise UserError(f"{path}: request {first} has no output length ({' or '.join(OUTPUT_KEYS)}) while others "
                        "do; give it for every request or for none")
    return RequestLengths(np.array(prompts, np.int64), np.array(known, np.int64) if known else None, estimated,
                          len(rows), **(prefix_fields(known_ids) if known_ids else {}))


def prefix_fields(prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """A job's shared prefixes as :class:`Workload` fields (:func:`prefix_runs`): each run of two
    or more prompts is a prefix, as long as the mean of the leading tokens its prompts share and
    as common as its share of the prompts (``prefix_lengths``, ``prefix_weights``, listed only
    where the lengths or shares differ, with ``own_part``: the sharing prompts' tokens after their
    prefix, and ``unshared_prompt``: the lengths of those that share nothing); ``prefix_tokens``
    is their weighted mean, ``prefix_groups`` their number and ``prefix_share`` their sum. A
    prompt that shares nothing is not a prefix: counted as one, a job of one system prompt and a
    few such prompts read as many equally likely prefixes, and the simulator priced 1.2-3.0x the
    positions the engine computes (benchmarks/prefix_pricing.py)."""
    runs, shared = _runs(prompts)
    sizes = np.bincount(runs) if runs else np.zeros(0, np.int64)
    sharing = np.flatnonzero(sizes > 1)
    total = np.bincount(runs, weights=shared) if runs else np.zeros(0)
    tokens = round(float(total[sharing].sum() / sizes[sharing].sum())) if sharing.size else 0
    if not tokens:
        return dict(prefix_tokens=0, prefix_groups=1, prefix_share=1.0, prefix_lengths=(), prefix_weights=(),
                    own_part=None, unshared_prompt=None)
    lengths = tuple(max(1, round(total[k] / sizes[k])) for k in sharing.tolist())
    weights = tuple(float(sizes[k] / len(prompts)) for k in sharing.tolist())
    share = float(sizes[sharing].sum() / len(prompts))
    table = len(set(lengths)) > 1 or len(set(sizes[sharing].tolist())) > 1
    if table:  # the mean of the rounded lengths, so that the fields agree (Workload checks them)
        tokens = round(sum(n * w for n, w in zip(lengths, weights)) / sum(weights))
    own = alone = None
    if table:
        length_of = dict(zip(sharing.tolist(), lengths))
        own = LengthDistribution.empirical([max(1, len(p) - length_of[k]) for p, k in zip(prompts, runs)
                                            if k in length_of])
        lone = [len(p) for p, k in zip(prompts, runs) if k not in length_of]
        alone = LengthDistribution.empirical(lone) if lone else None
    return dict(prefix_tokens=tokens, prefix_groups=int(sharing.size), prefix_share=share,
                prefix_lengths=lengths if table else (), prefix_weights=weights if table else (), own_part=own,
                unshared_prompt=alone)


def prefix_runs(prompts: Sequence[Sequence[int]]) -> tuple[int, list[int]]:
    """A job's shared leading tokens and which prefix each prompt begins with.

    Tokens: the mean, over its prompts, of the leading tokens a prompt shares with another (each
    kept below its own length: the runner computes a prompt's last token itself). Prefixes: the runs of prompts (sorted by their
    tokens) whose neighbours share at least half of what either shares with any prompt and a
    fifth of their tokens, numbered 0, 1, ...; a prompt that shares nothing is a run of its own,
    as the runner computes it. No shared tokens: one run."""
    runs, shared = _runs(prompts)
    return (round(sum(shared) / len(prompts)) if runs else 0), runs


def run_prefix_lengths(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Each prompt's run (:func:`prefix_runs`) and each run's prefix length: the mean of the
    leading tokens its prompts share (0 for a prompt that shares nothing)."""
    runs, shared = _runs(prompts)
    if not runs:
        return runs, []
    sizes = np.bincount(runs)
    total = np.bincount(runs, weights=shared)
    return runs, [round(t / n) if n > 1 else 0 for t, n in zip(total.tolist(), sizes.tolist())]


def _runs(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(:func:`prefix_runs`' run of each prompt, the leading tokens each shares with another)."""
    if len(prompts) < 2:
        return [0] * len(prompts), [0] * len(prompts)
    order, common = sorted_neighbours(prompts)
    best = [0] * len(prompts)
    for a, b, c in zip(order, order[1:], common):
        best[a], best[b] = max(best[a], c), max(best[b], c)
    shared = [min(c, len(p) - 1) for c, p in zip(best, prompts)]
    runs = [0] * len(prompts)
    if not round(sum(shared) / len(prompts)):
        return runs, shared
    k = 0
    for a, b, c in zip(order, order[1:], common):
        # Neighbours of one run share at least half of what each shares at most, and enough of
        # their prompts for the runner to share it (RUN_SHARE_AT_LEAST); a cut at half the job's
        # mean took 20- and 40-token templates among 100- and 200-token ones for prompts sharing nothing.
        k += c < max(1.0, 0.5 * min(best[a], best[b]), RUN_SHARE_AT_LEAST * min(len(prompts[a]), len(prompts[b])))
        runs[b] = k
    return runs, shared


def sorted_neighbours(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Prompt indices sorted by their tokens (prompts that begin alike end up next to each other)
    and the leading tokens each shares with the next one in that order."""
    seqs = [list(p) for p in prompts]
    order = sorted(range(len(seqs)), key=seqs.__getitem__)
    return order, [len(os.path.commonprefix([seqs[a], seqs[b]])) for a, b in zip(order, order[1:])]


def neighbour_runs(order: Sequence[int], common: Sequence[int], tau: float) -> tuple[list[list[int]], list[int]]:
    """:func:`sorted_neighbours`' ``order`` cut into runs whose neighbours share at least ``tau``
    leading tokens, and the tokens each run's prompts all share (-1 for a run of one)."""
    runs, shared = [[order[0]]], [-1]
    for c, i in zip(common, order[1:]):
        if c >= tau:
            runs[-1].append(i)
            shared[-1] = c if shared[-1] < 0 else min(shared[-1], c)
        else:
            runs.append([i])
            shared.append(-1)
    return runs, shared


def request_copies(row: dict[str, Any], where: str) -> int:
    """How many requests a row is: its ``"n"`` (``xsched run`` samples n outputs of it), else 1."""
    n = _optional_length(row, ("n",), where) or 1
    if n > MAX_SAMPLES:  # as `xsched run` says it (the workload's check named "samples", not the file's key)
        raise UserError(f"{where}: \"n\" asks for {n:,} outputs of one prompt; at most {MAX_SAMPLES:,}")
    return n


def spearman_to_copula(a: Any, b: Any) -> float:
    """Gaussian-copula correlation from Spearman's rank correlation: 2 sin(pi rho_s / 6)."""
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    from scipy import stats  # (here: it adds about 45 MiB to every process that reads a workload, the engine's too)

    rho_s = float(stats.spearmanr(a, b).statistic)
    if not math.isfinite(rho_s):
        return 0.0
    rho = 2 * math.sin(math.pi * rho_s / 6)
    return float(np.clip(rho, -0.999, 0.999))


def context_note(whose: str, longest: int, model: str, max_positions: int, advice: str = "") -> str | None:
    """A line when ``whose`` longest prompt + output passes the model's positions, else None."""
    if longest <= max_positions:
        return None
    return (f"{whose} longest prompt + output is {longest} tokens, beyond {model}'s {max_positions} positions; "
            f"`xsched run` refuses such requests{advice}")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The request objects of a JSONL file or the rows of a CSV file, as dicts (one-line errors)."""
    text = read_text(path)  # (a byte-order mark, which spreadsheet exports write, is dropped)
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if not reader.fieldnames or not set(reader.fieldnames) & set(PROMPT_KEYS):
            raise UserError(f"{path}: CSV needs a header with {' or '.join(PROMPT_KEYS)} "
                            f"and {' or '.join(OUTPUT_KEYS)}")
        counts = ("prompt_tokens", "n") + OUTPUT_KEYS  # numbers in a CSV cell; in JSON they must be numbers
        rows = []
        for r in reader:
            if None in r:  # cells past the header's columns (a comma inside an unquoted prompt): say so
                raise UserError(f"{path}:{reader.line_num}: {len(reader.fieldnames) + len(r[None])} cells under a "
                                f"header of {len(reader.fieldnames)}; quote a cell that holds a comma")
            rows.append({k: _cell_number(v) if k in counts else v for k, v in r.items()})
        return rows
    rows = []
    for lineno, line in jsonl_lines(text):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg}); expected one request object per line") \
                from None
        except RecursionError:
            raise UserError(f"{path}:{lineno}: nested too deeply; expected one request object per line") from None
        except ValueError as exc:  # an integer literal past Python's digit limit
            raise UserError(f"{path}:{lineno}: not a usable request ({str(exc).split(':')[0]})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        # An OpenAI batch file, in (requests, as `xsched run` reads them) or out (results, as it writes them)
        back = openai_result_rows(row, f"{path}:{lineno}")
        rows.extend(back if back is not None else [openai_batch_row(row, f"{path}:{lineno}")])
    return rows


def _cell_number(text: Any) -> Any:
    """A CSV cell as the number it spells, else as it is (for the one-line error after)."""
    try:
        return int(text)
    except (TypeError, ValueError):
        try:
            return float(text)
        except (TypeError, ValueError):
            return text


def _positive_int(value: Any, where: str, key: str) -> int:
    what = "outputs" if key == "n" else "tokens"
    if isinstance(value, bool):  # float(True) is 1.0
        raise UserError(f"{where}: {key}={value!r} must be a whole number of {what} >= 1")
    if isinstance(value, str) and value.strip():  # (CSV cells and fixed:P:N arrive as numbers: _cell_number)
        if _cell_number(value) is not value:  # `xsched run` refuses "4" too
            raise UserError(f"{where}: {key}={value!r} must be a JSON number, not text")
        raise UserError(f"{where}: {key}={value!r} is not a number")
    try:
        f = float(value)
    except OverflowError:  # a JSON integer too large for a float
        raise UserError(f"{where}: {key} is beyond any model's context (at most {MAX_LEN_TOKENS:,} tokens)") from None
    except (TypeError, ValueError):
        raise UserError(f"{where}: {key}={value!r} is not a number") from None
    if not math.isfinite(f) or f != int(f) or f < 1:
        raise UserError(f"{where}: {key}={value!r} must be a whole number of {what} >= 1")
    if f > MAX_LEN_TOKENS:  # before numpy's int64 arrays, which overflow at 2^63
        raise UserError(f"{where}: {key}={value!r} is beyond any model's context (at most {MAX_LEN_TOKENS:,} tokens)")
    return int(f)


def _optional_length(row: dict[str, Any], keys: tuple[str, ...], where: str) -> int | None:
    for key in keys:
        if row.get(key) not in (None, ""):
            return _positive_int(row[key], where, key)
    return None


def _prompt_length(row: dict[str, Any], count_tokens: Callable[..., int | Sequence[int]] | None,
                   where: str) -> tuple[int, bool, Sequence[int] | None]:
    """(token count, whether it was estimated without a tokenizer, the token ids where known). A
    chat (``"messages"``, as ``xsched run`` takes it) counts through the template; estimated, by
    its contents' bytes. ``count_tokens`` returns a count or the ids themselves."""
    def counted(got: int | Sequence[int]) -> tuple[int, bool, Sequence[int] | None]:
        return (max(1, int(got)), False, None) if isinstance(got, (int, np.integer)) else (max(1, len(got)), False, got)

    if row.get("prompt_tokens") not in (None, ""):
        return _positive_int(row["prompt_tokens"], where, "prompt_tokens"), False, None
    if sum(row.get(k) not in (None, "", []) for k in ("prompt", "messages", "prompt_ids")) > 1:  # as `run` refuses
        raise UserError(f"{where}: give exactly one of \"prompt\" (text), \"messages\" (a chat) or \"prompt_ids\" "
                        "(token ids)")
    ids = row.get("prompt_ids")
    if isinstance(ids, list) and ids and row.get("prompt") in (None, ""):  # `xsched run`'s pre-tokenized form
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):  # as xsched run refuses them
            raise UserError(f"{where}: prompt_ids must be token ids (whole numbers >= 0)")
        return len(ids), False, ids
    if row.get("messages") is not None and row.get("prompt") in (None, ""):
        messages = chat_messages(row["messages"], where)
        if count_tokens is not None:
            return counted(count_tokens(messages))
        size = sum(len(content.encode("utf-8")) for _, content in messages)
        return max(1, math.ceil(size / BYTES_PER_TOKEN_ESTIMATE)), True, None
    text = row.get("prompt")
    if not isinstance(text, str) or not text:
        raise UserError(f"{where}: needs prompt_tokens (a count), prompt (non-empty text), messages (a chat) or "
                        "prompt_ids (token ids)")
    check_text(text, f"{where}: \"prompt\"")  # the byte estimate and the tokenizer raised tracebacks on it
    if count_tokens is not None:  # a request's own "chat_template": false (an OpenAI completion) counts it bare
        return counted(count_tokens(text) if row.get("chat_template", True) else count_tokens(text, False))
    return max(1, math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_ESTIMATE)), True, None


# ---------------------------------------------------------------------- presets and specs
def _preset_table() -> dict[str, Any]:
    path = resources.files("workloads") / "presets" / "exegpt_table3.json"
    return json.loads(path.read_text())


def preset_names() -> list[str]:
    """Names of the built-in presets (ExeGPT Table 3 task ids)."""
    return list(_preset_table()["tasks"])


def preset_workload(name: str, scale: float = 1.0) -> Workload:
    """ExeGPT Table 3 task ``name``: truncated normals with the table's realised mean/std/max."""
    table = _preset_table()
    tasks = {k.upper(): v for k, v in table["tasks"].items()}
    task = tasks.get(name.upper())
    if task is None:
        raise UserError(f"unknown workload preset {name!r}; presets: {', '.join(table['tasks'])}, "
                        "or fixed:PROMPT:OUTPUT, or a JSONL/CSV file")

    def dist(d: dict[str, float]) -> LengthDistribution:
        top = max(1, round(d["max"] * scale))
        mean = min(max(1.0, d["mean"] * scale), top)
        return LengthDistribution.truncnorm_with_moments(mean, max(d["std"] * scale, 0.5), top)

    label = name.upper() if scale == 1.0 else f"{name.upper()}@{scale:g}"
    return Workload(name=label, prompt=dist(task["input"]), output=dist(task["output"]),
                    source=f"ExeGPT Table 3, {task['task']}" + (f", lengths x{scale:g}" if scale != 1.0 else ""))


def with_samples(workload: Workload, samples: int | None, prefix_tokens: int | None = None,
                 prefix_groups: int | None = None, prefix_share: float | None = None) -> Workload:
    """``workload`` with ``samples`` outputs per prompt, ``prefix_tokens`` shared leading tokens,
    ``prefix_groups`` distinct prefixes and ``prefix_share`` of the prompts behind one (a CLI's
    ``--samples``, ``--prefix-tokens``, ``--prefix-groups`` and ``--prefix-share``; None keeps its
    own). A prefix field given replaces the fitted per-prefix table: the prefixes are then alike."""
    given = dict(samples=samples, prefix_tokens=prefix_tokens, prefix_groups=prefix_groups,
                 prefix_share=prefix_share)
    table = {} if prefix_tokens is None and prefix_groups is None and prefix_share is None else \
        dict(prefix_lengths=(), prefix_weights=(), own_part=None, unshared_prompt=None)
    return replace(workload, **{k: v for k, v in given.items() if v is not None}, **table)


def fixed_workload(prompt_len: int, output_len: int) -> Workload:
    return Workload(name=f"fixed:{prompt_len}:{output_len}", prompt=LengthDistribution.fixed(prompt_len),
                    output=LengthDistribution.fixed(output_len), source="every request has the same lengths")


def get_workload(text: str) -> Workload:
    """Resolve a preset name, ``fixed:P:N``, or a file path, each optionally with ``@SCALE``."""
    if not text.strip():
        raise UserError(f"workload: got an empty name; give a preset ({', '.join(preset_names())}), "
                        "fixed:PROMPT:OUTPUT or a file")
    spec, scale = text, 1.0
    if "@" in text and not path_exists(text):
        spec, _, raw = text.rpartition("@")
        try:
            scale = float(raw)
        except ValueError:
            raise UserError(f"workload {text!r}: scale {raw!r} after '@' is not a number") from None
        if not scale > 0 or not math.isfinite(scale):
            raise UserError(f"workload {text!r}: scale must be a finite number > 0, e.g. {spec}@0.5")
    if spec.lower().startswith("fixed:"):
        parts = spec.split(":")
        if len(parts) != 3:
            raise UserError(f"workload {text!r}: write fixed:PROMPT_TOKENS:OUTPUT_TOKENS, e.g. fixed:512:32")
        p_len = _positive_int(_cell_number(parts[1]), f"workload {text!r}", "prompt length")
        o_len = _positive_int(_cell_number(parts[2]), f"workload {text!r}", "output length")
        w = fixed_workload(p_len, o_len)
        return w.scaled(scale) if scale != 1.0 else w
    path = Path(spec)
    if path_exists(path) or path.suffix.lower() in (".json", ".jsonl", ".csv"):
        w = _workload_from_path(path)
        return w.scaled(scale) if scale != 1.0 else w
    return preset_workload(spec, scale)


def workload_file(text: str) -> str | None:
    """The file a workload argument reads (``reqs.jsonl@0.5`` reads ``reqs.jsonl``), else None."""
    if path_exists(text):
        return text
    spec = text.rpartition("@")[0]
    return spec if spec and path_exists(spec) else None


def _workload_from_path(path: Path) -> Workload:
    if not path_exists(path):
        raise UserError(f"{path}: no such file")
    if path.suffix.lower() == ".json":
        return Workload.load(path)
    return Workload.from_file(path)
