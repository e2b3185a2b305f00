"""Suite-wide test settings.

Torch runs on one thread in tests and in the CLI subprocesses they start: on a 2-core machine
two threads stall whenever anything else holds a core, which made single tests swing from 17 s
to 95 s. Set before torch is imported anywhere, so the environment variable reaches torch's
thread pool here and in every child process.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# What xsched caches (converted tokenizers) goes to one fresh directory per test session, shared by
# the CLI subprocesses, never to the user's ~/.cache.
os.environ["XSCHED_CACHE_DIR"] = tempfile.mkdtemp(prefix="xsched-test-cache-")
atexit.register(shutil.rmtree, os.environ["XSCHED_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as a HF directory, with a word-level tokenizer ("w0".."w299")."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(300)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2").save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _host_without_cuda_unless_marked(request, monkeypatch):
    """Tests not marked ``cuda`` check the CPU host's paths (a declared-RAM gpu tier, O_DIRECT
    straight into stage slots, the CPU LM-head layout) and compare with CPU references, so on a
    machine with a GPU they still see none; the ``cuda`` tests run the same contracts on the device."""
    if request.node.get_closest_marker("cuda") is None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
