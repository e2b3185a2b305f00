"""xprofiler: measure a machine once and describe models.

Importing this package does not import torch: the contracts (ModelSpec, HardwareProfile),
preset loading with the other-machine warning, and the page-cache-bypassing disk I/O (numpy
buffers) are read by the simulator, scheduler and engine, which must not pay for torch here.
Measuring (``measure_profile``) imports torch when it runs.
"""

from xprofiler.diskio import ALIGN_BYTES, DirectFile, aligned_empty, probe_method, round_up
from xprofiler.fingerprint import detect_fingerprint, machine_differences
from xprofiler.measure import ProfileOptions, measure_profile, profile_machine
from xprofiler.presets import ProfileMismatchWarning, load_preset, load_profile, preset_names
from xprofiler.profile import (LAYER_FEATURES, BandwidthCurve, CalibrationError, Fingerprint, HardwareProfile,
                               HeadFit, LayerFit, WarmFit, layer_features)
from xprofiler.specs import ModelSpec, get_model_spec, model_names

__all__ = ["ALIGN_BYTES", "BandwidthCurve", "CalibrationError", "DirectFile", "Fingerprint", "HardwareProfile",
           "HeadFit", "LAYER_FEATURES", "LayerFit", "ModelSpec", "ProfileMismatchWarning", "ProfileOptions", "aligned_empty",
           "detect_fingerprint", "get_model_spec", "layer_features", "load_preset", "load_profile",
           "machine_differences", "measure_profile", "model_names", "preset_names", "probe_method",
           "profile_machine", "round_up", "WarmFit"]
