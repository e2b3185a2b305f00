"""benchmarks/offload_vs_accelerate.py: the pieces that decide what its figures mean."""

from __future__ import annotations

from bench_scripts import load_benchmark


def _bench():
    return load_benchmark("offload_vs_accelerate")


def _acc(batch, tps=None, status="ok", timed_out=False):
    return {"side": "accelerate", "batch": batch, "tokens_per_s": tps, "status": status, "timed_out": timed_out}


def test_accelerate_best_batch_is_flagged_unless_a_larger_batch_brackets_it():
    best = _bench().best_accelerate
    xs = {"side": "xsched run", "batch": "192x1", "tokens_per_s": 90.0, "status": "ok"}
    # One batch (the reported command of stops 26-34): the fastest tried, not known to be the best.
    row, why = best([_acc(32, 9.8), xs], 64, 900)
    assert row["batch"] == 32 and why and "upper bound" in why
    # The largest tried is the fastest: still open.
    assert best([_acc(16, 5.0), _acc(48, 14.0)], 64, 900)[1]
    # A larger batch OOM-killed, or slower: bracketed.
    row, why = best([_acc(32, 9.8), _acc(48, 14.0), _acc(64, status="OOM-killed")], 64, 900)
    assert row["batch"] == 48 and why is None
    assert best([_acc(32, 9.8), _acc(48, 9.0)], 64, 900) == (_acc(32, 9.8), None)
    # A smaller batch that failed does not bracket the best from above.
    assert best([_acc(16, status="OOM-killed"), _acc(32, 9.8)], 64, 900)[1]
    # A timeout brackets only when finishing at the timeout would have been slower than the best.
    assert best([_acc(32, 9.8), _acc(48, status="failed: timed out", timed_out=True)], 64, 900)[1] is None
    assert best([_acc(32, 9.8), _acc(48, status="failed: timed out", timed_out=True)], 64, 60)[1]
    # Another failure (a crash) says nothing about memory or speed.
    assert best([_acc(32, 9.8), _acc(48, status="failed: Traceback")], 64, 900)[1]
    assert best([xs], 64, 900) == (None, None)


def test_a_work_folder_left_by_another_shape_is_refused_not_reused():
    """The model and Accelerate folders are reused by name: a run with other --layers or --hidden
    must not time Accelerate on the old model while printing the new shape."""
    from types import SimpleNamespace

    b = _bench()
    spec = b.bench_spec(SimpleNamespace(dtype="float32", layers=3, hidden=256))
    config = {"num_hidden_layers": 3, "hidden_size": 256, "ffn_dim": 1024, "num_attention_heads": 4,
              "vocab_size": 50272, "max_position_embeddings": 2048, "dtype": "float32"}
    assert b.model_dir_mismatch(spec, config) is None
    assert b.model_dir_mismatch(spec, {**config, "num_hidden_layers": 2}) == "num_hidden_layers 2 vs 3"
    older = {k: v for k, v in config.items() if k != "dtype"} | {"torch_dtype": "float32"}
    assert b.model_dir_mismatch(spec, older) is None
    assert "dtype bfloat16 vs float32" in b.model_dir_mismatch(spec, {**config, "dtype": "bfloat16"})

    shapes = {"a.weight": (4, 8), "b.weight": (8,)}
    index = {"a.weight": {"dtype": "float32", "shape": [4, 8]}, "b.weight": {"dtype": "float32", "shape": [8]}}
    assert b.offload_index_mismatch(shapes, index) is None
    assert "missing c.weight" in b.offload_index_mismatch({**shapes, "c.weight": (1,)}, index)
    assert "extra b.weight" in b.offload_index_mismatch({"a.weight": (4, 8)}, index)
    assert "a.weight (4, 8) vs (4, 16)" in b.offload_index_mismatch({**shapes, "a.weight": (4, 16)}, index)


def test_the_table_names_the_stored_forms_of_each_side():
    from xsimulator.policy import Policy

    forms = _bench().stored_forms
    assert forms(Policy(gbs=192, nb=1, wg=0.0, wc=0.0, wd=1.0, compress_cache=True), "float32") == "float32 / 4-bit"
    assert forms(Policy(gbs=64, nb=1), "bfloat16") == "bfloat16 / bfloat16"


def test_fewer_rows_than_the_smallest_gpu_batch_still_get_a_policy():
    """--rows 8 was refused as 'no policy fits 1.43 GiB of RAM': every GPU batch tried was 16 or more."""
    from types import SimpleNamespace

    from xprofiler.presets import load_profile

    b = _bench()
    spec = b.bench_spec(SimpleNamespace(dtype="float32", layers=2, hidden=256))
    policy, _ = b.choose_policy(spec, load_profile("t4"), 2 * b.GiB, b.GiB // 2, 8, 8, 8, (False,))
    assert (policy.gbs, policy.nb) == (8, 1)
    policy, _ = b.choose_policy(spec, load_profile("t4"), 2 * b.GiB, b.GiB // 2, 8, 8, 64, (False,))
    assert policy.gbs * policy.nb == 64
