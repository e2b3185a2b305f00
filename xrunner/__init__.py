"""xrunner: the model core, weight loaders, sampling, compression and the offloading engine.

The public names below are loaded on first use (PEP 562), so ``xsched``'s CLI can register
the runner's commands without importing torch.
"""

from __future__ import annotations

from xsched.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # model core: the one copy of the math
    "ModelWeights": "xrunner.model", "Rope": "xrunner.model", "Weights": "xrunner.model",
    "embed": "xrunner.model", "attn_in": "xrunner.model", "attention": "xrunner.model",
    "attn_out_mlp": "xrunner.model", "layer_forward": "xrunner.model", "final_logits": "xrunner.model",
    "rope_tables": "xrunner.model", "position_ids_from_mask": "xrunner.model", "torch_dtype": "xrunner.model",
    # sampling and the in-memory generation loop
    "SamplingParams": "xrunner.sampling", "sample": "xrunner.sampling",
    "GenerationResult": "xrunner.reference", "generate": "xrunner.reference", "left_pad": "xrunner.model",
    # weight sources
    "ModelSource": "xrunner.loaders", "HFDirectorySource": "xrunner.loaders", "GGUFSource": "xrunner.loaders",
    "RandomSource": "xrunner.loaders", "open_model": "xrunner.loaders", "load_weights": "xrunner.loaders",
    "default_model_path": "xrunner.loaders", "hf_state_dict": "xrunner.loaders",
    # 4-bit group-wise compression
    "QuantizedTensor": "xrunner.compression", "quantize": "xrunner.compression",
    "dequantize": "xrunner.compression", "quantized_nbytes": "xrunner.compression",
    # the offloading engine and its tiered store
    "Engine": "xrunner.engine", "Request": "xrunner.engine", "Finished": "xrunner.engine",
    "EngineStats": "xrunner.engine", "rounded_policy": "xrunner.engine", "RunResult": "xrunner.result",
    "TierStore": "xrunner.tiers", "MemoryLedger": "xrunner.tiers", "DiskSlice": "xrunner.tiers", "Ref": "xrunner.tiers",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
